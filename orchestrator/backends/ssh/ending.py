"""FINISH: the job's end on every host it used (its containers swept, the newest snapshot and the
outputs fetched, its runtime files and claims removed) and the one JobResult made from how it
ended and its attempts."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from orchestrator.backends.ssh import attempt as attempt_mod
from orchestrator.backends.ssh import facts
from orchestrator.backends.ssh.attempt import AttemptPlan, Stage, Step
from orchestrator.backends.ssh.state import Ending, JobResult
from orchestrator.transport.remote import describe

if TYPE_CHECKING:
    from orchestrator.backends.ssh.job import Job
    from orchestrator.config.inventory import Host


def finish(job: Job, ending: Ending | None) -> JobResult:
    """FINISH: outputs fetched from every host used and still answering, runtime files removed;
    the job's one result, from how it ended and its attempts."""
    job.stage(Stage.FINISH)
    ending = ending or Ending("failed")  # an error ended the job before its attempt was judged
    job.record.state = ending.state
    job.record.save(job.run_dir)
    a, lost, stuck = job.last, job.lost, job.stuck
    reachable = tuple(h for h in job.used.values() if h.name not in lost)
    if a is not None and reachable:
        collect(job, a, reachable, stuck)
    if lost:
        job.note(f"lost during the job: {', '.join(sorted(lost))}; its container and runtime files may "
                  "still exist: 'fab stop' removes them once it answers again", "warning")
    if stuck:
        job.note(
            f"Docker engine stuck on {', '.join(sorted(stuck))}: its container may still exist; run "
            "'fab stop' once the engine answers",
            "warning",
        )
    watched = [d.watched for d in job.history if d.watched is not None]
    result = JobResult(
        job.spec.job_id,
        job.run_dir,
        ending.state,
        len(job.record.attempts),
        ending.reason,
        watched[-1] if watched else None,
        [f"attempt {d.plan.number} on {', '.join(h.name for h in d.plan.hosts)}: {d.line()}"
         for d in job.history if not d.outcome.ok and d.outcome.interrupted is None],
        ending.interrupted,
        sorted(lost),
        sorted(stuck),
    )
    job.emit("finished", state=result.state, attempts=result.attempts, run_dir=str(job.run_dir))
    return result


def collect(job: Job, a: AttemptPlan, reachable: tuple[Host, ...], stuck: frozenset[str]) -> None:
    """At the end, on every host used that answers: the job's containers swept, the newest snapshot
    and the outputs fetched, the runtime files and claim removed (attempt.end_steps)."""
    ends = attempt_mod.end_steps(a.inv, job.spec, reachable, str(job.run_dir))
    sweep(job, a, [s for s in ends if s.key == "sweep" and s.where not in stuck])
    if job.snaps is not None:
        # The newest snapshot, checked, is the one the outputs keep (the hosts keep K each). No
        # attempt follows, so no host's copy needs checking for placement (hosts=()): every
        # host used is still asked where the newest is.
        facts.newest_snapshot(
            job.ssh, job.snaps, replace(a.inv, hosts=()), job.spec, reachable, fetch=True
        )
    for h in reachable:
        (job.run_dir / "outputs" / h.name).mkdir(parents=True, exist_ok=True)
    fetched = job.run_steps(a, [s for s in ends if s.key == "fetch"])
    for name, exc in fetched.errors().items():
        job.note(f"could not fetch outputs from {name}: {exc}", "warning")
    job.run_steps(a, [s for s in ends if s.key == "cleanup"])


def sweep(job: Job, a: AttemptPlan, steps: list[Step]) -> None:
    """Every container of the job removed again, by its label, from the hosts it used: what a
    `docker run` that came back late (after its deadline, or after the teardown looked) left
    behind is named and gone before the job's claim on those GPUs is released."""
    if not steps:
        return
    swept = job.run_steps(a, steps)
    for name, r in swept.items():
        if name in swept.errors():
            job.note(f"{name}: could not look for containers of the job left after its teardown: "
                      f"{describe(job.used[name], r)}; 'fab stop' removes them", "warning")
        elif r.stdout.split() and not a.warm:  # a warm job's containers wait there by design
            job.note(
                f"{name}: removed {len(r.stdout.split())} container(s) of the job still there after its "
                "teardown (a docker run that came back after its deadline?)",
                "warning",
            )
