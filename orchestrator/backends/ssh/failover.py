"""A detached job's brain out of the blast radius: the active controller's mirror and heartbeat,
and the standby that takes the job over when the active one is lost (placement.py says where each
runs).

The active controller, every BEAT seconds, runs one command on the standby's host: it touches
mirror/heartbeat in the standby's directory, unless that directory holds TAKEN (the standby took
the job over: this controller is fenced and stops itself at once, removing its credentials and
touching nothing of the job). When the run directory changed, it pushes runs/JOB to the standby's
mirror/runs/JOB (rsync): the record, events.jsonl, the logs and the snapshots live on two hosts.
Before each stage that starts or removes containers the job asks the standby's host the same
question (job.FENCE), so a controller that wakes from a freeze never acts on a job another took.
At its end it pushes the run and its end (mirror/done.json), which ends the standby.

The standby (`controller /ctl --standby`) looks at the heartbeat's age every second (its own
host's clock, its own file). Past STALE it asks the active controller's host whether that
container runs: gone (killed, its engine restarted) -> it takes over at once; no answer (the host
frozen or lost) -> it takes over once the job's lease on every answering host of the job has not
been renewed for hostfiles.LEASE_LIVE s (the active one is not looking after the job from
anywhere). Taking over: TAKEN written first (the fence), mirror/runs/JOB moved to runs/JOB, the
events `controller_lost` and `controller_started` emitted, and the job followed from its running
attempt as `fab attach` does (no container started twice, the restart budget as recorded), or, with
nothing running, continued as `fab train --resume` does. One failover per job: the new controller
has no standby of its own.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from orchestrator.backends.ssh.placement import MIRROR
from orchestrator.core.errors import UserError
from orchestrator.core.recovery import RECORD, JobRecord
from orchestrator.hostcmds import hostfiles, sshargs
from orchestrator.transport.remote import Session

if TYPE_CHECKING:
    from collections.abc import Callable

    from orchestrator.backends.base import Finished, Launch
    from orchestrator.config.inventory import Host

BEAT = 2.0  # seconds between the active controller's heartbeats
STALE = 6.0  # a heartbeat older than this: the standby looks at the active controller
POLL = 1.0  # seconds between the standby's looks at its heartbeat
# Until the active controller was once seen alive (a heartbeat, or its container running), the
# standby judges nothing for this long: started beside it, the standby may look before the active's
# `docker run` has made its container on a loaded host ("gone" then means "not yet").
START_GRACE = 60.0
PROBE_TIMEOUT = 5.0  # the active controller's host answers within this, or it is silent
PUSH_TIMEOUT = 120.0
TAKEN = "taken"  # in a controller's directory: it took the job over (the fence of the one before)
FENCED = "fenced"  # ... it learnt that another took the job over and stopped itself
DONE = "done.json"
PROBES = ThreadPoolExecutor(max_workers=4, thread_name_prefix="probe")


def beat_script(standby_dir: str) -> str:
    """On the standby's host: `taken` when it took the job over, or when its directory is gone (the
    job ended and was cleared: nothing is left to look after), else the heartbeat touched."""
    d = sshargs.shell([standby_dir])
    return (
        f"if [ ! -d {d} ] || [ -e {d}/{TAKEN} ]; then echo {TAKEN}; else mkdir -p {d}/{MIRROR} && "
        f"touch {d}/{MIRROR}/heartbeat; fi"
    )


def probe_script(name: str, active_dir: str) -> str:
    """On the active controller's host: `running` while its container runs, `done` once it wrote
    its end, `gone` otherwise."""
    d = sshargs.shell([active_dir])
    return (
        f"[ -e {d}/{DONE} ] && {{ echo done; exit 0; }}; "
        f"s=$(docker inspect -f '{{{{.State.Running}}}}' {sshargs.shell([name])} 2>/dev/null); "
        '[ "$s" = true ] && echo running || echo gone'
    )


def push_argv(host: Host, source: Path, dest: str) -> list[str]:
    """The run directory to the standby's mirror, whole (links kept as links, nothing followed)."""
    return [
        "rsync",
        "--recursive",
        "--links",
        "--times",
        "--delete",
        "--mkpath",
        f"--timeout={sshargs.RSYNC_IO_TIMEOUT}",
        *sshargs.RSYNC_PROTECT,
        "--rsh",
        sshargs.shell(sshargs.ssh_argv(host)),
        str(source).rstrip("/") + "/",
        sshargs.rsync_remote(host, dest.rstrip("/") + "/"),
    ]


# What a failover needs at once (the record, the events, the snapshots): pushed at the next beat
# when they change; the rest (the logs, growing all the time) at most every PUSH_EVERY seconds.
PUSH_EVERY = 10.0
MUST = ("job.json", "events.jsonl", "snapshots", "checkpoints")


def tree_state(root: Path) -> tuple[tuple, tuple]:
    """(what MUST holds, everything): names, sizes and times of the run directory's files."""
    out = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                s = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            out.append((os.path.relpath(os.path.join(dirpath, f), root), s.st_size, s.st_mtime_ns))
    out.sort()
    return tuple(e for e in out if e[0].split(os.sep, 1)[0] in MUST), tuple(out)


class Mirror:
    """The active controller's side (module docstring): heartbeat, fence and pushes, in a thread."""

    def __init__(self, standby: Host, standby_dir: str, run_dir: Path, on_fenced: Callable[[], None]) -> None:
        self.standby, self.dir, self.run_dir = standby, standby_dir, run_dir
        self.on_fenced = on_fenced
        self.pushed: tuple[tuple, tuple] = ((), ())
        self.last_push = 0.0
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.session = Session((standby,))
        self.thread = threading.Thread(target=self.run, name="mirror", daemon=True)

    def start(self) -> Mirror:
        self.thread.start()
        return self

    def taken(self) -> bool:
        """One heartbeat: whether the standby took the job over (False when its host is silent: only
        the standby takes over, and it writes TAKEN on its own host before anything else)."""
        try:
            r = self.session.run(self.standby, beat_script(self.dir), timeout=PROBE_TIMEOUT, what="heartbeat")
        except paramiko.AuthenticationException:
            return True  # the job's key was taken back: its end came while this controller was away
        except Exception:  # noqa: BLE001 - a silent standby took nothing over
            return False
        return r.ok and r.stdout.strip() == TAKEN

    def check(self) -> None:
        """Stop here (on_fenced) when the standby took the job over: the job asks before it starts or
        removes anything."""
        if self.taken():
            self.on_fenced()

    def push(self, force: bool = False) -> str | None:
        """runs/JOB to the standby's mirror when it changed: None, or why it failed."""
        with self.lock:
            now = tree_state(self.run_dir)
            due = now[0] != self.pushed[0] or (
                now[1] != self.pushed[1] and time.monotonic() - self.last_push >= PUSH_EVERY
            )
            if not (due or force):
                return None
            argv = push_argv(self.standby, self.run_dir, f"{self.dir}/{MIRROR}/runs/{self.run_dir.name}")
            got = self.session.local(argv, PUSH_TIMEOUT)
            if got.ok:
                self.pushed, self.last_push = now, time.monotonic()
                return None
            return f"{self.standby.name}: {got.stderr.strip()[-300:]}"

    def run(self) -> None:
        while not self.stopping.wait(BEAT):
            if self.taken():
                self.on_fenced()
                return
            why = self.push()
            if why:
                print(f"warning: mirroring the run to the standby failed: {why}", file=sys.stderr, flush=True)

    def finish(self, end: dict) -> None:
        """The run and its end to the standby's mirror (which ends the standby)."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=PUSH_TIMEOUT)
        self.push(force=True)
        body = json.dumps(end).encode()
        d = sshargs.shell([f"{self.dir}/{MIRROR}"])
        try:
            self.session.run(
                self.standby,
                f"mkdir -p {d} && cat > {d}/.{DONE}.tmp && mv {d}/.{DONE}.tmp {d}/{DONE}",
                timeout=PROBE_TIMEOUT * 2,
                stdin=body,
                what="the end to the standby",
            )
        except Exception as exc:  # noqa: BLE001 - the standby then finds the active one's end itself
            print(f"warning: the end did not reach the standby: {exc!r}", file=sys.stderr, flush=True)
        self.session.close()


# ---------------------------------------------------------------- the standby


def heartbeat_age(root: Path) -> float | None:
    """Seconds since the active controller's last heartbeat reached the mirror; None before the first."""
    try:
        return time.time() - (root / MIRROR / "heartbeat").stat().st_mtime
    except OSError:
        return None


def lease_fresh(session: Session, launch: Launch, skip: str) -> str | None:
    """The host where the job's lease is fresh (its active controller still looks after it), or None."""
    from orchestrator.backends.ssh.takeover import refuse_if_looked_after
    from orchestrator.hosts import survey

    hosts = tuple(h for h in launch.inv.all_hosts if h.name != skip)
    try:
        refuse_if_looked_after(survey.survey(session, launch.inv, hosts), launch.spec.job_id)
    except UserError as exc:
        return str(exc)
    return None


def verdict(session: Session, launch: Launch, active: Host, active_dir: str) -> str:
    """`running`, `done`, `gone` (its container is not there) or `silent` (its host did not answer)."""
    name = f"fabtrain-ctl-{launch.spec.job_id}"
    # In a thread of its own: a frozen host accepts the connection and then says nothing, and a new
    # connection's banner wait is the host's connect_timeout, not PROBE_TIMEOUT.
    asking = PROBES.submit(
        session.run, active, probe_script(name, active_dir), timeout=PROBE_TIMEOUT, what="the controller"
    )
    try:
        r = asking.result(timeout=PROBE_TIMEOUT)
    except Exception:  # noqa: BLE001 - a host that does not answer is what is looked for
        return "silent"
    said = r.stdout.strip() if r.ok else ""
    return said if said in ("running", "done", "gone") else "silent"


def stand_by(
    root: Path, launch: Launch, active: Host, active_dir: str, own: str, taking_over: Callable[[], None]
) -> Finished | None:
    """The standby's life: None once the active controller ended the job, else the job's end
    after this one took it over (`taking_over` is called first)."""
    since, alive = time.time(), False
    with Session(launch.inv.all_hosts) as session:
        while True:
            time.sleep(POLL)
            if (root / MIRROR / DONE).exists():
                return None
            beat = heartbeat_age(root)
            alive = alive or beat is not None
            age = time.time() - since if beat is None else beat
            if age < STALE:
                continue
            seen = verdict(session, launch, active, active_dir)
            if seen in ("running", "done"):
                alive = True
                if seen == "done" and age > 10 * STALE:
                    return None  # it ended and its last push never came: its run is on its host
                continue
            if not alive and time.time() - since < START_GRACE:
                continue  # not seen alive yet: it may still be starting
            if seen == "silent" and lease_fresh(session, launch, active.name):
                continue
            why = (
                "its container is gone"
                if seen == "gone"
                else f"its host does not answer and the job's lease went {hostfiles.LEASE_LIVE:g} s unrenewed"
            )
            taking_over()
            return take_over(root, launch, session, active.name, own, why, age, answers=seen == "gone")


def take_over(
    root: Path,
    launch: Launch,
    session: Session,
    lost: str,
    own: str,
    why: str,
    age: float,
    answers: bool = True,
) -> Finished:
    """The job taken over here (module docstring)."""
    from orchestrator.backends.ssh.backend import SshBackend

    seen = time.monotonic()
    (root / TAKEN).write_text(json.dumps({"from": lost, "at": time.time()}))
    job = launch.spec.job_id
    runs, mirror = launch.runs, root / MIRROR / "runs" / job
    runs.mkdir(parents=True, exist_ok=True)
    if mirror.is_dir() and not (runs / job).exists():
        mirror.rename(runs / job)
    record = JobRecord.load(runs, job, "the job's record") if (runs / job / RECORD).is_file() else None
    if record is not None:
        launch = replace(launch, record=record, spec=record.spec)
    events: list[tuple[str, dict]] = [
        ("controller_lost", {"host": lost, "why": why, "seconds": round(age, 1)}),
        ("controller_started", {"host": own, "from_host": lost}),
    ]
    print(f"taking the job over from {lost}: {why}", file=sys.stderr, flush=True)
    return SshBackend().fail_over(launch, session, events, seen, silent=None if answers else lost)


def fence(root: Path) -> None:
    """This controller was taken over: its credentials removed, FENCED left, and the process ended
    at once (no clean-up: the job is another controller's now)."""
    wipe(root)
    (root / FENCED).write_text(str(time.time()))
    print("another controller took this job over: stopping, touching nothing", file=sys.stderr, flush=True)
    os._exit(0)


def wipe(root: Path) -> None:
    """A controller's credentials gone from its directory: the key, the launch, the secrets."""
    for name in ("key", "launch.pickle"):
        (root / name).unlink(missing_ok=True)
    for secret in (root / "secrets").glob("*"):
        secret.unlink(missing_ok=True)
