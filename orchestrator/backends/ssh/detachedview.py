"""What this machine shows of a detached job (detached.py says what runs where): `fab status`'s
lines (its end fetched, which controller runs it, a key or directory still on a host), `fab logs`
following it (its nodes while it runs, its run fetched at the end), and `fab logs` of one that
another machine started (its files copied, its record left with that machine)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.base import Finished
from orchestrator.backends.ssh.detached import (
    FOLLOW_POLL,
    MOUNT,
    controllers,
    detached_records,
    ended_at,
    fetch,
    keys_held,
    keys_line,
    look,
    running,
    running_at,
    save_keys,
    take_back,
)
from orchestrator.backends.ssh.placement import Place, at, places_of
from orchestrator.backends.ssh.runcopy import HostRecordRefused, copy_files
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.recovery import JobRecord
from orchestrator.hostcmds import sshargs
from orchestrator.transport import deadlines
from orchestrator.transport.remote import Session, describe

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.config.inventory import Inventory
    from orchestrator.transport.remote import PerHost


def status_lines(session: Session, inv: Inventory, runs: Path, found: PerHost) -> list[str]:
    """fab status on detached jobs: those that ended are fetched (runs/JOB) and their controllers'
    directories removed; which controller runs a job (the standby once it took over), one that is
    gone, or whose host does not answer, is named; a controller's key (or directory) still on a host
    is named, and taken back once the host answers."""
    lines, seen, said = [], controllers(found), set()
    for record in detached_records(runs):
        places = places_of(inv, record)
        if not places:
            continue
        said.add(record.job_id)
        lines.append(job_line(session, inv, runs, found, record, places, seen.get(record.job_id, {})))
    # A record whose controller's host this inventory does not name belongs to another inventory.
    for record in (r for r in keys_held(runs) if r.job_id not in said and places_of(inv, r)):
        lines += taken_back_lines(session, inv, runs, found, record)
    return lines


def job_line(
    session: Session,
    inv: Inventory,
    runs: Path,
    found: PerHost,
    record: JobRecord,
    places: list[Place],
    states: dict[str, str],
) -> str:
    """fab status's line on one detached job not yet fetched (`states`: its controllers' containers
    as the survey saw them): its end, fetched here if it ended; else which controller runs it, or
    that its controllers are gone (their key then taken back) or do not answer."""
    job = record.job_id
    silent = [p.host.name for p in places if found.error(p.host.name) is not None]
    flags = look(session, places)
    try:
        end = fetch(session, places, record, runs, flags)
    except HostRecordRefused as exc:
        return f"{job}: ended; its run is fetched into {runs / job}, but {exc}"
    except Exception as exc:  # noqa: BLE001 - one job's fetch never hides the others
        return f"{job}: its run could not be fetched: {hostile.line(str(exc), 300)}"
    if end is not None:
        why = f": {end['error'].splitlines()[0]}" if end["error"] else ""
        ended = f"{job}: ended ({end['state']}{why}); fetched its run into {runs / job}"
        return ended + keys_line(job, end["keys_left"], "; ")
    if len(silent) == len(places):
        return (
            f"{job}: its controllers' hosts {', '.join(silent)} do not answer (lost?), with the job's "
            f"record: once one answers, 'fab logs --job {job}' fetches the run"
        )
    now = running_at(places, flags)
    if not running(states):
        # Nobody needs its key now: `fab attach` goes on with this machine's own.
        left = take_back(session, inv, record, found)
        named = ", ".join(p.host.name for p in places)
        return (
            f"{job}: its controllers ({named}) are gone without "
            f"an end; 'fab attach {job}' takes the job over here" + keys_line(job, left, "; ")
        )
    assert now is not None
    where = f"{job}: detached, its controller runs on {now.host.name}"
    if now.host.name != places[0].host.name:
        where += f" (took over from {places[0].host.name})"
    elif len(places) > 1:
        where += f", its standby on {places[1].host.name}"
    return where + "".join(f"; {n} does not answer" for n in silent)


def taken_back_lines(
    session: Session, inv: Inventory, runs: Path, found: PerHost, record: JobRecord
) -> list[str]:
    """A fetched job's controller key taken back from the hosts that may still hold it: the hosts
    it is now gone from, and those where it may still be."""
    job, before = record.job_id, set(record.controller.keys if record.controller else ())
    left = take_back(session, inv, record, found, clear=True)
    save_keys(runs, job, left)
    gone = sorted(before - set(left))
    lines = [f"{job}: its controller's key is now removed from {', '.join(gone)}"] if gone else []
    return lines + ([keys_line(job, left)] if left else [])


def follow(
    inv: Inventory, record: JobRecord, runs: Path, console: Console, live: bool, json: bool = False
) -> Finished:
    """fab logs of a detached job: its nodes followed while it runs (each attempt), then its run
    fetched here once its controllers have ended (from the one that ended it, or a standby's mirror)."""
    from orchestrator.hosts import survey

    places = places_of(inv, record)
    if not places:
        ran_on = record.controller.host if record.controller else None
        raise UserError(
            f"job {record.job_id}: its controller ran on {ran_on}, which "
            f"{inv.path} does not name; give the inventory it was started with",
            exit_code=2,
        )
    job = record.job_id
    with Session(inv.all_hosts) as session:
        while True:
            end = fetch(session, places, record, runs)
            if end is not None:
                error = (
                    UserError(end["error"].replace(f"{MOUNT}/runs/", f"{runs}/")) if end["error"] else None
                )
                ended = JobRecord.load(runs, job).controller
                return Finished(
                    job,
                    runs / job,
                    error,
                    f"job {job} {end['state']}; logs and outputs in {runs / job} (fetched from its "
                    f"controller on {(ended and ended.ended_on) or places[0].host.name})"
                    + keys_line(job, end["keys_left"], "\n  warning: "),
                )
            found = survey.survey(session, inv)
            if job in survey.running_jobs(found):
                if not nodes_followed(session, inv, job, runs, console, live, json):
                    return Finished(job, None, None, "detached; the job goes on ('fab stop --job' ends it)")
                continue
            answering = [p for p in places if found.error(p.host.name) is None]
            if not answering:
                why = "; ".join(describe(p.host, e) for p in places if (e := found.error(p.host.name)))
                raise UserError(
                    f"job {job}: its controllers' hosts do not answer ({why}); 'fab status' says more"
                )
            if not running(controllers(found).get(job, {})) and fetch(session, places, record, runs) is None:
                raise UserError(
                    f"job {job}: its controllers are gone without an end; "
                    f"'fab attach {job}' takes it over here"
                )
            time.sleep(FOLLOW_POLL)


def nodes_followed(
    session: Session, inv: Inventory, job: str, runs: Path, console: Console, live: bool, json: bool = False
) -> bool:
    """The running attempt's nodes followed to its end (True), or until Ctrl+C (False)."""
    from orchestrator.backends.ssh import jobcontrol

    try:
        jobcontrol.attach(session, inv, job, runs, console, live=live, json=json)
    except KeyboardInterrupt:
        return False
    except UserError:
        pass  # its attempt ended between the survey and the follow
    return True


def found_places(session: Session, inv: Inventory, job: str) -> list[Place]:
    """The controllers' directories of `job` on the inventory's hosts, for a machine that has no
    record of it (another clone, another laptop): each host asked, those that answered with one."""
    if not jobspec.valid_job_id(job):
        return []
    d = at(inv, job, inv.all_hosts[0]).dir
    got = session.fan_out(
        lambda h: session.run(
            h, sshargs.shell(["test", "-d", d]), what="looking there", timeout=deadlines.STATUS_TIMEOUT
        ),
        inv.all_hosts,
    )
    return [at(inv, job, h) for h in inv.all_hosts if got.error(h.name) is None and got[h.name].ok]


def follow_unowned(
    inv: Inventory,
    job: str,
    places: list[Place],
    runs: Path,
    console: Console,
    live: bool,
    json: bool = False,
) -> Finished:
    """fab logs of a detached job this machine did not start: its nodes followed while it runs,
    then its run's files (logs, events, snapshots) copied here from the controller that ended it;
    its record stays with the machine that started it (and nothing is removed from the hosts)."""
    from orchestrator.hosts import survey

    with Session(inv.all_hosts) as session:
        while True:
            src = ended_at(places, look(session, places))
            if src is not None:
                run_dir = copy_files(session, src, job, runs)
                return Finished(
                    job,
                    run_dir,
                    None,
                    f"job {job} ended; its logs, events and snapshots are in {run_dir} (copied "
                    f"from its controller on {src.host.name}; its record stays with the machine "
                    "that started it, where 'fab status' clears the hosts)",
                )
            found = survey.survey(session, inv)
            if job in survey.running_jobs(found):
                if not nodes_followed(session, inv, job, runs, console, live, json):
                    return Finished(job, None, None, "detached; the job goes on")
                continue
            if not running(controllers(found).get(job, {})):
                raise UserError(f"job {job}: its controllers are gone without an end")
            time.sleep(FOLLOW_POLL)
