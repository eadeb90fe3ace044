"""What runs jobs (Runner), what writes a job as files (Renderer), the options each takes (Option),
what the command line hands one (Launch) and gets back (Finished, Status, Stopped, Rendered).

A backend is a folder under backends/ with a class that is a Runner (SSH hosts, Slurm), a Renderer
(the Kubernetes manifests) or both (Slurm also writes its sbatch script), registered by name in
backends/registry.py (BACKENDS), the one place that chooses one. `fab train --on NAME` runs a job on
a Runner (with --dry-run, any of them renders it); `fab export.NAME` writes a Renderer's files; `fab
logs`, `fab stop --job` and `fab train --resume` find a job's Runner in its record (runs/JOB/job.json);
`fab status` and `fab stop` ask every Runner the inventory uses.

Each declares the fab train options it takes (`accepts`, from TRAIN_OPTIONS, typed as TorchX's
runopts are); the command line refuses any other one given, naming it and the backend's `declines`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from orchestrator.core.policy import HANG_TIMEOUT

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.config.inventory import Inventory
    from orchestrator.core.errors import UserError
    from orchestrator.core.jobspec import JobSpec
    from orchestrator.core.policy import Policy
    from orchestrator.core.record import Notify
    from orchestrator.core.recovery import JobRecord


@dataclass(frozen=True)
class Option:
    """One option a backend takes, typed (TorchX's runopts): the name it has in fab's TrainRequest (or
    in an export task), the type of its value, its default and what it does."""

    name: str
    type: type
    default: Any = None
    help: str = ""

    @property
    def flag(self) -> str:
        """As people type it: --continue for continue_, --num-nodes for num_nodes."""
        return "--" + self.name.rstrip("_").replace("_", "-")


# The fab train options that depend on where the job runs: a backend takes those in its `accepts`
# and the command line refuses the others when given. (The job's own options, --inventory, --on,
# --dry-run, --resume and --plain mean the same everywhere.)
TRAIN_OPTIONS: tuple[Option, ...] = (
    Option("continue_", bool, False, "continue the newest job of this --name"),
    Option("restarts", int, 0, "restart the whole job up to N times after a failure"),
    Option("min_nodes", int, None, "with no spare left, go on with at least this many nodes"),
    Option("hang_timeout", float, HANG_TIMEOUT, "seconds without progress before an attempt fails"),
    Option("include", str, None, "run on these hosts (and GPUs) only"),
    Option("exclude", str, None, "run on every host but these"),
    Option("num_nodes", int, None, "run on the first N hosts where the job fits"),
    Option("gpus", int, None, "take N free GPUs (CPU slots) on each host"),
    Option("cpuset", bool, False, "pin each CPU host's container to its slots' CPUs"),
    Option("health", bool, False, "the deep check first; unhealthy hosts left out"),
    Option("smoke", bool, False, "the collective smoke test before the start"),
    Option("skip_preflight", bool, False, "start without the preflight checks"),
    Option("json", bool, False, "events as JSON lines on stdout"),
    Option("notify", str, None, "a command run for each notification"),
    Option("notify_url", str, None, "an http(s) URL each notification is posted to"),
    Option("detach", bool, False, "the job's control on a host of the inventory; return at once"),
    Option("queue", bool, False, "wait in line while the hosts are held"),
    Option("hot_spares", bool, False, "the spares started with the job, warm"),
    Option("metrics_port", str, None, "serve the job's metrics for Prometheus"),
    Option("stop_idle", bool, False, "stop the job when a GPU it holds stays idle"),
)


def train_options(*names: str) -> tuple[Option, ...]:
    """The TRAIN_OPTIONS of these names, in their order there (KeyError for a name not among them)."""
    unknown = set(names) - {o.name for o in TRAIN_OPTIONS}
    if unknown:
        raise KeyError(f"not fab train options: {', '.join(sorted(unknown))}")
    return tuple(o for o in TRAIN_OPTIONS if o.name in names)


@dataclass(frozen=True)
class Launch:
    """A job the command line has resolved, ready to run: where (inv), what (spec), how hard to try
    (policy), its record when it continues an earlier one, and how to show it."""

    inv: Inventory
    spec: JobSpec
    policy: Policy
    record: JobRecord | None
    runs: Path
    console: Console  # where people read (stderr with --json)
    json: bool = False  # events as JSON lines on stdout
    live: bool = True  # the status board at the bottom of a terminal
    checks: bool = True  # preflight before the start
    smoke: bool = False
    selected: tuple[str, ...] | None = None  # hosts chosen by --include/--exclude/--num-nodes/--health
    notify: Notify | None = None  # --notify, --notify-url (None: as recorded)
    queue: bool = False  # wait in line while the hosts are held (fab train --queue)


@dataclass(frozen=True)
class Finished:
    """How a job (or the following of one) ended, whatever ran it."""

    job_id: str
    run_dir: Path | None  # runs/JOB: logs, outputs, curves
    error: UserError | None  # None: it finished, every node exited 0 (or the follower detached)
    closing: str = ""  # the last line for people


@dataclass
class Status:
    """A backend's part of `fab status`."""

    doc: dict[str, Any] = field(default_factory=dict)  # merged into --json's document
    tables: list[Any] = field(default_factory=list)  # rich renderables, in order
    lines: list[str] = field(default_factory=list)  # after the tables
    errors: list[str] = field(default_factory=list)  # hosts that did not answer: exit non-zero


@dataclass
class Stopped:
    """A backend's part of `fab stop`."""

    lines: list[str] = field(default_factory=list)  # what was stopped (stdout)
    problems: list[str] = field(default_factory=list)  # what could not be (stderr)
    failed: list[str] = field(default_factory=list)  # hosts to try again
    jobs: list[str] = field(default_factory=list)  # the jobs stopped (--json)
    removed: dict[str, int] = field(default_factory=dict)  # host -> containers removed there (--json)
    left_alone: list[str] = field(default_factory=list)  # others' jobs not stopped (--json)

    def doc(self) -> dict:
        """`fab stop --json`: what was stopped, where, what was left alone, and what failed."""
        return {
            "stopped": self.jobs,
            "containers_removed": self.removed,
            "left_alone": self.left_alone,
            "failed_hosts": self.failed,
            "problems": self.problems,
            "lines": self.lines,
        }


@dataclass(frozen=True)
class Rendered:
    """What a Renderer makes of a job: its files ({name: text}, in order) and warnings (settings it
    cannot give every node, said to people, never written)."""

    job_id: str
    files: dict[str, str]
    warnings: tuple[str, ...] = ()
    title: str = ""  # the line above the files in what --dry-run prints ("": none)

    def text(self) -> str:
        """What `fab train --on NAME --dry-run` prints: the title, then each file under its name; with
        no title (a runner's plan), the files' text alone."""
        if not self.title:
            return "\n".join(self.files.values())
        return "\n".join([self.title, *(f"\n--- {file} ---\n{text}" for file, text in self.files.items())])


class Renderer(Protocol):
    """Writes a job as files, running nothing: `fab export.NAME`, and `fab train --on NAME --dry-run`
    for one that is not also a Runner."""

    name: str
    accepts: tuple[Option, ...]  # the fab train options it reads from the Launch (TRAIN_OPTIONS')
    declines: str  # why it takes no other one (said with the refusal)
    settings: tuple[Option, ...]  # its own options (fab export.NAME's), handed to render with defaults

    def render(self, launch: Launch, settings: dict[str, Any]) -> Rendered:
        """The job's files; pure but for reading what the Launch names."""
        ...


class Runner(Protocol):
    """Runs jobs, follows, stops and lists them."""

    name: str
    where: str  # in "resuming job JOB{where}": "" over SSH, " on Slurm"
    accepts: tuple[Option, ...]  # the fab train options it takes (TRAIN_OPTIONS'); others are refused
    declines: str  # why it takes no other one (Slurm picks the nodes, requeues, ...)

    def serves(self, inv: Inventory) -> bool:
        """Whether the inventory uses this backend (fab status and fab stop ask only those)."""
        ...

    def refuse_if_running(self, inv: Inventory, job_id: str, how: str) -> None:
        """UserError when the job still runs: `how` (--resume, --continue) would hurt it."""
        ...

    def dry_run(self, launch: Launch) -> str:
        """Every command the job would run, in order, from what `run` would execute; nothing runs."""
        ...

    def run(self, launch: Launch) -> Finished: ...

    def detach(self, launch: Launch) -> Finished:
        """fab train --detach: start the job's control away from this machine and return."""
        ...

    def take_over(self, launch: Launch) -> Finished:
        """fab attach: go on controlling a running job (launch.record's) whose controller is gone."""
        ...

    def attach(
        self, inv: Inventory, job_id: str | None, runs: Path, console: Console, live: bool, json: bool = False
    ) -> Finished:
        """fab logs: follow a running job from the start of its output; Ctrl+C detaches. `json`: its
        events as JSON lines on stdout instead of the hosts' log lines (as fab train --json)."""
        ...

    def stop(
        self, inv: Inventory, job_id: str | None, everyone: bool, yes: bool, grace: float, runs: Path
    ) -> Stopped: ...

    def status(self, inv: Inventory, runs: Path) -> Status: ...


# What the runners' own modules check themselves against (`_checked: Backend = SshBackend()`).
Backend = Runner
