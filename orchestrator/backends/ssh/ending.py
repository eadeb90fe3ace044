"""FINISH: the job's end on every host it used (its containers swept, the newest snapshot and the
outputs fetched, its runtime files and claims removed) and the one JobResult made from how it
ended and its attempts."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from orchestrator.backends.ssh import facts
from orchestrator.backends.ssh.attempt import AttemptPlan, Stage
from orchestrator.backends.ssh.planstep import Step
from orchestrator.backends.ssh.stagesteps import end_steps
from orchestrator.backends.ssh.state import Ending, JobResult
from orchestrator.transport.remote import describe, failure

if TYPE_CHECKING:
    from orchestrator.backends.ssh.jobcontext import JobContext
    from orchestrator.backends.ssh.jobstate import JobState
    from orchestrator.config.inventory import Host


def finish(job: JobContext, state: JobState, ending: Ending | None) -> JobResult:
    """FINISH: outputs fetched from every host used and still answering, runtime files removed;
    the job's one result, from how it ended and its attempts (`state`: as the last stage left it)."""
    job.stage(Stage.FINISH)
    ending = ending or Ending("failed")  # an error ended the job before its attempt was judged
    job.record_ended(ending.state)
    a, lost, stuck = state.last, state.lost, state.stuck
    reachable = tuple(h for h in state.used.values() if h.name not in lost)
    if a is not None and reachable:
        collect(job, state, a, reachable)
    if lost:
        job.note(
            f"lost during the job: {', '.join(sorted(lost))}; its container and runtime files may "
            "still exist: 'fab stop' removes them once it answers again",
            "warning",
        )
    if stuck:
        job.note(
            f"Docker engine stuck on {', '.join(sorted(stuck))}: its container may still exist; run "
            "'fab stop' once the engine answers",
            "warning",
        )
    watched = [d.watched for d in state.history if d.watched is not None]
    result = JobResult(
        job.spec.job_id,
        job.run_dir,
        ending.state,
        len(job.record.attempts),
        ending.reason,
        watched[-1] if watched else None,
        [
            f"attempt {d.plan.number} on {', '.join(h.name for h in d.plan.hosts)}: {d.line()}"
            for d in state.history
            if not d.outcome.ok and d.outcome.interrupted is None
        ],
        ending.interrupted,
        sorted(lost),
        sorted(stuck),
    )
    job.emit("finished", state=result.state, attempts=result.attempts, run_dir=str(job.run_dir))
    return result


def collect(job: JobContext, state: JobState, a: AttemptPlan, reachable: tuple[Host, ...]) -> None:
    """At the end, on every host used that answers: the job's containers swept, the newest snapshot
    and the outputs fetched, the runtime files and claim removed (stagesteps.end_steps). When no
    container of the job ever ran (`state.ran`: its first preflight failed), there is nothing to
    sweep or fetch, and a host whose engine is stuck is not waited for again."""
    ends = end_steps(a.inv, state.spec, reachable, str(job.run_dir))
    if not state.ran:
        cleanup(job, state, a, ends)
        return
    stuck, reach = state.stuck, state.reach(a)
    sweep(job, state, a, [s for s in ends if s.key == "sweep" and s.where not in stuck])
    if job.snaps is not None:
        # The newest snapshot, checked, is the one the outputs keep (the hosts keep K each). No
        # attempt follows, so no host's copy needs checking for placement (hosts=()): every
        # host used is still asked where the newest is.
        facts.newest_snapshot(job.ssh, job.snaps, replace(a.inv, hosts=()), state.spec, reachable, fetch=True)
    for h in reachable:
        (job.run_dir / "outputs" / h.name).mkdir(parents=True, exist_ok=True)
    fetched = job.run_steps(reach, [s for s in ends if s.key == "fetch"])
    for name, exc in fetched.errors().items():
        job.note(f"could not fetch outputs from {name}: {exc}", "warning")
    cleanup(job, state, a, ends)


def cleanup(job: JobContext, state: JobState, a: AttemptPlan, ends: list[Step]) -> None:
    """The job's runtime files (its secrets among them) and claim removed from every host used that
    answers; a host where that failed is named, with what removes them later."""
    hosts = {h.name: h for h in state.reach(a)}
    done = job.run_steps(hosts.values(), [s for s in ends if s.key == "cleanup"])
    for name, r in done.items():
        why = failure(hosts[name], r, "removing the job's runtime files and claim")
        if why is not None:
            job.note(f"{why}; 'fab stop --job {job.spec.job_id}' removes them once it answers", "warning")


def sweep(job: JobContext, state: JobState, a: AttemptPlan, steps: list[Step]) -> None:
    """Every container of the job removed again, by its label, from the hosts it used: what a
    `docker run` that came back late (after its deadline, or after the teardown looked) left
    behind is named and gone before the job's claim on those GPUs is released."""
    if not steps:
        return
    swept = job.run_steps(state.reach(a), steps)
    for name, r in swept.items():
        if name in swept.errors():
            job.note(
                f"{name}: could not look for containers of the job left after its teardown: "
                f"{describe(state.used[name], r)}; 'fab stop' removes them",
                "warning",
            )
        elif r.stdout.split() and not a.warm:  # a warm job's containers wait there by design
            job.note(
                f"{name}: removed {len(r.stdout.split())} container(s) of the job still there after its "
                "teardown (a docker run that came back after its deadline?)",
                "warning",
            )
