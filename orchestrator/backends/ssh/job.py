"""The life of a job, in named stages (attempt.Stage): `run` walks them from the first plan to the
last clean-up and reports what happens as events (events.py); it never prints.

What the job knows between two stages is one frozen value (jobstate.JobState: its roster, the
attempts done and the one under way); each stage takes it and returns the next one, acting only
through the job's context (jobcontext.JobContext: the SSH session, the reporter, the record). The
stages: PLAN (planning.py), CLAIM to TEARDOWN (attempting.py, with claiming.py, gate.py and
starting.py), DECIDE and the pause between attempts (here), FINISH (ending.py).

Each attempt is a frozen plan (attempt.py) built from read-only facts about the hosts (facts.py);
the stages run that plan's steps, so `--dry-run` and runs/JOB/plan.txt show exactly what runs. After
an attempt, policy.decide says whether another follows and on which hosts.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from orchestrator.backends.ssh import attempting, claiming, planning
from orchestrator.backends.ssh import ending as ending_mod
from orchestrator.backends.ssh.attempt import AttemptPlan, Stage
from orchestrator.backends.ssh.jobcontext import JobContext
from orchestrator.backends.ssh.state import Again, Attempted, Ending, JobResult, Queued, Refused
from orchestrator.backends.ssh.waiting import QUEUE_POLL
from orchestrator.core.policy import Decision, Roster, backoff
from orchestrator.core.policy import decide as policy_decide
from orchestrator.hostcmds import hostfiles

if TYPE_CHECKING:
    from collections.abc import Iterator

    from orchestrator.backends.ssh.jobstate import JobState

STOP_POLL = 2.0  # seconds between looks for `fab stop` while waiting between attempts
REPLANS = 3  # plans made again in a row when other jobs claim the same units or port meanwhile


def _unfenced() -> None:
    pass


# A detached job's active controller sets this (failover.Mirror.check): asked before an attempt
# starts containers and before its teardown removes them; it ends the process when another
# controller took the job over (a controller that wakes from a freeze never acts on a job it lost).
FENCE: Callable[[], None] = _unfenced


def fence() -> None:
    """FENCE as it is now (set by the controller after this module loaded)."""
    FENCE()


class Job(JobContext):
    """One job across its attempts: its context (what it was asked, its record, its effects) and its
    state as the last stage left it (`state`, replaced only by this module's driver)."""

    @property
    def roster(self) -> Roster:
        """The next attempt's hosts (policy.decide's)."""
        return self.state.roster

    @roster.setter
    def roster(self, roster: Roster) -> None:
        self.state = replace(self.state, roster=roster)

    @property
    def history(self) -> tuple[Attempted, ...]:
        return self.state.history

    @property
    def last(self) -> AttemptPlan | None:
        return self.state.last

    def plan(self, dry: bool = False) -> AttemptPlan:
        """PLAN on its own (--dry-run): the next attempt's plan."""
        self.state, a = planning.plan(self, self.state, dry)
        return a


def run(job: Job, running: AttemptPlan | None = None, state: JobState | None = None) -> JobResult:
    """The life of a job: PLAN -> CLAIM -> GATE -> SNAPSHOT -> START -> WATCH -> TEARDOWN -> DECIDE,
    again from PLAN while the policy allows, then FINISH. From `state` (default: the job's own);
    with `running` (an attempt whose containers run: fab attach), from its WATCH."""
    if state is not None:
        job.state = state
    try:
        with job.open(), leased(job):
            ending = None
            try:
                ending = course(job, running)
            finally:
                job.leave_queue()
                result = ending_mod.finish(job, job.state, ending)
    except Refused:
        if not job.resuming:  # a new job refused its hosts leaves nothing, here either
            shutil.rmtree(job.run_dir, ignore_errors=True)
        raise
    return result


def course(job: Job, running: AttemptPlan | None) -> Ending | None:
    """Attempt after attempt, as the policy decides; how the job ended (None: an error ended it
    before its last attempt was judged). A claim that found its hosts taken meanwhile plans
    again (up to REPLANS times in a row), or waits in the queue (--queue)."""
    replans = 0
    while True:
        tried = one_attempt(job, running, may_replan=replans < REPLANS)
        running = None
        if isinstance(tried, Again):
            if tried.queued is None:
                replans += 1
                continue
            replans = 0
            ended = wait_in_queue(job, job.state, tried.queued)
            if ended is not None:
                return ended
            continue
        job.state, d = decide(job, job.state, tried)
        if d.roster is None:
            return Ending.of(job.state.history[-1].outcome, d.reason)
        ended = between_attempts(job, job.state, pause_after(d, tried.plan.number))
        if ended is not None:
            return ended


def one_attempt(job: Job, running: AttemptPlan | None, may_replan: bool) -> Attempted | Again:
    """One attempt from its PLAN (or, `running`, from the WATCH of one taken over) to its TEARDOWN.
    The state is replaced after each stage, so that the finish after an error sees the attempt."""
    if running is not None:
        job.state = attempting.take_over(job, job.state, running)
        job.state, done = attempting.follow(job, job.state, running, fence)
        return done
    job.state, a = planning.plan(job, job.state)
    job.state = attempting.begin(job, job.state, a, fence)
    try:
        job.state, tried = attempting.attempt(job, job.state, a, may_replan, fence)
    except Refused:  # nothing of this job is left on its hosts to fetch or clean
        job.state = replace(job.state, current=None)
        raise
    return tried


def decide(job: JobContext, state: JobState, done: Attempted) -> tuple[JobState, Decision]:
    """DECIDE: the attempt recorded (a failure may have been `fab stop`), the policy asked; the state
    with the attempt done and, when another follows, its roster."""
    a = done.plan
    job.stage(Stage.DECIDE, a.number)
    o = done.outcome
    if (
        o.failures
        and not o.stopped
        and job.stopped(state.answering(h for h in state.used.values() if h.name not in done.lost))
    ):
        done = replace(done, outcome=replace(o, stopped=True))
    line = done.line()
    job.record_judged(line)
    job.emit("attempt_end", attempt=a.number, ok=done.outcome.ok, outcome=line)
    d = policy_decide(
        done.outcome,
        job.policy,
        state.roster,
        job.target_nodes,
        warm=frozenset(done.warm_ranks),
        hot=frozenset(h.name for h in a.hot),
    )
    if d.roster is None:
        job.emit("decision", attempt=a.number, next=False, reason=d.reason, notes=list(d.notes))
        return state.judged(done, None), d
    for n in d.notes:
        job.note(n, "warning")
    job.emit(
        "decision",
        attempt=a.number,
        next=True,
        notes=list(d.notes),
        reason=(
            f"attempt {a.number} failed ({line}); restart {d.roster.restarts_used} of "
            f"{job.policy.restarts} in {pause_after(d, a.number):g}s"
        )
        if d.restart
        else f"attempt {a.number}: {line}; trying again with other hosts",
    )
    return state.judged(done, d.roster), d


def pause_after(d: Decision, number: int) -> float:
    """Seconds before the attempt after `number`: a restart backs off, other hosts go at once."""
    return backoff(number + 1) if d.restart else 0


def between_attempts(job: JobContext, state: JobState, pause: float) -> Ending | None:
    """The pause before the next attempt; the job's end when `fab stop` came meanwhile."""
    deadline = time.monotonic() + pause
    while True:
        if job.stopped(state.answering(state.used.values())):
            return ended_by_stop(job, "ended by 'fab stop' between attempts")
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(STOP_POLL, max(0.0, deadline - time.monotonic())))


def wait_in_queue(job: JobContext, state: JobState, q: Queued) -> Ending | None:
    """fab train --queue, while the hosts are held: the job's place kept in the queue of each of
    its hosts (queue.py), then a pause; the job's end when `fab stop` ended it meanwhile."""
    place = job.place_in_queue
    assert place is not None, "only a job with --queue waits in the queue"
    hosts = state.roster.hosts
    place.keep(job.ssh, hosts, q)
    deadline = time.monotonic() + QUEUE_POLL
    while time.monotonic() < deadline:
        if job.stopped(state.answering(hosts)):
            # Out of the queue, and fab stop's marker gone with it (no claim, no runtime files).
            claiming.release(job, list(hosts), queue=True)
            place.forget()
            return ended_by_stop(job, "ended by 'fab stop' while it waited in the queue")
        time.sleep(min(STOP_POLL, max(0.0, deadline - time.monotonic())))
    return None


def ended_by_stop(job: JobContext, reason: str) -> Ending:
    job.emit("decision", next=False, reason=reason, notes=[])
    return Ending("stopped", reason)


@contextlib.contextmanager
def leased(job: Job) -> Iterator[None]:
    """The job's lease on its hosts kept while it lives (keep_lease, in a thread of its own)."""
    leasing = threading.Event()
    threading.Thread(target=keep_lease, args=(job, leasing), daemon=True, name="lease").start()
    try:
        yield
    finally:
        leasing.set()


def keep_lease(job: Job, leasing: threading.Event) -> None:
    """Touch the job's lease on its hosts every hostfiles.LEASE_EVERY s (hostops: left-over runtime
    directories are those whose lease went stale), until `leasing` is set."""
    while not leasing.wait(hostfiles.LEASE_EVERY):
        state = job.state
        a, lost = state.last, state.lost
        if a is not None:
            job.run_steps(state.reach(a), [s for s in a.steps if s.key == "lease" and s.where not in lost])
