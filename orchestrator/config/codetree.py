"""The code a job runs: a local tree, copied to every host into a directory named by what it holds.

A host keeps each tree under job.code_dir/KEY, KEY a hash of the tree's file names, sizes and
modification times (`key`), so a directory, once filled, never changes: two jobs with different
code on the same hosts each keep their own, and a running job's code stays what it started with
whatever is synced after it. A job records its KEY; a restart re-checks it, and a tree edited
meanwhile goes to a new KEY (the job says so). The container mounts KEY read-only, and the
job's working directory, writable, holds links to its files (docker/entrypoint.py), so a
program's relative writes (checkpoints/, outputs/, wandb/) land in the job's outputs.

The built-in trainers sync only their own directory of this project (`only` = BUILTIN_ONLY);
a user's tree (--code, or the current directory for --script) is synced whole, less EXCLUDES.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
from pathlib import Path

BUILTIN_ONLY = "trainers"
# Never synced: version control, caches, virtualenvs, this project's local state.
EXCLUDES = (".git", "__pycache__", "*.pyc", ".venv", ".cache", ".cluster", "runs",
            ".pytest_cache", "*.egg-info")


def rsync_filters(only: str = "") -> list[str]:
    """rsync's filter options for a tree: the excludes, and with `only`, that top folder alone."""
    argv = [f"--exclude={pattern}" for pattern in EXCLUDES]
    if only:
        argv += [f"--include=/{only}/***", "--exclude=*"]
    return argv


def files(root: str | Path, only: str = "") -> list[str]:
    """The regular files rsync copies, as './relative/path', in C sort order (the hosts' order)."""
    root = Path(root)

    def excluded(name: str) -> bool:
        return any(fnmatch.fnmatch(name, pat) for pat in EXCLUDES)
    top = root / only if only else root
    found = []
    # Excluded directories are pruned, not walked: a project's .venv alone can hold 100k files.
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if not excluded(d)]
        for name in filenames:
            path = Path(dirpath) / name
            if not excluded(name) and path.is_file() and not path.is_symlink():
                found.append("./" + path.relative_to(root).as_posix())
    return sorted(found, key=lambda s: s.encode())


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
    listing = "".join(f"{hashlib.sha256((root / f[2:]).read_bytes()).hexdigest()}  {f}\n"
                      for f in files(root, only))
    return hashlib.sha256(listing.encode()).hexdigest()
