"""A test host as a container of this machine's Docker engine (its name, container and address),
commands run in it through `docker exec` (a trusted channel, no SSH), and where progress lines
go: what the cluster (cluster) and its Slurm (slurmbed) both use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.core.errors import UserError

if TYPE_CHECKING:
    from docker.models.containers import Container

# Where progress lines go: print by default, or any callable that takes the line.
Log = Callable[[str], object]


@dataclass(frozen=True)
class NodeInfo:
    name: str
    container: str
    address: str


def exec_checked(container: Container, argv: list[str]) -> str:
    code, out = container.exec_run(argv)
    if code != 0:
        raise UserError(f"{container.name}: {' '.join(argv[:3])}... failed ({code}): {out.decode()[-300:]}")
    return out.decode()
