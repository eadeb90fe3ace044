"""Commands for the remote shell: the one place an argv is quoted (shell), deadlines carried to
the host (bounded), and the ssh and rsync argv run on this machine. Pure: nothing here touches the
network."""

from __future__ import annotations

import shlex
from dataclasses import replace

from orchestrator.config.codetree import rsync_filters
from orchestrator.config.inventory import Host
from orchestrator.config.sshconf import SSH
from orchestrator.core.jobspec import CONSOLE_DIR

# rsync gives up when no data moves for this long (a frozen disk or link), however long the copy.
RSYNC_IO_TIMEOUT = 60


def shell(argv: list[str] | tuple[str, ...]) -> str:
    """The one place an argv becomes a remote command string."""
    return shlex.join(argv)


# A command that starts something is ended on the host too when fab stops waiting for it: sshd
# does not end a command whose channel closes (no pty), so a `docker run` that returned after its
# deadline would leave a container running, untracked, on GPUs the job has released. GNU timeout
# (coreutils, on every host) sends SIGTERM to the command's process group a margin before fab's
# deadline, SIGKILL a few seconds later, and exits TIMED_OUT; the teardown and the job's finish
# then remove by label whatever the engine made of a request cut short.
HOST_MARGIN = 10.0  # seconds before fab's deadline that the host's SIGTERM comes (at most)
KILL_AFTER = 5.0  # seconds from that SIGTERM to the SIGKILL (at most)
TIMED_OUT = (124, 137)  # timeout's exit status: SIGTERM sent, or SIGKILL needed


def host_deadline(timeout: float) -> tuple[float, float]:
    """(seconds to the host's SIGTERM, seconds more to its SIGKILL) for a command fab waits `timeout`
    s for: both before fab gives up (half of a short deadline is kept as the margin)."""
    margin = min(HOST_MARGIN, timeout / 2)
    return timeout - margin, min(KILL_AFTER, margin / 2)


def bounded(argv: list[str], timeout: float) -> list[str]:
    """argv run under GNU timeout on the host, ended there before fab's own `timeout` passes."""
    term, kill = host_deadline(timeout)
    return ["timeout", "-k", f"{kill:g}", f"{term:g}", *argv]


def timed_out_note(timeout: float) -> str:
    """Shell text after a bounded command: when timeout ended it, say so on stderr (fab quotes it),
    keeping the exit status."""
    term, _ = host_deadline(timeout)
    why = f"not done within {term:g}s: ended on the host (timeout); check its Docker engine and disks"
    return (
        f" || {{ rc=$?; case $rc in {'|'.join(map(str, TIMED_OUT))}) echo {shell([why])} >&2;; esac; "
        "exit $rc; }"
    )


def ssh_argv(host: Host) -> list[str]:
    """The OpenSSH client command rsync uses to reach a host (its target not included): built from
    the same resolved settings as paramiko's connection (connect.connect_kwargs), so both reach the
    same host with the same keys and the same trust."""
    return ssh_options(host.ssh)


def ssh_options(ssh: SSH) -> list[str]:
    # -F none: every setting is here, already resolved from the user's ssh_config (sshconf), so
    # OpenSSH must not apply that file a second time.
    argv = [
        "ssh",
        "-F",
        "none",
        "-p",
        str(ssh.port),
        "-l",
        ssh.user,
        # Never prompt; a host whose key is unknown or changed is refused, not trusted.
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "UserKnownHostsFile=" + " ".join(_ssh_escape(k) for k in ssh.known_hosts),
        # The system-wide files too, the same ones paramiko reads (hostkeys.host_trust); none
        # is /dev/null, as ssh would open a file named 'none'.
        "-o",
        "GlobalKnownHostsFile="
        + (" ".join(_ssh_escape(k, False) for k in ssh.global_known_hosts) or "/dev/null"),
        "-o",
        f"ConnectTimeout={int(ssh.connect_timeout)}",
        # Notice a dead link during a long transfer instead of hanging.
        "-o",
        f"ServerAliveInterval={int(ssh.keepalive)}",
        "-o",
        "ServerAliveCountMax=3",
    ]
    for key in ssh.keys:
        argv += ["-i", key]
    if ssh.keys_only:
        argv += ["-o", "IdentitiesOnly=yes"]
    if ssh.jump:
        # Each hop is dialled by its own ssh (same checks) through the hops before it; -W carries
        # the stream on. '%' is ssh's token character, so it is doubled in the command.
        *before, last = ssh.jump
        proxy = [
            *ssh_options(replace(last, jump=tuple(before))),
            "-W",
            f"[{ssh.hostname}]:{ssh.port}",
            last.hostname,
        ]
        argv += ["-o", "ProxyCommand=" + shell(proxy).replace("%", "%%")]
    return argv


def _ssh_escape(path: str, tokens: bool = True) -> str:
    """A known_hosts path for ssh's option parser, which splits on spaces and honours quotes and
    backslashes; with `tokens` (UserKnownHostsFile, not GlobalKnownHostsFile) ssh also reads '%' as
    a token, so it is doubled."""
    if tokens:
        path = path.replace("%", "%%")
    if any(c in path for c in " \t\"\\'"):
        path = '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return path


# In every rsync argv, before --rsh: the remote paths (names from hosts among them: snapshots,
# outputs) go to the host's rsync through rsync's protocol, never through the host's shell, so
# no '$(...)', quote or space in one is read by a shell. rsync 3.2.4 and later escape them by
# default, but RSYNC_OLD_ARGS in this machine's environment, or an older rsync here, turns that
# off; an explicit -s wins over both variables (and over RSYNC_PROTECT_ARGS=0) and works back to
# rsync 3.0. A server rsync reads neither variable. ('-s': rsync's most compatible spelling of
# --protect-args, called --secluded-args since 3.2.6.) Preflight's rsync check judges versions.
RSYNC_PROTECT = ("-s",)


def rsync_argv(host: Host, source: str, dest: str, only: str = "", listed: bool = True) -> list[str]:
    """Mirror the local tree `source` (with `only`, its top folder of that name) to `dest` on the
    host (same path on every host), with codetree's filters and, for a user's code (`listed`), its
    exact file list (the ignore rules; no empty folder); its progress on stdout (progress/bars.py
    reads it for the bars and the `transfer` events)."""
    return [
        "rsync",
        "--archive",
        "--compress",
        "--delete",
        "--mkpath",
        f"--timeout={RSYNC_IO_TIMEOUT}",
        "--info=progress2",
        *RSYNC_PROTECT,
        "--rsh",
        shell(ssh_argv(host)),
        *rsync_filters(only, source if listed else None),
        source.rstrip("/") + "/",
        rsync_remote(host, dest + "/"),
    ]


def rsync_remote(host: Host, path: str) -> str:
    """rsync's HOST:PATH for a remote path (the user comes from ssh's -l). The path reaches the
    host's rsync through rsync's protocol, never its shell (RSYNC_PROTECT in every argv)."""
    address = host.ssh.hostname
    return f"[{address}]:{path}" if ":" in address else f"{address}:{path}"


def fetch_file_argv(host: Host, remote_file: str, dest: str) -> list[str]:
    """Copy one file (a snapshot) from a host; rsync writes a temporary file and renames it."""
    return [
        "rsync",
        "--times",
        f"--timeout={RSYNC_IO_TIMEOUT}",
        "--info=progress2",
        *RSYNC_PROTECT,
        "--rsh",
        shell(ssh_argv(host)),
        rsync_remote(host, remote_file),
        dest,
    ]


def push_file_argv(host: Host, source: str, remote_file: str, first: str = "") -> list[str]:
    """Copy one local file (a snapshot) to a host, its directory made if missing; `first`: a shell
    command the host runs before its rsync starts, which ends the copy when it fails."""
    return [
        "rsync",
        "--times",
        "--mkpath",
        f"--timeout={RSYNC_IO_TIMEOUT}",
        "--info=progress2",
        *RSYNC_PROTECT,
        *(["--rsync-path", f"{first} && rsync"] if first else []),
        "--rsh",
        shell(ssh_argv(host)),
        source,
        rsync_remote(host, remote_file),
    ]


# The job's snapshots, complete (snapshot-NNNNNNNNN.pt) and being written or copied (.snapshot-*):
# the newest complete one is already in runs/JOB/snapshots, copied and verified while the job ran
# (snapshots/store.py), so the end-of-job fetch leaves them out. Anything else a script writes there is
# still fetched.
SNAPSHOT_EXCLUDES = (
    "/snapshots/snapshot-[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9].pt",
    "/snapshots/.snapshot-*",
)


def fetch_argv(host: Host, remote_dir: str, dest: str) -> list[str]:
    """Copy a job's outputs from a host, safely: a host (or a container writing its outputs) may be
    hostile, so no owners, groups, permissions bits beyond the umask (no setuid), devices or special
    files are kept, and symlinks pointing outside the copied tree are skipped. The nodes' console
    files and the snapshots are left out: both are already on this machine."""
    return [
        "rsync",
        "--recursive",
        "--times",
        "--links",
        "--safe-links",
        f"--timeout={RSYNC_IO_TIMEOUT}",
        f"--exclude=/{CONSOLE_DIR}/",  # the nodes' output: already here, in runs/JOB/HOST.log
        *(f"--exclude={pattern}" for pattern in SNAPSHOT_EXCLUDES),
        *RSYNC_PROTECT,
        "--rsh",
        shell(ssh_argv(host)),
        rsync_remote(host, remote_dir.rstrip("/") + "/"),
        dest,
    ]
