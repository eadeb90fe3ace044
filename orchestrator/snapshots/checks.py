"""Asking what a snapshot is, here and on a host: its size and SHA-256 (a set: each file's), and a
host's listing of the job's snapshots, each command under its deadline; a try that gets no
usable answer is a CopyFailed naming why. Snapshots (snapshots/store.py) copies, checks
and places with these."""

from __future__ import annotations

import hashlib
import os
import stat as stat_mod
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.snapshots.commands import checksum_command, layout, list_command, manifest_command
from orchestrator.snapshots.listings import (
    Digest,
    Listing,
    Manifest,
    manifest,
    newest,
    parse_checksum,
    parse_listing,
    parse_manifest,
)
from orchestrator.transport.remote import Session, describe

LIST_TIMEOUT = 10  # find, mv, rm in the snapshot directory: metadata only
# sha256sum reads the whole file: at a slow disk's 100 MB/s that is 30 GB of snapshot, well beyond
# the medium preset's ~4 GB (weights and AdamW state), while a stuck disk is still named in time.
CHECKSUM_TIMEOUT = 300


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


class CopyFailed(Exception):
    """One try of a copy that did not succeed; its text says what was wrong."""


def remote_digest(session: Session, host: Host, remote_file: str) -> Digest:
    """The Digest of a file on a host (checksum_command, with a deadline); CopyFailed says why not."""
    return remote_check(session, host, checksum_command(remote_file), parse_checksum, remote_file)


def remote_manifest(
    session: Session, host: Host, directory: str, files: tuple[str, ...] | list[str] | None = None
) -> Manifest:
    """The Manifest of files on a host (manifest_command, with a deadline); CopyFailed says why not."""
    return remote_check(session, host, manifest_command(directory, files), parse_manifest, directory)


_Checked = TypeVar("_Checked", Digest, Manifest)


def remote_check(
    session: Session, host: Host, command: str, parse: Callable[[str], _Checked], what: str
) -> _Checked:
    """`command` (checksum_command or manifest_command) run on a host under CHECKSUM_TIMEOUT, its
    output read by `parse`; CopyFailed says why not (`what`: the path, for the deadline's message)."""
    try:
        r = session.run(host, command, timeout=CHECKSUM_TIMEOUT, what=f"checksumming {what}")
    except Exception as exc:  # noqa: BLE001 - an unreachable host or a deadline: this try failed
        raise CopyFailed(f"no checksum from the host: {describe(host, exc)}") from None
    if not r.ok:
        raise CopyFailed(
            f"stat/sha256sum on the host exited {r.exited}: {hostile.text(r.stderr.strip())[-200:]}"
        )
    try:
        return parse(r.stdout)
    except ValueError as exc:
        raise CopyFailed(f"unreadable checksum from the host: {hostile.text(str(exc))}") from None


Warn = Callable[[str, str, str], None]  # (host, name as sent, why)


def remote_newest(
    session: Session,
    host: Host,
    inv: Inventory,
    spec: jobspec.JobSpec,
    settle: float = 0.0,
    warn: Warn | None = None,
) -> str | None:
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


def list_set(session: Session, host: Host, inv: Inventory, spec: jobspec.JobSpec) -> Listing | None:
    """A host's set listing (parse_listing); CopyFailed when the host does not answer."""
    try:
        r = session.run(host, list_command(inv, spec), timeout=LIST_TIMEOUT, what="listing checkpoints")
    except Exception as exc:  # noqa: BLE001 - this try failed
        raise CopyFailed(f"no listing from the host: {describe(host, exc)}") from None
    return parse_listing(r.stdout, spec.checkpoint)
