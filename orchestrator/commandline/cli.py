"""From command-line options to a job: a new job's spec, a resumed job's changes, the policy, and
what is shown when a job ends (the job's hosts: hostselect.py). fabfile.py's tasks only parse
options and call these.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, overload

from orchestrator.config import codetree
from orchestrator.config.inventory import Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.policy import HANG_TIMEOUT, Policy
from orchestrator.core.record import Resume
from orchestrator.core.recovery import JobRecord
from orchestrator.progress import report
from orchestrator.progress.steps import straggler_line

if TYPE_CHECKING:
    from rich.console import Console


def quiet_on_closed_pipe() -> None:
    """`fab --help train | head -1`, `fab status | head`: a reader that closes the pipe early ends
    the command quietly, as it ends `yes | head` (exit 141, 128 + SIGPIPE), never with a
    traceback. Only a BrokenPipeError that reaches the top is taken: while a job runs, its
    terminal output already stops at a closed pipe and the job goes on (logs.Multiplexer)."""
    previous = sys.excepthook

    def hook(kind, value, tb):  # noqa: ANN001 - sys.excepthook's signature
        if issubclass(kind, BrokenPipeError):
            # Python would flush stdout again at exit and print "Exception ignored": point it at
            # /dev/null first.
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            os._exit(141)
        previous(kind, value, tb)

    sys.excepthook = hook


def code_dir(path: str | None) -> Path:
    """--code DIR, checked; without it, the current directory (where a user runs their own script from)."""
    p = Path(path or ".").expanduser().resolve()
    if not p.is_dir():
        raise UserError(
            f"--code {path}: not a directory; give the folder holding your training code", exit_code=2
        )
    return p


def code_tree(path: str | None) -> tuple[Path, str]:
    """What `fab sync` and `fab preflight` check: --code DIR, or the built-in trainers."""
    return (code_dir(path), "") if path else (jobspec.PROJECT_ROOT, codetree.BUILTIN_ONLY)


def new_spec(o: dict, trainers: dict[str, str]) -> jobspec.JobSpec:
    """A new job from the command line (`o`: the job options, None where not given): a built-in
    trainer (this project's trainers/), or --script or --module in --code DIR (default: the
    current directory), with its arguments."""
    script, module = o.get("script"), o.get("module")
    if not (script or module) and o.get("code"):
        raise UserError(
            "--code is the folder of your own --script or --module; the built-in trainers bring their own",
            exit_code=2,
        )
    source, only = (
        (code_dir(o.get("code")), "") if script or module else (jobspec.PROJECT_ROOT, codetree.BUILTIN_ONLY)
    )
    if script and module:
        raise UserError("--script and --module both name what to run; give one of them", exit_code=2)
    script, extra = _what_to_run(o, trainers, source)
    job_name = default_name(o, trainers)
    if not jobspec.valid_job_id(job_name):
        raise UserError(
            f"--name {hostile.text(job_name)!r}: use letters, digits, '.', '_' and '-'", exit_code=2
        )
    nproc = o.get("nproc")
    checkpoint = checkpoint_option(o.get("checkpoint"))
    if checkpoint and script in trainers.values() and not module:
        raise UserError(
            "--checkpoint names where your own program writes its checkpoints; the built-in "
            "trainers' snapshots are kept without it",
            exit_code=2,
        )
    return jobspec.JobSpec(
        job_id=jobspec.new_job_id(job_name),
        script=script,
        module=bool(module),
        args=tuple(extra),
        image=o.get("image"),
        nproc_per_node=str(nproc) if nproc else None,
        code=str(source),
        code_only=only,
        code_key=codetree.key(source, only),
        checkpoint=checkpoint,
    )


def _what_to_run(o: dict, trainers: dict[str, str], source: Path) -> tuple[str, list[str]]:
    """What a new job runs and its arguments: --module, --script (a file in `source`), or a built-in
    trainer with its --model and --epochs."""
    script, module, args = o.get("script"), o.get("module"), o.get("args") or ""
    if script or module:
        # Options only the built-in trainers read: silently dropped, a user would train something else.
        ignored = [f"--{k} {o[k]}" for k in ("trainer", "model", "epochs") if o.get(k) is not None]
        if ignored:
            raise UserError(
                f"{', '.join(ignored)}: only the built-in trainers take "
                f"{'it' if len(ignored) == 1 else 'them'}; --{'module' if module else 'script'} "
                'runs your program: give its own options in --args "..."',
                exit_code=2,
            )
    if module:
        if not jobspec.MODULE_RE.match(module):
            raise UserError(
                f"--module {hostile.text(module)!r} is not a Python module name; write e.g. "
                "mypkg.train (dotted names, no .py)",
                exit_code=2,
            )
        script, extra = module, split_args(args)
    elif script:
        if not (source / script).is_file():
            raise UserError(
                f"--script {script}: no such file in {source}; give a path relative to --code DIR "
                "(default: the current directory)",
                exit_code=2,
            )
        extra = split_args(args)
    else:
        trainer = o.get("trainer") or "gpt"
        if trainer not in trainers:
            raise UserError(
                f"unknown trainer {trainer!r}; use one of {', '.join(trainers)} or --script PATH", exit_code=2
            )
        script = trainers[trainer]
        model = o.get("model") or "tiny"
        if trainer == "gpt" and model not in GPT_PRESETS:
            raise UserError(
                f"--model {hostile.text(str(model))!r}: the GPT presets are {', '.join(GPT_PRESETS)}",
                exit_code=2,
            )
        extra = [
            "--model",
            model,
            "--epochs",
            str(epochs(5 if o.get("epochs") is None else o["epochs"])),
            *split_args(args),
        ]
    return script, extra


# The built-in trainers, --trainer NAME (this project's trainers/), that fabfile.py's tasks hand to
# new_spec and resumed_spec.
TRAINERS = {"gpt": "trainers/gpt.py", "mlp-tp": "trainers/mlp_tp.py"}

# trainers/gpt.py's PRESETS (it imports torch, which this machine need not have; a unit test holds
# the two lists equal).
GPT_PRESETS = ("tiny", "small", "medium")


def checkpoint_option(value: str | None) -> str:
    """--checkpoint as JobSpec.checkpoint ("" when not given)."""
    if not value:
        return ""
    try:
        return jobspec.checkpoint_pattern(value)
    except ValueError as exc:
        raise UserError(f"--checkpoint {exc}", exit_code=2) from None


def default_name(o: dict, trainers: dict[str, str]) -> str:
    """--name, else the module's, script's or trainer's name (what --continue looks for in runs/)."""
    if o.get("name"):
        return o["name"]
    module, script = o.get("module"), o.get("script") or trainers.get(o.get("trainer") or "gpt", "job")
    return (module.rsplit(".", 1)[-1] if module else Path(script).stem).replace("_", "-")


def split_args(args: str) -> list[str]:
    try:
        return shlex.split(args)
    except ValueError as exc:
        raise UserError(f"--args {args!r}: {exc}; quote it as a shell would", exit_code=2) from None


def epochs(value: str | int) -> int:
    return count("--epochs", value)


# What a resumed job keeps, because its snapshots and ranks depend on it: given again with the
# recorded value, fine (the same command run again with --continue); with another, refused.
FIXED_ON_RESUME = {
    "trainer": "what the job runs",
    "script": "what the job runs",
    "module": "what the job runs",
    "model": "the model its snapshots hold",
    "nproc": "its processes per node (the snapshots' world size)",
    "name": "its id and output directory",
}


def recorded(spec: jobspec.JobSpec, key: str, trainers: dict[str, str]) -> str | None:
    """The value option `key` had when the job was started, as the command line gives it."""
    builtin = not spec.module and spec.script in trainers.values()
    return {
        "trainer": next((t for t, s in trainers.items() if s == spec.script and builtin), None),
        "script": None if spec.module or builtin else spec.script,
        "module": spec.script if spec.module else None,
        "model": spec.args[1] if builtin and len(spec.args) > 1 else None,
        "nproc": spec.nproc_per_node,
        "name": job_name(spec.job_id),
    }.get(key)


def job_name(job_id: str) -> str:
    """The --name part of a job id (NAME-YYYYmmdd-HHMMSS-xxxx)."""
    m = re.match(r"^(.*)-\d{8}-\d{6}-[0-9a-f]{4}$", job_id)
    return m.group(1) if m else job_id


def resumed_spec(
    record: JobRecord, o: dict, trainers: dict[str, str], again: bool = False
) -> tuple[jobspec.JobSpec, dict]:
    """The recorded job with the options a resume may change (--epochs, --args, --image, --code,
    --checkpoint), and what changed; an option that would make it another job is refused, never
    dropped. A finished job is resumed (--resume) only with something new to do (--epochs or
    --args), or `again` (--continue: the program decides what is left)."""
    spec = record.spec
    for key, why in FIXED_ON_RESUME.items():
        if o.get(key) is not None and str(o[key]) != str(recorded(spec, key, trainers)):
            raise UserError(
                f"--{key} cannot change when resuming job {spec.job_id}: it fixes {why}. Leave "
                f"--{key} out to continue the job, or start a new job without --resume",
                exit_code=2,
            )
    if record.state == "finished" and not again and o.get("epochs") is None and o.get("args") is None:
        raise UserError(
            f"job {spec.job_id} already finished; to train it further give --epochs N (the built-in "
            'trainers) or --args "..." (your script\'s own options), e.g. more epochs',
            exit_code=2,
        )
    before = spec
    args = list(spec.args)
    builtin = not spec.module and args[:1] == ["--model"] and args[2:3] == ["--epochs"]
    if o.get("epochs") is not None:
        if not builtin:
            raise UserError(
                f"--epochs applies to the built-in trainers; job {spec.job_id} runs {spec.script}: "
                "give its own option with --args instead",
                exit_code=2,
            )
        args[3] = str(epochs(o["epochs"]))
    if o.get("args") is not None:
        args = [*args[:4], *split_args(o["args"])] if builtin else split_args(o["args"])
    spec = replace(spec, args=tuple(args))
    if o.get("image") is not None:
        spec = replace(spec, image=o["image"])
    if o.get("code") is not None:
        spec = replace(spec, code=str(code_dir(o["code"])), code_only="")
    if o.get("checkpoint") is not None:
        spec = replace(spec, checkpoint=checkpoint_option(o["checkpoint"]))
    changed = {
        k: getattr(spec, k)
        for k in ("args", "image", "code", "checkpoint")
        if getattr(spec, k) != getattr(before, k)
    }
    return spec, changed


@overload
def count(option: str, value: None) -> None: ...
@overload
def count(option: str, value: str | int) -> int: ...
def count(option: str, value: str | int | None) -> int | None:
    """A whole number option of 1 or more (None when not given): --epochs, --gpus, --num-nodes."""
    if value is None:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise UserError(f"{option} {value!r}: give a whole number, 1 or more", exit_code=2)
    return n


def resume_entry(record: JobRecord, changed: dict) -> Resume:
    """What JobRecord.resumes keeps of one resume."""
    import time

    return Resume(
        time.time(),
        len(record.attempts),
        record.state,
        {k: list(v) if isinstance(v, tuple) else v for k, v in changed.items()},
    )


def changes_line(changed: dict) -> str:
    if not changed:
        return ""
    shown = {k: shlex.join(v) if isinstance(v, tuple) else v for k, v in changed.items()}
    return "; now " + ", ".join(f"{k} {hostile.text(str(v))!r}" for k, v in shown.items())


def inventory_checkpoint(inv: Inventory) -> str | None:
    """job.checkpoint as --checkpoint would give it (the inventory stores the normalised form)."""
    c = inv.job.checkpoint
    if not c:
        return None
    return c[len(jobspec.WORK) + 1 :] if c.startswith(jobspec.WORK + "/") else f"{jobspec.OUTDIR}/{c}"


def find_named(run_root: Path, name: str) -> str | None:
    """The newest job started with --name NAME under run_root (None: none), for --continue."""
    found = [p for p in run_root.glob(f"{name}-*") if job_name(p.name) == name and (p / "job.json").is_file()]
    return max(found, key=lambda p: p.name.split("-")[-3:-1]).name if found else None


def policy(
    inv: Inventory,
    restarts: str | int,
    min_nodes: str | int | None,
    hang_timeout: str | float | None,
    chosen: str = "",
) -> Policy:
    """The job's policy from its options, each checked; --min-nodes against the job's hosts (`inv`'s,
    as the options named in `chosen`, e.g. "--include/--num-nodes", left them)."""
    try:
        p = Policy(
            restarts=int(restarts),
            min_nodes=None if min_nodes in (None, "") else int(min_nodes),
            hang_timeout=HANG_TIMEOUT if hang_timeout is None else float(hang_timeout),
        )
    except ValueError as exc:
        raise UserError(
            f"--restarts, --min-nodes and --hang-timeout take numbers: {exc}", exit_code=2
        ) from None
    if p.restarts < 0 or p.hang_timeout < 0:
        raise UserError("--restarts and --hang-timeout cannot be negative", exit_code=2)
    if p.min_nodes is not None and not 1 <= p.min_nodes <= len(inv.hosts):
        which = f"of {inv.path} left by {chosen}" if chosen else f"in {inv.path}"
        raise UserError(
            f"--min-nodes {p.min_nodes}: give 1 to {len(inv.hosts)} (the hosts {which})", exit_code=2
        )
    return p


def stderr_console() -> Console:
    """Where people read when stdout is for machines (--json)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def present(run_dir: Path, console: Console) -> None:
    """The end of a run: curves and summary.json (failed runs included), the step-time table and
    the stragglers."""
    try:
        data, _ = report.finish(run_dir)
        if data["per_host"]:
            console.print(report.timing_table(data))
        for st in data["stragglers"]:
            console.print(
                hostile.rich_text(
                    straggler_line(st["rank"], st["compute_ms_median"], st["times_median"]), "red"
                )
            )
    except Exception as exc:  # noqa: BLE001 - a drawing problem must not hide how the job ended
        console.print(hostile.rich_text(f"could not write the run's curves and summary: {exc}", "yellow"))
