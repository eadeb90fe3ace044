"""The one place that chooses a backend: BACKENDS names each one (a Runner, a Renderer, or both, as
base.py says), for `fab train --on NAME`, `fab export.NAME` and a job's record; and the refusal of
the fab train options a backend does not take, derived from the options it declares (`accepts`)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from orchestrator.backends.base import TRAIN_OPTIONS, Option, Rendered
from orchestrator.core import hostile
from orchestrator.core.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from orchestrator.backends.base import Launch, Renderer, Runner
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


def get(name: str) -> Runner | Renderer:
    """The backend called `name`, whatever it is (UserError, exit 2, naming the others when none is)."""
    try:
        module, _, cls = BACKENDS[name].partition(":")
    except KeyError:
        raise UserError(f"--on {hostile.text(name)!r}: give {' or '.join(BACKENDS)}", exit_code=2) from None
    backend: Runner | Renderer = getattr(importlib.import_module(module), cls)()
    return backend


def runs_jobs(backend: Runner | Renderer) -> bool:
    """Whether it is a Runner (Kubernetes is not: it only renders)."""
    return callable(getattr(backend, "run", None))


def as_runner(backend: Runner | Renderer) -> Runner:
    """The backend as a Runner; one that only renders refuses (exit 2) with what it does instead."""
    if runs_jobs(backend):
        return cast("Runner", backend)
    raise UserError(f"--on {backend.name}: {backend.declines}", exit_code=2)


def runner(name: str) -> Runner:
    return as_runner(get(name))


def choose(on: str | None) -> Runner | Renderer:
    """The backend `fab train --on` names (ssh when none)."""
    return get(on or DEFAULT)


def of_job(runs: Path, job_id: str) -> Runner | None:
    """The runner a job ran on, from its record (runs/JOB/job.json); None when there is none."""
    from orchestrator.core.recovery import JobRecord

    try:
        record = JobRecord.load(runs, job_id)
    except UserError:
        return None
    return runner(record.on)


def serving(inv: Inventory) -> list[Runner]:
    """Every runner the inventory uses, for fab status and fab stop (Slurm first: its jobs hold
    nodes that may also be the inventory's hosts). A backend that only renders has no jobs to ask of."""
    found = [get(name) for name in reversed(list(BACKENDS))]
    return [r for r in (as_runner(b) for b in found if runs_jobs(b)) if r.serves(inv)]


def refuse(backend: Runner | Renderer, given: Mapping[str, Any]) -> None:
    """UserError (exit 2) when `given` (fab train's options by name; None or False: not given) holds
    one of TRAIN_OPTIONS that the backend does not accept: each named, then why (its `declines`) and
    what it does take. A backend registered without `accepts` takes none of them."""
    accepted: tuple[Option, ...] = getattr(backend, "accepts", ())
    names = {o.name for o in accepted}
    refused = [
        o.flag for o in TRAIN_OPTIONS if o.name not in names and given.get(o.name) not in (None, False)
    ]
    if not refused:
        return
    why = getattr(backend, "declines", "")
    takes = ", ".join(o.flag for o in accepted)
    raise UserError(
        f"{', '.join(refused)}: not with --on {backend.name}"
        + (f": {why}" if why else "")
        + (f" (it takes {takes})" if takes else ""),
        exit_code=2,
    )


class Plan:
    """A Runner's dry run as a Renderer: the one file plan.txt, every command the job would run (over
    SSH, what `fab train --dry-run` prints and runs/JOB/plan.txt holds for each attempt)."""

    settings: tuple[Option, ...] = ()

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.name = runner.name
        self.accepts: tuple[Option, ...] = getattr(runner, "accepts", ())
        self.declines: str = getattr(runner, "declines", "")

    def render(self, launch: Launch, settings: dict[str, Any]) -> Rendered:
        return Rendered(launch.spec.job_id, {"plan.txt": self.runner.dry_run(launch)})


def renderer(name: str) -> Renderer:
    """What `fab export.NAME` writes with: the backend called `name` when it renders (Kubernetes'
    manifests, Slurm's sbatch script), else its runner's plan."""
    backend = get(name)
    if callable(getattr(backend, "render", None)):
        return cast("Renderer", backend)
    return Plan(as_runner(backend))


def render(backend: Renderer, launch: Launch, **settings: Any) -> Rendered:
    """The renderer's files for the job, with `settings` (its own options, as it declares them:
    each checked for its type, the others at their defaults)."""
    declared = {o.name: o for o in backend.settings}
    for key, value in settings.items():
        if key not in declared:
            raise UserError(f"{Option(key, object).flag}: not with {backend.name}'s files", exit_code=2)
        option = declared[key]
        if value is not None and not isinstance(value, option.type):
            raise UserError(
                f"{option.flag} {hostile.text(str(value))!r}: give a {option.type.__name__}", exit_code=2
            )
    return backend.render(launch, {o.name: settings.get(o.name, o.default) for o in backend.settings})


def dry_run(backend: Runner | Renderer, launch: Launch) -> str:
    """What `fab train --dry-run` prints: a runner's plan, or a renderer's files under their names (its
    warnings said on the launch's console, as fab export says them)."""
    rendered = render(Plan(as_runner(backend)) if runs_jobs(backend) else cast("Renderer", backend), launch)
    for warning in rendered.warnings:
        launch.console.print(f"warning: {hostile.text(warning)}", markup=False, highlight=False)
    return rendered.text()
