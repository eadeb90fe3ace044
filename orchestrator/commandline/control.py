"""fab attach, stop, status and logs: each handed to the backend that serves it (the job's record
says which; else every backend the inventory uses), and its answer printed as the task shows it
(as JSON with --json)."""

from __future__ import annotations

import json as _json
import sys
from typing import TYPE_CHECKING

from orchestrator.backends import registry
from orchestrator.backends.base import Finished, Launch, Status, Stopped
from orchestrator.backends.ssh.jobcontrol import unknown_job
from orchestrator.commandline import cli, hostselect
from orchestrator.config import inventory as inventory_file
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.recovery import JobRecord

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console


def attach(
    inventory: str | None, job: str | None, runs: Path, console: Console, json: bool, plain: bool
) -> Finished:
    """fab attach: take over a running job whose fab train (or controller) is gone, as fab train
    would go on with it; its curves and step times shown at the end."""
    if not job:
        raise UserError("give the job to take over: fab attach JOB ('fab status' lists them)", exit_code=2)
    if not jobspec.valid_job_id(job):
        raise unknown_job(job)
    if not (runs / job).is_dir():
        # Taking a job over needs its record, so the hosts are not asked: only a job started from
        # this directory has one.
        raise unknown_job(
            job,
            f" in {runs}/ (fab attach takes over a job started from this directory; "
            f"'fab logs --job {job}' follows one started elsewhere)",
        )
    say = cli.stderr_console() if json else console
    record = JobRecord.load(runs, job, "fab attach")
    inv = inventory_file.load(inventory or record.inventory)
    if record.selected:
        inv = hostselect.select_hosts(inv, "@".join(record.selected), None, set(), None)
    policy = cli.policy(inv, record.restarts, record.min_nodes, record.hang_timeout)
    launch = Launch(
        inv, record.spec, policy, record, runs, say, json=json, live=not (plain or json), checks=False
    )
    backend = registry.of_job(runs, job) or registry.runner(registry.DEFAULT)
    return backend.take_over(launch)


def stop(
    inventory: str | None, job: str | None, everyone: bool, yes: bool, grace: float | None, runs: Path
) -> Stopped:
    """fab stop: --job's backend (from its record), else every backend the inventory uses, Slurm's
    jobs first (they may hold the hosts)."""
    inv = inventory_file.load(inventory)
    wait = inv.job.stop_grace if grace is None else float(grace)
    if job and not jobspec.valid_job_id(job):
        raise UserError(
            f"--job {hostile.text(job)!r} is not a fabtrain job id; 'fab status' lists them", exit_code=2
        )
    if job:
        chosen = [registry.of_job(runs, job) or registry.runner(registry.DEFAULT)]
    else:
        chosen = list(reversed(registry.serving(inv)))
    out = Stopped()
    for backend in chosen:
        part = backend.stop(inv, job, everyone, yes, wait, runs)
        out.lines += part.lines
        out.problems += part.problems
        out.failed += part.failed
        out.jobs += part.jobs
        out.removed.update(part.removed)
        out.left_alone += part.left_alone
    return out


def status(inventory: str | None, runs: Path) -> Status:
    """fab status: every backend the inventory uses, in one document."""
    inv = inventory_file.load(inventory)
    out = Status()
    for backend in registry.serving(inv):
        part = backend.status(inv, runs)
        out.doc.update(part.doc)
        out.tables += part.tables
        out.lines += part.lines
        out.errors += part.errors
    out.doc["errors"] = out.errors
    return out


def logs(
    inventory: str | None, job: str | None, runs: Path, console: Console, plain: bool, json: bool = False
) -> Finished:
    """fab logs: follow the job where it runs (its record says; the hosts when there is none). An id
    that cannot be a job's is refused before any host is asked; a well-formed one is looked for on
    the hosts, in runs/ or not (a detached job another machine started has its controller's
    directory there: jobcontrol.attach refuses one that neither knows)."""
    if job is not None and not jobspec.valid_job_id(job):
        raise unknown_job(job)
    inv = inventory_file.load(inventory)
    backend = (registry.of_job(runs, job) if job else None) or registry.runner(registry.DEFAULT)
    return backend.attach(inv, job, runs, console, live=not plain, json=json)


def print_stopped(out: Stopped, json: bool) -> None:
    """What fab stop did: its problems on stderr, then what it stopped (as JSON with --json);
    UserError naming the hosts it failed on."""
    for line in out.problems:
        print(line, file=sys.stderr)
    if json:
        print(_json.dumps(out.doc(), indent=2))
    else:
        for line in out.lines:
            print(line)
    if out.failed:
        raise UserError(f"stop failed on {', '.join(out.failed)}; run 'fab stop' again once they answer")


def print_status(found: Status, json: bool, console: Console) -> None:
    """fab status's tables and lines (its document with --json); UserError naming the hosts that
    did not answer."""
    if json:
        print(_json.dumps(found.doc, indent=2))
    else:
        from rich.console import Console

        # Piped or captured, rows stay whole (rich would fit the table to 80 columns).
        out = console if console.is_terminal else Console(highlight=False, width=250)
        for table in found.tables:
            out.print(table)
        for line in found.lines:
            out.print(line, markup=False)
    if found.errors:
        raise UserError("\n".join(found.errors))


def print_followed(finished: Finished, json: bool, say: Console) -> None:
    """The end of fab logs: a detached job's curves and step times (its record fetched here), how
    it ended (on stderr with --json), and its error raised."""
    if finished.run_dir is not None and (finished.run_dir / "job.json").is_file():  # a detached job, fetched
        cli.present(finished.run_dir, say)
    if finished.closing:
        print(finished.closing, file=sys.stderr if json else sys.stdout)
    if finished.error is not None:
        raise finished.error


def print_taken_over(finished: Finished, json: bool, console: Console) -> None:
    """The end of fab attach: the run's curves and step times, its error raised, else how it ended."""
    if finished.run_dir is not None:
        cli.present(finished.run_dir, cli.stderr_console() if json else console)
    if finished.error is not None:
        raise finished.error
    print(finished.closing)
