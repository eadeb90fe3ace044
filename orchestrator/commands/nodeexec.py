"""Into a running node from this machine (`fab shell`): `docker exec` in the node's container, run by
the system's OpenSSH client over the same SSH path fabtrain uses for that host (sshargs.ssh_argv:
the inventory's user, port, keys, known_hosts and jump hosts; host keys checked, never prompted).
Pure: argv lists, the remote command quoted exactly once (sshargs.shell)."""
from __future__ import annotations

from orchestrator.commands.sshargs import shell, ssh_argv
from orchestrator.config.inventory import Host
from orchestrator.core.jobspec import container_name

# What `fab shell` runs without a command: bash where the image has it (NGC and ROCm images do),
# else the POSIX shell every image has.
LOGIN_SHELL = ("sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash; else exec sh; fi")


def exec_argv(job_id: str, rank: int, command: list[str] | tuple[str, ...], tty: bool) -> list[str]:
    """`docker exec` of `command` (LOGIN_SHELL when empty) in node `rank`'s container of the job.
    stdin is always passed on (`fab shell JOB -- python - < script.py`); a terminal only with `tty`."""
    return ["docker", "exec", "--interactive", *(["--tty"] if tty else []), container_name(job_id, rank),
            *(command or LOGIN_SHELL)]


def ssh_command_argv(host: Host, remote: list[str], tty: bool) -> list[str]:
    """The OpenSSH client running `remote` (an argv, quoted here once) on the host: with a pseudo-
    terminal (-t) when `tty`, else none (-T: output byte for byte, stdout and stderr apart). '--'
    ends ssh's options, so neither the address nor the command is read as one."""
    return [*ssh_argv(host), "-t" if tty else "-T", "--", host.ssh.hostname, shell(remote)]
