"""One attempt's stages, from its CLAIM to its TEARDOWN: CLAIM (claiming.py), GATE (gate.py),
SNAPSHOT and START (starting.py), WATCH, and the TEARDOWN that follows whatever happened (`guarded`:
Ctrl+C and SIGTERM included). Each takes the job's state and returns the next one with what the
attempt came to (state.Attempted), or Again when its claim found the hosts taken meanwhile.

`fence` (job.FENCE: a detached job's failover fencing) is asked before the attempt starts
containers and before its teardown removes them.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from orchestrator.backends.ssh import claiming, gate, starting
from orchestrator.backends.ssh.attempt import AttemptPlan, Stage
from orchestrator.backends.ssh.planstep import When
from orchestrator.backends.ssh.state import Again, Attempted
from orchestrator.backends.ssh.watch import watch as follow_nodes
from orchestrator.core.policy import Failure, HostFailure, Outcome

if TYPE_CHECKING:
    from orchestrator.backends.ssh.jobcontext import JobContext
    from orchestrator.backends.ssh.jobstate import JobState

Fence = Callable[[], None]  # job.FENCE


def begin(job: JobContext, state: JobState, a: AttemptPlan, fence: Fence) -> JobState:
    """Attempt `a` recorded as running (runs/JOB/job.json) and under way."""
    fence()
    job.record_begun(a)
    return state.begun(a)


def attempt(
    job: JobContext, state: JobState, a: AttemptPlan, may_replan: bool, fence: Fence
) -> tuple[JobState, Attempted | Again]:
    """CLAIM, GATE, SNAPSHOT, START, WATCH, TEARDOWN of the attempt under way (`begin`): the state
    after it and the attempt as they left it, or Again when its claim found the hosts taken
    meanwhile (then it is as if the attempt never was)."""
    after = state

    def stages() -> Attempted | Again:
        nonlocal after
        ended = prepare(job, state, a, may_replan)
        if ended is not None:
            return ended
        after = replace(after, started=True)
        ended = starting.start(job, after, a)
        if ended is not None:
            return ended
        after = after.watched()
        return watch(job, state, a)

    tried = guarded(job, state, a, stages, fence, started=lambda: after.ran)
    if isinstance(tried, Again):
        job.record_retracted()
        return state.retracted(), tried
    return after, tried


def take_over(job: JobContext, state: JobState, a: AttemptPlan) -> JobState:
    """Attempt `a`, whose containers another process started (fab attach, a failover), under way."""
    job.took_over(a.hosts)
    job.note(
        f"took over job {job.spec.job_id}: attempt {a.number} on "
        f"{', '.join(f'{h.name} (rank {h.rank})' for h in a.hosts)}; following it "
        "from the start of its output"
    )
    return state.taken_over(a)


def follow(job: JobContext, state: JobState, a: AttemptPlan, fence: Fence) -> tuple[JobState, Attempted]:
    """WATCH and TEARDOWN of an attempt taken over (`take_over`): no second container is started."""
    done = guarded(job, state, a, lambda: watch(job, state, a), fence)
    assert isinstance(done, Attempted), "a watch is never planned again"
    return state.watched(), done


def guarded(
    job: JobContext,
    state: JobState,
    a: AttemptPlan,
    body: Callable[[], Attempted | Again],
    fence: Fence,
    started: Callable[[], bool] = lambda: True,
) -> Attempted | Again:
    """The attempt's stages from `body`, then TEARDOWN whatever happened (not after an Again:
    nothing of that attempt started). `started`: whether a container of the job may exist; when an
    error ended the stages before any did (a first preflight that failed), TEARDOWN has nothing to
    end, and a host whose engine is stuck is not waited for."""
    done: Attempted | Again | None = None
    reach = state.reach(a)
    try:
        done = body()
    except KeyboardInterrupt as exc:  # Ctrl+C or SIGTERM outside the watch
        done = Attempted(a, Outcome(interrupted=getattr(exc, "signum", signal.SIGINT)))
        lost = state.lost
        job.run_steps(reach, [s for s in a.steps if s.when is When.ON_INTERRUPT and s.where not in lost])
    finally:  # whatever happened, no container of the attempt is left (lost hosts aside)
        if not isinstance(done, Again):
            skip = state.lost | (done.lost | done.stuck if done else frozenset())
            if done is not None:  # a warm generation seen ended has nothing left to end
                skip |= frozenset(done.warm_ranks)
            fence()
            job.stage(Stage.TEARDOWN, a.number)
            if done is not None or started():
                job.run_steps(reach, [s for s in a.select("stop") if s.where not in skip])
    return done


def prepare(job: JobContext, state: JobState, a: AttemptPlan, may_replan: bool) -> Attempted | Again | None:
    """CLAIM, GATE and SNAPSHOT; the attempt's end when it cannot start (None: it goes on)."""
    job.stage(Stage.CLAIM, a.number)
    refused = claiming.claim(job, state, a, may_replan)
    if refused:
        return refused
    with (job.run_dir / "plan.txt").open("a") as fh:  # after the claim: a queued job's tries are not plans
        fh.write(a.render() + "\n")
    job.emit(
        "attempt",
        attempt=a.number,
        hosts={h.name: h.rank for h in a.hosts},
        port=a.port,
        snapshot=a.snapshot,
        run_dir=str(job.run_dir),
    )
    job.stage(Stage.GATE, a.number)
    bad = gate.sync_and_check(job, state, a)
    if bad:
        return Attempted(a, Outcome(tuple(HostFailure(n, Failure.PREFLIGHT, why) for n, why in bad.items())))
    if job.stopped(state.answering(a.hosts)):
        return Attempted(a, Outcome(stopped=True))
    if a.snapshot:
        placed = starting.place(job, a)
        if placed.errors():
            return starting.failed_to_start(job, state, a, placed)
    return None


def watch(job: JobContext, state: JobState, a: AttemptPlan) -> Attempted:
    """WATCH: follow every node (watch.py) while snapshots are copied off rank 0's host; a host a
    failover found silent (state.known_lost) is lost from the start."""
    job.stage(Stage.WATCH, a.number)
    copying = threading.Event()
    job.store.follow(job.ssh, a.master, copying)
    lost = {"known_lost": dict(state.known_lost)} if state.known_lost else {}
    try:
        w = follow_nodes(
            job.ssh,
            a,
            job.run_dir,
            job.reporter,
            hang_timeout=job.policy.hang_timeout,
            **job.watch_options,
            **lost,
        )
    finally:
        copying.set()
    if w.interrupted is not None:
        return Attempted(a, Outcome(interrupted=w.interrupted), w)
    return Attempted(a, Outcome(tuple(e.failure_line() for e in w.failures)), w)
