"""A job's snapshots, kept off its hosts, so that a job survives the loss of any host.

Snapshots are files named snapshot-NNNNNNNNN.pt in the job's output directory
(`$FABTRAIN_OUTPUT/snapshots` in the container), written atomically by rank 0, which keeps the
newest `job.keep_snapshots` there (the trainer reads FABTRAIN_KEEP_SNAPSHOTS). While a job runs,
each new one is copied from rank 0's host to runs/JOB/snapshots on this machine, which keeps the
same number; before an attempt starts, the newest one known (on this machine or on any host still
answering) is placed on every host of the attempt. So a snapshot survives the loss of any host,
rank 0's included.

Every copy, host to this machine and this machine to host, is checked by size and SHA-256 against
the file it was made from (the host's side by `stat` and `sha256sum` in one SSH command, this
machine's in Python), never trusted by its name. It is written under a temporary name and renamed
only once it matches, so a snapshot's name, here or on a host, always holds checked bytes. A copy
that fails or differs is made again, up to COPY_TRIES times in all; one that still fails is
reported through the caller's `report` callback, one line naming the host, the snapshot and what
was wrong. Nothing here prints.

The commands are built by pure functions (list_command, checksum_command, rename_command,
remove_command, and plan.fetch_file_argv / plan.push_file_argv for the copies, with temp_name for
the temporary names), so a job's plan can show exactly what runs.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import plan
from .errors import UserError
from .inventory import Host, Inventory
from . import hostile
from .remote import Session, describe

SNAPSHOT_RE = re.compile(r"^snapshot-\d{9}\.pt$")
# A program's own checkpoint (fab train --checkpoint) is complete once it has not changed for this
# long while the job runs (it may be written in place, unlike our snapshots, which are renamed
# into place); with no container running, as it is when an attempt is planned, at once.
SETTLE = 1.0
SNAPSHOT_POLL = 0.5   # seconds between looks for a new snapshot on rank 0's host (an ls on an open SSH link)
DEFAULT_KEEP = 2      # job.keep_snapshots when the inventory does not say (trainers/snapshot.py's default too)
LIST_TIMEOUT = 10     # ls, mv, rm in the snapshot directory: metadata only
# sha256sum reads the whole file: at a slow disk's 100 MB/s that is 30 GB of snapshot, well beyond
# the medium preset's ~4 GB (weights and AdamW state), while a stuck disk is still named in time.
CHECKSUM_TIMEOUT = 300
COPY_TRIES = 3        # tries per copy, the first included
RETRY_PAUSE = 1.0     # seconds between two tries: a dropped link gets a moment to come back


def snapshots_dir(inv: Inventory, spec: plan.JobSpec) -> str:
    """The job's snapshot directory on every host (`$FABTRAIN_OUTPUT/snapshots` in the container)."""
    return f"{inv.job.output_dir}/{spec.job_id}/snapshots"


def newest(names) -> str | None:
    """The newest complete snapshot among names (temporary and other files ignored): our own
    snapshots' file names, or Layout names of a program's checkpoints."""
    found = sorted(n for n in names if SNAPSHOT_RE.match(n) or CHECKPOINT_NAME_RE.match(n))
    return found[-1] if found else None


# A program's checkpoint, named by its modification time (ns, so names sort by age) and its path
# in the job's output directory: "01700000000123456789 work/checkpoints/ckpt.pt".
CHECKPOINT_NAME_RE = re.compile(r"^\d{20} \S")


@dataclass(frozen=True)
class Layout:
    """Which files of a job are its snapshots, how they are named, and where they live. Our own
    trainers' snapshots (pattern ""): snapshot-NNNNNNNNN.pt in snapshots/, named by their file
    name. A program's own checkpoints (fab train --checkpoint): the files matching `pattern` (a
    glob relative to the job's output directory: work/ckpt.pt, work/checkpoints/*.pt), named by
    their modification time and path, so the newest sorts last either way."""

    pattern: str = ""

    def list_command(self, inv: Inventory, spec: plan.JobSpec) -> str:
        """What lists them on a host; no output (and success) when there are none."""
        if not self.pattern:
            return plan.shell(["ls", "-1", snapshots_dir(inv, spec)]) + " 2>/dev/null; true"
        root = f"{inv.job.output_dir}/{spec.job_id}"
        return (f"cd {plan.shell([root])} 2>/dev/null && date +%s.%N && "
                + plan.shell(["find", ".", "-path", "./" + self.pattern, "-type", "f", "!", "-name", ".*",
                              "-printf", "%T@ %P\\n"]) + "; true")

    def names(self, stdout: str, settle: float = 0.0) -> list[str]:
        """The complete ones in list_command's output; with `settle`, only a checkpoint unchanged
        for that many seconds (by the host's clock)."""
        if not self.pattern:
            return [n for n in stdout.split() if SNAPSHOT_RE.match(n)]
        lines = stdout.splitlines()
        try:
            now = float(lines[0]) if lines else 0.0
        except ValueError:
            return []
        out = []
        for line in lines[1:]:
            stamp, _, path = line.partition(" ")
            ns = _ns(stamp)
            if ns is None or not path or (settle and now - ns / 1e9 < settle):
                continue
            out.append(f"{ns:020d} {path}")
        return out

    def path(self, name: str) -> str:
        """Where snapshot `name` is, relative to the job's output directory (here: runs/JOB/snapshots)."""
        return f"snapshots/{name}" if not self.pattern else name.split(" ", 1)[1]

    def describe(self, name: str) -> str:
        """A snapshot's name for people: ours as it is; a checkpoint by its path and time."""
        if not self.pattern:
            return name
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(name[:20]) / 1e9))
        return f"{self.path(name).removeprefix(plan.WORK + '/')} (written {stamp})"

    def remote(self, inv: Inventory, spec: plan.JobSpec, name: str) -> str:
        return f"{inv.job.output_dir}/{spec.job_id}/{self.path(name)}"

    def local(self, local_dir: Path, name: str) -> Path:
        return local_dir / (name if not self.pattern else self.path(name))

    def local_names(self, local_dir: Path) -> list[str]:
        """The snapshots kept in local_dir, named as on the hosts (a copy keeps its time)."""
        if not self.pattern:
            return [p.name for p in local_dir.iterdir() if SNAPSHOT_RE.match(p.name)]
        return [f"{p.stat().st_mtime_ns:020d} {p.relative_to(local_dir).as_posix()}"
                for p in local_dir.rglob("*") if p.is_file() and not p.name.startswith(".")]


def _ns(stamp: str) -> int | None:
    """find's %T@ (seconds with a fraction) as integer nanoseconds."""
    whole, _, frac = stamp.partition(".")
    if not whole.isdigit() or (frac and not frac.isdigit()):
        return None
    return int(whole) * 10**9 + int((frac + "000000000")[:9])


def layout(spec: plan.JobSpec) -> Layout:
    return Layout(spec.checkpoint)


def local_dir_name(spec: plan.JobSpec) -> str:
    """Where runs/JOB keeps them: snapshots/ (ours) or checkpoints/ (the program's, by path)."""
    return "checkpoints" if spec.checkpoint else "snapshots"


def push_commands(host: Host, local_file: str, remote_file: str) -> tuple[list[str], str, str]:
    """One checked push (Snapshots.push): the local rsync to a temporary name on the host, the
    host's size and SHA-256 of it (compared with this machine's), the rename into place."""
    tmp = temp_path(remote_file)
    return plan.push_file_argv(host, local_file, tmp), checksum_command(tmp), rename_command(tmp, remote_file)


def temp_name(name: str) -> str:
    """The name a copy of snapshot `name` is written under until it is checked, here and on a host:
    not a snapshot's name, so nothing takes it for one, and matching the trainer's own temporary
    files (`.snapshot-*.tmp`), so the trainer's next write removes one left on a host."""
    return f".{name}.copy.tmp"


def temp_path(path: str) -> str:
    """temp_name beside the file at `path`."""
    head, tail = posixpath.split(path)
    return posixpath.join(head, temp_name(tail))


# ---------------------------------------------------------------- the remote commands

def list_command(inv: Inventory, spec: plan.JobSpec) -> str:
    """List the job's snapshots on a host; no output (and success) when there are none."""
    return layout(spec).list_command(inv, spec)


def checksum_command(remote_file: str) -> str:
    """Size in bytes, then SHA-256, of a file on a host, in one SSH command (parse_checksum reads it)."""
    return plan.shell(["stat", "-c", "%s", remote_file]) + " && " + plan.shell(["sha256sum", remote_file])


def rename_command(source: str, dest: str) -> str:
    """Rename a checked copy into place on a host (atomic within the directory)."""
    return plan.shell(["mv", "-f", source, dest])


def remove_command(remote_file: str) -> str:
    """Remove a copy that failed its check on a host (nothing when it is not there)."""
    return plan.shell(["rm", "-f", remote_file])


# ---------------------------------------------------------------- checking a copy

@dataclass(frozen=True)
class Digest:
    """What a copy is checked by: the file's size and SHA-256."""

    size: int
    sha256: str

    def __str__(self) -> str:
        return f"{self.size} bytes, sha256 {self.sha256[:12]}"


def parse_checksum(stdout: str) -> Digest:
    """The Digest in checksum_command's output; ValueError when it is not that."""
    lines = stdout.strip().splitlines()
    if len(lines) != 2 or not lines[0].strip().isdigit():
        raise ValueError(f"not a size and a sha256sum line: {stdout.strip()[:120]!r}")
    # sha256sum puts a backslash before the hash when it had to escape the file's name.
    digest = lines[1].split(maxsplit=1)[0].lstrip("\\").lower() if lines[1].split() else ""
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError(f"not a sha256sum line: {lines[1][:120]!r}")
    return Digest(int(lines[0]), digest)


def local_digest(path: Path) -> Digest:
    """The Digest of a file on this machine."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return Digest(size, h.hexdigest())


class _CopyFailed(Exception):
    """One try of a copy that did not succeed; its text says what was wrong."""


def remote_digest(session: Session, host: Host, remote_file: str) -> Digest:
    """The Digest of a file on a host (checksum_command, with a deadline); _CopyFailed says why not."""
    try:
        r = session.run(host, checksum_command(remote_file), timeout=CHECKSUM_TIMEOUT,
                        what=f"checksumming {remote_file}")
    except Exception as exc:  # noqa: BLE001 - an unreachable host or a deadline: this try failed
        raise _CopyFailed(f"no checksum from the host: {describe(host, exc)}") from None
    if not r.ok:
        raise _CopyFailed(f"stat/sha256sum on the host exited {r.exited}: "
                          f"{hostile.text(r.stderr.strip())[-200:]}")
    try:
        return parse_checksum(r.stdout)
    except ValueError as exc:
        raise _CopyFailed(f"unreadable checksum from the host: {hostile.text(str(exc))}") from None


def remote_newest(session: Session, host: Host, inv: Inventory, spec: plan.JobSpec,
                  settle: float = 0.0) -> str | None:
    """The newest complete snapshot in the job's output directory on a host (None: none, or no answer)."""
    try:
        r = session.run(host, list_command(inv, spec), timeout=LIST_TIMEOUT, what="listing snapshots")
    except BaseException:  # noqa: BLE001 - a host that does not answer holds no usable snapshot
        return None
    return newest(layout(spec).names(r.stdout, settle))


# ---------------------------------------------------------------- runs/JOB/snapshots

Report = Callable[[str], None]


class Snapshots:
    """runs/JOB/snapshots: the newest `keep` snapshots of the job, copied off the hosts and checked.

    `report` gets one line for each copy that still failed after COPY_TRIES tries. `copy` runs the
    rsync argv (plan.fetch_file_argv / push_file_argv) as subprocess.run would, and returns what it
    returns; rsync's own --timeout ends a copy whose data stops moving."""

    def __init__(self, run_dir: Path, inv: Inventory, spec: plan.JobSpec, keep: int, report: Report,
                 copy: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest snapshot is kept (1 or more)")
        self.layout = layout(spec)
        self.dir = run_dir / local_dir_name(spec)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.inv, self.spec, self.keep, self.report, self.copy = inv, spec, keep, report, copy
        # Held by fetch and by the whole of place: the follow thread must not prune the snapshot
        # that place is pushing. Reentrant, as place fetches.
        self.lock = threading.RLock()
        # (host, snapshot) copies that failed every try and were reported: the follow thread does
        # not try them again at every look (the next snapshot gets its own tries).
        self.given_up: set[tuple[str, str]] = set()

    def local_newest(self) -> str | None:
        """The newest snapshot in runs/JOB/snapshots (every one there was checked)."""
        return newest(self.layout.local_names(self.dir))

    def local_path(self, name: str) -> Path:
        return self.layout.local(self.dir, name)

    def remote_path(self, name: str) -> str:
        return self.layout.remote(self.inv, self.spec, name)

    def _copy(self, argv: list[str]) -> None:
        try:
            proc = self.copy(argv, capture_output=True, text=True)
        except OSError as exc:  # rsync missing or not runnable
            raise _CopyFailed(f"{argv[0]} could not run: {exc}") from None
        if proc.returncode != 0:
            raise _CopyFailed(f"rsync exited {proc.returncode}: {hostile.text((proc.stderr or '').strip())[-200:]}")

    def fetch(self, session: Session, host: Host, name: str) -> bool:
        """Copy snapshot `name` from a host into runs/JOB/snapshots, checked (see the module's
        docstring), and keep the newest `keep` there. True when it is here (a newer one too counts);
        False when every try failed, which `report` was told."""
        with self.lock:
            if name <= (self.local_newest() or ""):
                return True
            remote, final = self.remote_path(name), self.local_path(name)
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_name(temp_name(final.name))
            why = ""
            try:
                for n in range(COPY_TRIES):
                    if n:
                        time.sleep(RETRY_PAUSE)
                    # Removed before each try: rsync skips a file whose size and time already match.
                    tmp.unlink(missing_ok=True)
                    try:
                        want = remote_digest(session, host, remote)
                        self._copy(plan.fetch_file_argv(host, remote, str(tmp)))
                        try:
                            got = local_digest(tmp)
                        except OSError as exc:
                            raise _CopyFailed(f"the copy cannot be read here: {exc}") from None
                        if got != want:
                            raise _CopyFailed(f"the copy ({got}) differs from the host's file ({want})")
                    except _CopyFailed as exc:
                        why = str(exc)
                        continue
                    os.replace(tmp, final)
                    self._prune()
                    return True
            finally:
                tmp.unlink(missing_ok=True)
            have = self.local_newest()
            self.report(f"{host.name}: could not copy snapshot {name} to {self.dir} in {COPY_TRIES} tries "
                        f"(last: {why}); {'still ' + have if have else 'no snapshot'} here to resume from. "
                        f"Check {host.name}'s disk and the network if this repeats")
            return False

    def _prune(self) -> None:
        """Keep the newest `keep` snapshots here (called with the lock held, after a checked copy)."""
        for old in sorted(self.layout.local_names(self.dir))[:-self.keep]:
            self.local_path(old).unlink(missing_ok=True)

    def follow(self, session: Session, rank0: Host, stop: threading.Event) -> threading.Thread:
        """Copy every new snapshot from rank 0's host as soon as it is complete, until `stop`; then
        look once more, so that a snapshot written just before the job ended is copied too. Join
        the returned thread before relying on runs/JOB/snapshots holding that last one."""
        def look() -> None:
            name = remote_newest(session, rank0, self.inv, self.spec, settle=SETTLE if self.spec.checkpoint else 0)
            if name and (rank0.name, name) not in self.given_up:
                if not self.fetch(session, rank0, name):
                    self.given_up.add((rank0.name, name))

        def loop() -> None:
            while not stop.wait(SNAPSHOT_POLL):
                look()
            look()
        t = threading.Thread(target=loop, daemon=True, name="snapshot-copy")
        t.start()
        return t

    def place(self, session: Session, inv: Inventory, also_ask: tuple[Host, ...] = ()) -> str | None:
        """Before an attempt: find the newest snapshot on this machine or on any host answering
        (the attempt's and `also_ask`, which should leave out hosts known lost: each silent one costs
        LIST_TIMEOUT), copy it here, then onto every host of the attempt that does not already hold
        the same bytes. Returns the snapshot placed (None: there is none); UserError naming each
        host where the copy still failed after COPY_TRIES tries (also told to `report`)."""
        asked = {h.name: h for h in (*inv.hosts, *also_ask)}
        found = session.fan_out(lambda h: remote_newest(session, h, inv, self.spec), tuple(asked.values()))
        with self.lock:
            # Newest first, from each host that holds it in turn: one bad link does not lose it.
            for snap, name in sorted(((found.value(n), n) for n in found if found.value(n)), reverse=True):
                if snap <= (self.local_newest() or ""):
                    break
                if self.fetch(session, asked[name], snap):
                    break
            best = self.local_newest()
            if best is None:
                return None
            digest = local_digest(self.local_path(best))

            def push(h: Host) -> None:
                if found.value(h.name) == best and self.holds(session, h, self.remote_path(best), digest):
                    return
                self.push(session, h, best, digest)
            errors = [str(e) for e in session.fan_out(push, inv.hosts).errors().values()]
            if errors:
                raise UserError("\n".join(errors))
            return best

    def holds(self, session: Session, host: Host, remote_file: str, digest: Digest) -> bool:
        """Whether a host's file has exactly these bytes (not just this name)."""
        try:
            return remote_digest(session, host, remote_file) == digest
        except _CopyFailed:
            return False

    def push(self, session: Session, host: Host, name: str, digest: Digest) -> None:
        """Copy runs/JOB/snapshots/`name` to its place on a host under temp_name, check it there,
        and rename it into place; UserError (also told to `report`) when every try failed."""
        final = self.remote_path(name)
        tmp = temp_path(final)
        why = ""
        for n in range(COPY_TRIES):
            if n:
                time.sleep(RETRY_PAUSE)
            try:
                self._copy(plan.push_file_argv(host, str(self.local_path(name)), tmp))
                got = remote_digest(session, host, tmp)
                if got != digest:
                    raise _CopyFailed(f"the host's copy ({got}) differs from this machine's ({digest})")
                try:
                    r = session.run(host, rename_command(tmp, final), timeout=LIST_TIMEOUT,
                                    what=f"renaming {tmp}")
                except Exception as exc:  # noqa: BLE001 - this try failed; the next one says more
                    raise _CopyFailed(f"mv on the host failed: {describe(host, exc)}") from None
                if not r.ok:
                    raise _CopyFailed(f"mv on the host exited {r.exited}: {hostile.text(r.stderr.strip())[-200:]}")
                return
            except _CopyFailed as exc:
                why = str(exc)
                # Removed, not left for the next try: rsync would skip a file whose size and time match.
                try:
                    session.run(host, remove_command(tmp), timeout=LIST_TIMEOUT, what=f"removing {tmp}")
                except Exception:  # noqa: BLE001 - a host that does not answer fails the next try anyway
                    pass
        line = (f"{host.name}: could not place snapshot {name} in {posixpath.dirname(final)} in {COPY_TRIES} tries (last: {why}); "
                f"check the host's disk space and SSH access, or leave it out so a spare takes its place")
        self.report(line)
        raise UserError(line)
