"""From command-line options to a job: a new job's spec, a resumed job's changes, the policy, and
what is shown when a job ends. fabfile.py's tasks only parse options and call these.
"""
from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

from . import plan, report
from .errors import UserError
from .inventory import Inventory
from .logs import sanitize
from .policy import HANG_TIMEOUT, Policy
from .recovery import JobRecord


def code_dir(path: str | None) -> Path:
    p = Path(path).expanduser().resolve() if path else plan.PROJECT_ROOT
    if not p.is_dir():
        raise UserError(f"--code {path}: not a directory; give the folder holding your training code", exit_code=2)
    return p


def new_spec(o: dict, trainers: dict[str, str]) -> plan.JobSpec:
    """A new job from the command line (`o`: the job options, None where not given): a built-in
    trainer, --script or --module, with its arguments."""
    source = code_dir(o.get("code"))
    script, module, args = o.get("script"), o.get("module"), o.get("args") or ""
    if script and module:
        raise UserError("--script and --module both name what to run; give one of them", exit_code=2)
    if module:
        if not plan.MODULE_RE.match(module):
            raise UserError(f"--module {sanitize(module)!r} is not a Python module name; write e.g. "
                            "mypkg.train (dotted names, no .py)", exit_code=2)
        script, extra = module, split_args(args)
    elif script:
        if not (source / script).is_file():
            raise UserError(f"--script {script}: no such file in {source}; give a path relative to --code", exit_code=2)
        extra = split_args(args)
    else:
        trainer = o.get("trainer") or "gpt"
        if trainer not in trainers:
            raise UserError(f"unknown trainer {trainer!r}; use one of {', '.join(trainers)} or --script PATH",
                            exit_code=2)
        script = trainers[trainer]
        extra = ["--model", o.get("model") or "tiny", "--epochs", str(epochs(o.get("epochs") or 5)), *split_args(args)]
    job_name = o.get("name") or (module.rsplit(".", 1)[-1] if module else Path(script).stem).replace("_", "-")
    if not plan.valid_job_id(job_name):
        raise UserError(f"--name {sanitize(job_name)!r}: use letters, digits, '.', '_' and '-'", exit_code=2)
    nproc = o.get("nproc")
    return plan.JobSpec(job_id=plan.new_job_id(job_name), script=script, module=bool(module), args=tuple(extra),
                        image=o.get("image"), nproc_per_node=str(nproc) if nproc else None, code=str(source))


def split_args(args: str) -> list[str]:
    try:
        return shlex.split(args)
    except ValueError as exc:
        raise UserError(f"--args {args!r}: {exc}; quote it as a shell would", exit_code=2) from None


def epochs(value) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise UserError(f"--epochs {value!r}: give a whole number of epochs, 1 or more", exit_code=2)
    return n


# What a resumed job keeps, because its snapshots and ranks depend on it.
FIXED_ON_RESUME = {
    "trainer": "what the job runs", "script": "what the job runs", "module": "what the job runs",
    "model": "the model its snapshots hold", "nproc": "its processes per node (the snapshots' world size)",
    "name": "its id and output directory",
}


def resumed_spec(record: JobRecord, o: dict) -> plan.JobSpec:
    """The recorded job with the options a resume may change (--epochs, --args, --image, --code);
    an option that would make it another job is refused, never dropped."""
    spec = record.job_spec()
    for key, why in FIXED_ON_RESUME.items():
        if o.get(key) is not None:
            raise UserError(f"--{key} cannot change when resuming job {spec.job_id}: it fixes {why}. Leave "
                            f"--{key} out to continue the job, or start a new job without --resume", exit_code=2)
    args = list(spec.args)
    builtin = not spec.module and args[:1] == ["--model"] and args[2:3] == ["--epochs"]
    if o.get("epochs") is not None:
        if not builtin:
            raise UserError(f"--epochs applies to the built-in trainers; job {spec.job_id} runs {spec.script}: "
                            "give its own option with --args instead", exit_code=2)
        args[3] = str(epochs(o["epochs"]))
    if o.get("args") is not None:
        args = [*args[:4], *split_args(o["args"])] if builtin else split_args(o["args"])
    spec = replace(spec, args=tuple(args))
    if o.get("image") is not None:
        spec = replace(spec, image=o["image"])
    if o.get("code") is not None:
        spec = replace(spec, code=str(code_dir(o["code"])))
    return spec


def policy(inv: Inventory, restarts, min_nodes, hang_timeout) -> Policy:
    try:
        p = Policy(restarts=int(restarts), min_nodes=int(min_nodes) if min_nodes else None,
                   hang_timeout=HANG_TIMEOUT if hang_timeout is None else float(hang_timeout))
    except ValueError as exc:
        raise UserError(f"--restarts, --min-nodes and --hang-timeout take numbers: {exc}", exit_code=2) from None
    if p.restarts < 0 or p.hang_timeout < 0:
        raise UserError("--restarts and --hang-timeout cannot be negative", exit_code=2)
    if p.min_nodes is not None and not 1 <= p.min_nodes <= len(inv.hosts):
        raise UserError(f"--min-nodes {p.min_nodes}: give 1 to {len(inv.hosts)} (the hosts in {inv.path})",
                        exit_code=2)
    return p


def present(result, console) -> None:
    """The end of a run: curves and summary.json (failed runs included), the step-time table and
    the stragglers."""
    try:
        data, _ = report.finish(result.run_dir)
        if data["per_host"]:
            console.print(report.timing_table(data))
        for st in data["stragglers"]:
            console.print(f"[red]{sanitize(report.straggler_line(st['rank'], st['compute_ms_median'], st['times_median']))}[/]",
                          highlight=False)
    except Exception as exc:  # noqa: BLE001 - a drawing problem must not hide how the job ended
        console.print(f"[yellow]could not write the run's curves and summary: {sanitize(str(exc))}[/]")
