"""Into a running node from this machine (`fab shell`): `docker exec` in the node's container, run by
the system's OpenSSH client over the same SSH path fabtrain uses for that host (sshargs.ssh_argv:
the inventory's user, port, keys, known_hosts and jump hosts; host keys checked, never prompted).
Pure: argv lists, the remote command quoted exactly once (sshargs.shell)."""

from __future__ import annotations

from orchestrator.config.inventory import Host
from orchestrator.core.jobspec import container_name
from orchestrator.hostcmds.sshargs import shell, ssh_argv

# What `fab shell` runs without a command: bash where the image has it (NGC and ROCm images do),
# else the POSIX shell every image has.
LOGIN_SHELL = ("sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash; else exec sh; fi")


def exec_argv(
    job_id: str, rank: int, command: list[str] | tuple[str, ...], tty: bool, term: str | None = None
) -> list[str]:
    """`docker exec` of `command` (LOGIN_SHELL when empty) in node `rank`'s container of the job.
    stdin is always passed on (`fab shell JOB -- python - < script.py`); a terminal only with `tty`,
    of this terminal's type `term` (docker exec would say xterm: no 256 colours, wrong keys)."""
    terminal = ["--tty", *(["--env", f"TERM={term}"] if term else [])] if tty else []
    return [
        "docker",
        "exec",
        "--interactive",
        *terminal,
        container_name(job_id, rank),
        *(command or LOGIN_SHELL),
    ]


def ssh_command_argv(host: Host, remote: list[str], tty: bool) -> list[str]:
    """The OpenSSH client running `remote` (an argv, quoted here once) on the host: with a pseudo-
    terminal (-t) when `tty`, else none (-T: output byte for byte, stdout and stderr apart). '--'
    ends ssh's options, so neither the address nor the command is read as one. LogLevel=ERROR: ssh's
    errors still show, its "Connection to ... closed." after a terminal session does not."""
    return [
        *ssh_argv(host),
        "-o",
        "LogLevel=ERROR",
        "-t" if tty else "-T",
        "--",
        host.ssh.hostname,
        shell(remote),
    ]
