"""fab export.slurm and fab export.k8s: the job, as fab train would run it, rendered by a backend that
writes files (backends/registry.py's renderers) and written here, its warnings on stderr."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.backends import registry
from orchestrator.backends.base import Launch
from orchestrator.commandline import cli
from orchestrator.config import inventory as inventory_file
from orchestrator.core import hostile

if TYPE_CHECKING:
    from collections.abc import Iterable

    from rich.console import Console

    from orchestrator.backends.base import Rendered


def export(
    name: str,
    inventory: str | None,
    job: dict[str, Any],
    trainers: dict[str, str],
    runs: Path,
    console: Console,
    restarts: str | int = 0,
    **settings: Any,
) -> Rendered:
    """fab export.NAME: the job (`job`: JOB_OPTIONS) as the files of the backend called `name`
    (registry.renderer), with its own `settings`; `restarts` as fab train's."""
    inv = inventory_file.load(inventory)
    spec = cli.new_spec(job, trainers)
    job_launch = Launch(inv, spec, cli.policy(inv, restarts, None, None), None, runs, console)
    return registry.render(registry.renderer(name), job_launch, **settings)


def warn(warnings: Iterable[str]) -> None:
    """A renderer's warnings, each on stderr."""
    for w in warnings:
        print(f"warning: {hostile.text(w)}", file=sys.stderr)


def write_sbatch(rendered: Rendered, out: str | None) -> None:
    """The one sbatch script written to `out` (default: its own name, JOB.sbatch), executable."""
    warn(rendered.warnings)
    [(name, text)] = rendered.files.items()
    target = Path(out or name)
    target.write_text(text)
    target.chmod(0o755)
    print(
        f"wrote {target} (job {rendered.job_id}); put the code on every node (fab sync) and submit: "
        f"sbatch {target}"
    )


def write_manifests(rendered: Rendered, out: str | None) -> None:
    """The Kubernetes manifests written into the directory `out` (default: JOB-k8s), made if need be."""
    warn(rendered.warnings)
    target = Path(out or f"{rendered.job_id}-k8s")
    target.mkdir(parents=True, exist_ok=True)
    for file, text in rendered.files.items():
        (target / file).write_text(text)
    print(
        f"wrote {', '.join(f'{target}/{f}' for f in rendered.files)} (job {rendered.job_id}); apply one with "
        f"kubectl apply -f (trainjob.yaml on Kubeflow Trainer v2)"
    )
