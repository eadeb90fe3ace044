"""What lets a job outlive a failure: its record under runs/JOB, copies of its snapshots, the choice
of hosts for the next attempt, and the stacks of a hung job.

A job keeps one id, one output directory and one set of arguments across attempts (fab train
--restarts) and across invocations (fab train --resume JOB). Snapshots are files named
snapshot-NNNNNNNNN.pt in the job's output directory (`$FABTRAIN_OUTPUT/snapshots` in the
container), written atomically by rank 0. While a job runs, each new one is copied from rank 0's
host to runs/JOB/snapshots on this machine; before an attempt starts, the newest one known (on this
machine or on any host still answering) is placed on every host of the attempt. So a snapshot
survives the loss of any host, rank 0's included.
"""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import plan
from .errors import UserError
from .inventory import Host, Inventory
from .logs import sanitize
from .remote import Session

SNAPSHOT_RE = re.compile(r"^snapshot-\d{9}\.pt$")
SNAPSHOT_POLL = 0.5   # seconds between looks for a new snapshot on rank 0's host (an ls on an open SSH link)
KEEP_LOCAL = 2        # snapshots kept in runs/JOB/snapshots
LIST_TIMEOUT = 10
RECORD = "job.json"


# ---------------------------------------------------------------- the job's record

@dataclass
class Attempt:
    number: int
    hosts: list[str]
    started: float
    ended: float | None = None
    outcome: str = "running"
    resumed_from: str | None = None


@dataclass
class JobRecord:
    """runs/JOB/job.json: what `fab train --resume JOB` needs to continue the same job."""

    spec: dict
    inventory: str
    state: str = "running"  # running, finished, failed, interrupted, stopped
    restarts: int = 0
    min_nodes: int | None = None
    hang_timeout: float = 0
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def job_id(self) -> str:
        return self.spec["job_id"]

    def job_spec(self) -> plan.JobSpec:
        s = dict(self.spec)
        s["args"] = tuple(s.get("args", ()))
        s["env"] = tuple(tuple(kv) for kv in s.get("env", ()))
        return plan.JobSpec(**s)

    def save(self, run_dir: Path) -> None:
        tmp = run_dir / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(run_dir / RECORD)

    @classmethod
    def new(cls, spec: plan.JobSpec, inv: Inventory, restarts: int, min_nodes: int | None,
            hang_timeout: float) -> "JobRecord":
        return cls(spec=asdict(spec), inventory=str(inv.path), restarts=restarts, min_nodes=min_nodes,
                   hang_timeout=hang_timeout)

    @classmethod
    def load(cls, run_root: Path, job_id: str) -> "JobRecord":
        if not plan.valid_job_id(job_id):
            raise UserError(f"--resume {sanitize(job_id)!r} is not a job id; 'ls {run_root}' lists them",
                            exit_code=2)
        path = run_root / job_id / RECORD
        try:
            doc = json.loads(path.read_text())
            attempts = [Attempt(**a) for a in doc.pop("attempts", [])]
            record = cls(**doc, attempts=attempts)
            record.job_spec()
        except FileNotFoundError:
            raise UserError(f"--resume {job_id}: no {path}; only jobs started by 'fab train' from this "
                            f"directory can be resumed ('ls {run_root}' lists them)", exit_code=2) from None
        except (ValueError, TypeError, KeyError) as exc:
            raise UserError(f"{path}: not a job record this version can read ({exc}); start a new job "
                            "instead", exit_code=2) from None
        if record.state == "finished":
            raise UserError(f"job {job_id} already finished (see {path}); nothing to resume", exit_code=2)
        return record


# ---------------------------------------------------------------- choosing hosts

@dataclass
class NextHosts:
    inventory: Inventory
    notes: list[str]


def next_hosts(inv: Inventory, replace_names: list[str], spares: list[Host], min_nodes: int,
               why: dict[str, str]) -> NextHosts:
    """The hosts of the next attempt: each host in `replace_names` gives its node rank to the next
    unused spare (a new rank 0 when rank 0's host goes); with no spare left it is dropped, and the
    job goes on with fewer nodes only down to `min_nodes`. `spares` is consumed."""
    hosts, notes, dropped = [], [], []
    for h in inv.hosts:
        if h.name not in replace_names:
            hosts.append(h)
        elif spares:
            spare = spares.pop(0)
            hosts.append(replace(spare, rank=h.rank))
            notes.append(f"spare {spare.name} takes the place of {h.name} ({why.get(h.name, 'failed')}) "
                         f"as node rank {h.rank}")
        else:
            dropped.append(h)
    if dropped:
        names = ", ".join(h.name for h in dropped)
        if len(hosts) < min_nodes:
            raise UserError(
                f"no spare host left to replace {names} ({'; '.join(why.get(h.name, 'failed') for h in dropped)}), "
                f"and {len(hosts)} node(s) are fewer than the {min_nodes} the job needs. Add hosts under "
                "'spares:' in the inventory, or allow fewer nodes with --min-nodes, then "
                "'fab train --resume JOB'")
        notes.append(f"no spare left: going on without {names} with {len(hosts)} node(s) "
                     f"(--min-nodes {min_nodes})")
        hosts = [replace(h, rank=i) for i, h in enumerate(hosts)]
    return NextHosts(replace(inv, hosts=tuple(hosts)), notes)


# ---------------------------------------------------------------- snapshots

def snapshots_dir(inv: Inventory, spec: plan.JobSpec) -> str:
    return f"{inv.job.output_dir}/{spec.job_id}/snapshots"


def newest(names) -> str | None:
    found = sorted(n for n in names if SNAPSHOT_RE.match(n))
    return found[-1] if found else None


def remote_newest(session: Session, host: Host, inv: Inventory, spec: plan.JobSpec) -> str | None:
    """The newest complete snapshot in the job's output directory on a host (None: none, or no answer)."""
    try:
        r = session.run(host, plan.shell(["ls", "-1", snapshots_dir(inv, spec)]) + " 2>/dev/null; true",
                        timeout=LIST_TIMEOUT, what="listing snapshots")
    except BaseException:  # noqa: BLE001 - a host that does not answer holds no usable snapshot
        return None
    return newest(r.stdout.split())


class Snapshots:
    """runs/JOB/snapshots: the newest snapshots of the job, copied off the hosts."""

    def __init__(self, run_dir: Path, inv: Inventory, spec: plan.JobSpec) -> None:
        self.dir = run_dir / "snapshots"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.inv, self.spec = inv, spec
        self.lock = threading.Lock()

    def local_newest(self) -> str | None:
        return newest(p.name for p in self.dir.iterdir())

    def fetch(self, host: Host, name: str) -> bool:
        """Copy one snapshot from a host (rsync writes a temporary file and renames it)."""
        with self.lock:
            if name <= (self.local_newest() or ""):
                return True
            proc = subprocess.run(plan.fetch_file_argv(host, f"{snapshots_dir(self.inv, self.spec)}/{name}",
                                                       str(self.dir / name)),
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                return False
            for old in sorted(p.name for p in self.dir.iterdir() if SNAPSHOT_RE.match(p.name))[:-KEEP_LOCAL]:
                (self.dir / old).unlink(missing_ok=True)
            return True

    def follow(self, session: Session, rank0: Host, stop: threading.Event) -> threading.Thread:
        """Copy every new snapshot from rank 0's host as soon as it is complete, until `stop`."""
        def loop() -> None:
            while not stop.wait(SNAPSHOT_POLL):
                name = remote_newest(session, rank0, self.inv, self.spec)
                if name:
                    self.fetch(rank0, name)
        t = threading.Thread(target=loop, daemon=True, name="snapshot-copy")
        t.start()
        return t

    def place(self, session: Session, inv: Inventory, also_ask: tuple[Host, ...] = ()) -> str | None:
        """Before an attempt: find the newest snapshot on this machine or on any host answering
        (the attempt's and `also_ask`, which should leave out hosts known lost: each silent one costs
        LIST_TIMEOUT), copy it here, then onto every host of the attempt."""
        asked = {h.name: h for h in (*inv.hosts, *also_ask)}
        found = session.fan_out(lambda h: remote_newest(session, h, inv, self.spec), tuple(asked.values()))
        remote = max(((snap, name) for name, snap in found.items() if found.value(name)), default=None)
        if remote:
            self.fetch(asked[remote[1]], remote[0])
        best = self.local_newest()
        if best is None:
            return None
        dest = snapshots_dir(inv, self.spec)

        def push(h: Host) -> None:
            if found.get(h.name) == best:
                return
            proc = subprocess.run(plan.push_file_argv(h, str(self.dir / best), f"{dest}/{best}"),
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise UserError(f"{h.name}: could not place snapshot {best}: {sanitize(proc.stderr.strip()[-300:])}")
        errors = [str(e) for e in session.fan_out(push, inv.hosts).errors().values()]
        if errors:
            raise UserError("\n".join(errors))
        return best


# ---------------------------------------------------------------- stacks of a hung job

def stack_summary(dump: str) -> list[str]:
    """One line per rank from the dumped stacks: the innermost frame of its main thread (the one
    running <module>) and the innermost frame of the user's code below it."""
    lines = []
    for block in re.split(r"(?m)^(?=--- rank )", dump):
        head = re.match(r"--- rank (\S+) \(local rank (\S+), pid (\d+)\)", block)
        if not head:
            continue
        threads = re.split(r"(?m)^(?=(?:Current thread|Thread) 0x)", block)
        frames = []
        for t in threads:
            fs = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', t)
            if fs and fs[-1][2] == "<module>":
                frames = fs
        if not frames:
            continue
        inner = frames[0]
        user = next((f for f in frames if f[0].startswith(plan.WORKDIR + "/")), None)
        where = f"{inner[2]} ({inner[0].rsplit('/', 1)[-1]}:{inner[1]})"
        if user and user is not inner:
            where += f" called from {user[0][len(plan.WORKDIR) + 1:]}:{user[1]}"
        elif user:
            where = f"{user[0][len(plan.WORKDIR) + 1:]}:{user[1]} in {user[2]}"
        lines.append(f"rank {head.group(1)}: {where}")
    return lines


def source_line(code_root: str, path_line: str) -> str:
    """The source text at 'relpath:line' in the local code tree, when it is there."""
    rel, _, line = path_line.rpartition(":")
    try:
        text = (Path(code_root) / rel).read_text(encoding="utf-8", errors="replace").splitlines()
        return text[int(line) - 1].strip()
    except (OSError, ValueError, IndexError):
        return ""


# Seconds of silence from every rank before the watchdog dumps stacks and fails the attempt: as
# long as NCCL's own collective timeout, so only a job that NCCL would also call stuck is ended.
HANG_TIMEOUT = 600.0
BACKOFF_MAX = 30.0


def backoff(attempt: int) -> float:
    """Seconds to wait before attempt `attempt` (2, 3, ...): 1, 2, 4, ... at most BACKOFF_MAX."""
    return min(BACKOFF_MAX, 2.0 ** (attempt - 2))
