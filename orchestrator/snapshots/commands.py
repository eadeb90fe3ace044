"""The commands that list, check, copy and place a job's snapshots (snapshots/store.py
tells what they are for and how they are used), built by pure functions (Layout.list_command,
checksum_command, manifest_command, rename_command, set_place_command, remove_command, and
sshargs.fetch_file_argv / push_file_argv, fetch_set_argv / push_set_argv for the copies, with
temp_name for the temporary names), so a job's plan can show exactly what runs."""

from __future__ import annotations

import posixpath
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.hostcmds import sshargs
from orchestrator.snapshots.listings import (
    DCP_METADATA,
    END,
    SET_RE,
    SNAPSHOT_RE,
    checkpoint_set,
    parse_listing,
    parse_names,
)

PLACE_TMP = ".fabtrain-set-{}.tmp"  # a set pushed to a host, in the job's output directory, until checked
REPLACED = ".fabtrain-replaced"  # where a host's files matching the glob, not in the set placed, go


def snapshots_dir(inv: Inventory, spec: jobspec.JobSpec) -> str:
    """The job's snapshot directory on every host (`$FABTRAIN_OUTPUT/snapshots` in the container)."""
    return f"{inv.job.output_dir}/{spec.job_id}/snapshots"


def job_root(inv: Inventory, spec: jobspec.JobSpec) -> str:
    """The job's output directory on every host (/output in the container)."""
    return f"{inv.job.output_dir}/{spec.job_id}"


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
            return [
                p.name
                for p in local_dir.iterdir()
                if SNAPSHOT_RE.fullmatch(p.name) and p.is_file() and not p.is_symlink()
            ]
        return [
            p.name
            for p in local_dir.iterdir()
            if SET_RE.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
        ]

    def push_commands(
        self, host: Host, inv: Inventory, spec: jobspec.JobSpec, name: str, local_dir: Path
    ) -> tuple[list[str], str, str]:
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
        return (
            push_set_argv(host, local_file, tmp),
            manifest_command(tmp),
            set_place_command(remote_file, PLACE_TMP.format(name), pattern),
        )
    tmp = temp_path(remote_file)
    guard = no_link_command(posixpath.dirname(remote_file))
    return (
        sshargs.push_file_argv(host, local_file, tmp, guard),
        checksum_command(tmp),
        rename_command(tmp, remote_file),
    )


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
_NO_SH = (
    'no() { printf "' + REFUSED_MARK + "%s %s in the job output directory %s; nothing is written "
    'through it\\n" "$1" "$2" "$(pwd)" >&2; exit 3; }; '
)
_PLACE_FUNCS = (
    "set -f; " + _NO_SH + "dir() { p=; IFS=/; for c in $1; do "
    '[ -z "$c" ] || [ "$c" = . ] && continue; [ "$c" = .. ] && no "$1" "goes up (..)"; '
    'p=${p:+$p/}$c; if [ -L "$p" ]; then no "$p" "is a symbolic link"; '
    'elif [ ! -e "$p" ]; then mkdir -- "$p" || exit 1; '
    'elif [ ! -d "$p" ]; then no "$p" "is not a directory"; fi; done; unset IFS; }; '
    'spot() { if [ -L "$1" ]; then rm -f -- "$1" || exit 1; '
    'elif [ -d "$1" ]; then no "$1" "is a directory where a file goes"; fi; }; '
)


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
    move = _PLACE_FUNCS + (
        'for f; do d=./${f#"$0"/}; dir "${d%/*}"; spot "$d"; mv -f -- "$f" "$d" || exit 1; done'
    )
    steps = [sshargs.shell(["sh", "-c", check, "./" + tmp])]
    if pattern:
        p = "./" + pattern
        match = ["(", "-path", p, "-o", "-path", p + "/*", ")"]
        aside = _PLACE_FUNCS + (
            'for f; do [ -e "$0/$f" ] && continue; '
            f'dir "{REPLACED}/${{f%/*}}"; spot "{REPLACED}/$f"; '
            f'mv -f -- "$f" "{REPLACED}/$f" || exit 1; done'
        )
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
        "--info=progress2",
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
    return [
        "rsync",
        "--recursive",
        "--times",
        "--mkpath",
        f"--timeout={sshargs.RSYNC_IO_TIMEOUT}",
        "--info=progress2",
        *sshargs.RSYNC_PROTECT,
        "--rsync-path",
        f"rm -rf -- {sshargs.shell([target])} && rsync",
        "--rsh",
        sshargs.shell(sshargs.ssh_argv(host)),
        local_dir.rstrip("/") + "/",
        sshargs.rsync_remote(host, target + "/"),
    ]
