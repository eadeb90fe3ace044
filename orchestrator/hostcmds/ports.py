"""The job's master port: what listens on a host, and the first free port above job.master_port."""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.hostcmds import sshargs

PORT_RANGE = 100  # master ports tried above job.master_port


def port_command() -> str:
    """The TCP ports listening on a host (numbers only, one per line)."""
    return sshargs.shell(["ss", "-Htln"])


def free_port(listening: str, base: int, taken: Iterable[int] = frozenset()) -> int | None:
    """The first port from `base` (within PORT_RANGE) that nothing listens on (`ss -Htln` output)
    and no other job of ours was given."""
    busy = set(taken)
    for line in listening.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            port = fields[3].rsplit(":", 1)[-1]
            if port.isdigit():
                busy.add(int(port))
    return next((p for p in range(base, min(base + PORT_RANGE, 65536)) if p not in busy), None)
