"""What every place a job runs offers (Backend), what the command line hands one (Launch) and gets
back (Finished, Status, Stopped), and the one place that chooses a backend (backends/__init__.py).

A backend is a folder under backends/ with a class that has these methods, registered by name in
backends/__init__.py (BACKENDS). `fab train --on NAME` starts a job there; `fab logs`, `fab stop
--job` and `fab train --resume` find a job's backend in its record (runs/JOB/job.json); `fab status`
and `fab stop` ask every backend the inventory uses."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.config.inventory import Inventory
    from orchestrator.core.errors import UserError
    from orchestrator.core.jobspec import JobSpec
    from orchestrator.core.policy import Policy
    from orchestrator.core.recovery import JobRecord


@dataclass(frozen=True)
class Launch:
    """A job the command line has resolved, ready to run: where (inv), what (spec), how hard to try
    (policy), its record when it continues an earlier one, and how to show it."""

    inv: Inventory
    spec: JobSpec
    policy: Policy
    record: JobRecord | None
    runs: Path
    console: Console            # where people read (stderr with --json)
    json: bool = False          # events as JSON lines on stdout
    live: bool = True           # the status board at the bottom of a terminal
    checks: bool = True         # preflight before the start
    smoke: bool = False
    selected: tuple[str, ...] | None = None   # hosts chosen by --include/--exclude/--num-nodes/--health
    notify: dict[str, str] | None = None      # {"command", "url"}: --notify, --notify-url (None: as recorded)
    queue: bool = False                       # wait in line while the hosts are held (fab train --queue)


@dataclass(frozen=True)
class Finished:
    """How a job (or the following of one) ended, whatever ran it."""

    job_id: str
    run_dir: Path | None        # runs/JOB: logs, outputs, curves
    error: UserError | None     # None: it finished, every node exited 0 (or the follower detached)
    closing: str = ""           # the last line for people


@dataclass
class Status:
    """A backend's part of `fab status`."""

    doc: dict[str, Any] = field(default_factory=dict)   # merged into --json's document
    tables: list[Any] = field(default_factory=list)      # rich renderables, in order
    lines: list[str] = field(default_factory=list)       # after the tables
    errors: list[str] = field(default_factory=list)      # hosts that did not answer: exit non-zero


@dataclass
class Stopped:
    """A backend's part of `fab stop`."""

    lines: list[str] = field(default_factory=list)       # what was stopped (stdout)
    problems: list[str] = field(default_factory=list)    # what could not be (stderr)
    failed: list[str] = field(default_factory=list)      # hosts to try again


class Backend(Protocol):
    name: str
    where: str  # in "resuming job JOB{where}": "" over SSH, " on Slurm"
    # fab train options that make no sense here (Slurm picks nodes and restarts by requeue), with why.
    refuses: dict[str, str]

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
        self, inv: Inventory, job_id: str | None, runs: Path, console: Console, live: bool
    ) -> Finished:
        """fab logs: follow a running job from the start of its output; Ctrl+C detaches."""
        ...

    def stop(self, inv: Inventory, job_id: str | None, everyone: bool, yes: bool, grace: float,
             runs: Path) -> Stopped: ...

    def status(self, inv: Inventory, runs: Path) -> Status: ...
