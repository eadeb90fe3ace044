"""The values a job's stages hand each other (job.py): each attempt's state as one frozen value
(`Attempted`), what a claim that could not go on asks for (`Again`), how the job ended (`Ending`),
and the one `JobResult` made from them at its end; and the errors that end a job before it starts.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core.errors import UserError
from orchestrator.core.policy import Failure, Outcome

if TYPE_CHECKING:
    from orchestrator.backends.ssh.attempt import AttemptPlan
    from orchestrator.backends.ssh.watch import Watched
    from orchestrator.config.inventory import Host
    from orchestrator.hosts import claims, queue
    from orchestrator.preflight.checks import Check


@dataclass(frozen=True)
class Attempted:
    """One attempt when its stages are done: its plan, how it ended, what its watch saw (None: it
    ended before the watch). The job's knowledge of its hosts is the sum of these."""

    plan: AttemptPlan
    outcome: Outcome
    watched: Watched | None = None

    @property
    def lost(self) -> frozenset[str]:
        """Hosts lost in this attempt: never asked again, by any later step of the job."""
        return frozenset(f.host for f in self.outcome.failures if f.kind is Failure.LOST)

    @property
    def stuck(self) -> frozenset[str]:
        """Hosts whose Docker engine stopped answering: their teardown is not tried."""
        return frozenset(self.watched.stuck_engines if self.watched else ())

    @property
    def warm_ranks(self) -> dict[str, int]:
        """host -> rank of its container waiting warm between generations, as the watch left it."""
        if self.watched is None:
            return {}
        return {n: e.host.rank for n, e in self.watched.ends.items() if e.warm}

    def line(self) -> str:
        """How it ended, in one line: 'ok', 'interrupted (SIGINT)', or the failures."""
        o = self.outcome
        if o.ok:
            return "ok"
        if o.interrupted is not None:
            return f"interrupted ({signal.Signals(o.interrupted).name})"
        return "; ".join(f.line() for f in o.failures) or "ended by 'fab stop'"


@dataclass(frozen=True)
class Queued:
    """fab train --queue: a host's GPUs (slots) are held, or jobs queued before this one wait for it."""

    host: Host
    held: tuple[claims.Holder, ...]
    ahead: tuple[queue.Waiting, ...]


@dataclass(frozen=True)
class Again:
    """The claim found the attempt's units or master port taken between its plan and its claim:
    plan it again from the claims as they are now, at once, or, with `queued`, once the job's
    place in the queue comes."""

    queued: Queued | None = None


@dataclass(frozen=True)
class Ending:
    """How the job ended, decided once (by the policy, `fab stop`, or an interruption)."""

    state: str  # finished, failed, stopped, interrupted
    reason: str = ""
    interrupted: int | None = None

    @staticmethod
    def of(outcome: Outcome, reason: str) -> Ending:
        state = (
            "finished"
            if outcome.ok
            else "interrupted"
            if outcome.interrupted is not None
            else "stopped"
            if outcome.stopped
            else "failed"
        )
        return Ending(state, reason, outcome.interrupted)


@dataclass(frozen=True)
class JobResult:
    job_id: str
    run_dir: Path
    state: str = "failed"  # finished, failed, stopped, interrupted
    attempts: int = 0
    reason: str = ""  # why the job ended (policy.decide), when it did not finish
    watched: Watched | None = None  # the last attempt's that was watched
    failures: list[str] = field(default_factory=list)  # every failed attempt, one line each
    interrupted: int | None = None
    lost: list[str] = field(default_factory=list)
    stuck_engines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.state == "finished"


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Refused(UserError):
    """The job's hosts (or GPUs) are held by another job: nothing was started."""


class PreflightFailed(UserError):
    """The first attempt's gate failed: nothing was started."""

    def __init__(self, checks: list[Check], hosts: list[str], text: str = "") -> None:
        super().__init__(
            text
            or f"preflight failed on {', '.join(hosts)}; nothing was started. Fix the checks "
            "above, then run the command again"
        )
        self.checks = checks
