"""What fab train asks for, as a value (TrainRequest), and the functions that answer it: resolve the
request into a Launch (resume or continue, host selection, the health gate), then hand it to the
backend that serves it (backends/registry.py chooses). fab attach, stop, status and logs:
control.py; the exports: exports.py. The Fabric tasks (fabfile.py) only parse options and print."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.backends import registry
from orchestrator.backends.base import TRAIN_OPTIONS, Launch
from orchestrator.commandline import cli, hostselect
from orchestrator.config import inventory as inventory_file
from orchestrator.config.fields import listen_address
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.record import Notify
from orchestrator.core.recovery import JobRecord
from orchestrator.hosts import claims, survey
from orchestrator.transport.remote import Session

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.backends.base import Renderer, Runner
    from orchestrator.config.inventory import Inventory
    from orchestrator.core.policy import Policy

# The options that describe the job itself (cli.new_spec and cli.resumed_spec read them).
JOB_OPTIONS = (
    "model",
    "epochs",
    "trainer",
    "script",
    "args",
    "image",
    "nproc",
    "name",
    "code",
    "module",
    "checkpoint",
)


def job_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options that describe the job, from a task's keyword arguments (None: not given)."""
    return {k: options.get(k) for k in JOB_OPTIONS}


@dataclass(frozen=True)
class TrainRequest:
    """fab train's options, as given (None: not given)."""

    job: dict[str, Any] = field(default_factory=dict)  # JOB_OPTIONS
    inventory: str | None = None
    on: str | None = None
    dry_run: bool = False
    resume: str | None = None
    continue_: bool = False
    restarts: str | int | None = None
    min_nodes: str | int | None = None
    hang_timeout: str | float | None = None
    include: str | None = None
    exclude: str | None = None
    num_nodes: str | int | None = None
    gpus: str | int | None = None
    cpuset: bool = False
    health: bool = False
    smoke: bool = False
    skip_preflight: bool = False
    json: bool = False
    plain: bool = False
    notify: str | None = None
    notify_url: str | None = None
    detach: bool = False
    queue: bool = False
    hot_spares: bool = False
    metrics_port: str | int | None = None
    stop_idle: bool = False

    @classmethod
    def of(cls, options: dict[str, Any]) -> TrainRequest:
        """From the task's keyword arguments (the job's own options gathered in `job`)."""
        names = set(cls.__dataclass_fields__) - {"job"}
        return cls(job=job_options(options), **{k: v for k, v in options.items() if k in names})


def refused(req: TrainRequest, backend: Runner | Renderer) -> None:
    """UserError (exit 2) for each option given that the backend does not accept (registry.refuse)."""
    registry.refuse(backend, {o.name: getattr(req, o.name) for o in TRAIN_OPTIONS})


def earlier(req: TrainRequest, runs: Path, say: Console, trainers: dict[str, str]) -> str | None:
    """The job to go on with: --resume's, or --continue's newest of its --name (None: a new one)."""
    if req.resume and req.continue_:
        raise UserError(
            "--resume names the job to continue and --continue finds it by --name; give one", exit_code=2
        )
    if not req.continue_:
        return req.resume
    name = cli.default_name(req.job, trainers)
    found = cli.find_named(runs, name)
    if found is None:
        say.print(f"no earlier job named {name} in {runs}/: starting a new one", markup=False)
    return found


def resumed(
    req: TrainRequest,
    chosen: Runner | Renderer,
    record: JobRecord,
    inv: Inventory,
    say: Console,
    trainers: dict[str, str],
) -> tuple[jobspec.JobSpec, Policy, JobRecord]:
    """An earlier job's spec, policy and record as this request changes them (a new record value)."""
    if record.on != chosen.name:
        where = "over SSH" if record.on == "ssh" else f"on {record.on}"
        raise UserError(f"job {record.job_id} ran {where}; resume it with --on {record.on}", exit_code=2)
    backend = registry.as_runner(chosen)  # a job ran there
    if not req.dry_run:
        backend.refuse_if_running(inv, record.job_id, "--continue" if req.continue_ else "--resume")
    spec, changed = cli.resumed_spec(record, req.job, trainers, again=req.continue_)
    policy = cli.policy(
        inv,
        record.restarts if req.restarts is None else req.restarts,
        record.min_nodes if req.min_nodes is None else req.min_nodes,
        record.hang_timeout if req.hang_timeout is None else req.hang_timeout,
    )
    record = replace(
        record,
        restarts=policy.restarts,
        min_nodes=policy.min_nodes,
        hang_timeout=policy.hang_timeout,
        resumes=[*record.resumes, cli.resume_entry(record, changed)],
    )
    say.print(
        f"{'continuing' if req.continue_ else 'resuming'} job {spec.job_id}{backend.where} "
        f"({len(record.attempts)} attempt(s) so far, {record.state}){cli.changes_line(changed)}",
        markup=False,
    )
    return spec, policy, record


def choosers(req: TrainRequest, include: str | None, health: bool = False) -> str:
    """The options that choose the job's hosts among the inventory's, as a message names them
    ("--include/--num-nodes"; "" when none does)."""
    given = {
        "--include": include,
        "--exclude": req.exclude,
        "--num-nodes": req.num_nodes,
        "--health": req.health and health,
    }
    return "/".join(k for k, v in given.items() if v not in (None, "", False))


def checked_early(req: TrainRequest, inv: Inventory, include: str | None) -> None:
    """What the command line alone refuses, before any host is asked (--num-nodes surveys them,
    --health measures them, a resume looks for the job there): hosts --include/--exclude do not
    name or leave none of, --num-nodes or --min-nodes above the hosts they leave, a negative
    --restarts or --hang-timeout."""
    planned = hostselect.planned_hosts(inv, include, req.exclude, req.num_nodes)
    cli.policy(planned, req.restarts or 0, req.min_nodes, req.hang_timeout, choosers(req, include))


def hosts_for(
    req: TrainRequest, inv: Inventory, include: str | None, units: str, gpus: int | None, say: Console
) -> tuple[Inventory, bool]:
    """The inventory with the hosts --include/--exclude/--num-nodes and --health leave (and whether
    any of them chose)."""
    selected = bool(include or req.exclude or req.num_nodes is not None)
    if selected:
        busy: set[str] = set()
        if req.num_nodes is not None:
            want = claims.want_of(
                jobspec.JobSpec(
                    job_id="-", script="", units=units, gpus=gpus, nproc_per_node=req.job.get("nproc")
                ),
                inv.job.nproc_per_node,
            )
            with Session(inv.all_hosts) as session:
                busy = set(survey.busy_hosts(survey.survey(session, inv), inv, want))
        inv = hostselect.select_hosts(inv, include, req.exclude, busy, req.num_nodes)
    if req.health:
        from orchestrator.preflight import deep

        with Session(inv.all_hosts) as session:
            inv, lines = deep.gate(session, inv)
        for line in lines:
            say.print(hostile.rich_text(f"health: {line}"))
        selected = True
    return inv, selected


def launch(
    req: TrainRequest, runs: Path, console: Console, say: Console, trainers: dict[str, str]
) -> tuple[Runner | Renderer, Launch]:
    """The request resolved: its backend and the Launch to hand it (one that only renders, with
    --dry-run only)."""
    backend = registry.choose(req.on)
    refused(req, backend)
    if not req.dry_run:  # one that only renders is refused now, before anything is read
        registry.as_runner(backend)
    resume = earlier(req, runs, say, trainers)
    include = req.include
    record = None
    if resume:
        record = JobRecord.load(runs, resume)
        inv = inventory_file.load(req.inventory or record.inventory)
        if record.selected and not (req.include or req.exclude or req.num_nodes):
            include = "@".join(record.selected)
        checked_early(req, inv, include)
        spec, policy, record = resumed(req, backend, record, inv, say, trainers)
    else:
        inv = inventory_file.load(req.inventory)
        checked_early(req, inv, include)
    units = hostselect.units_asked(inv, req.include)
    gpus = cli.count("--gpus", req.gpus)
    inv, selected = hosts_for(req, inv, include, units, gpus, say)
    inv = with_job_settings(req, inv)
    if record is None:
        policy = cli.policy(
            inv, req.restarts or 0, req.min_nodes, req.hang_timeout, choosers(req, include, health=True)
        )
        spec = cli.new_spec(
            {**req.job, "checkpoint": req.job.get("checkpoint") or cli.inventory_checkpoint(inv)}, trainers
        )
    chosen = tuple(h.name for h in inv.hosts) if selected else None
    spec, record = owned(req, spec, record, units, gpus, chosen)
    return backend, Launch(
        inv,
        spec,
        policy,
        record,
        runs,
        say,
        json=req.json,
        live=not (req.plain or req.json),
        checks=not req.skip_preflight,
        smoke=req.smoke,
        selected=chosen,
        notify=hooks(req, inv, record),
        queue=req.queue,
    )


def with_job_settings(req: TrainRequest, inv: Inventory) -> Inventory:
    """The inventory with the job: settings fab train's options give for this job: --hot-spares,
    --metrics-port (checked), --stop-idle."""
    if req.hot_spares:  # --hot-spares: as the inventory's job.hot_spares: true
        inv = replace(inv, job=replace(inv.job, hot_spares=True))
    if req.metrics_port is not None:  # --metrics-port: as the inventory's job.metrics_port
        try:
            listen_address(str(req.metrics_port))
        except ValueError as exc:
            raise UserError(
                f"--metrics-port: {exc}; use a port (9400) or an address and port (0.0.0.0:9400)", exit_code=2
            ) from None
        inv = replace(inv, job=replace(inv.job, metrics_port=str(req.metrics_port)))
    if req.stop_idle:
        inv = replace(inv, job=replace(inv.job, stop_idle=True))
    return inv


def owned(
    req: TrainRequest,
    spec: jobspec.JobSpec,
    record: JobRecord | None,
    units: str,
    gpus: int | None,
    chosen: tuple[str, ...] | None,
) -> tuple[jobspec.JobSpec, JobRecord | None]:
    """The spec (and a resumed job's record) with who runs it now (fab stop ends only its own), and
    the GPUs or slots asked for (a resume keeps the recorded ones unless given again); the record
    also with the hosts `chosen` (None: as recorded)."""
    spec = replace(
        spec,
        owner=claims.me(),
        units=units if req.include else spec.units,
        gpus=spec.gpus if gpus is None else gpus,
        cpuset=req.cpuset or spec.cpuset,
    )
    if record is not None:
        record = replace(
            record,
            selected=list(chosen) if chosen is not None else record.selected,
            spec=replace(record.spec, owner=spec.owner, units=spec.units, gpus=spec.gpus, cpuset=spec.cpuset),
        )
    return spec, record


def hooks(req: TrainRequest, inv: Inventory, record: JobRecord | None) -> Notify | None:
    """Where the job's notifications go: --notify/--notify-url, else what a resumed job recorded,
    else the inventory's job.notify/notify_url (None: keep the record's)."""
    from orchestrator.progress import notify

    if req.notify_url:
        notify.check_url(req.notify_url, "--notify-url")
    if record is not None and not (req.notify or req.notify_url):
        return None
    return Notify(
        command=req.notify or inv.job.notify or None, url=req.notify_url or inv.job.notify_url or None
    )


def train(req: TrainRequest, runs: Path, console: Console, trainers: dict[str, str]) -> str | None:
    """fab train: the dry run's text; or the job run, its curves and step times shown, and its end
    said (UserError when it did not finish)."""
    # With --json, stdout carries JSON lines only: what people read goes to stderr.
    say = cli.stderr_console() if req.json else console
    chosen, job = launch(req, runs, console, say, trainers)
    if req.dry_run:
        return registry.dry_run(chosen, job)
    backend = registry.as_runner(chosen)
    if req.detach:
        finished = backend.detach(job)
        say.print(finished.closing, markup=False)
        return None
    finished = backend.run(job)
    if finished.run_dir is not None:
        cli.present(finished.run_dir, say)
    if finished.error is not None:
        raise finished.error
    say.print(finished.closing, markup=False)
    return None
