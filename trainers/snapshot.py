"""Atomic training snapshots: a crash mid-write never leaves a snapshot that fails to load.

Each snapshot is written to a temporary file in the same directory, fsynced, then renamed into
place (rename is atomic within a filesystem) and the directory fsynced. Resume picks the newest
snapshot that loads. A file named snapshot-NNNNNNNNN.pt is complete: the orchestrator copies it
off the host as soon as it appears (fab train --restarts).

`Writer` takes the state in memory and writes it in a background thread, so a slow disk never
holds rank 0 inside a step while the other ranks wait in a collective (and time out).

Retention: after each write the directory keeps the newest `keep` complete snapshots (the
trainer's `keep` comes from FABTRAIN_KEEP_SNAPSHOTS, which fab train sets from job.keep_snapshots;
default 2). Older ones are removed only once the new one is durable (renamed and its directory
fsynced), and the one just written is never removed, so a reader (a resume, the orchestrator's
copy) always finds at least the newest complete snapshot.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import threading
from pathlib import Path

import torch
import torch.distributed as dist

PREFIX = "snapshot-"
COMPLETE_RE = re.compile(rf"^{PREFIX}\d{{9}}\.pt$")  # what write() renames into place; nothing else is pruned
KEEP_ENV = "FABTRAIN_KEEP_SNAPSHOTS"
# The orchestrator's default for job.keep_snapshots too: the newest is what a restart resumes from;
# the one before it is the fallback when the newest does not load, and a copy of it that the
# orchestrator has started still finds it after the next one is written.
DEFAULT_KEEP = 2


def keep_from_env(environ=os.environ) -> int:
    """How many snapshots to keep: FABTRAIN_KEEP_SNAPSHOTS (a whole number, at least 1), else 2."""
    raw = environ.get(KEEP_ENV, "").strip()
    if not raw:
        return DEFAULT_KEEP
    try:
        keep = int(raw)
    except ValueError:
        keep = 0
    if keep < 1:
        # Refused rather than clamped: 0 or a typo must not silently mean "keep one" or "keep all".
        raise ValueError(
            f"{KEEP_ENV}={raw!r}: how many snapshots to keep must be a whole number, 1 or "
            f"more; set job.keep_snapshots in the inventory (or unset it for {DEFAULT_KEEP})"
        )
    return keep


def save(directory: Path, model, optimizer, epoch: int, step: int, keep: int | None = None) -> Path:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
    return write(directory, state, step, keep)


def cpu_copy(obj):
    """A copy of a state dict whose tensors are on the CPU and no longer shared with training."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


class Writer:
    """Snapshots written in the background, one at a time, in order, the newest `keep` kept (see
    the module's docstring; None keeps every one)."""

    def __init__(self, directory: Path, keep: int | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: at least the snapshot just written is kept (1 or more)")
        self.directory = directory
        self.keep = keep
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, model, optimizer, epoch: int, step: int) -> None:
        self.wait()  # a snapshot still being written is finished first (bounded memory: one copy)
        state = cpu_copy(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
        )
        self._thread = threading.Thread(
            target=self._write, args=(state, step), daemon=True, name="snapshot-writer"
        )
        self._thread.start()

    def _write(self, state: dict, step: int) -> None:
        try:
            final = write(self.directory, state, step)  # durable once it returns: only then pruned
            if self.keep is not None:
                prune(self.directory, self.keep, final)
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
            self.error = exc

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def write(directory: Path, state: dict, step: int, keep: int | None = None) -> Path:
    """Write one snapshot atomically (see the module's docstring); then, with `keep`, remove all
    but the newest `keep` complete snapshots, never the one just written. None keeps every one."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: at least the snapshot just written is kept (1 or more)")
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f".{PREFIX}*.tmp"):  # left by a writer killed mid-write
        stale.unlink(missing_ok=True)
    final = directory / f"{PREFIX}{step:09d}.pt"
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if keep is not None:
        prune(directory, keep, final)
    return final


def prune(directory: Path, keep: int, written: Path) -> None:
    """Remove all but the newest `keep` complete snapshots of `directory`, never `written`. Called
    only after `written` is durable, so a reader looking for the newest always finds one."""
    names = sorted(p.name for p in directory.iterdir() if COMPLETE_RE.match(p.name))
    for name in names[:-keep]:
        if name != written.name:  # an older name than snapshots already there: still the one to resume from
            (directory / name).unlink(missing_ok=True)


def load_latest(directory: Path, map_location=None) -> dict | None:
    """The newest snapshot that loads, with its path and the SHA-256 of its bytes; None when there
    is none."""
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob(f"{PREFIX}*.pt"), reverse=True):
        try:
            data = path.read_bytes()
            state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception:  # noqa: BLE001 - a damaged file (e.g. copied in by hand); try the next
            continue
        state["path"], state["sha256"] = str(path), hashlib.sha256(data).hexdigest()
        return state
    return None


def load_agreed(directory: Path, map_location=None) -> dict | None:
    """The newest snapshot, the same bytes on every rank: rank 0's. Each rank reads its own disk;
    when any rank's newest differs from rank 0's by step or by SHA-256 (a node whose disk lacks it:
    fab train places a snapshot on rank 0's host only and leaves the others to this; a Slurm job
    requeued onto other nodes without a shared filesystem), rank 0 sends its file's bytes with
    their SHA-256 to every rank over the process group, and each rank checks them before loading,
    so no rank starts from another step than the others (a collective mismatch)."""
    snap = load_latest(directory, map_location)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return snap
    mine = (snap["step"], snap["sha256"]) if snap else None
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    if all(s == seen[0] for s in seen):
        return snap
    payload: list[tuple[str, bytes, str] | None] = [None]
    if dist.get_rank() == 0 and snap is not None:
        payload = [(snap["path"], Path(snap["path"]).read_bytes(), snap["sha256"])]
    dist.broadcast_object_list(payload, src=0)
    if payload[0] is None:
        return None  # rank 0 has none: every rank starts afresh
    if dist.get_rank() == 0:
        return snap  # what it sent, loaded already
    path, data, digest = payload[0]
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        raise RuntimeError(
            f"rank 0's snapshot {path} arrived with other bytes than it sent "
            f"(SHA-256 {got[:16]}, not {digest[:16]})"
        )
    state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    state["path"], state["sha256"] = f"{path} (rank 0's copy)", digest
    return state
