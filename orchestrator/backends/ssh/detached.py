"""Detached jobs (fab train --detach): the job's whole life (job.py, the same stages) runs in a
controller, a container started for the job on one host (the inventory's controller: host, by
default the first host), so the terminal that started it may close. Here: where a controller runs
(Place), and what this machine does with a detached job once it is started: its end and run
fetched, followed (fab logs), named by fab status, its key taken back by fab stop. Starting one:
submit.py; the controller itself: controller.py.

What is copied where (README: Detached jobs). On the controller's host, in
<job.output_dir>/.controllers/JOB (mode 700, the SSH user's own), mounted at /ctl in the controller:
  key, key.pub    an SSH key made for this job alone (Ed25519, mode 600). Its public half is added
                  to ~/.ssh/authorized_keys of the SSH user on every host and spare, marked
                  `fabtrain-controller:JOB` and restricted (no forwarding), and removed from them at
                  the job's end (by the controller, or by `fab stop --job JOB`).
  known_hosts     the host keys this machine trusts for the job's hosts: the controller checks them.
  secrets/NAME    job.secret_files' contents (mode 600).
  launch.pickle   the job as this machine resolved it (inventory, spec, policy, record), mode 600.
  fabtrain/       the orchestrator's code, as it is here; code/: the job's code tree.
  runs/JOB/       the job's run directory, as the controller writes it.
The key, secrets and launch.pickle are removed when the controller ends; `fab logs` and `fab status`
fetch runs/JOB here once the job has ended, then remove the whole directory.

The controller runs as the SSH user's uid, with every capability dropped and no new privileges,
on the host's network (it reaches the hosts as this machine does, at their addresses).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.base import Finished
from orchestrator.commands import hostfiles, sshargs
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.recovery import JobRecord
from orchestrator.hosts.keys import revoke_script
from orchestrator.hosts.survey import HostJobs
from orchestrator.transport import deadlines
from orchestrator.transport.remote import Session, describe

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.transport.remote import PerHost

MOUNT = "/ctl"
DONE = "done.json"         # the controller's last word: {"state", "error", "closing"}
FETCH_TIMEOUT = 600.0
FOLLOW_POLL = 2.0          # seconds between looks while a detached job is between attempts


@dataclass(frozen=True)
class Place:
    """Where a detached job's controller runs."""

    job: str
    host: Host
    dir: str            # on the host: <job.output_dir>/.controllers/JOB
    container: str      # fabtrain-ctl-JOB

    def record(self) -> dict:
        return {"host": self.host.name, "dir": self.dir, "container": self.container}


def place(inv: Inventory, job_id: str) -> Place:
    name = inv.controller.host or inv.hosts[0].name
    host = next((h for h in inv.all_hosts if h.name == name), None)
    if host is None:
        raise UserError(
            f"--detach: the controller's host {name} (the inventory's controller:) is not among this "
            "job's hosts and spares: include it, or name another there",
            exit_code=2,
        )
    return Place(job_id, host, hostfiles.controller_dir(inv, job_id), f"fabtrain-ctl-{job_id}")


def unfetched(record: JobRecord) -> bool:
    """A detached job whose run is still with its controller (not fetched here, not taken over)."""
    c = record.controller
    return bool(c) and not c.get("fetched") and not c.get("taken_over")


def place_of(inv: Inventory, record: JobRecord) -> Place | None:
    """The controller a job's record names (None: not detached, or a host this inventory lacks)."""
    c = record.controller
    host = next((h for h in inv.all_hosts if h.name == c.get("host")), None)
    if not c or host is None or not jobspec.valid_job_id(record.job_id):
        return None
    return place(replace(inv, controller=replace(inv.controller, host=host.name)), record.job_id)


# ---------------------------------------------------------------- this machine: after the end

def done_command(p: Place) -> str:
    return sshargs.shell(["cat", f"{p.dir}/{DONE}"])


def fetch(session: Session, p: Place, record: JobRecord, runs: Path) -> dict | None:
    """The controller's end ({"state", "error", "closing"}) and runs/JOB copied here, then its
    directory removed from the host; None while the controller has not ended."""
    r = session.run(p.host, done_command(p), timeout=deadlines.STATUS_TIMEOUT, what="asking the controller")
    if not r.ok:
        return None
    try:
        done = json.loads(r.stdout[:100_000])
        end = {k: hostile.text(str(done.get(k) or "")) for k in ("state", "error", "closing")}
    except (ValueError, AttributeError):
        end = {"state": "failed", "error": "the controller's done.json is not JSON", "closing": ""}
    fetched = copy_runs(session, p, record, runs, {"fetched": time.time()})
    if fetched.state == "running":  # the controller ended before its job did (refused, or it failed)
        fetched.state = end["state"] if end["state"] != "running" else "failed"
        fetched.save(runs / record.job_id)
    remove(session, p)
    return end


def copy_runs(session: Session, p: Place, record: JobRecord, runs: Path, mark: dict) -> JobRecord:
    """The controller's runs/JOB copied here whole (snapshots too), as safely as any host's outputs;
    the record copied with it keeps where its controller was, and `mark`."""
    run_dir = runs / record.job_id
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = sshargs.fetch_argv(p.host, f"{p.dir}/runs/{record.job_id}", str(run_dir))
    got = session.local([a for a in argv if not a.startswith("--exclude")], FETCH_TIMEOUT)
    if not got.ok:
        raise UserError(f"{p.host.name}: fetching {p.dir}/runs/{record.job_id} failed: "
                        f"{hostile.line(got.stderr.strip(), 300)}; it stays there: run the command again")
    try:
        fetched = JobRecord.load(runs, record.job_id, "the controller's record of")
    except UserError:  # the controller ended before its job began: keep ours
        fetched = record
    fetched.controller = {**record.controller, **mark}
    fetched.spec["code"] = record.spec["code"]  # the controller's copy was /ctl/code; resumes read it here
    fetched.save(run_dir)
    return fetched


def remove(session: Session, p: Place) -> None:
    """The controller's directory, and its key on every host (what it may have left), gone."""
    session.run(p.host, sshargs.shell(["docker", "rm", "-f", p.container]) + " >/dev/null 2>&1; "
                + sshargs.shell(["rm", "-rf", p.dir]), timeout=deadlines.STATUS_TIMEOUT,
                what="removing the controller and its directory")
    session.fan_out(lambda h: session.run(h, revoke_script([p.job]), timeout=deadlines.STATUS_TIMEOUT,
                                          what="removing the controller's key"))


def controllers(found: PerHost) -> dict[str, str]:
    """job -> "HOST STATE" of every controller container the survey saw."""
    out = {}
    for host, hj in found.items():
        if isinstance(hj, HostJobs):
            out.update({job: f"{host} {state}" for job, state in hj.controllers.items()})
    return out


def keys_to_revoke(found: PerHost, targets: list[str], runs: Path) -> list[str]:
    """The jobs among `targets` (fab stop's) whose controller key goes with them: those the survey
    saw a controller container of, or this machine's record shows detached; not one whose
    controller still runs: that one needs it to fetch the outputs, and removes it itself at its end."""
    live = controllers(found)
    out = []
    for j in targets:
        if live.get(j, "").endswith(" running"):
            continue
        if j not in live:
            try:
                if not JobRecord.load(runs, j, "runs/").controller:
                    continue
            except (UserError, OSError):  # no record here it can read: not known to be detached
                continue
        out.append(j)
    return out


def detached_records(runs: Path) -> list[JobRecord]:
    """This machine's records of detached jobs whose run directory is not fetched yet."""
    found = []
    for path in sorted(runs.glob("*/job.json")) if runs.is_dir() else ():
        try:
            record = JobRecord.load(runs, path.parent.name, "runs/")
        except UserError:
            continue
        if unfetched(record):
            found.append(record)
    return found


def status_lines(session: Session, inv: Inventory, runs: Path, found: PerHost) -> list[str]:
    """fab status on detached jobs: those that ended are fetched (runs/JOB) and their controller's
    directory removed; a controller that is gone, or whose host does not answer, is named."""
    lines, seen = [], controllers(found)
    for record in detached_records(runs):
        p = place_of(inv, record)
        if p is None:
            continue
        job = record.job_id
        if found.error(p.host.name) is not None:
            lines.append(
                f"{job}: its controller's host {p.host.name} does not answer (lost?), with the job's "
                f"record: once it answers, 'fab logs --job {job}' fetches the run; if it is gone for "
                f"good, 'fab stop --job {job}' and then 'fab train --resume {job}'"
            )
            continue
        try:
            end = fetch(session, p, record, runs)
        except Exception as exc:  # noqa: BLE001 - one job's fetch never hides the others
            lines.append(f"{job}: its run could not be fetched from {p.host.name}: {describe(p.host, exc)}")
            continue
        if end is not None:
            why = f": {end['error'].splitlines()[0]}" if end["error"] else ""
            lines.append(f"{job}: ended ({end['state']}{why}); fetched its run into {runs / job}")
        elif not seen.get(job, "").endswith(" running"):
            lines.append(f"{job}: its controller on {p.host.name} is gone without an end; 'fab attach {job}' "
                         "takes the job over here")
        else:
            lines.append(f"{job}: detached, its controller runs on {p.host.name}")
    return lines


def follow(inv: Inventory, record: JobRecord, runs: Path, console: Console, live: bool) -> Finished:
    """fab logs of a detached job: its nodes followed while it runs (each attempt), then its run
    fetched here once its controller has ended."""
    from orchestrator.backends.ssh import jobs
    from orchestrator.hosts import survey
    p = place_of(inv, record)
    if p is None:
        raise UserError(f"job {record.job_id}: its controller ran on {record.controller.get('host')}, which "
                        f"{inv.path} does not name; give the inventory it was started with", exit_code=2)
    job = record.job_id
    with Session(inv.all_hosts) as session:
        while True:
            try:
                end = fetch(session, p, record, runs)
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001 - the controller's host is named, not a traceback
                raise UserError(
                    f"job {job}: its controller's host does not answer ({describe(p.host, exc)}); "
                    f"'fab status' says more"
                ) from None
            if end is not None:
                error = (
                    UserError(end["error"].replace(f"{MOUNT}/runs/", f"{runs}/")) if end["error"] else None
                )
                return Finished(
                    job,
                    runs / job,
                    error,
                    f"job {job} {end['state']}; logs and outputs in {runs / job} (fetched from its "
                    f"controller on {p.host.name})",
                )
            found = survey.survey(session, inv)
            if job in survey.running_jobs(found):
                try:
                    jobs.attach(session, inv, job, runs, console, live=live)
                except KeyboardInterrupt:
                    return Finished(job, None, None, "detached; the job goes on ('fab stop --job' ends it)")
                except UserError:
                    pass  # its attempt ended between the survey and the follow
                continue
            state = controllers(found).get(job, "")
            if not state.endswith(" running") and found.error(p.host.name) is None:
                if fetch(session, p, record, runs) is None:
                    raise UserError(f"job {job}: its controller on {p.host.name} is gone without an end; "
                                    f"'fab attach {job}' takes it over here")
                continue
            time.sleep(FOLLOW_POLL)
