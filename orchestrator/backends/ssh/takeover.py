"""`fab attach JOB`: take over a running job whose `fab train` (or controller) is gone.

The job's record (runs/JOB/job.json) says its running attempt: number and hosts in rank order;
the hosts' claims say its GPUs (slots) and master port. From those the attempt's plan is built again
(attempt.py, the same function every attempt uses) and the job goes on from WATCH, in the same
stages (job.py): the watchdog, restarts, snapshot copies and the final fetch, with no second
container started. A job whose lease is fresh is looked after by someone: it is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from orchestrator.backends.ssh import attempt as attempt_mod
from orchestrator.backends.ssh.planning import key_code
from orchestrator.core.errors import UserError
from orchestrator.core.policy import Roster
from orchestrator.hostcmds import hostfiles
from orchestrator.hosts.survey import HostJobs

if TYPE_CHECKING:
    from orchestrator.backends.ssh.attempt import AttemptPlan
    from orchestrator.backends.ssh.jobcontext import JobContext
    from orchestrator.backends.ssh.jobstate import JobState
    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.core.recovery import JobRecord
    from orchestrator.transport.remote import PerHost


@dataclass(frozen=True)
class Running:
    """A running attempt as the record and the hosts show it."""

    number: int
    hosts: tuple[Host, ...]  # rank order, ranks set
    port: int
    units: dict[str, tuple[int, ...]]
    restarts_used: int  # restarts spent since the job was last started or resumed


def running_attempt(found: PerHost, inv: Inventory, record: JobRecord, lease: bool = True) -> Running:
    """What to take over, or UserError saying why there is nothing to (pure: from the survey).
    `lease`: refused while the job's lease is fresh (not for a standby that saw its controller gone)."""
    job = record.job_id
    if record.state != "running" or not record.attempts:
        raise UserError(
            f"job {job} is {record.state} (runs/{job}/job.json): there is nothing to take over; "
            f"continue it with 'fab train --resume {job}'",
            exit_code=2,
        )
    by_name = {h.name: h for h in inv.all_hosts}
    last = record.attempts[-1]
    unknown = [n for n in last.hosts if n not in by_name]
    if unknown:
        raise UserError(
            f"job {job} runs on {', '.join(unknown)}, which {inv.path} does not name; give the "
            "inventory it was started with (--inventory)",
            exit_code=2,
        )
    survey = {n: hj for n, hj in found.items() if isinstance(hj, HostJobs)}
    if lease:
        refuse_if_looked_after(found, job)
    if not any(job in survey[n].containers for n in last.hosts if n in survey):
        raise UserError(
            f"job {job} has no container on its hosts ({', '.join(last.hosts)}) that answered: "
            f"nothing runs to take over; continue it with 'fab train --resume {job}'",
            exit_code=2,
        )
    hosts = tuple(replace(by_name[n], rank=rank) for rank, n in enumerate(last.hosts))
    units, port = {}, inv.job.master_port
    for n in last.hosts:
        for c in survey[n].claimed if n in survey else ():
            if c.job == job:
                units[n] = c.units
                port = c.port if n == last.hosts[0] and c.port else port
    since = record.resumes[-1].after_attempt if record.resumes else 0
    return Running(last.number, hosts, port, units, max(0, len(record.attempts) - 1 - since))


def refuse_if_looked_after(found: PerHost, job: str) -> None:
    """UserError when the job's lease on a host is fresh: its fab train or controller is alive."""
    fresh = sorted(
        (age, n)
        for n, hj in found.items()
        if isinstance(hj, HostJobs)
        and (age := hj.runtime.get(job)) is not None
        and age < hostfiles.LEASE_LIVE
    )
    if fresh:
        age, host = fresh[0]
        raise UserError(
            f"job {job} is looked after right now: its lease on {host} was renewed {age:.0f}s ago (by its "
            f"'fab train' or controller). 'fab logs --job {job}' follows it; if that process is gone, "
            f"try again in {hostfiles.LEASE_LIVE - age:.0f}s",
            exit_code=2,
        )


def plan(job: JobContext, state: JobState, running: Running) -> tuple[JobState, AttemptPlan]:
    """The running attempt's plan, built as the job built it, and the job's state to go on from it."""
    inv = replace(job.inv, hosts=running.hosts)
    taken = {h.name for h in running.hosts}
    roster = Roster(
        running.hosts,
        tuple(h for h in job.inv.all_hosts if h.name not in taken),
        restarts_used=running.restarts_used,
    )
    state = replace(state, roster=roster, spec=key_code(job, state.spec))
    # The spares as the job kept them (hot: waiting with their containers, which the job's end
    # removes); only this attempt's watch and teardown run, not its start.
    hot = roster.spares if job.hot_spares else ()
    return state, attempt_mod.build(
        inv,
        state.spec,
        running.number,
        running.port,
        keep=job.inv.job.keep_snapshots,
        first=False,
        run_dir=str(job.run_dir),
        units=running.units,
        warm=job.warm,
        hot=hot,
    )
