"""What a host says of a job's snapshots, read (pure: no I/O): the listing of a program's checkpoint
set (NUL-separated records, every name checked by hostile.relpath and the glob), which files make
one set and when it is complete (Settle), our snapshots' names, and the checksums a copy is
checked by (Digest, Manifest). The commands that print these are in snapshots/commands.py; what
runs them, in snapshots/store.py (whose docstring tells the whole story)."""

from __future__ import annotations

import fnmatch
import hashlib
import posixpath
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from orchestrator.core import hostile

# Whole names only (fullmatch), in ASCII digits: [0-9], not \d, which takes other scripts' digits too.
SNAPSHOT_RE = re.compile(r"snapshot-[0-9]{9}\.pt")  # ours
SET_RE = re.compile(r"[0-9]{20}")  # a program's checkpoint set
# A program's checkpoint set is complete, while the job runs, once two looks this far apart saw
# the same files and its newest file is this old by the host's clock (snapshots/store.py's
# docstring).
SETTLE = 1.0
MAX_SET_FILES = 10000  # files in one checkpoint set; a listing with more is not taken as a set
END = "end"  # the last record of a set listing: the listing is whole (not cut, find succeeded)
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint writes it last, once every rank's file is there


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
    return Listing(
        now,
        tuple(sorted(entries, key=lambda e: e.path)),
        tuple((name, str(why)) for name, why in refused),
        whole,
    )


@dataclass(frozen=True)
class CheckpointSet:
    """The files of a program's checkpoint that belong together (snapshots/store.py's
    docstring), sorted by path, named by the newest one's modification time (20 digits); `partial`
    the DCP directories left out because their `.metadata` is not written yet."""

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
    partial = sorted(
        d
        for d, es in by_dir.items()
        if any(e.path.endswith(".distcp") for e in es)
        and not any(posixpath.basename(e.path) == DCP_METADATA for e in es)
    )
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
