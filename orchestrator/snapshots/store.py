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

The commands are built by pure functions (snapshots/commands.py), so a job's plan can show
exactly what runs; what hosts send back is read by snapshots/listings.py; one try of a copy, checked,
is snapshots/copying.py's.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.progress import bars
from orchestrator.snapshots.checks import (
    LIST_TIMEOUT,
    CopyFailed,
    list_set,
    remote_digest,
    remote_manifest,
    remote_newest,
)
from orchestrator.snapshots.commands import (
    PLACE_TMP,
    layout,
    local_dir_name,
    local_temp_name,
    remove_command,
    remove_tree_command,
    temp_path,
)
from orchestrator.snapshots.copying import Changed, Refused, fetch_file, fetch_set, push_once, run_copy
from orchestrator.snapshots.listings import SETTLE, Digest, Manifest, Settle, newest
from orchestrator.transport.remote import Session

SNAPSHOT_POLL = 0.5  # seconds between looks for a new snapshot on rank 0's host (a find on an open SSH link)
COPY_TRIES = 3  # tries per copy, the first included
RETRY_PAUSE = 1.0  # seconds between two tries: a dropped link gets a moment to come back

# ---------------------------------------------------------------- runs/JOB/snapshots

Report = Callable[[str], None]


class Snapshots:
    """runs/JOB/snapshots (or checkpoints/): the newest `keep` snapshots of the job, copied off the
    hosts and checked.

    `report` gets one line for each copy that still failed after COPY_TRIES tries, and one for each
    name from a host that was refused (`warn`, once per host and name). `copy` runs the rsync argv
    (sshargs.fetch_file_argv / push_file_argv, fetch_set_argv / push_set_argv) as subprocess.run
    would, and returns what it returns; rsync's own --timeout ends a copy whose data stops moving."""

    def __init__(
        self,
        run_dir: Path,
        inv: Inventory,
        spec: jobspec.JobSpec,
        keep: int,
        report: Report,
        copy: Callable[..., subprocess.CompletedProcess] | None = None,
        transfers: bars.Transfers | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest snapshot is kept (1 or more)")
        self.layout = layout(spec)
        self.dir = run_dir / local_dir_name(spec)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.inv, self.spec, self.keep, self.report = inv, spec, keep, report
        self.copy = copy or run_copy
        self.transfers = transfers  # each copy's bytes as `transfer` events (fab train --json)
        # Held by fetch and by the whole of a placement (starting.place): the follow thread must not
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
        self.report(
            hostile.refusal(
                host, "checkpoint" if self.spec.checkpoint else "snapshot", name, hostile.UnsafeName(why)
            )
        )

    def local_newest(self) -> str | None:
        """The newest snapshot in runs/JOB/snapshots (every one there was checked)."""
        return newest(self.layout.local_names(self.dir))

    def local_path(self, name: str) -> Path:
        return self.layout.local(self.dir, name)

    def remote_path(self, name: str) -> str:
        return self.layout.remote(self.inv, self.spec, name)

    def _copy(self, argv: Sequence[str], host: str = "", what: str = "", size: int = 0) -> None:
        t = self.transfers.start(host, what, size) if self.transfers is not None and host else None
        watch = {"on_output": t.output} if t is not None else {}
        try:
            proc = self.copy(list(argv), capture_output=True, text=True, **watch)
        except OSError as exc:  # rsync missing or not runnable
            raise CopyFailed(f"{argv[0]} could not run: {exc}") from None
        if t is not None:
            t.finish(proc.returncode == 0)
        if proc.returncode != 0:
            raise CopyFailed(
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
                        fetch_set(
                            session, host, self.inv, self.spec, name, tmp, self._copy, self._newest_copy
                        )
                    else:
                        fetch_file(session, host, self.remote_path(name), tmp, self._copy)
                except CopyFailed as exc:
                    why = str(exc)
                    continue
                except Changed:
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
        self.report(
            f"{host.name}: could not copy snapshot {name} to {self.dir} in {COPY_TRIES} tries "
            f"(last: {why}); {'still ' + have if have else 'no snapshot'} here to resume from. "
            f"Check {host.name}'s disk and the network if this repeats"
        )
        return False

    def _newest_copy(self) -> Path | None:
        """The newest snapshot here, as its path (a set's next copy hard-links what it shares)."""
        link = self.local_newest()
        return self.local_path(link) if link else None

    def _prune(self) -> None:
        """Keep the newest `keep` snapshots here (called with the lock held, after a checked copy)."""
        for old in sorted(self.layout.local_names(self.dir))[: -self.keep]:
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
                listing = list_set(session, rank0, self.inv, self.spec)
            except CopyFailed:
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
                listing = list_set(session, host, self.inv, self.spec)
                if (
                    listing is None
                    or not listing.whole
                    or tuple(e.path for e in listing.entries) != digest.paths
                ):
                    return False
                return remote_manifest(session, host, remote_file, digest.paths) == digest
            return remote_digest(session, host, remote_file) == digest
        except CopyFailed:
            return False

    def push(
        self,
        session: Session,
        host: Host,
        name: str,
        digest: Digest | Manifest,
        *,
        argv: Sequence[str],
        check: str,
        rename: str,
    ) -> None:
        """Copy runs/JOB/snapshots/`name` to its place on a host under temp_name (a set: into
        PLACE_TMP), check it there, and rename it into place (a set: set_place_command); UserError
        (also told to `report`) when every try failed. `argv`, `check` and `rename` are the plan's
        place, place-check and place-rename steps for this host (Layout.push_commands): what runs
        is what the plan shows. `check`'s output is read as the copy's Digest (a set: its Manifest)."""
        final = self.remote_path(name)
        is_set = isinstance(digest, Manifest)
        tmp = f"{final}/{PLACE_TMP.format(name[:20])}" if is_set else temp_path(final)
        why = ""
        for n in range(COPY_TRIES):
            if n:
                time.sleep(RETRY_PAUSE)
            try:
                push_once(session, host, argv, check, rename, tmp, digest, self._copy)
                return
            except CopyFailed as exc:
                why = str(exc)
                # Removed, not left for the next try: rsync would skip a file whose size and time match.
                try:
                    session.run(
                        host,
                        remove_tree_command(tmp) if is_set else remove_command(tmp),
                        timeout=LIST_TIMEOUT,
                        what=f"removing {tmp}",
                    )
                except Exception:  # noqa: BLE001 - a host that does not answer fails the next try anyway
                    pass
                if isinstance(exc, Refused):  # the same the next time: not tried again
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
