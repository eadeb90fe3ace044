"""The code a job runs: a local tree, copied to every host into a directory named by what it holds.

A host keeps each tree under job.code_dir/KEY, KEY a hash of the tree's file names, sizes and
modification times (`key`), so a directory, once filled, never changes: two jobs with different
code on the same hosts each keep their own, and a running job's code stays what it started with
whatever is synced after it. A job records its KEY; a restart re-checks it, and a tree edited
meanwhile goes to a new KEY (the job says so). The container mounts KEY read-only, and the
job's working directory, writable, holds links to its files (docker/entrypoint.py), so a
program's relative writes (checkpoints/, outputs/, wandb/) land in the job's outputs.

The built-in trainers sync only their own directory of this project (`only` = BUILTIN_ONLY);
a user's tree (--code, or the current directory for --script) is synced less EXCLUDES and less
what its ignore rules leave out (`select`): every `.gitignore` in the tree, as git reads them (a
deeper file's patterns win over a higher one's, the last matching pattern of a file wins, `!`
re-includes, a directory left out is not looked into), and a `.fabtrainignore` at its root in the
same syntax, read after the root's `.gitignore` (so it can also re-include what that leaves out).
rsync is given the exact list (`rsync_filters` with the tree: --files-from), so the hosts get
exactly the files the key and the content hash are computed over, plus the tree's symbolic links
as links; empty directories are not copied (git does not keep them either).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pathspec import GitIgnoreSpec

from orchestrator.core.errors import UserError

BUILTIN_ONLY = "trainers"
# Never synced: version control, caches, virtualenvs, this project's local state.
EXCLUDES = (
    ".git",
    "__pycache__",
    "*.pyc",
    ".venv",
    ".cache",
    ".cluster*",
    "runs",
    ".fabtrain",
    ".pytest_cache",
    "*.egg-info",
)
IGNORE_FILES = (".gitignore",)  # read in every directory
ROOT_IGNORE_FILE = ".fabtrainignore"  # read at the tree's root only, after its .gitignore
# Above this many bytes synced, a warning: most often a data folder nobody meant to copy.
WARN_BYTES = 100 * 1000 * 1000
# Entries counted inside left-out directories, at most (the summary then says "at least"): a
# left-out dataset of millions of files must not make every sync slow.
LEFT_COUNT_MAX = 200_000
LEFT_TOP_SHOWN = 3


@dataclass(frozen=True)
class Selection:
    """What a sync of a tree copies and what its ignore rules leave out (EXCLUDES not counted)."""

    files: tuple[str, ...]  # regular files, './relative/path', C sort order
    links: tuple[str, ...]  # symbolic links, copied as links (not in the key or the hash)
    bytes: int  # the regular files' total size
    left_files: int
    left_bytes: int
    left_top: tuple[tuple[str, int], ...]  # left-out top-level entries ('data/', bytes), biggest first
    partial: bool = False  # counting inside left-out directories stopped at LEFT_COUNT_MAX


def _excluded(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pat) for pat in EXCLUDES)


def _spec(path: Path) -> GitIgnoreSpec | None:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as exc:
        raise UserError(
            f"{path}: cannot read this ignore file ({exc.strerror}); fix its permissions"
        ) from None
    spec = GitIgnoreSpec.from_lines(lines)
    return spec if len(spec) else None


class _Rules:
    """The ignore files that apply at one directory: (directory relative to the root, spec) from
    the root down; git's precedence is the order (the last one with a matching pattern decides)."""

    def __init__(self, specs: tuple[tuple[str, GitIgnoreSpec], ...] = ()) -> None:
        self.specs = specs

    def below(self, root: Path, rel: str) -> _Rules:
        here = root / rel if rel else root
        found = [(rel, s) for name in IGNORE_FILES if (s := _spec(here / name))]
        if not rel and (s := _spec(root / ROOT_IGNORE_FILE)):
            found.append(("", s))
        return _Rules(self.specs + tuple(found)) if found else self

    def ignored(self, rel: str, is_dir: bool) -> bool:
        verdict = None
        for base, spec in self.specs:
            inner = rel[len(base) + 1 :] if base else rel
            got = spec.check_file(inner + "/" if is_dir else inner).include
            if got is not None:
                verdict = got
        return bool(verdict)


def _size_below(path: Path, budget: list[int]) -> tuple[int, int]:
    """(files, bytes) under a left-out directory, links not followed, at most budget[0] entries."""
    count = size = 0
    stack = [path]
    while stack and budget[0] > 0:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    budget[0] -= 1
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        count += 1
                        size += entry.stat(follow_symlinks=False).st_size
                    if budget[0] <= 0:
                        break
        except OSError:
            continue
    return count, size


def select(root: str | Path, only: str = "") -> Selection:
    """The tree's files as a sync copies them (module docstring), and what the rules left out."""
    root = Path(root)
    files: list[str] = []
    links: list[str] = []
    total = 0
    left: dict[str, list[int]] = {}  # top-level entry -> [files, bytes]
    budget = [LEFT_COUNT_MAX]

    def leave(rel: str, path: Path, is_dir: bool) -> None:
        top = rel.split("/", 1)[0] + ("/" if is_dir or "/" in rel else "")
        n, size = _size_below(path, budget) if is_dir else (1, _lsize(path))
        acc = left.setdefault(top, [0, 0])
        acc[0] += n
        acc[1] += size

    rules = _Rules().below(root, "")
    start = ""
    if only:  # the rules of the folders above `only` apply too, as git reads them
        for part in Path(only).parts:
            start = f"{start}/{part}" if start else part
            rules = rules.below(root, start)
    stack = [(start, rules)]
    while stack:
        rel_dir, rules = stack.pop()
        try:
            entries = sorted(os.scandir(root / rel_dir if rel_dir else root), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if _excluded(entry.name):
                continue  # pruned, never walked: a project's .venv alone can hold 100k files
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            if rules.ignored(rel, is_dir):
                leave(rel, Path(entry.path), is_dir)
            elif is_dir:
                stack.append((rel, rules.below(root, rel)))
            elif entry.is_symlink():
                links.append("./" + rel)
            elif entry.is_file(follow_symlinks=False):
                files.append("./" + rel)
                total += entry.stat(follow_symlinks=False).st_size
    order = sorted(left.items(), key=lambda kv: (-kv[1][1], kv[0]))
    return Selection(
        files=tuple(sorted(files, key=lambda s: s.encode())),
        links=tuple(sorted(links, key=lambda s: s.encode())),
        bytes=total,
        left_files=sum(v[0] for v in left.values()),
        left_bytes=sum(v[1] for v in left.values()),
        left_top=tuple((name, v[1]) for name, v in order),
        partial=budget[0] <= 0,
    )


def _lsize(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def files(root: str | Path, only: str = "") -> list[str]:
    """The regular files a sync copies, as './relative/path', in C sort order (the hosts' order)."""
    return list(select(root, only).files)


def size_text(n: float) -> str:
    """Bytes for a person: 512 B, 3.4 kB, 52.4 MB, 1.2 GB (powers of 1000, as rsync and du -h --si)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover - the loop returns


def summary(sel: Selection, source: str | Path) -> list[tuple[str, str]]:
    """What a sync of `source` copies and leaves out, as (level, text) lines: info, and a warning
    above WARN_BYTES synced."""
    lines = [("info", f"code: {len(sel.files)} files, {size_text(sel.bytes)} from {source}")]
    if sel.left_files or sel.left_top:
        biggest = ", ".join(f"{name} {size_text(size)}" for name, size in sel.left_top[:LEFT_TOP_SHOWN])
        more = " (at least: counting stopped)" if sel.partial else ""
        lines.append(
            (
                "info",
                f"left out by .gitignore/{ROOT_IGNORE_FILE}: {sel.left_files} files, "
                f"{size_text(sel.left_bytes)}{more} ({biggest})",
            )
        )
    if sel.bytes > WARN_BYTES:
        tops: dict[str, int] = {}
        for f in sel.files:
            first, _, rest = f[2:].partition("/")
            tops[first + ("/" if rest else "")] = tops.get(first + ("/" if rest else ""), 0) + _lsize(
                Path(source) / f[2:]
            )
        big = sorted(tops.items(), key=lambda kv: -kv[1])[:LEFT_TOP_SHOWN]
        lines.append(
            (
                "warning",
                f"{size_text(sel.bytes)} of code to sync (biggest: "
                f"{', '.join(f'{n} {size_text(s)}' for n, s in big)}): a data folder? "
                f"list it in .gitignore or {ROOT_IGNORE_FILE}",
            )
        )
    return lines


def key(root: str | Path, only: str = "") -> str:
    """The tree's name on the hosts: a hash of its files' names, sizes and modification times (no
    file is read, so a large tree is keyed in milliseconds; rsync decides by the same facts)."""
    root = Path(root)
    h = hashlib.sha256()
    for f in files(root, only):
        st = (root / f[2:]).stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def content_hash(root: str | Path, only: str = "") -> str:
    """The hash the hosts compute over a synced tree (sha256sum of every file, C sort order)."""
    root = Path(root)
    listing = "".join(
        f"{hashlib.sha256((root / f[2:]).read_bytes()).hexdigest()}  {f}\n" for f in files(root, only)
    )
    return hashlib.sha256(listing.encode()).hexdigest()


def _lists_dir() -> Path:
    """A directory of this account's own for the file lists: the user's cache, else a private one
    under the temporary directory (a controller's container may have no writable home)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    for d in (
        Path(base) / "fabtrain" / "code-lists",
        Path(tempfile.gettempdir()) / f"fabtrain-code-lists-{os.getuid()}",
    ):
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = d.lstat()
            if st.st_uid == os.getuid() and not d.is_symlink():
                return d
        except OSError:
            continue
    raise UserError(
        f"no writable directory for the sync's file list: make {base} writable or set XDG_CACHE_HOME"
    )


def list_file(root: str | Path, only: str = "") -> Path:
    """The sync's file list (rsync --from0 --files-from): the selected files and links, NUL
    separated, in a file named by its content (so a plan names the same file for the same tree)."""
    sel = select(root, only)
    data = b"".join(p.encode() + b"\0" for p in sorted(sel.files + sel.links, key=lambda s: s.encode()))
    path = _lists_dir() / hashlib.sha256(data).hexdigest()[:24]
    if not path.exists():  # several hosts' syncs may write it at once: each its own temporary file
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return path


# A plan names the list once per host (sshargs.rsync_argv): for LIST_REUSE seconds the same tree's
# list is reused, so 64 hosts cost one walk of a 10k-file tree (~0.1 s), not 64.
LIST_REUSE = 2.0
_recent: dict[tuple[str, str], tuple[float, Path]] = {}
_recent_lock = threading.Lock()


def rsync_filters(only: str = "", source: str | Path | None = None) -> list[str]:
    """rsync's options that choose what a tree sends: the excludes, with `only` that top folder
    alone, and with the tree (`source`) its exact list of files (list_file)."""
    argv = [f"--exclude={pattern}" for pattern in EXCLUDES]
    if only:
        argv += [f"--include=/{only}/***", "--exclude=*"]
    if source is not None:
        where, now = (str(Path(source).resolve()), only), time.monotonic()
        with _recent_lock:
            made, path = _recent.get(where, (-LIST_REUSE, Path()))
            if now - made >= LIST_REUSE or not path.exists():
                path = list_file(source, only)
                _recent[where] = (now, path)
        argv += ["--from0", f"--files-from={path}"]
    return argv
