"""One try of copying a snapshot, checked (snapshots/store.py's docstring tells the whole story;
Snapshots runs these, up to COPY_TRIES times each): a host's snapshot file or set into a temporary
name here (fetch_file, fetch_set), and this machine's copy onto a host under its temporary name,
checked there and renamed into place (push_once). A try that goes wrong raises CopyFailed saying
what was wrong; fetch_set raises Changed when the host's set changed meanwhile, push_once Refused
when the rename refused a path. run_copy runs a copy's rsync."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.hostcmds import sshargs
from orchestrator.progress import bars
from orchestrator.snapshots.checks import (
    CHECKSUM_TIMEOUT,
    LIST_TIMEOUT,
    CopyFailed,
    list_set,
    local_digest,
    local_manifest,
    remote_check,
    remote_digest,
    remote_manifest,
)
from orchestrator.snapshots.commands import REFUSED_MARK, fetch_set_argv, job_root
from orchestrator.snapshots.listings import (
    Digest,
    Manifest,
    checkpoint_set,
    manifest,
    parse_checksum,
    parse_manifest,
)
from orchestrator.transport.remote import Session, describe

# One rsync (argv, host's name, what for the transfer events, bytes); CopyFailed when it fails.
Copy = Callable[[Sequence[str], str, str, int], None]


class Refused(CopyFailed):
    """Placing a set refused a path on its host (set_place_command: a symbolic link or a file where
    a directory goes, left by the job's program): not tried again."""


class Changed(Exception):
    """The set being copied changed on its host meanwhile: not a failure, the next one settles."""


def run_copy(
    argv: list[str],
    capture_output: bool = True,
    text: bool = True,
    on_output: Callable[[bytes], None] | None = None,
) -> subprocess.CompletedProcess:
    """subprocess.run for a copy's rsync; with `on_output`, its stdout (--info=progress2) handed
    over as it comes (bars.run_watched) and only its stderr kept."""
    if on_output is None:
        return subprocess.run(argv, capture_output=capture_output, text=text)
    code, err = bars.run_watched(argv, on_output)
    return subprocess.CompletedProcess(argv, code, "", err.decode("utf-8", "replace"))


# ---------------------------------------------------------------- off a host, to here


def fetch_file(session: Session, host: Host, remote: str, tmp: Path, copy: Copy) -> None:
    """One try of copying our snapshot file `remote` from a host to `tmp` here, checked by size and
    SHA-256 against the host's file."""
    want = remote_digest(session, host, remote)
    copy(sshargs.fetch_file_argv(host, remote, str(tmp)), host.name, "snapshot fetch", want.size)
    try:
        got = local_digest(tmp)
    except OSError as exc:
        raise CopyFailed(f"the copy cannot be read here: {exc}") from None
    if got != want:
        raise CopyFailed(f"the copy ({got}) differs from the host's file ({want})")


def fetch_set(
    session: Session,
    host: Host,
    inv: Inventory,
    spec: jobspec.JobSpec,
    name: str,
    tmp: Path,
    copy: Copy,
    newest_here: Callable[[], Path | None],
) -> None:
    """One try of copying set `name` into the directory `tmp`: listed, the host's manifest of its
    files, rsync of exactly those files, the copy's manifest compared, listed again (the set must
    not have changed meanwhile). Changed when it is not (or no longer) the host's set.
    `newest_here` gives the newest set here (rsync hard-links the files it shares with it)."""
    before = list_set(session, host, inv, spec)
    if before is None or not before.whole:
        raise Changed()
    found = checkpoint_set(before.entries)
    if found is None or found.name != name:
        raise Changed()
    tmp.mkdir(parents=True)
    for p in found.paths:  # safe already (parse_listing); and inside the copy's directory here
        try:
            hostile.relpath(p, root=tmp)
        except hostile.UnsafeName as exc:
            raise CopyFailed(f"refused: {exc}") from None
    root = job_root(inv, spec)
    want = remote_manifest(session, host, root, found.paths)
    # The manifest read each file at its literal path (manifest_command refuses one reached
    # through a link); the listing's sizes must be what it read too.
    if want.paths != found.paths:
        raise CopyFailed(
            f"the host's checksums name other files than its listing: {want.differs(manifest([]))}"
        )
    resized = [p for (p, d), e in zip(want.files, found.files, strict=True) if d.size != e.size]
    if resized:
        raise CopyFailed(
            f"the host's checksums read other sizes than its listing: "
            f"{hostile.line(repr(resized[0]), 80)}"
            + (f" and {len(resized) - 1} more" if len(resized) > 1 else "")
        )
    listfile = tmp.with_name(tmp.name + ".files")
    listfile.write_bytes(b"".join(p.encode() + b"\0" for p in found.paths))
    link = newest_here()
    copy(
        fetch_set_argv(host, root, str(listfile), str(tmp), str(link.resolve()) if link else None),
        host.name,
        "snapshot fetch",
        sum(d.size for _, d in want.files),
    )
    try:
        got = local_manifest(tmp)
    except OSError as exc:
        raise CopyFailed(f"the copy cannot be read here: {exc}") from None
    if got != want:
        raise CopyFailed(f"the copy ({got}) differs from the host's files ({want}): {got.differs(want)}")
    after = list_set(session, host, inv, spec)
    if after is None or after.entries != before.entries:
        raise Changed()


# ---------------------------------------------------------------- from here, onto a host


def push_once(
    session: Session,
    host: Host,
    argv: Sequence[str],
    check: str,
    rename: str,
    tmp: str,
    digest: Digest | Manifest,
    copy: Copy,
) -> None:
    """One try of push: the copy, its check against `digest`, the rename; CopyFailed (Refused:
    the rename refused a path) says why not."""
    is_set = isinstance(digest, Manifest)
    size = sum(d.size for _, d in digest.files) if isinstance(digest, Manifest) else digest.size
    copy(argv, host.name, "snapshot push", size)
    if isinstance(digest, Manifest):
        got_set = remote_check(session, host, check, parse_manifest, tmp)
        if got_set != digest:
            raise CopyFailed(
                f"the host's copy ({got_set}) differs from this machine's "
                f"({digest}): {got_set.differs(digest)}"
            )
    else:
        got = remote_check(session, host, check, parse_checksum, tmp)
        if got != digest:
            raise CopyFailed(f"the host's copy ({got}) differs from this machine's ({digest})")
    try:
        r = session.run(
            host, rename, timeout=CHECKSUM_TIMEOUT if is_set else LIST_TIMEOUT, what=f"renaming {tmp}"
        )
    except Exception as exc:  # noqa: BLE001 - this try failed; the next one says more
        raise CopyFailed(f"mv on the host failed: {describe(host, exc)}") from None
    if not r.ok and REFUSED_MARK in r.stderr:
        refused = r.stderr[r.stderr.index(REFUSED_MARK) + len(REFUSED_MARK) :]
        raise Refused(hostile.line(refused.split("\n", 1)[0].strip(), 300))
    if not r.ok:
        raise CopyFailed(f"mv on the host exited {r.exited}: {hostile.text(r.stderr.strip())[-200:]}")
