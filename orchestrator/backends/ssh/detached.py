"""Detached jobs (fab train --detach): the job's whole life (job.py, the same stages) runs in a
controller, a container started for the job on one host, with a standby on a second one that takes
the job over if the first is lost (placement.py says where, failover.py how), so the terminal that
started it may close. Here: what this machine does with a detached job once it is started: its end
and run fetched (from the controller that ended it, or a standby's mirror), its controllers'
directories removed, its key taken back by fab stop; what it shows of one: detachedview.py.
Starting one: submit.py; the controller itself: controller.py.

What is copied where (docs/detached.md). On both controllers' hosts, in
<job.output_dir>/.controllers/JOB (mode 700, the SSH user's own), mounted at /ctl in the controller:
  key, key.pub    an SSH key made for this job alone (Ed25519, mode 600). Its public half is added
                  to ~/.ssh/authorized_keys of the SSH user on every host and spare, marked
                  `fabtrain-controller:JOB`, with `restrict`, `from=` the controllers' hosts'
                  addresses and an `expiry-time=` the controller moves on while the job lives
                  (hosts/keys.py says why each); removed at the job's end by the controller, and
                  checked gone by this machine (`fab status`, `fab logs`, `fab stop --job JOB`),
                  which names every host that still holds it until it is gone.
  key.json        what the controller needs to write its line again: the from= list of each host,
                  the line's lifetime and how often it is renewed.
  known_hosts     the host keys this machine trusts for the job's hosts: the controller checks them.
  secrets/NAME    job.secret_files' contents (mode 600).
  launch.pickle   the job as this machine resolved it (inventory, spec, policy, record), mode 600.
  fabtrain/       the orchestrator's code, as it is here; code/: the job's code tree.
  runs/JOB/       the job's run directory, as the controller writes it; mirror/runs/JOB on the
                  standby's host: the active controller's copy of it (failover.py).
The key, secrets and launch.pickle are removed when the controller ends; `fab logs` and `fab status`
fetch runs/JOB here once the job has ended, then remove the whole directory. The directory is mounted
in no job container (they mount job.output_dir/JOB, the code and the runtime directory; submit.py
refuses an inventory mount that would hold it).

What comes back is data (docs/security.md). The controller's copy of the job's record is not copied
over this machine's: it is read as hostile data and only what a controller changes (the state, the
attempts after this machine's) is taken into this machine's record (JobRecord.with_host_data), so
notify, the inventory, secrets, code and image always come from this machine's own record: runcopy.py.

The controller runs as the SSH user's uid, with every capability dropped and no new privileges,
on the host's network (it reaches the hosts as this machine does, at their addresses).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.ssh.placement import MIRROR, Place, place, place_of, places_of, unfetched
from orchestrator.backends.ssh.runcopy import HostRecordRefused, copy_runs
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.core.record import Controller
from orchestrator.core.recovery import STATES, JobRecord
from orchestrator.hostcmds import sshargs
from orchestrator.hosts import keys
from orchestrator.hosts.keys import revoke_script
from orchestrator.hosts.survey import HostJobs
from orchestrator.transport import deadlines
from orchestrator.transport.remote import Session, failure, timed_out

__all__ = ["Place", "place", "place_of", "places_of", "unfetched"]

if TYPE_CHECKING:
    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.transport.remote import PerHost

MOUNT = "/ctl"
DONE = "done.json"  # the controller's last word: {"state", "error", "closing", "keys_left"}
KEY_FILE = "key.json"  # what the controller renews its key's line with (submit.authorize writes it)
FOLLOW_POLL = 2.0  # seconds between looks while a detached job is between attempts


# ---------------------------------------------------------------- this machine: after the end

REVOKE_TRIES = 3
REVOKE_PAUSE = 1.0  # seconds before the second try of a key's removal, twice that before the third


def done_command(p: Place) -> str:
    return sshargs.shell(["cat", f"{p.dir}/{DONE}"])


# What a controller's directory may hold, as look_command says it (failover.py says who writes each).
ENDED, MIRRORED, TAKEN, FENCED = DONE, f"{MIRROR}/{DONE}", "taken", "fenced"


def look_command(p: Place) -> str:
    d = sshargs.shell([p.dir])
    return f"for f in {ENDED} {MIRRORED} {TAKEN} {FENCED}; do [ -e {d}/$f ] && echo $f; done; true"


def look(session: Session, places: Sequence[Place]) -> list[set[str] | None]:
    """What each controller's directory holds (None: its host did not answer)."""
    by_host = {p.host.name: p for p in places}
    got = session.fan_out(
        lambda h: session.run(
            h, look_command(by_host[h.name]), what="looking there", timeout=deadlines.STATUS_TIMEOUT
        ),
        [p.host for p in places],
    )
    out: list[set[str] | None] = []
    for p in places:
        r = got.value(p.host.name) if got.error(p.host.name) is None else None
        ok = r is not None and r.ok
        out.append(set(r.stdout.split()) & {ENDED, MIRRORED, TAKEN, FENCED} if r is not None and ok else None)
    return out


def ended_at(places: Sequence[Place], seen: Sequence[set[str] | None]) -> Place | None:
    """Where a detached job's end is to be read (pure): the controller that wrote its own end and
    was not taken over; else a standby's mirror of it (the active one's host does not answer)."""
    for p, flags in zip(places, seen, strict=True):
        if flags is not None and ENDED in flags and FENCED not in flags:
            return p
    for p, flags in zip(places, seen, strict=True):
        if flags is not None and MIRRORED in flags:
            return p.mirror()
    return None


def running_at(places: Sequence[Place], seen: Sequence[set[str] | None]) -> Place | None:
    """The controller that runs the job now (pure): the standby once it took over, else the first."""
    for p, flags in zip(places, seen, strict=True):
        if flags is not None and TAKEN in flags:
            return p
    return places[0] if places else None


def newest_run(places: Sequence[Place], seen: Sequence[set[str] | None]) -> Place | None:
    """Where a running detached job's newest run is (pure): the standby once it took over, else
    the controller; a standby's mirror when that one's host does not answer (None: no host did)."""
    now = running_at(places, seen)
    if now is not None and seen[list(places).index(now)] is not None:
        return now
    for p, flags in zip(places, seen, strict=True):
        if flags is not None and p is not now:
            return p.mirror()
    return None


def fetch(
    session: Session,
    places: Sequence[Place],
    record: JobRecord,
    runs: Path,
    seen: Sequence[set[str] | None] | None = None,
) -> dict | None:
    """The controllers' end ({"state", "error", "closing", "keys_left"}) and runs/JOB copied here,
    from the one that ended the job (or a standby's mirror of it), then their directories removed
    from their hosts and the key from every host (keys_left: the hosts where that failed, with why);
    None while the job has not ended. HostRecordRefused, after all of that, when the controller's
    copy of the record was refused (this machine's is kept). `seen`: look's answer, when the caller
    has it already."""
    src = ended_at(places, look(session, places) if seen is None else seen)
    if src is None:
        return None
    r = session.run(
        src.host, done_command(src), timeout=deadlines.STATUS_TIMEOUT, what="asking the controller"
    )
    if not r.ok:
        return None
    try:
        done = json.loads(r.stdout[:100_000])
        end = {k: hostile.text(str(done.get(k) or "")) for k in ("state", "error", "closing")}
    except (ValueError, AttributeError):
        end = {"state": "failed", "error": "the controller's done.json is not JSON", "closing": ""}
    if end["state"] not in STATES:
        end["state"] = "failed"
    refused = None
    ended = replace(controller_of(record), fetched=time.time(), ended_on=src.host.name)
    try:
        fetched = copy_runs(session, src, record, runs, ended)
    except HostRecordRefused as exc:
        refused = exc
        fetched = replace(copy.deepcopy(record), controller=ended)
    if fetched.state == "running":  # the controller ended before its job did (refused, or it failed)
        fetched.state = end["state"] if end["state"] != "running" else "failed"
    left = remove(session, *places)
    fetched.controller = replace(ended, keys=tuple(sorted(left)))
    fetched.save(runs / record.job_id)
    if refused is not None:
        raise HostRecordRefused(f"{refused}{keys_line(record.job_id, left, '; ')}") from None
    return {**end, "keys_left": left}


def controller_of(record: JobRecord) -> Controller:
    """A detached job's controllers, as its record names them."""
    if record.controller is None:
        raise UserError(
            f"job {record.job_id} was not detached: its record (runs/{record.job_id}/job.json) "
            "names no controller",
            exit_code=2,
        )
    return record.controller


def clear_script(p: Place) -> str:
    """A controller gone from its host: its container and its directory."""
    return (
        sshargs.shell(["docker", "rm", "-f", p.container])
        + " >/dev/null 2>&1; "
        + sshargs.shell(["rm", "-rf", p.dir])
    )


def remove(session: Session, *places: Place) -> dict[str, str]:
    """The controllers and their directories gone from their hosts, and the key from every host of
    the session: the hosts where any of that may still be, with why (revoke_on)."""
    job = places[0].job
    return revoke_on(session, session.hosts, [job], clear={p.host.name: p for p in places})


def revoke_on(
    session: Session,
    hosts: Sequence[Host],
    job_ids: Sequence[str],
    tries: int = REVOKE_TRIES,
    pause: float = REVOKE_PAUSE,
    clear: dict[str, Place] | None = None,
) -> dict[str, str]:
    """These jobs' controller keys removed from each host, checked there (keys.revoke_script), and
    on the hosts in `clear` that controller's container and directory; tried again where that
    failed at once (the host refused or had no route, its lock was busy), not where a deadline
    passed (a frozen host: another try would only wait as long again): host -> why, for the hosts
    where it failed every time."""
    what = "removing the controller's key"
    clear = clear or {}

    def command(h: Host) -> str:
        revoke = revoke_script(job_ids)
        if h.name not in clear:
            return revoke
        # The key first (its script runs in a shell of its own); its failure is the one said.
        return f"{revoke}; r=$?; {clear_script(clear[h.name])} || exit 9; exit $r"

    left: dict[str, str] = {}
    todo = tuple(hosts)
    for n in range(tries):
        if n:
            time.sleep(pause * n)
        done = session.fan_out(lambda h: session.run(h, command(h), timeout=keys.TIMEOUT, what=what), todo)
        left = {h.name: why for h in todo if (why := failure(h, done[h.name], what))}
        todo = tuple(h for h in todo if h.name in left and not timed_out(done[h.name]))
        if not todo:
            break
    return left


def keys_line(job: str, left: dict[str, str], lead: str = "") -> str:
    """What a person is told about hosts that may still hold a job's controller key ('' if none)."""
    if not left:
        return ""
    names = sorted(left)
    return (
        f"{lead}{job}: its controller's key may still be in ~/.ssh/authorized_keys on {', '.join(names)} "
        f"({'; '.join(left[n] for n in names)}); 'fab status' tries again, as does "
        f"'fab stop --job {job}' (the line expires by itself a while after its controller last renewed "
        f"it: {keys.LIFETIME // 3600} h by default)"
    )


def controllers(found: PerHost) -> dict[str, dict[str, str]]:
    """job -> {host: state} of every controller container the survey saw (a job has two: its
    controller and its standby)."""
    out: dict[str, dict[str, str]] = {}
    for host, hj in found.items():
        if isinstance(hj, HostJobs):
            for job, state in hj.controllers.items():
                out.setdefault(job, {})[host] = state
    return out


def running(states: dict[str, str]) -> bool:
    return any(s == "running" for s in states.values())


def keys_to_revoke(found: PerHost, targets: list[str], runs: Path) -> list[str]:
    """The jobs among `targets` (fab stop's) whose controller key goes with them: those the survey
    saw a controller container of, or this machine's record shows detached; not one whose
    controller still runs: that one needs it to fetch the outputs, and removes it itself at its end."""
    live = controllers(found)
    out = []
    for j in targets:
        if running(live.get(j, {})):
            continue
        if j not in live:
            try:
                if not JobRecord.load(runs, j, "runs/").controller:
                    continue
            except (UserError, OSError):  # no record here it can read: not known to be detached
                continue
        out.append(j)
    return out


def _records(runs: Path) -> list[JobRecord]:
    found = []
    for path in sorted(runs.glob("*/job.json")) if runs.is_dir() else ():
        try:
            found.append(JobRecord.load(runs, path.parent.name, "runs/"))
        except UserError:
            continue
    return found


def detached_records(runs: Path) -> list[JobRecord]:
    """This machine's records of detached jobs whose run directory is not fetched yet."""
    return [r for r in _records(runs) if unfetched(r)]


def keys_held(runs: Path) -> list[JobRecord]:
    """This machine's records of detached jobs whose controller is done with (fetched, or taken
    over and ended since) and whose key this machine has not yet seen gone from every host."""
    return [
        r
        for r in _records(runs)
        if r.controller and not unfetched(r) and r.state != "running" and r.controller.keys
    ]


def take_back(
    session: Session, inv: Inventory, record: JobRecord, found: PerHost, clear: bool = False
) -> dict[str, str]:
    """The job's controller key removed from the hosts its record says may hold it (and with `clear`,
    its controllers' containers and directories): those where it still may, with why (one the survey
    found unreachable is not tried)."""
    names = list(record.controller.keys) if record.controller else []
    by_name = {h.name: h for h in inv.all_hosts}
    left = {hostile.line(n, 80): f"{inv.path} names no such host" for n in names if n not in by_name}
    left.update({n: f"{n} does not answer" for n in names if n in by_name and found.error(n) is not None})
    ask = tuple(by_name[n] for n in names if n in by_name and n not in left)
    places = {p.host.name: p for p in places_of(inv, record)} if clear else {}
    return {**left, **revoke_on(session, ask, [record.job_id], clear=places)}


def save_keys(runs: Path, job: str, left: dict[str, str]) -> None:
    """The record's hosts that may hold the key, read and written back at once (a `fab train
    --resume` of the job may be saving it too)."""
    try:
        record = JobRecord.load(runs, job, "runs/")
    except UserError:
        return
    if record.controller is not None:
        record.controller = replace(record.controller, keys=tuple(sorted(left)))
        record.save(runs / job)
