"""A detached job's run copied here from a controller's host (detached.py says what is where):
its files, as safely as any host's outputs (copy_files), and the controller's copy of the job's
record read as hostile data, only what a controller changes taken into this machine's record
(copy_runs, host_record; docs/security.md)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

from orchestrator.backends.ssh.placement import Place
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.core.record import Controller
from orchestrator.core.recovery import RECORD, JobRecord
from orchestrator.hostcmds import sshargs
from orchestrator.transport import deadlines
from orchestrator.transport.remote import Session

FETCH_TIMEOUT = 600.0
RECORD_MAX = 1 << 20  # bytes of the controller's copy of the record read (a real one: a few KiB)
NO_RECORD = 3  # host_record_command's exit status: the controller wrote none
NOT_A_FILE = 5  # ... and when job.json there is a link, a directory or the like


class HostRecordRefused(UserError):
    """The controller's copy of a job's record was not taken; this machine's record stands."""


def copy_files(session: Session, p: Place, job: str, runs: Path) -> Path:
    """The controller's runs/JOB copied here whole (snapshots too), as safely as any host's outputs,
    but for its record, which no copy from a host ever writes here: runs/JOB."""
    run_dir = runs / job
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        a
        for a in sshargs.fetch_argv(p.host, f"{p.dir}/runs/{job}", str(run_dir))
        if not a.startswith("--exclude")
    ]
    # No copy from a host ever writes this machine's record (nor the file the controller saves it through).
    argv[1:1] = [f"--exclude=/{RECORD}", f"--exclude=/.{RECORD}.tmp"]
    got = session.local(argv, FETCH_TIMEOUT)
    if not got.ok:
        raise UserError(
            f"{p.host.name}: fetching {p.dir}/runs/{job} failed: "
            f"{hostile.line(got.stderr.strip(), 300)}; it stays there: run the command again"
        )
    return run_dir


def copy_runs(session: Session, p: Place, record: JobRecord, runs: Path, controller: Controller) -> JobRecord:
    """copy_files, and the controller's record read as data (host_record) and merged into this
    machine's, which keeps where its controller was, now as `controller` says (fetched, taken over).
    HostRecordRefused, with this machine's record as it was, when the controller's copy cannot be
    taken."""
    run_dir = copy_files(session, p, record.job_id, runs)
    merged = replace(host_record(session, p, record), controller=controller)
    merged.save(run_dir)
    return merged


def host_record_path(p: Place) -> str:
    return f"{p.dir}/runs/{p.job}/{RECORD}"


def host_record_command(p: Place) -> str:
    """Its first RECORD_MAX + 1 bytes (more is refused), if it is a plain file."""
    f = sshargs.shell([host_record_path(p)])
    return (
        f"[ -e {f} ] || [ -L {f} ] || exit {NO_RECORD}; [ -f {f} ] && [ ! -L {f} ] || exit {NOT_A_FILE}; "
        + sshargs.shell(["head", "-c", str(RECORD_MAX + 1), host_record_path(p)])
    )


def host_record(session: Session, p: Place, record: JobRecord) -> JobRecord:
    """This machine's record with the controller's state and attempts (JobRecord.with_host_data),
    read from the controller's copy as hostile data; this machine's record as it is when the
    controller wrote none (it ended before its job began). HostRecordRefused naming the host and the
    file when the copy cannot be read, is too large, is not JSON or fails the checks."""
    job, where = record.job_id, f"{p.host.name}:{host_record_path(p)}"
    r = session.run(
        p.host,
        host_record_command(p),
        timeout=deadlines.STATUS_TIMEOUT,
        what="reading the controller's record",
    )
    if r.exited == NO_RECORD:
        return copy.deepcopy(record)
    why = ""
    if r.exited == NOT_A_FILE:
        why = "it is not a plain file (a link, a directory?)"
    elif not r.ok:
        why = f"it could not be read: {hostile.line(r.stderr.strip() or f'exit {r.exited}', 200)}"
    elif len(r.stdout.encode()) > RECORD_MAX:
        why = f"it is larger than {RECORD_MAX} bytes"
    else:
        names = {h.name for h in session.hosts} | set(record.selected or ())
        names |= {n for a in record.attempts for n in a.hosts}
        try:
            return record.with_host_data(json.loads(r.stdout), names)
        except ValueError as exc:  # json's errors too
            why = hostile.line(str(exc), 300)
    raise HostRecordRefused(
        f"{where}: the controller's copy of job {job}'s record was refused: {why}. This machine's record "
        f"(runs/{job}/job.json) is kept, with the state and attempts it had when the job was detached; a "
        "controller changes only those, so a change to anything else there was made by someone else: "
        "look at that host",
        exit_code=1,
    )
