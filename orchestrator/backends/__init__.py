"""Where a job runs: over SSH on the inventory's hosts (ssh/), as a Slurm job (slurm/), and as
manifests to hand to kubectl (kubernetes/: render only). export.py holds what the sbatch script and
the manifests share. base.py says what a backend offers; this module is the one place that chooses one."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core import hostile
from orchestrator.core.errors import UserError

if TYPE_CHECKING:
    from orchestrator.backends.base import Backend
    from orchestrator.config.inventory import Inventory

# name -> "module:Class". A new backend is one folder and one line here (or register()).
BACKENDS: dict[str, str] = {
    "ssh": "orchestrator.backends.ssh.backend:SshBackend",
    "slurm": "orchestrator.backends.slurm.backend:SlurmBackend",
    "kubernetes": "orchestrator.backends.kubernetes.backend:KubernetesBackend",
}
DEFAULT = "ssh"


def register(name: str, target: str) -> None:
    """Make `target` ("module:Class") the backend called `name`."""
    BACKENDS[name] = target


def get(name: str) -> Backend:
    try:
        module, _, cls = BACKENDS[name].partition(":")
    except KeyError:
        raise UserError(f"--on {hostile.text(name)!r}: give {' or '.join(BACKENDS)}", exit_code=2) from None
    backend: Backend = getattr(importlib.import_module(module), cls)()
    return backend


def choose(on: str | None) -> Backend:
    """The backend `fab train --on` names (ssh when none)."""
    return get(on or DEFAULT)


def of_job(runs: Path, job_id: str) -> Backend | None:
    """The backend a job ran on, from its record (runs/JOB/job.json); None when there is none."""
    from orchestrator.core.recovery import JobRecord
    try:
        record = JobRecord.load(runs, job_id)
    except UserError:
        return None
    return get(record.on)


def serving(inv: Inventory) -> list[Backend]:
    """Every backend the inventory uses, for fab status and fab stop (Slurm first: its jobs hold
    nodes that may also be the inventory's hosts)."""
    found = [get(name) for name in reversed(list(BACKENDS))]
    return [b for b in found if b.serves(inv)]
