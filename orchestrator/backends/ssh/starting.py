"""SNAPSHOT and START: the newest snapshot placed on every host of the attempt that lacks it, then
the containers started on every host at once; and what an attempt that could not start leaves
(`failed_to_start`: the hosts that failed named, the others' part of it ended).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.backends.ssh.attempt import AttemptPlan, Stage
from orchestrator.backends.ssh.planstep import When
from orchestrator.backends.ssh.state import Attempted
from orchestrator.core.errors import UserError
from orchestrator.core.policy import Failure, HostFailure, Outcome
from orchestrator.snapshots.checks import local_digest
from orchestrator.transport.remote import PerHost, describe

if TYPE_CHECKING:
    from orchestrator.backends.ssh.jobcontext import JobContext
    from orchestrator.backends.ssh.jobstate import JobState
    from orchestrator.config.inventory import Host


def place(job: JobContext, a: AttemptPlan) -> PerHost:
    """SNAPSHOT: the plan's place steps, per host that lacks the snapshot: its copy pushed, checked
    by size and SHA-256 and renamed into place (Snapshots.push; up to 3 tries each)."""
    snapshot = a.snapshot
    if snapshot is None:
        raise ValueError(f"attempt {a.number} places no snapshot")
    job.stage(Stage.SNAPSHOT, a.number)
    snaps = job.store
    digest = local_digest(snaps.local_path(snapshot))
    targets = tuple(a.host(s.host) for s in a.select("place"))

    def push(h: Host) -> None:
        copy = next(s for s in a.select("place") if s.host == h.name)
        snaps.push(
            job.ssh,
            h,
            snapshot,
            digest,
            argv=copy.argv,
            check=a.step(h.name, "place-check").command,
            rename=a.step(h.name, "place-rename").command,
        )

    with snaps.lock:  # the copier of the last attempt must not prune it meanwhile
        return job.ssh.fan_out(push, targets)


def start(job: JobContext, state: JobState, a: AttemptPlan) -> Attempted | None:
    """START: the secrets file and docker run on every host at once, rank 0's issued first.
    Nothing waits for rank 0: torchrun's workers retry the rendezvous until it listens."""
    job.stage(Stage.START, a.number)
    job.leave_queue()
    starts = [s for s in a.steps if s.key in ("secrets", "start", "spare") and s.when is When.ALWAYS]
    started = job.run_steps(state.reach(a), starts)
    hot = {h.name for h in a.hot}
    for name, exc in started.errors().items():
        if name in hot:  # the attempt goes on; that spare is started again (or cold) when needed
            job.note(f"{name}: the hot spare was not started ({exc}); it stays a cold spare", "warning")
    ranks = PerHost({n: r for n, r in started.items() if n not in hot})
    return failed_to_start(job, state, a, ranks) if ranks.errors() else None


def failed_to_start(job: JobContext, state: JobState, a: AttemptPlan, results: PerHost) -> Attempted:
    """The hosts that could not start (a host that did not answer is lost), the others' part of
    the attempt ended (ON_FAILURE)."""
    failures = []
    used = state.used
    for name, exc in results.errors().items():
        h = a.host(name) if name in {x.name for x in a.hosts} else used[name]
        kind = Failure.START if isinstance(exc, UserError) else Failure.LOST
        failures.append(HostFailure(name, kind, describe(h, exc)))
        job.emit("host_failed", attempt=a.number, host=name, kind=kind.value, detail=failures[-1].detail)
    others = [s for s in a.steps if s.when is When.ON_FAILURE and s.where not in results.errors()]
    job.run_steps(state.reach(a), others)
    return Attempted(a, Outcome(tuple(failures)))
