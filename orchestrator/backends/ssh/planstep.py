"""One step of an attempt's plan (attempt.py): a command on a host or on this machine (`Step`),
when it runs (`When`), and the two ways a step builder (stagesteps.py, conditionalsteps.py) makes
one: `remote_step` and `local_step`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from orchestrator.config.inventory import Host
from orchestrator.core.jobspec import LOCAL
from orchestrator.hostcmds import sshargs
from orchestrator.transport.deadlines import COPY_TIMEOUT


class When(enum.Enum):
    """When a step runs. ALWAYS steps run in every attempt that gets that far, in order; the others
    when what their value says happens (the value is the plan's heading for them)."""

    ALWAYS = ""
    ON_LEASE = "every 5 s while fab train looks after the job: its hosts"
    ON_SNAPSHOT = "every 0.5 s on rank 0's host, and when a new snapshot appears"
    ON_SILENT = "when a node shows no progress for a while: its heartbeat file's age"
    ON_HANG = (
        "when the hang watchdog fires: every rank's stacks and flight recorder (the stacks also every "
        "hang timeout / 5, to see whether the ranks move)"
    )
    ON_MISSED = "when the follow missed output (OFFSET: the bytes it received + 1)"
    ON_FAILURE = "when a node fails or a host is lost: the other hosts"
    ON_INTERRUPT = "on Ctrl+C, SIGTERM or fab stop: every host"
    ON_FAILED = "after a failed attempt, and between attempts: did fab stop end it? (every host used)"
    ON_SAMPLE = "every job.telemetry_every seconds while the job is watched: GPUs, containers, load, memory"


@dataclass(frozen=True)
class Step:
    """One command: on a host (a remote command string, quoted once) or on this machine (an argv)."""

    where: str  # a host name, or LOCAL
    key: str  # what it is for: sync, secrets, start, follow, stop, ...
    command: str  # the exact remote command, or the local argv quoted for reading
    timeout: float | None
    when: When = When.ALWAYS
    argv: tuple[str, ...] = ()  # a local step's argv, run as is
    stdin: bytes | None = field(default=None, repr=False, compare=False)
    stdin_note: str = ""  # what stdin holds, as rendered (secret values never shown)
    what: str = ""  # for error messages
    host: str = ""  # a local step's peer host

    @property
    def deadline(self) -> float:
        """The timeout of a step that is run to its end: every step but the follow, which is only
        streamed (its liveness is the keepalive's, remote.Command)."""
        if self.timeout is None:
            raise ValueError(f"the {self.key} step on {self.where} has no timeout: it is only streamed")
        return self.timeout

    def render(self, rank: int | None = None) -> str:
        where = f"[{self.where}" + (f" rank {rank}" if rank is not None else "") + "]"
        note = f"  # stdin: {self.stdin_note}" if self.stdin_note else ""
        return f"{where} {self.command}{note}"


def local_step(host: Host, key: str, argv: list[str], when: When = When.ALWAYS, what: str = "") -> Step:
    return Step(
        LOCAL, key, sshargs.shell(argv), COPY_TIMEOUT, when, tuple(argv), what=what or key, host=host.name
    )


def remote_step(
    host: Host,
    key: str,
    command: str,
    timeout: float | None,
    when: When = When.ALWAYS,
    what: str = "",
    stdin: bytes | None = None,
    stdin_note: str = "",
) -> Step:
    return Step(host.name, key, command, timeout, when, stdin=stdin, stdin_note=stdin_note, what=what or key)
