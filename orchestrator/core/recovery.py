"""What lets a job outlive a failure: its record under runs/JOB and the stacks of a hung job (the
next attempt's hosts are policy.py's decision, its snapshots snapshots/store.py's).

A job keeps one id, one output directory and one set of arguments across attempts (fab train
--restarts) and across invocations (fab train --resume JOB).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.record import (
    VERSION,
    BackendPlace,
    Controller,
    Notify,
    Resume,
    UnknownKey,
    plain,
    read,
)

if TYPE_CHECKING:  # the core imports no other layer
    from orchestrator.config.inventory import Inventory

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
    """runs/JOB/job.json: what `fab train --resume JOB` needs to continue the same job. Its typed
    parts, its format's version and how an older one is read: record.py."""

    spec: jobspec.JobSpec
    inventory: str
    state: str = "running"  # running, finished, failed, interrupted, stopped
    restarts: int = 0
    min_nodes: int | None = None
    hang_timeout: float = 0
    attempts: list[Attempt] = field(default_factory=list)
    # Each later `fab train --resume/--continue` of the job: when, after which attempt, what changed.
    resumes: list[Resume] = field(default_factory=list)
    # The hosts chosen with --include/--exclude/--num-nodes (None: the inventory's hosts:).
    selected: list[str] | None = None
    backend: BackendPlace | None = None  # None: over SSH
    notify: Notify = Notify()
    controller: Controller | None = None  # None: not detached

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def on(self) -> str:
        """The backend the job ran on (backends/registry.py names them)."""
        return self.backend.on if self.backend is not None else "ssh"

    def to_dict(self) -> dict:
        return {"version": VERSION, **plain(self)}

    @classmethod
    def from_dict(cls, doc: object) -> JobRecord:
        """A record read from its JSON (record.py's versions): ValueError naming the field or key
        that is wrong, NewerRecord when a newer fabtrain wrote it."""
        if not isinstance(doc, dict):
            raise ValueError(f"it is {type(doc).__name__}, not a JSON object")
        doc = dict(doc)
        version = doc.pop("version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"version is {version!r}, not a version number")
        if version > VERSION:
            raise NewerRecord(version)
        if version == 1:  # before versions: an absent part was {}
            doc.update({k: None for k in ("backend", "controller") if doc.get(k) == {}})
        return read(cls, doc, "")

    def save(self, run_dir: Path) -> None:
        tmp = run_dir / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(run_dir / RECORD)

    @classmethod
    def new(
        cls, spec: jobspec.JobSpec, inv: Inventory, restarts: int, min_nodes: int | None, hang_timeout: float
    ) -> JobRecord:
        return cls(
            spec=spec,
            inventory=str(inv.path),
            restarts=restarts,
            min_nodes=min_nodes,
            hang_timeout=hang_timeout,
        )

    def with_host_data(self, doc: object, hosts: Collection[str]) -> JobRecord:
        """This record with what a detached job's controller legitimately changes, read from its
        copy of the record (`doc`, parsed JSON from its host: hostile data): the state, and the
        attempts after those this record holds (number, hosts, times, outcome, the snapshot each
        resumed from). Everything else, above all what runs a command or reads a file here (notify,
        inventory, spec with its code and image, backend, secrets through the inventory, the
        controller's place), stays this record's. ValueError saying what was refused: a host name
        not in `hosts` (this machine's inventory and record), attempts this record holds rewritten,
        a value of the wrong kind."""
        if not isinstance(doc, dict):
            raise ValueError(f"it is not a JSON object but {type(doc).__name__}")
        spec = doc.get("spec")
        if isinstance(spec, dict) and spec.get("job_id") != self.job_id:
            raise ValueError(f"it names job {hostile.line(repr(spec.get('job_id')), 80)}, not {self.job_id}")
        state = doc.get("state")
        if state not in STATES:
            raise ValueError(f"state {hostile.line(repr(state), 80)} is none of {', '.join(STATES)}")
        raw = doc.get("attempts")
        if not isinstance(raw, list) or len(raw) > MAX_ATTEMPTS:
            raise ValueError(f"attempts is not a list of at most {MAX_ATTEMPTS}")
        attempts = [_host_attempt(a, i + 1, hosts) for i, a in enumerate(raw)]
        ours = self.attempts
        if len(attempts) < len(ours) or any(
            (a.number, a.hosts) != (o.number, o.hosts) for a, o in zip(attempts, ours, strict=False)
        ):
            recorded = ", ".join(f"{o.number} on {'+'.join(o.hosts)}" for o in ours) or "none"
            raise ValueError(
                f"its attempts do not begin with the {len(ours)} this machine recorded ({recorded})"
            )
        # The frozen parts (spec, backend, notify, controller) are shared; nothing that changes is.
        return replace(
            self,
            state=state,
            attempts=[replace(a) for a in ours] + attempts[len(ours) :],
            resumes=copy.deepcopy(self.resumes),
            selected=list(self.selected) if self.selected is not None else None,
        )

    @classmethod
    def load(cls, run_root: Path, job_id: str, what: str = "--resume") -> JobRecord:
        if not jobspec.valid_job_id(job_id):
            raise UserError(
                f"{what} {hostile.text(job_id)!r} is not a job id; 'ls {run_root}' lists them", exit_code=2
            )
        path = run_root / job_id / RECORD
        try:
            record = cls.from_dict(json.loads(path.read_text()))
            if record.job_id != job_id:  # it names directories on the hosts and here
                raise ValueError(f"it names job {hostile.line(repr(record.job_id), 80)}, not {job_id}")
        except FileNotFoundError:
            raise UserError(
                f"{what} {job_id}: no {path}; only jobs started by 'fab train' from this "
                f"directory are recorded there ('ls {run_root}' lists them)",
                exit_code=2,
            ) from None
        except NewerRecord as exc:
            raise UserError(
                f"{path}: written by a newer fabtrain (job record version {exc.version}; this "
                f"one reads versions up to {VERSION}): update this fabtrain (git pull in "
                f"{jobspec.PROJECT_ROOT}), or use the one that wrote it",
                exit_code=2,
            ) from None
        except UnknownKey as exc:
            raise UserError(
                f"{path}: not a job record this version can read ({exc}, which no fabtrain "
                "writes in a record of its version): was it edited? Remove that key, or start "
                "a new job instead",
                exit_code=2,
            ) from None
        except (ValueError, TypeError, KeyError) as exc:
            raise UserError(
                f"{path}: not a job record this version can read ({exc}); start a new job instead",
                exit_code=2,
            ) from None
        return record


class NewerRecord(ValueError):
    """A job record in a format newer than VERSION."""

    def __init__(self, version: int) -> None:
        super().__init__(f"version {version}")
        self.version = version


STATES = ("running", "finished", "failed", "interrupted", "stopped")
MAX_ATTEMPTS = 10_000
OUTCOME_MAX = 2000


def _host_attempt(doc: object, number: int, hosts: Collection[str]) -> Attempt:
    """One attempt of a host's copy of a record (JobRecord.with_host_data), checked field by field."""
    where = f"attempt {number}"
    if not isinstance(doc, dict):
        raise ValueError(f"{where} is not a JSON object")
    if doc.get("number") != number or isinstance(doc.get("number"), bool):
        seen = hostile.line(repr(doc.get("number")), 40)
        raise ValueError(f"{where} is numbered {seen}: attempts count from 1 one by one")
    names = doc.get("hosts")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(names) > len(hosts):
        raise ValueError(f"{where}: hosts is not a list of host names")
    strange = [n for n in names if n not in hosts]
    if strange:
        seen = hostile.line(", ".join(map(repr, strange[:4])), 200)
        raise ValueError(f"{where} names host(s) {seen} that this machine's inventory and record do not")
    started, ended = _time(doc.get("started")), _time(doc.get("ended"))
    if started is None or (ended is None and doc.get("ended") is not None):
        raise ValueError(f"{where}: started/ended are not times (seconds since 1970)")
    outcome, snapshot = doc.get("outcome", "running"), doc.get("resumed_from")
    if not isinstance(outcome, str):
        raise ValueError(f"{where}: outcome is not text")
    if snapshot is not None:
        try:
            hostile.component(snapshot if isinstance(snapshot, str) else "")
        except hostile.UnsafeName as exc:
            raise ValueError(f"{where}: resumed_from is not a snapshot's name ({exc})") from None
    return Attempt(number, list(names), started, ended, hostile.line(outcome, OUTCOME_MAX), snapshot)


def _time(value: object) -> float | None:
    """A time in seconds since 1970 (None: not one; NaN and infinities are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e11:
        return None
    return float(value)


# ---------------------------------------------------------------- stacks of a hung job


def main_threads(dump: str) -> list[tuple[str, str, tuple[tuple[str, str, str], ...]]]:
    """Per rank in a stacks dump (docker/fabtrain_hook.py): (rank, pid, the frames of its main
    thread, innermost first, as (file, line, function)). The main thread is the one whose outermost
    frame runs <module> (a script) or _run_module_as_main (a module: torchrun -m, runpy); a rank
    whose dump holds no such thread is left out. A dump holding a rank twice keeps the last."""
    ranks = {}
    for block in re.split(r"(?m)^(?=--- rank )", dump):
        head = re.match(r"--- rank (\S+) \(local rank (\S+), pid (\d+)\)", block)
        if not head:
            continue
        frames: list[tuple[str, str, str]] = []
        for t in re.split(r"(?m)^(?=(?:Current thread|Thread) 0x)", block):
            fs = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', t)
            if fs and fs[-1][2] in ("<module>", "_run_module_as_main"):
                frames = [f for f in fs if not f[0].endswith(("/runpy.py", "<frozen runpy>"))] or fs
        if frames:
            ranks[(head.group(1), head.group(3))] = tuple(frames)
    return [(rank, pid, frames) for (rank, pid), frames in ranks.items()]


def stack_summary(dump: str) -> list[str]:
    """One line per rank from the dumped stacks: the innermost frame of its main thread and the
    innermost frame of the user's code below it."""
    lines = []
    for rank, _pid, frames in main_threads(dump):
        inner = frames[0]
        user = next((f for f in frames if _in_code(f[0])), None)
        where = f"{inner[2]} ({inner[0].rsplit('/', 1)[-1]}:{inner[1]})"
        if user and user is not inner:
            where += f" called from {_in_code(user[0])}:{user[1]}"
        elif user:
            where = f"{_in_code(user[0])}:{user[1]} in {user[2]}"
        lines.append(f"rank {rank}: {where}")
    return lines


def stack_signature(dump: str) -> tuple:
    """Where a node's ranks are, to compare two looks: each rank's pid and main-thread frames.
    Empty when the dump shows no rank (nothing registered yet, or unreadable)."""
    return tuple(sorted((pid, frames) for _rank, pid, frames in main_threads(dump)))


def flight_summaries(host: str, text: str) -> list[tuple[str, int, dict]]:
    """(host, rank, process groups) from the lines a host's flight step printed (FLIGHT_PY, run in
    the job's container: hostile). Lines that are not such a JSON object are skipped; numbers that
    are not numbers make the group unknown."""
    out = []
    for line in text.splitlines()[:1024]:
        try:
            doc = json.loads(line[:65536])
            rank = int(doc["rank"])
            pgs = {}
            for pg, v in dict(doc["pgs"]).items():
                done = v.get("completed")
                pgs[hostile.line(str(pg), 40)] = {
                    "seq": int(v["seq"]),
                    "op": hostile.line(str(v.get("op") or "?"), 60),
                    "name": hostile.line(str(v.get("name") or pg), 60),
                    "completed": int(done) if done not in (None, "") else None,
                }
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        out.append((host, rank, pgs))
    return out


def flight_verdict(summaries: list[tuple[str, int, dict]]) -> list[tuple[str, str]]:
    """What torch's flight recorder says about a hang, per process group: the newest collective some
    ranks entered and did not complete, and the ranks that never entered it (what the others wait
    for). (host to blame, or '' when no rank is missing; one line)."""
    verdicts = []
    groups = sorted({pg for _, _, pgs in summaries for pg in pgs})
    for pg in groups:
        have = {rank: (host, pgs[pg]) for host, rank, pgs in summaries if pg in pgs}
        if pg == "0":  # the default group holds every rank: one with no collective in it yet is behind
            none = {"seq": 0, "op": "none", "name": "", "completed": None}
            have.update({rank: (host, none) for host, rank, _ in summaries if rank not in have})
        if len(have) < 2:
            continue
        top = max(v["seq"] for _, v in have.values())
        waiting = sorted(
            r
            for r, (_, v) in have.items()
            if v["seq"] == top and (v["completed"] is None or v["completed"] < top)
        )
        missing = sorted(r for r, (_, v) in have.items() if v["seq"] < top)
        if not waiting:
            continue
        host, first = have[waiting[0]]
        what = f"{first['op']} #{top} of process group {first['name']}"
        if missing:
            for r in missing:
                h, v = have[r]
                newest = f"{v['op']} #{v['seq']}" if v["seq"] else "no collective yet"
                verdicts.append(
                    (
                        h,
                        f"flight recorder: rank {r} on {h} never entered {what}, which rank(s) "
                        f"{_ranks(waiting)} wait in (its newest: {newest})",
                    )
                )
        elif len(waiting) == len(have):
            verdicts.append(
                (
                    "",
                    f"flight recorder: every rank is in {what} and none is missing: the "
                    "collective itself is stuck (network, device or a rank's GPU)",
                )
            )
    return verdicts


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _in_code(path: str) -> str:
    """A frame's file as a path in the user's code ('' when it is not there): the working directory
    links to the code, and modules imported from it show the code's own mount."""
    for root in (jobspec.WORKDIR, jobspec.CODE_MOUNT):
        if path.startswith(root + "/"):
            return path[len(root) + 1 :]
    return ""


# Innermost frames that mean "waiting for the other ranks" (torch.distributed's collectives).
COLLECTIVE_FILES = ("distributed_c10d.py", "c10d_logger.py", "_functional_collectives.py")


def in_collective(where: str) -> bool:
    """Whether a rank's stack_summary place is inside a collective (it waits for another rank)."""
    return any(f"({name}:" in where for name in COLLECTIVE_FILES)


def source_line(code_root: str, path_line: str) -> str:
    """The source text at 'relpath:line' in the local code tree, when it is there."""
    rel, _, line = path_line.rpartition(":")
    try:
        text = (Path(code_root) / rel).read_text(encoding="utf-8", errors="replace").splitlines()
        return text[int(line) - 1].strip()
    except (OSError, ValueError, IndexError):
        return ""
