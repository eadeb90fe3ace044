"""What surrounds a job's life (job.py): its dry run, re-attaching to a running one (`fab logs`),
the message a job that did not finish exits with, and the refusal of a job id that names no job.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.ssh import attempt as attempt_mod
from orchestrator.backends.ssh import detached
from orchestrator.backends.ssh.job import Job
from orchestrator.backends.ssh.nodefollow import worker_failure
from orchestrator.backends.ssh.state import JobResult
from orchestrator.backends.ssh.watch import Watcher
from orchestrator.config.inventory import Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.events import JsonLines, Terminal
from orchestrator.hosts import survey
from orchestrator.transport.remote import PerHost, Session

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


def dry_run(job: Job) -> str:
    """The next attempt's plan, as `run` would execute it: the facts read from the hosts
    (read-only; a host that does not answer is shown so), nothing started or copied."""
    with job.connected():
        return job.plan(dry=True).render()


def refuse_if_running(inv: Inventory, job_id: str, how: str) -> None:
    """A job that still runs (a container of it, or the fresh lease of the `fab train` that looks
    after it) is never continued by another command: that would remove its console files,
    containers, claim and secrets. UserError (exit 2) naming it and where it runs."""
    with Session(inv.all_hosts) as session:
        found = survey.survey(session, inv)
    where = survey.live_jobs(found).get(job_id)
    if where:
        raise UserError(
            f"{how} {job_id}: that job is still running on {', '.join(sorted(where))}; it was left "
            f"alone. Follow it with 'fab logs --job {job_id}', or end it with 'fab stop --job {job_id}' "
            "and then continue it",
            exit_code=2,
        )


def attach(
    session: Session,
    inv: Inventory,
    job_id: str | None,
    run_root: Path,
    console: Console,
    live: bool = True,
    json: bool = False,
) -> JobResult:
    """Follow a running job's nodes from the start of their output (`fab logs`); Ctrl+C detaches.
    `json`: the watch's events as JSON lines on stdout, not the hosts' log lines (runs/JOB/attach/ keeps
    those)."""
    found = survey.survey(session, inv)
    jobs = survey.running_jobs(found)
    if job_id is None:
        if not jobs:
            raise UserError("no job is running; 'fab status' lists stopped ones")
        if len(jobs) > 1:
            raise UserError(f"several jobs run ({', '.join(jobs)}); pick one with --job")
        job_id = next(iter(jobs))
    if job_id not in jobs and not known_to(found, job_id, run_root):
        # Followed anyway, it would wait on every host for containers that never come.
        raise unknown_job(job_id, f" on the hosts of {inv.path} or in {run_root}/")
    # The hosts the job runs on now, with their node ranks (a restart may have moved it to spares).
    ranks = jobs.get(job_id) or {h.name: h.rank for h in inv.hosts}
    hosts = tuple(
        sorted(
            (replace(h, rank=ranks[h.name]) for h in inv.all_hosts if h.name in ranks), key=lambda h: h.rank
        )
    )
    quiet = replace(inv, hosts=hosts, job=replace(inv.job, secret_files=()))
    a = attempt_mod.build(
        quiet, jobspec.JobSpec(job_id=job_id, script=""), 0, inv.job.master_port, sync=False
    )
    run_dir = run_root / job_id / "attach"
    reporter = JsonLines() if json else Terminal(console)
    w = Watcher(
        session, a, run_dir, reporter, detach=True, console=console, live=live and not json, echo=not json
    ).run()
    return JobResult(
        job_id,
        run_dir,
        "finished" if w.ok else "failed",
        1,
        watched=w,
        failures=[f"{e.host.name}: {e.detail}" for e in w.failures],
    )


def explain(result: JobResult) -> UserError | None:
    """The error a job that did not finish exits with: the host, its node rank and what it did,
    the last lines of its log, and how to continue."""
    if result.ok:
        return None
    w = result.watched
    if result.interrupted is not None:
        name = signal.Signals(result.interrupted).name
        took = f" (teardown {w.teardown_seconds:.1f}s)" if w and w.teardown_seconds is not None else ""
        return UserError(
            f"job {result.job_id} interrupted ({name}); every container was stopped{took}. Continue "
            f"it with: fab train --resume {result.job_id}. Logs: {result.run_dir}",
            exit_code=128 + int(result.interrupted),
        )
    blamed = w.failures[0] if w and w.failures else None
    what = (
        f"{blamed.host.name} (node rank {blamed.host.rank}) {blamed.summary()}{worker_failure(blamed.tail)}"
        if blamed
        else ""
    )
    if result.state == "stopped":
        how = result.reason if result.reason.startswith("ended by 'fab stop'") else "ended by 'fab stop'"
        head = f"job {result.job_id} was {how}" + (f" ({what})." if what else ".")
    else:
        torn = (
            f"; the other nodes were stopped in {w.teardown_seconds:.1f}s"
            if w and w.teardown_seconds is not None and blamed
            else ""
        )
        cause = (what or result.failures[-1]) if result.failures else result.reason
        head = f"job {result.job_id} failed: {cause}{torn}."
        if result.reason and result.reason not in head:
            head += f"\n  the job ended: {result.reason}"
    if len(result.failures) > 1:
        head += f"\n  every attempt failed ({result.attempts}):\n" + "\n".join(
            "    " + hostile.text(f) for f in result.failures
        )
    tail = ""
    if blamed:
        tail = f"\n  last lines of {blamed.host.name}:\n" + "\n".join(
            "    " + line for line in hostile.text(blamed.tail).splitlines()[-20:]
        )
    return UserError(
        f"{head}{tail}\n  full logs: {result.run_dir}\n"
        f"  continue from the newest snapshot with: fab train --resume {result.job_id}"
    )


def to_stop(
    views: dict[str, survey.JobView], job: str | None, everything: bool, me: str
) -> tuple[set[str], dict[str, survey.JobView]]:
    """Which jobs `fab stop` ends: --job's, --all's, or by default those started by `me` (and
    those whose owner is not recorded); and the others' jobs (left alone unless --all)."""
    others = {j: v for j, v in views.items() if v.who and v.who != me}
    if job:
        return {job}, {}
    if everything:
        return set(views), others
    return {j for j in views if j not in others}, others


def known_job(
    job: str,
    views: dict[str, survey.JobView],
    controllers: dict[str, dict[str, str]],
    unsurveyed: bool,
    runs: Path,
) -> bool:
    """Whether `fab stop --job JOB` names a job: one the hosts hold (containers, claims, a
    controller), or one this machine recorded; a host that did not answer may hold any."""
    return (
        job in views
        or job in controllers
        or unsurveyed
        or (jobspec.valid_job_id(job) and (runs / job / "job.json").is_file())
    )


def known_to(found: PerHost, job: str, runs: Path) -> bool:
    """known_job over a survey of every host: whether `job` names a job the hosts hold or this
    machine recorded (a host that did not answer may hold any)."""
    if not jobspec.valid_job_id(job):
        return False
    return known_job(job, survey.job_views(found), detached.controllers(found), bool(found.errors()), runs)


def unknown_job(job: str, where: str = "") -> UserError:
    """The refusal of a job id that names no job (exit 2: nothing was done), and where the right
    one is listed: `fab logs`, `attach`, `shell`, `forward` and `metrics` give it alike."""
    return UserError(
        f"no job {hostile.text(job)}{where}; 'fab runs' lists this machine's, 'fab status' the hosts'",
        exit_code=2,
    )


def confirm_all(others: dict[str, survey.JobView]) -> None:
    """--all without --yes: ask on a terminal; elsewhere refuse (nothing is stopped)."""
    listing = "; ".join(f"{v.job} of {v.who} on {', '.join(v.hosts)}" for v in others.values())
    if not sys.stdin.isatty():
        raise UserError(
            f"--all would also stop other people's jobs ({listing}); add --yes to do it without asking",
            exit_code=2,
        )
    answer = input(f"--all also stops other people's jobs: {listing}. Stop them? [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise UserError("nothing was stopped", exit_code=1)


def since_text(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def status_rows(views: dict[str, survey.JobView], steps: dict[str, int]) -> list[dict]:
    """One dict per job, newest first: what `fab status` shows."""
    rows = []
    for v in sorted(views.values(), key=lambda v: (-v.since, v.job)):
        rows.append(
            {
                "job": v.job,
                "who": v.who or None,
                "state": v.state,
                "attempt": int(v.attempt) if v.attempt.isdigit() else None,
                "step": steps.get(v.job),
                "since": v.since or None,
                "queue": {"position": max(v.queue.values()), "hosts": v.queue, "waits": v.waits}
                if v.queue
                else None,
                "hosts": {
                    h: {
                        "units": list(u) if u is not None else None,
                        "rank": v.ranks.get(h),
                        "container": v.states.get(h),
                    }
                    for h, u in v.hosts.items()
                },
            }
        )
    return rows


def status_json(views: dict[str, survey.JobView], steps: dict[str, int], errors: list[str]) -> str:
    return json.dumps({"jobs": status_rows(views, steps), "errors": errors}, indent=2)


def status_table(views: dict[str, survey.JobView], steps: dict[str, int], inv: Inventory) -> Table:
    from rich.table import Table
    from rich.text import Text

    from orchestrator.hosts import claimdir, claims

    by_name = {h.name: h for h in inv.all_hosts}
    table = Table(title="fabtrain jobs")
    table.add_column("job", no_wrap=True)
    for col in ("who", "hosts (GPUs / slots)", "state", "attempt", "step", "since"):
        table.add_column(col)
    for r in status_rows(views, steps):
        hosts = ", ".join(
            f"{h}"
            + (
                f" {claims.kind(by_name[h])}s {claimdir.units_text(tuple(x['units']))}"
                if x["units"] and h in by_name
                else ""
            )
            for h, x in r["hosts"].items()
        )
        style = {"running": "green", "left over": "yellow"}.get(r["state"], "")
        if r["queue"]:
            hosts = "; ".join(r["queue"]["waits"])
        table.add_row(
            hostile.rich_text(r["job"]),
            hostile.rich_text(r["who"] or "-"),
            hostile.rich_text(hosts),
            hostile.rich_text(r["state"], style),
            str(r["attempt"] or "-"),
            str(r["step"] if r["step"] is not None else "-"),
            since_text(r["since"] or 0),
        )
    if not views:
        table.add_row("-", "-", "-", Text("no jobs", style="dim"), "-", "-", "-")
    return table
