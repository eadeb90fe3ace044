"""What surrounds a job's life (job.py): its dry run, re-attaching to a running one (`fab logs`),
and the message a job that did not finish exits with.
"""
from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

from . import attempt as attempt_mod
from . import hostops, plan
from .errors import UserError
from .events import Terminal
from .inventory import Inventory
from .job import Job, JobResult
from .logs import sanitize
from .remote import Session
from .watch import Watcher, worker_failure


def dry_run(job: Job) -> str:
    """The next attempt's plan, as `run` would execute it: the facts read from the hosts
    (read-only; a host that does not answer is shown so), nothing started or copied."""
    if job.session is not None:
        return job.plan(dry=True).render()
    with Session(job.inv.all_hosts) as session:
        job.session = session
        return job.plan(dry=True).render()


def attach(session: Session, inv: Inventory, job_id: str | None, run_root: Path, console,
           live: bool = True) -> JobResult:
    """Follow a running job's nodes from the start of their output (`fab logs`); Ctrl+C detaches."""
    jobs = hostops.running_jobs(hostops.survey(session, inv))
    if job_id is None:
        if not jobs:
            raise UserError("no job is running; 'fab status' lists stopped ones")
        if len(jobs) > 1:
            raise UserError(f"several jobs run ({', '.join(jobs)}); pick one with --job")
        job_id = next(iter(jobs))
    if not plan.valid_job_id(job_id):
        raise UserError(f"job id {sanitize(job_id)!r} is not a fabtrain job id; pass --job with the right id")
    # The hosts the job runs on now, with their node ranks (a restart may have moved it to spares).
    ranks = jobs.get(job_id) or {h.name: h.rank for h in inv.hosts}
    hosts = tuple(sorted((replace(h, rank=ranks[h.name]) for h in inv.all_hosts if h.name in ranks),
                         key=lambda h: h.rank))
    quiet = replace(inv, hosts=hosts, job=replace(inv.job, secret_files=()))
    a = attempt_mod.build(quiet, plan.JobSpec(job_id=job_id, script=""), 0, inv.job.master_port, sync=False)
    run_dir = run_root / job_id / "attach"
    w = Watcher(session, a, run_dir, Terminal(console), detach=True, console=console, live=live).run()
    return JobResult(job_id, run_dir, "finished" if w.ok else "failed", 1, watched=w,
                     failures=[f"{e.host.name}: {e.detail}" for e in w.failures])


def explain(result: JobResult) -> UserError | None:
    """The error a job that did not finish exits with: the host, its node rank and what it did,
    the last lines of its log, and how to continue."""
    if result.ok:
        return None
    w = result.watched
    if result.interrupted is not None:
        name = signal.Signals(result.interrupted).name
        took = f" (teardown {w.teardown_seconds:.1f}s)" if w and w.teardown_seconds is not None else ""
        return UserError(f"job {result.job_id} interrupted ({name}); every container was stopped{took}. Continue "
                         f"it with: fab train --resume {result.job_id}. Logs: {result.run_dir}",
                         exit_code=128 + int(result.interrupted))
    blamed = w.failures[0] if w and w.failures else None
    what = f"{blamed.host.name} (node rank {blamed.host.rank}) {blamed.summary()}{worker_failure(blamed.tail)}" if blamed else ""
    if result.state == "stopped":
        head = f"job {result.job_id} was ended by 'fab stop'" + (f" ({what})." if what else ".")
    else:
        torn = (f"; the other nodes were stopped in {w.teardown_seconds:.1f}s"
                if w and w.teardown_seconds is not None and blamed else "")
        head = f"job {result.job_id} failed: {what or result.failures[-1] if result.failures else result.reason}{torn}."
        if result.reason and result.reason not in head:
            head += f"\n  the job ended: {result.reason}"
    if len(result.failures) > 1:
        head += (f"\n  every attempt failed ({result.attempts}):\n" + "\n".join("    " + sanitize(f) for f in result.failures))
    tail = ""
    if blamed:
        tail = f"\n  last lines of {blamed.host.name}:\n" + "\n".join(
            "    " + line for line in sanitize(blamed.tail).splitlines()[-20:])
    return UserError(f"{head}{tail}\n  full logs: {result.run_dir}\n"
                     f"  continue from the newest snapshot with: fab train --resume {result.job_id}")
