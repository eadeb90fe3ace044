"""A job's snapshots, kept off its hosts, so that a job survives the loss of any host.

Two kinds, one Layout each:

- **Our trainers' snapshots** (pattern ""): files named snapshot-NNNNNNNNN.pt in the job's output
  directory (`$FABTRAIN_OUTPUT/snapshots` in the container), written atomically by rank 0, which
  keeps the newest `job.keep_snapshots` there (the trainer reads FABTRAIN_KEEP_SNAPSHOTS). Named by
  their file name.
- **A program's own checkpoints** (fab train --checkpoint GLOB): what the program writes, as it
  writes it: one file rewritten in place, model.pt + optim.pt written each epoch, a torch
  distributed-checkpoint (DCP) directory of `.distcp` files and a `.metadata`. All the files that
  match the glob (and every file under a directory that matches it) are one *set*, kept and placed
  whole, never in parts; a set is named by its newest file's modification time in nanoseconds
  (20 digits, so names sort by age). A DCP directory without its `.metadata` (written last) is
  still being written and is left out of the set; hidden files (rsync's and the program's
  temporary files) are never part of one, `.metadata` excepted. While the job runs, a set is
  complete once two looks at least SETTLE apart saw exactly the same files (paths, sizes and
  times) and its newest file is SETTLE old by the host's clock: a program that pauses longer than
  that between two files of one checkpoint can still be caught between them (write into a new
  directory and rename it, or use DCP, to be exact). With no container running, as when an
  attempt is planned or the job ends, a set is taken as it is.

While a job runs, each new snapshot is copied from rank 0's host to runs/JOB/snapshots (ours) or
runs/JOB/checkpoints/NAME/ (a set, its files at their paths in the job's output directory) on
this machine, which keeps the newest `keep`; before an attempt starts, the newest one known (on
this machine or on any host still answering) is placed on every host of the attempt. So a
snapshot survives the loss of any host, rank 0's included.

Every copy, host to this machine and this machine to host, is checked by size and SHA-256 of each
file against the files it was made from (the host's side by `stat` and `sha256sum` in one SSH
command, this machine's in Python), never trusted by its name. It is written under a temporary
name (a set: into a temporary directory) and renamed only once it matches, so a snapshot's name,
here or on a host, always holds checked bytes; a set fetched while its files changed is dropped
(the next settled one is fetched). On a host, a set is moved into place from its checked
temporary directory in one command, and the host's other files matching the glob (an older or
half-written checkpoint) are moved aside to `.fabtrain-replaced/` in the job's output directory,
so every host holds exactly the set. A copy that fails or differs is made again, up to COPY_TRIES
times in all; one that still fails is reported through the caller's `report` callback, one line
naming the host, the snapshot and what was wrong. Nothing here prints.

Names read from a host are hostile input (a container chose them): a set's list comes
NUL-separated (`find -printf '...\\0'`) with an end mark, so no name can forge a record (ours:
only whole lines that are a snapshot's name, see parse_names); every name goes through
hostile.relpath (no absolute path, no `..`, no control character or newline; on this machine,
resolved inside its directory) and must match the glob; a refused name is skipped and reported
once, naming the host (`Snapshots.warn`). `keep` may be 1: the only complete copy here is removed
only after its successor is checked and renamed into place, and a host's copy is replaced only by
a checked one.

What `keep: 1` cannot do for a program's set: a program that crashes (or whose host is lost)
between writing two files of one checkpoint (model.pt of epoch 8 written, optim.pt still epoch 7's)
leaves a set that no longer changes, so it settles, and it is the newest by name (its newest
file's time): it is copied here, and with `keep: 1` it replaces the last whole one, which is
gone. Whether a set's files belong to one step is the program's knowledge, not fabtrain's. Keep 2
or more (the default) so the one before it is still here to resume from by hand, or have the
program write each checkpoint into a new directory and rename it into place, or use DCP (whose
`.metadata`, written last, marks a whole one).

Links: the job's output directory is the container's (/output), and so is every symbolic link in
it. Nothing is written through one: the host's rsync starts only once the temporary directory's
name is cleared (push_set_argv), and set_place_command refuses a link or a non-directory on the
way to any file it moves, naming it (Snapshots.push reports it, untried again). Nothing is read
through one either: the checksums refuse a file whose real path is not its path in the job's
output directory (manifest_command), and the sizes they read must be the listing's, so a folder
swapped for a link to the host's files between two looks is never copied here. Links elsewhere
in the output directory (the working directory's links into the code) are left alone.

The commands are built by pure functions (Layout.list_command, checksum_command, manifest_command,
rename_command, set_place_command, remove_command, and sshargs.fetch_file_argv / push_file_argv,
fetch_set_argv / push_set_argv for the copies, with temp_name for the temporary names), so a
job's plan can show exactly what runs.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import posixpath
import re
import shutil
import stat as stat_mod
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from orchestrator.commands import sshargs
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.transport.remote import Session, describe

# Whole names only (fullmatch), in ASCII digits: [0-9], not \d, which takes other scripts' digits too.
SNAPSHOT_RE = re.compile(r"snapshot-[0-9]{9}\.pt")  # ours
SET_RE = re.compile(r"[0-9]{20}")                    # a program's checkpoint set
# A program's checkpoint set is complete, while the job runs, once two looks this far apart saw
# the same files and its newest file is this old by the host's clock (see the module's docstring).
SETTLE = 1.0
SNAPSHOT_POLL = 0.5   # seconds between looks for a new snapshot on rank 0's host (a find on an open SSH link)
DEFAULT_KEEP = 2  # job.keep_snapshots when the inventory does not say (trainers/snapshot.py's default too)
LIST_TIMEOUT = 10     # find, mv, rm in the snapshot directory: metadata only
# sha256sum reads the whole file: at a slow disk's 100 MB/s that is 30 GB of snapshot, well beyond
# the medium preset's ~4 GB (weights and AdamW state), while a stuck disk is still named in time.
CHECKSUM_TIMEOUT = 300
COPY_TRIES = 3        # tries per copy, the first included
RETRY_PAUSE = 1.0     # seconds between two tries: a dropped link gets a moment to come back
MAX_SET_FILES = 10000  # files in one checkpoint set; a listing with more is not taken as a set
END = "end"            # the last record of a set listing: the listing is whole (not cut, find succeeded)
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint writes it last, once every rank's file is there
PLACE_TMP = ".fabtrain-set-{}.tmp"  # a set pushed to a host, in the job's output directory, until checked
REPLACED = ".fabtrain-replaced"     # where a host's files matching the glob, not in the set placed, go


def snapshots_dir(inv: Inventory, spec: jobspec.JobSpec) -> str:
    """The job's snapshot directory on every host (`$FABTRAIN_OUTPUT/snapshots` in the container)."""
    return f"{inv.job.output_dir}/{spec.job_id}/snapshots"


def job_root(inv: Inventory, spec: jobspec.JobSpec) -> str:
    """The job's output directory on every host (/output in the container)."""
    return f"{inv.job.output_dir}/{spec.job_id}"


def newest(names: Iterable[str]) -> str | None:
    """The newest complete snapshot among names (temporary and other names ignored): our own
    snapshots' file names, or checkpoint sets' names."""
    found = sorted(n for n in names if SNAPSHOT_RE.fullmatch(n) or SET_RE.fullmatch(n))
    return found[-1] if found else None


# ---------------------------------------------------------------- listings from hosts (pure)

@dataclass(frozen=True)
class Entry:
    """One file of a listing: its path relative to the job's output directory (checked by
    hostile.relpath), size in bytes and modification time in nanoseconds."""

    path: str
    size: int
    ns: int


@dataclass(frozen=True)
class Listing:
    """A host's set listing as read: the host's clock, the safe entries (sorted by path), the names
    refused (as sent, with why), and whether it was whole (its end mark came: not cut short, and
    find read every directory)."""

    now_ns: int
    entries: tuple[Entry, ...]
    refused: tuple[tuple[str, str], ...] = ()
    whole: bool = True


def _ns(stamp: str) -> int | None:
    """find's %T@ (seconds with a fraction) as integer nanoseconds."""
    whole, _, frac = stamp.partition(".")
    if not whole.isdigit() or (frac and not frac.isdigit()) or len(whole) > 11:
        return None
    return int(whole) * 10**9 + int((frac + "000000000")[:9])


def glob_matches(pattern: str, path: str) -> bool:
    """Whether find's `-path ./PATTERN -o -path ./PATTERN/*` selects `path` ('*' matches '/' too)."""
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + "/*")


def parse_listing(stdout: str, pattern: str) -> Listing | None:
    """Layout.list_command's output for a set: NUL-terminated records, the host's clock first, then
    one `MTIME SIZE PATH` per file, then END. None when there is nothing (no job directory yet).

    Every path goes through hostile.relpath and must match `pattern`; one that does not, or a record
    that is not find's, is refused (kept in `refused` with why), never guessed at. Paths with a
    hidden component (temporary files), `.metadata` excepted as a file name, are skipped silently.
    A listing without its END (cut by the output cap, or find failed on some directory) is not
    whole: some of the set may be missing from it, so it is never taken as a set."""
    if not stdout:
        return None
    records = stdout.split("\0")
    # A whole listing ends with END and its NUL, so the split leaves "" after END.
    whole = len(records) >= 3 and records[-1] == "" and records[-2] == END
    body = records[1:-2] if whole else records[1:-1]  # the piece after the last NUL is never a record
    now = _ns(records[0].strip())
    if now is None:
        return None
    entries: list[Entry] = []
    refused: list[tuple[str, str | hostile.UnsafeName]] = []
    for record in body:
        stamp, _, rest = record.partition(" ")
        size, _, path = rest.partition(" ")
        ns = _ns(stamp)
        if ns is None or not size.isdigit():
            refused.append((record, "not a file record of find"))
            continue
        if "\ufffd" in path:
            refused.append((path, hostile.UnsafeName(f"a name that is not UTF-8: {path!r}")))
            continue
        try:
            clean = hostile.relpath(path)
        except hostile.UnsafeName as exc:
            refused.append((path, exc))
            continue
        if clean != path or not glob_matches(pattern, clean):
            refused.append((path, hostile.UnsafeName(f"{path!r} is not a plain path matching {pattern!r}")))
            continue
        parts = clean.split("/")
        if any(p.startswith(".") for p in parts[:-1]) or (
            parts[-1].startswith(".") and parts[-1] != DCP_METADATA
        ):
            continue
        entries.append(Entry(clean, int(size), ns))
    if len(entries) > MAX_SET_FILES:
        whole = False
    return Listing(now, tuple(sorted(entries, key=lambda e: e.path)),
                   tuple((name, str(why)) for name, why in refused), whole)


@dataclass(frozen=True)
class CheckpointSet:
    """The files of a program's checkpoint that belong together (see the module's docstring),
    sorted by path, named by the newest one's modification time (20 digits); `partial` the DCP
    directories left out because their `.metadata` is not written yet."""

    name: str
    files: tuple[Entry, ...]
    partial: tuple[str, ...] = ()

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files)


def checkpoint_set(entries: Sequence[Entry]) -> CheckpointSet | None:
    """The set in a listing's entries: every file, less the DCP directories (those holding a
    `.distcp` file) that have no `.metadata` yet. None when nothing is left."""
    by_dir: dict[str, list[Entry]] = {}
    for e in entries:
        by_dir.setdefault(posixpath.dirname(e.path), []).append(e)
    partial = sorted(d for d, es in by_dir.items()
                     if any(e.path.endswith(".distcp") for e in es)
                     and not any(posixpath.basename(e.path) == DCP_METADATA for e in es))
    files = tuple(
        sorted((e for e in entries if posixpath.dirname(e.path) not in partial), key=lambda e: e.path)
    )
    if not files:
        return None
    return CheckpointSet(f"{max(e.ns for e in files):020d}", files, tuple(partial))


class Settle:
    """While a job runs: a set is complete once two looks at least `settle` s apart (this
    machine's monotonic clock) saw exactly the same listing, and its newest file is `settle` old by
    the host's clock. Feed it every look (`see`); pure but for the state it keeps."""

    def __init__(self, settle: float = SETTLE) -> None:
        self.settle = settle
        self.seen: tuple[Entry, ...] | None = None
        self.since = 0.0

    def see(self, listing: Listing | None, now: float) -> CheckpointSet | None:
        if listing is None or not listing.whole:
            self.seen = None
            return None
        if listing.entries != self.seen:
            self.seen, self.since = listing.entries, now
            return None
        if now - self.since < self.settle:
            return None
        found = checkpoint_set(listing.entries)
        if found is None or listing.now_ns - int(found.name) < self.settle * 1e9:
            return None
        return found


def parse_names(stdout: str) -> list[str]:
    """Our snapshots in Layout.list_command's output (`ls -1`, one name a line): only lines that are
    wholly a snapshot's name (SNAPSHOT_RE). A file name holding a newline can at most make a line
    name a file in the same directory, which must then exist and pass its checksums: the program
    could have written that file itself. So ours need no NUL-separated list; a set's does."""
    return [n for n in stdout.split("\n") if SNAPSHOT_RE.fullmatch(n)]


@dataclass(frozen=True)
class Layout:
    """Which files of a job are its snapshots, how they are named, and where they live. Our own
    trainers' snapshots (pattern ""): snapshot-NNNNNNNNN.pt in snapshots/, named by their file
    name. A program's own checkpoints (fab train --checkpoint): the set of files matching `pattern`
    (a glob relative to the job's output directory: work/ckpt.pt, work/checkpoints/*), named by
    its newest file's time, so the newest sorts last either way."""

    pattern: str = ""

    def list_command(self, inv: Inventory, spec: jobspec.JobSpec) -> str:
        """What lists them on a host, NUL-separated; no output (and success) when there are none.
        A set's listing: the host's clock, then `MTIME SIZE PATH` per file, then END (parse_listing)."""
        if not self.pattern:
            return sshargs.shell(["ls", "-1", snapshots_dir(inv, spec)]) + " 2>/dev/null; true"
        p = "./" + self.pattern
        return (
            f"cd {sshargs.shell([job_root(inv, spec)])} 2>/dev/null && printf '%s\\0' \"$(date +%s.%N)\" && "
            + sshargs.shell(
                [
                    "find",
                    ".",
                    "(",
                    "-path",
                    p,
                    "-o",
                    "-path",
                    p + "/*",
                    ")",
                    "-type",
                    "f",
                    "(",
                    "!",
                    "-name",
                    ".*",
                    "-o",
                    "-name",
                    DCP_METADATA,
                    ")",
                    "-printf",
                    "%T@ %s %P\\0",
                ]
            )
            + f" && printf '{END}\\0'; true"
        )

    def read(self, stdout: str, settle: float = 0.0) -> tuple[list[str], tuple[tuple[str, str], ...]]:
        """The complete snapshots in list_command's output (a set: at most one, the host's whole
        matched set; with `settle`, only if its newest file is that old by the host's clock), and
        the names refused (as sent, with why)."""
        if not self.pattern:
            return parse_names(stdout), ()
        listing = parse_listing(stdout, self.pattern)
        if listing is None:
            return [], ()
        found = checkpoint_set(listing.entries) if listing.whole else None
        if found is None or (settle and listing.now_ns - int(found.name) < settle * 1e9):
            return [], listing.refused
        return [found.name], listing.refused

    def path(self, name: str) -> str:
        """Where our snapshot `name` is, relative to the job's output directory (here: runs/JOB/snapshots)."""
        return f"snapshots/{_ours(name)}"

    def describe(self, name: str) -> str:
        """A snapshot's name for people: ours as it is; a set by its glob and time."""
        if not self.pattern:
            return name
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(_set_name(name)) / 1e9))
        return f"{self.pattern.removeprefix(jobspec.WORK + '/')} (written {stamp})"

    def remote(self, inv: Inventory, spec: jobspec.JobSpec, name: str) -> str:
        """Ours: the snapshot's file on a host. A set: the job's output directory, its files' root."""
        if not self.pattern:
            return f"{job_root(inv, spec)}/{self.path(name)}"
        _set_name(name)
        return job_root(inv, spec)

    def local(self, local_dir: Path, name: str) -> Path:
        """Where snapshot `name` is kept here: ours a file, a set a directory named by it (its
        files at their paths in the job's output directory). UnsafeName for any other name."""
        clean = _ours(name) if not self.pattern else _set_name(name)
        return local_dir / hostile.relpath(clean, root=local_dir)

    def local_names(self, local_dir: Path) -> list[str]:
        """The snapshots kept in local_dir (temporary copies and anything else ignored)."""
        if not self.pattern:
            return [p.name for p in local_dir.iterdir() if SNAPSHOT_RE.fullmatch(p.name) and p.is_file()
                    and not p.is_symlink()]
        return [
            p.name
            for p in local_dir.iterdir()
            if SET_RE.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
        ]

    def push_commands(self, host: Host, inv: Inventory, spec: jobspec.JobSpec, name: str,
                      local_dir: Path) -> tuple[list[str], str, str]:
        """One checked push of snapshot `name` (Snapshots.push): the rsync to a temporary name on the
        host, the host's sizes and SHA-256 of it, the rename into place."""
        return push_commands(
            host, str(self.local(local_dir, name)), self.remote(inv, spec, name), self.pattern
        )


def _ours(name: str) -> str:
    """Our snapshot's name as one plain path component (a plan may show a placeholder: NAME)."""
    return hostile.component(name)


def _set_name(name: str) -> str:
    """A set's name: its first 20 characters, digits (a plan may show a placeholder after them)."""
    if not SET_RE.fullmatch(name[:20]):
        raise hostile.UnsafeName(f"{name!r} is not a checkpoint set's name (20 digits)")
    return name[:20]


def layout(spec: jobspec.JobSpec) -> Layout:
    return Layout(spec.checkpoint)


def local_dir_name(spec: jobspec.JobSpec) -> str:
    """Where runs/JOB keeps them: snapshots/ (ours) or checkpoints/ (the program's sets)."""
    return "checkpoints" if spec.checkpoint else "snapshots"


def push_commands(
    host: Host, local_file: str, remote_file: str, pattern: str = ""
) -> tuple[list[str], str, str]:
    """One checked push (Snapshots.push): the local rsync to a temporary name on the host, the
    host's size and SHA-256 of it (compared with this machine's), the rename into place. A set
    (`local_file` a directory named by 20 digits, `remote_file` the job's output directory): the
    rsync of the directory to PLACE_TMP there, manifest_command of it, set_place_command."""
    if SET_RE.fullmatch(posixpath.basename(local_file.rstrip("/"))):
        name = posixpath.basename(local_file.rstrip("/"))
        tmp = f"{remote_file}/{PLACE_TMP.format(name)}"
        return (push_set_argv(host, local_file, tmp), manifest_command(tmp),
                set_place_command(remote_file, PLACE_TMP.format(name), pattern))
    tmp = temp_path(remote_file)
    guard = no_link_command(posixpath.dirname(remote_file))
    return (sshargs.push_file_argv(host, local_file, tmp, guard), checksum_command(tmp),
            rename_command(tmp, remote_file))


def temp_name(name: str) -> str:
    """The name a copy of snapshot `name` is written under until it is checked, here and on a host:
    not a snapshot's name, so nothing takes it for one, and matching the trainer's own temporary
    files (`.snapshot-*.tmp`), so the trainer's next write removes one left on a host."""
    return f".{name}.copy.tmp"


def local_temp_name(name: str) -> str:
    """temp_name of one copy here: two copies of the same snapshot at once (the follower and the
    next attempt's placement) each write their own."""
    return f"{temp_name(name)}.{threading.get_ident()}"


def temp_path(path: str) -> str:
    """temp_name beside the file at `path`."""
    head, tail = posixpath.split(path)
    return posixpath.join(head, temp_name(tail))


# ---------------------------------------------------------------- the remote commands

def list_command(inv: Inventory, spec: jobspec.JobSpec) -> str:
    """List the job's snapshots on a host; no output (and success) when there are none."""
    return layout(spec).list_command(inv, spec)


def checksum_command(remote_file: str) -> str:
    """Size in bytes, then SHA-256, of a file on a host, in one SSH command (parse_checksum reads it)."""
    return (
        sshargs.shell(["stat", "-c", "%s", remote_file]) + " && " + sshargs.shell(["sha256sum", remote_file])
    )


# For each file given: `SIZE SHA256 PATH` and a NUL. The file is opened once, as the shell's
# stdin, and everything is read from that open file: its real path (readlink of /proc/self/fd/0)
# must be the literal path in the directory, so a file reached through a symbolic link (the
# program swapped a folder of its set for a link to ~/.ssh between two looks) is refused, not
# read; then its size and SHA-256, by sha256sum reading stdin, so no name is ever escaped or
# parsed out of its output.
_MANIFEST_SH = (
    "r=$(pwd -P) || exit 1; for f; do "
    '{ [ "$(readlink /proc/self/fd/0)" = "$r/${f#./}" ] || { printf '
    '"fabtrain: refused: %s is not a plain file at its path in %s (a symbolic link on the way?)\\n" '
    '"$f" "$r" >&2; exit 1; }; s=$(stat -L -c %s /proc/self/fd/0) && h=$(sha256sum); } < "$f" '
    '|| exit 1; printf \'%s %.64s %s\\0\' "$s" "$h" "$f"; done'
)


def manifest_command(directory: str, files: tuple[str, ...] | list[str] | None = None) -> str:
    """Size and SHA-256 of files on a host, relative to `directory`: the ones given (a set's, at
    their place), or every file under it (a set pushed to a temporary directory). parse_manifest
    reads it; it fails when a file cannot be read."""
    head = f"cd {sshargs.shell([directory])} && "
    if files is not None:
        return head + sshargs.shell(["sh", "-c", _MANIFEST_SH, "sh", *files])
    return head + sshargs.shell(
        ["find", ".", "-type", "f", "-exec", "sh", "-c", _MANIFEST_SH, "sh", "{}", "+"]
    )


# The start of what a set's placing commands print when they refuse (Snapshots.push tells it from
# a failure worth another try).
REFUSED_MARK = "fabtrain: refused: "

# The scripts of set_place_command run with the job's output directory as their working
# directory. `no PATH WHY` refuses (exit 3, one line naming the path); `dir D` makes sure
# every component of the relative directory D is a real directory, making the missing ones one at
# a time (never `mkdir -p`, which goes through links), and refuses at a symbolic link or a
# non-directory; `spot P` readies P, a file's place: a symbolic link there is removed (mv would
# move into the directory it points to), a directory there refused. Nothing is followed: `[ -L ]`
# on each component before anything is written through it. A check, then an act: fine here, as
# a set is placed between attempts, when no container of the job runs to swap a folder for a
# link in between (Snapshots.push, attempt.py's place steps).
_NO_SH = ('no() { printf "' + REFUSED_MARK + '%s %s in the job output directory %s; nothing is written '
          'through it\\n" "$1" "$2" "$(pwd)" >&2; exit 3; }; ')
_PLACE_FUNCS = ('set -f; ' + _NO_SH
                + 'dir() { p=; IFS=/; for c in $1; do '
                '[ -z "$c" ] || [ "$c" = . ] && continue; [ "$c" = .. ] && no "$1" "goes up (..)"; '
                'p=${p:+$p/}$c; if [ -L "$p" ]; then no "$p" "is a symbolic link"; '
                'elif [ ! -e "$p" ]; then mkdir -- "$p" || exit 1; '
                'elif [ ! -d "$p" ]; then no "$p" "is not a directory"; fi; done; unset IFS; }; '
                'spot() { if [ -L "$1" ]; then rm -f -- "$1" || exit 1; '
                'elif [ -d "$1" ]; then no "$1" "is a directory where a file goes"; fi; }; ')


def set_place_command(root: str, tmp: str, pattern: str) -> str:
    """Move a set, checked in `root`/`tmp`, into place in `root` (the job's output directory) in one
    command: the host's files matching `pattern` that the set does not hold are first moved aside
    to REPLACED (an older or half-written checkpoint must not sit beside it; kept, not deleted),
    directories left empty by that removed, then each of the set's files renamed into place
    (renames within one file system: nothing is copied again), and `tmp` removed. Without a
    pattern, nothing is moved aside (an empty one would match every file of the job).

    Everything under `root` is the container's: no write goes through a symbolic link there.
    `tmp` must be a real directory; every directory on the way to a file's place (the set's and
    REPLACED's) a real directory, made one at a time where missing; a link at a file's own place
    is replaced, not followed. Anything else is refused, before that file is moved, with one
    line starting REFUSED_MARK naming the path (the command fails). Symbolic links elsewhere
    under `root` (the working directory's links into the code) are none of this command's business."""
    check = (
        _NO_SH + '[ -L "$0" ] && no "$0" "is a symbolic link"; [ -d "$0" ] || no "$0" "is not a directory"'
    )
    move = _PLACE_FUNCS + ('for f; do d=./${f#"$0"/}; dir "${d%/*}"; spot "$d"; '
                           'mv -f -- "$f" "$d" || exit 1; done')
    steps = [sshargs.shell(["sh", "-c", check, "./" + tmp])]
    if pattern:
        p = "./" + pattern
        match = ["(", "-path", p, "-o", "-path", p + "/*", ")"]
        aside = _PLACE_FUNCS + ('for f; do [ -e "$0/$f" ] && continue; '
                                f'dir "{REPLACED}/${{f%/*}}"; spot "{REPLACED}/$f"; '
                                f'mv -f -- "$f" "{REPLACED}/$f" || exit 1; done')
        steps += [
            sshargs.shell(
                ["find", ".", *match, "-type", "f", "-exec", "sh", "-c", aside, "./" + tmp, "{}", "+"]
            ),
            sshargs.shell(["find", ".", "-mindepth", "2", *match, "-type", "d", "-empty", "-delete"]),
        ]
    steps += [
        sshargs.shell(["find", "./" + tmp, "-type", "f", "-exec", "sh", "-c", move, "./" + tmp, "{}", "+"]),
        sshargs.shell(["rm", "-rf", "--", tmp]),
    ]
    return f"cd {sshargs.shell([root])} && " + " && ".join(steps)


def no_link_command(directory: str) -> str:
    """Fails, saying so, when `directory` on a host is a symbolic link: the container may have made
    its snapshots/ directory one, and a copy written through it would land outside the job."""
    why = f"{directory} is a symbolic link; nothing is written through it"
    return f"{{ [ ! -L {sshargs.shell([directory])} ] || {{ echo {sshargs.shell([why])} >&2; exit 1; }}; }}"


def rename_command(source: str, dest: str) -> str:
    """Rename a checked copy into place on a host (atomic within the directory), never through a
    link: not when the directory is one, and a link at `dest` is replaced, not followed (-T)."""
    return f"{no_link_command(posixpath.dirname(dest))} && {sshargs.shell(['mv', '-fT', source, dest])}"


def remove_command(remote_file: str) -> str:
    """Remove a copy that failed its check on a host (nothing when it is not there)."""
    return sshargs.shell(["rm", "-f", remote_file])


def remove_tree_command(remote_dir: str) -> str:
    """Remove a set's temporary directory on a host (nothing when it is not there)."""
    return sshargs.shell(["rm", "-rf", "--", remote_dir])


def fetch_set_argv(
    host: Host, root: str, files_from: str, dest: str, link_dest: str | None = None
) -> list[str]:
    """Copy a set's files (their paths relative to `root`, NUL-separated in the local file
    `files_from`) from a host into the local directory `dest`, at their paths; files unchanged since
    the set in `link_dest` are hard-linked from it. The names reach the host's rsync through rsync's
    protocol, never a shell; no links, devices or permissions are kept."""
    return [
        "rsync",
        "--times",
        f"--timeout={sshargs.RSYNC_IO_TIMEOUT}",
        "--from0",
        f"--files-from={files_from}",
        *([f"--link-dest={link_dest}"] if link_dest else []),
        *sshargs.RSYNC_PROTECT,
        "--rsh",
        sshargs.shell(sshargs.ssh_argv(host)),
        sshargs.rsync_remote(host, root.rstrip("/") + "/"),
        dest.rstrip("/") + "/",
    ]


def push_set_argv(host: Host, local_dir: str, remote_dir: str) -> list[str]:
    """Copy a set's local directory to a (temporary) directory on a host, made if missing.

    The host's rsync is started by `rm -rf -- REMOTE_DIR && rsync` (--rsync-path), so whatever
    stands at that name is gone first, and rsync makes a fresh directory: the name is predictable
    (the set's time, which the program sets), and a symbolic link the container left there would
    have rsync write the set into the link's target. rm -rf removes a link itself, never what it
    points to (the name is given without a trailing slash, which would follow it). The path is
    quoted for the host's shell; it is the inventory's output directory and fabtrain's own name."""
    target = remote_dir.rstrip("/")
    return ["rsync", "--recursive", "--times", "--mkpath", f"--timeout={sshargs.RSYNC_IO_TIMEOUT}",
            *sshargs.RSYNC_PROTECT, "--rsync-path", f"rm -rf -- {sshargs.shell([target])} && rsync",
            "--rsh", sshargs.shell(sshargs.ssh_argv(host)),
            local_dir.rstrip("/") + "/", sshargs.rsync_remote(host, target + "/")]


# ---------------------------------------------------------------- checking a copy

@dataclass(frozen=True)
class Digest:
    """What a copy of one file is checked by: the file's size and SHA-256."""

    size: int
    sha256: str

    def __str__(self) -> str:
        return f"{self.size} bytes, sha256 {self.sha256[:12]}"


@dataclass(frozen=True)
class Manifest:
    """What a copy of a set is checked by: each file's path (relative to the set's root) and Digest."""

    files: tuple[tuple[str, Digest], ...]

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.files)

    def __str__(self) -> str:
        size = sum(d.size for _, d in self.files)
        digest = hashlib.sha256(
            "".join(f"{p}\0{d.size}\0{d.sha256}\0" for p, d in self.files).encode()
        ).hexdigest()
        return f"{len(self.files)} file(s), {size} bytes, sha256 of the list {digest[:12]}"

    def differs(self, other: Manifest) -> str:
        """What differs from `other`, for people (the first few paths)."""
        mine, theirs = dict(self.files), dict(other.files)
        bad = sorted(p for p in mine.keys() | theirs.keys() if mine.get(p) != theirs.get(p))
        return ", ".join(hostile.line(repr(p), 80) for p in bad[:3]) + (
            f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        )


def manifest(entries: Iterable[tuple[str, Digest]]) -> Manifest:
    return Manifest(tuple(sorted(entries)))


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


def parse_manifest(stdout: str) -> Manifest:
    """The Manifest in manifest_command's output (NUL-terminated `SIZE SHA256 PATH` records, PATH as
    find or the caller gave it, './' dropped); ValueError when it is not that. The paths are only
    compared with a set's own, never used as paths."""
    records = stdout.split("\0")
    if records[-1] != "":
        raise ValueError(f"not NUL-terminated records: {hostile.line(stdout[-120:])!r}")
    out = []
    for record in records[:-1]:
        size, _, rest = record.partition(" ")
        digest, _, path = rest.partition(" ")
        if not size.isdigit() or not re.fullmatch(r"[0-9a-f]{64}", digest) or not path:
            raise ValueError(f"not a size, sha256 and path: {hostile.line(record[:120])!r}")
        out.append((path.removeprefix("./"), Digest(int(size), digest)))
    return manifest(out)


def local_digest(path: Path) -> Digest | Manifest:
    """The Digest of a file on this machine; a set's directory: its Manifest (local_manifest)."""
    if path.is_dir():
        return local_manifest(path)
    return file_digest(path)


def file_digest(path: Path) -> Digest:
    """The Digest of a file on this machine."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return Digest(size, h.hexdigest())


def local_manifest(directory: Path) -> Manifest:
    """The Manifest of every file under a directory here; OSError for anything there that is not a
    regular file or a directory (a copy holds nothing else)."""
    out = []
    for top, dirs, files in os.walk(directory):
        for d in dirs:
            if os.path.islink(os.path.join(top, d)):
                raise OSError(f"a symbolic link {os.path.join(top, d)} in a copy")
        for f in files:
            full = os.path.join(top, f)
            if not stat_mod.S_ISREG(os.lstat(full).st_mode):
                raise OSError(f"{full} in a copy is not a regular file")
            out.append((Path(full).relative_to(directory).as_posix(), file_digest(Path(full))))
    return manifest(out)


class _CopyFailed(Exception):
    """One try of a copy that did not succeed; its text says what was wrong."""


class _Refused(_CopyFailed):
    """Placing a set refused a path on its host (set_place_command: a symbolic link or a file where
    a directory goes, left by the job's program): not tried again."""


class _Changed(Exception):
    """The set being copied changed on its host meanwhile: not a failure, the next one settles."""


def remote_digest(session: Session, host: Host, remote_file: str) -> Digest:
    """The Digest of a file on a host (checksum_command, with a deadline); _CopyFailed says why not."""
    return _remote_check(session, host, checksum_command(remote_file), parse_checksum, remote_file)


def remote_manifest(
    session: Session, host: Host, directory: str, files: tuple[str, ...] | list[str] | None = None
) -> Manifest:
    """The Manifest of files on a host (manifest_command, with a deadline); _CopyFailed says why not."""
    return _remote_check(session, host, manifest_command(directory, files), parse_manifest, directory)


_Checked = TypeVar("_Checked", Digest, Manifest)


def _remote_check(
    session: Session, host: Host, command: str, parse: Callable[[str], _Checked], what: str
) -> _Checked:
    try:
        r = session.run(host, command, timeout=CHECKSUM_TIMEOUT, what=f"checksumming {what}")
    except Exception as exc:  # noqa: BLE001 - an unreachable host or a deadline: this try failed
        raise _CopyFailed(f"no checksum from the host: {describe(host, exc)}") from None
    if not r.ok:
        raise _CopyFailed(f"stat/sha256sum on the host exited {r.exited}: "
                          f"{hostile.text(r.stderr.strip())[-200:]}")
    try:
        return parse(r.stdout)
    except ValueError as exc:
        raise _CopyFailed(f"unreadable checksum from the host: {hostile.text(str(exc))}") from None


Warn = Callable[[str, str, str], None]  # (host, name as sent, why)


def remote_newest(session: Session, host: Host, inv: Inventory, spec: jobspec.JobSpec,
                  settle: float = 0.0, warn: Warn | None = None) -> str | None:
    """The newest complete snapshot in the job's output directory on a host (None: none, or no
    answer); each name refused told to `warn`."""
    try:
        r = session.run(host, list_command(inv, spec), timeout=LIST_TIMEOUT, what="listing snapshots")
    except BaseException:  # noqa: BLE001 - a host that does not answer holds no usable snapshot
        return None
    names, refused = layout(spec).read(r.stdout, settle)
    for name, why in refused:
        if warn is not None:
            warn(host.name, name, why)
    return newest(names)


def _list_set(session: Session, host: Host, inv: Inventory, spec: jobspec.JobSpec) -> Listing | None:
    """A host's set listing (parse_listing); _CopyFailed when the host does not answer."""
    try:
        r = session.run(host, list_command(inv, spec), timeout=LIST_TIMEOUT, what="listing checkpoints")
    except Exception as exc:  # noqa: BLE001 - this try failed
        raise _CopyFailed(f"no listing from the host: {describe(host, exc)}") from None
    return parse_listing(r.stdout, spec.checkpoint)


# ---------------------------------------------------------------- runs/JOB/snapshots

Report = Callable[[str], None]


class Snapshots:
    """runs/JOB/snapshots (or checkpoints/): the newest `keep` snapshots of the job, copied off the
    hosts and checked.

    `report` gets one line for each copy that still failed after COPY_TRIES tries, and one for each
    name from a host that was refused (`warn`, once per host and name). `copy` runs the rsync argv
    (sshargs.fetch_file_argv / push_file_argv, fetch_set_argv / push_set_argv) as subprocess.run
    would, and returns what it returns; rsync's own --timeout ends a copy whose data stops moving."""

    def __init__(self, run_dir: Path, inv: Inventory, spec: jobspec.JobSpec, keep: int, report: Report,
                 copy: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest snapshot is kept (1 or more)")
        self.layout = layout(spec)
        self.dir = run_dir / local_dir_name(spec)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.inv, self.spec, self.keep, self.report, self.copy = inv, spec, keep, report, copy
        # Held by fetch and by the whole of a placement (job.py's place): the follow thread must not
        # prune the snapshot being pushed. Reentrant, as a holder may fetch.
        self.lock = threading.RLock()
        # (host, snapshot) copies that failed every try and were reported: the follow thread does
        # not try them again at every look (the next snapshot gets its own tries).
        self.given_up: set[tuple[str, str]] = set()
        self.warned: set[tuple[str, str]] = set()  # (host, name) refused and reported

    def warn(self, host: str, name: str, why: str) -> None:
        """A name from `host` refused: reported once (the follow thread looks every SNAPSHOT_POLL s)."""
        if (host, name) in self.warned:
            return
        self.warned.add((host, name))
        self.report(hostile.refusal(host, "checkpoint" if self.spec.checkpoint else "snapshot", name,
                                    hostile.UnsafeName(why)))

    def local_newest(self) -> str | None:
        """The newest snapshot in runs/JOB/snapshots (every one there was checked)."""
        return newest(self.layout.local_names(self.dir))

    def local_path(self, name: str) -> Path:
        return self.layout.local(self.dir, name)

    def remote_path(self, name: str) -> str:
        return self.layout.remote(self.inv, self.spec, name)

    def _copy(self, argv: Sequence[str]) -> None:
        try:
            proc = self.copy(list(argv), capture_output=True, text=True)
        except OSError as exc:  # rsync missing or not runnable
            raise _CopyFailed(f"{argv[0]} could not run: {exc}") from None
        if proc.returncode != 0:
            raise _CopyFailed(
                f"rsync exited {proc.returncode}: {hostile.text((proc.stderr or '').strip())[-200:]}"
            )

    def fetch(self, session: Session, host: Host, name: str) -> bool:
        """Copy snapshot `name` from a host into runs/JOB/snapshots, checked (see the module's
        docstring), and keep the newest `keep` there. True when it is here (a newer one too counts);
        False when every try failed, which `report` was told, or when a set changed on its host
        meanwhile (not told: the next settled one is copied)."""
        # The copy runs without the lock (a host that froze mid-copy must not hold up the next
        # attempt's placement for the copy's deadlines), into a name of this call's own; the lock is
        # taken only to put the checked copy in place and prune.
        if name <= (self.local_newest() or ""):
            return True
        final = self.local_path(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(local_temp_name(final.name))
        why = ""
        try:
            for n in range(COPY_TRIES):
                if n:
                    time.sleep(RETRY_PAUSE)
                # Removed before each try: rsync skips a file whose size and time already match.
                _remove(tmp)
                try:
                    if self.spec.checkpoint:
                        self._fetch_set(session, host, name, tmp)
                    else:
                        self._fetch_file(session, host, name, tmp)
                except _CopyFailed as exc:
                    why = str(exc)
                    continue
                except _Changed:
                    return False
                with self.lock:
                    if name > (self.local_newest() or ""):
                        os.replace(tmp, final)
                        self._prune()  # only now: the only complete copy goes once its successor is checked
                return True
        finally:
            _remove(tmp)
            _remove(tmp.with_name(tmp.name + ".files"))
        have = self.local_newest()
        self.report(f"{host.name}: could not copy snapshot {name} to {self.dir} in {COPY_TRIES} tries "
                    f"(last: {why}); {'still ' + have if have else 'no snapshot'} here to resume from. "
                    f"Check {host.name}'s disk and the network if this repeats")
        return False

    def _fetch_file(self, session: Session, host: Host, name: str, tmp: Path) -> None:
        want = remote_digest(session, host, self.remote_path(name))
        self._copy(sshargs.fetch_file_argv(host, self.remote_path(name), str(tmp)))
        try:
            got = local_digest(tmp)
        except OSError as exc:
            raise _CopyFailed(f"the copy cannot be read here: {exc}") from None
        if got != want:
            raise _CopyFailed(f"the copy ({got}) differs from the host's file ({want})")

    def _fetch_set(self, session: Session, host: Host, name: str, tmp: Path) -> None:
        """One try of copying set `name` into the directory `tmp`: listed, the host's manifest of its
        files, rsync of exactly those files, the copy's manifest compared, listed again (the set must
        not have changed meanwhile). _Changed when it is not (or no longer) the host's set."""
        before = _list_set(session, host, self.inv, self.spec)
        if before is None or not before.whole:
            raise _Changed()
        found = checkpoint_set(before.entries)
        if found is None or found.name != name:
            raise _Changed()
        tmp.mkdir(parents=True)
        for p in found.paths:  # safe already (parse_listing); and inside the copy's directory here
            try:
                hostile.relpath(p, root=tmp)
            except hostile.UnsafeName as exc:
                raise _CopyFailed(f"refused: {exc}") from None
        root = job_root(self.inv, self.spec)
        want = remote_manifest(session, host, root, found.paths)
        # The manifest read each file at its literal path (manifest_command refuses one reached
        # through a link); the listing's sizes must be what it read too.
        if want.paths != found.paths:
            raise _CopyFailed(
                f"the host's checksums name other files than its listing: {want.differs(manifest([]))}"
            )
        resized = [p for (p, d), e in zip(want.files, found.files, strict=True) if d.size != e.size]
        if resized:
            raise _CopyFailed(
                f"the host's checksums read other sizes than its listing: "
                f"{hostile.line(repr(resized[0]), 80)}"
                + (f" and {len(resized) - 1} more" if len(resized) > 1 else "")
            )
        listfile = tmp.with_name(tmp.name + ".files")
        listfile.write_bytes(b"".join(p.encode() + b"\0" for p in found.paths))
        link = self.local_newest()
        self._copy(fetch_set_argv(host, root, str(listfile), str(tmp),
                                  str(self.local_path(link).resolve()) if link else None))
        try:
            got = local_manifest(tmp)
        except OSError as exc:
            raise _CopyFailed(f"the copy cannot be read here: {exc}") from None
        if got != want:
            raise _CopyFailed(f"the copy ({got}) differs from the host's files ({want}): {got.differs(want)}")
        after = _list_set(session, host, self.inv, self.spec)
        if after is None or after.entries != before.entries:
            raise _Changed()

    def _prune(self) -> None:
        """Keep the newest `keep` snapshots here (called with the lock held, after a checked copy)."""
        for old in sorted(self.layout.local_names(self.dir))[:-self.keep]:
            _remove(self.local_path(old))

    def follow(self, session: Session, rank0: Host, stop: threading.Event) -> threading.Thread:
        """Copy every new snapshot from rank 0's host as soon as it is complete (a set: settled, see
        Settle), until `stop`; then look once more, so that a snapshot written just before the job
        ended is copied too. Join the returned thread before relying on runs/JOB/snapshots holding
        that last one."""
        settle = Settle(SETTLE)

        def newest_there() -> str | None:
            if not self.spec.checkpoint:
                return remote_newest(session, rank0, self.inv, self.spec, warn=self.warn)
            try:
                listing = _list_set(session, rank0, self.inv, self.spec)
            except _CopyFailed:
                return None
            for bad, why in listing.refused if listing else ():
                self.warn(rank0.name, bad, why)
            found = settle.see(listing, time.monotonic())
            return found.name if found else None

        def look() -> None:
            name = newest_there()
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

    def holds(self, session: Session, host: Host, remote_file: str, digest: Digest | Manifest) -> bool:
        """Whether a host's file has exactly these bytes (not just this name); a set: whether the
        host's files matching the glob are exactly the set's, with these bytes."""
        try:
            if isinstance(digest, Manifest):
                listing = _list_set(session, host, self.inv, self.spec)
                if (
                    listing is None
                    or not listing.whole
                    or tuple(e.path for e in listing.entries) != digest.paths
                ):
                    return False
                return remote_manifest(session, host, remote_file, digest.paths) == digest
            return remote_digest(session, host, remote_file) == digest
        except _CopyFailed:
            return False

    def push(self, session: Session, host: Host, name: str, digest: Digest | Manifest, *,
             argv: Sequence[str] | None = None, check: str | None = None, rename: str | None = None) -> None:
        """Copy runs/JOB/snapshots/`name` to its place on a host under temp_name (a set: into
        PLACE_TMP), check it there, and rename it into place (a set: set_place_command); UserError
        (also told to `report`) when every try failed. `argv`, `check` and `rename` are the plan's
        place, place-check and place-rename steps for this host (Layout.push_commands): what runs
        is what the plan shows. `check`'s output is read as the copy's Digest (a set: its Manifest)."""
        final = self.remote_path(name)
        if argv is None or check is None or rename is None:  # until every caller passes the plan's steps
            argv, check, rename = self.layout.push_commands(host, self.inv, self.spec, name, self.dir)
        is_set = isinstance(digest, Manifest)
        tmp = f"{final}/{PLACE_TMP.format(name[:20])}" if is_set else temp_path(final)
        why = ""
        for n in range(COPY_TRIES):
            if n:
                time.sleep(RETRY_PAUSE)
            try:
                self._copy(argv)
                if isinstance(digest, Manifest):
                    got_set = _remote_check(session, host, check, parse_manifest, tmp)
                    if got_set != digest:
                        raise _CopyFailed(f"the host's copy ({got_set}) differs from this machine's "
                                          f"({digest}): {got_set.differs(digest)}")
                else:
                    got = _remote_check(session, host, check, parse_checksum, tmp)
                    if got != digest:
                        raise _CopyFailed(f"the host's copy ({got}) differs from this machine's ({digest})")
                try:
                    r = session.run(host, rename, timeout=CHECKSUM_TIMEOUT if is_set else LIST_TIMEOUT,
                                    what=f"renaming {tmp}")
                except Exception as exc:  # noqa: BLE001 - this try failed; the next one says more
                    raise _CopyFailed(f"mv on the host failed: {describe(host, exc)}") from None
                if not r.ok and REFUSED_MARK in r.stderr:
                    refused = r.stderr[r.stderr.index(REFUSED_MARK) + len(REFUSED_MARK):]
                    raise _Refused(hostile.line(refused.split("\n", 1)[0].strip(), 300))
                if not r.ok:
                    raise _CopyFailed(
                        f"mv on the host exited {r.exited}: {hostile.text(r.stderr.strip())[-200:]}"
                    )
                return
            except _CopyFailed as exc:
                why = str(exc)
                # Removed, not left for the next try: rsync would skip a file whose size and time match.
                try:
                    session.run(host, remove_tree_command(tmp) if is_set else remove_command(tmp),
                                timeout=LIST_TIMEOUT, what=f"removing {tmp}")
                except Exception:  # noqa: BLE001 - a host that does not answer fails the next try anyway
                    pass
                if isinstance(exc, _Refused):  # the same the next time: not tried again
                    line = (
                        f"{host.name}: did not place snapshot {name} in {final}: {why}. The job's program "
                        f"left that there; remove it on {host.name}, or leave the host out so a spare "
                        "takes its place"
                    )
                    self.report(line)
                    raise UserError(line) from None
        where = final if is_set else posixpath.dirname(final)
        line = (
            f"{host.name}: could not place snapshot {name} in {where} in {COPY_TRIES} tries (last: {why}); "
            f"check the host's disk space and SSH access, or leave it out so a spare takes its place"
        )
        self.report(line)
        raise UserError(line)


def _remove(path: Path) -> None:
    """A file or a directory here gone (nothing when it is not there); a link itself, never its target."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
