"""--on kubernetes: the job as Kubernetes manifests (manifests.py) to hand to kubectl. fabtrain renders
them and runs nothing there: `fab export.k8s` writes them to files, `fab train --on kubernetes
--dry-run` prints them, and every method that would run, follow or stop a job refuses."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.base import Finished, Launch, Status, Stopped
from orchestrator.backends.kubernetes import manifests
from orchestrator.core import hostile
from orchestrator.core.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.config.inventory import Inventory
    from orchestrator.core.jobspec import JobSpec

RENDER_ONLY = ("--on kubernetes writes manifests to hand to kubectl; fabtrain does not run jobs there: use "
               "fab export.k8s, or fab train --on kubernetes --dry-run")


def render_only() -> UserError:
    return UserError(RENDER_ONLY, exit_code=2)


class KubernetesBackend:
    name = "kubernetes"
    where = " on Kubernetes"
    # Options that reach the hosts or follow a running job: nothing of them is in the manifests.
    refuses = {
        option: "not with --on kubernetes: it only writes manifests (fab train --on kubernetes --dry-run)"
        for option in (
            "health",
            "num_nodes",
            "smoke",
            "queue",
            "detach",
            "notify",
            "notify_url",
            "hot_spares",
        )
    }

    def render(self, inv: Inventory, spec: JobSpec, restarts: int = 0) -> tuple[dict[str, str], list[str]]:
        """({file name: its text}, warnings): a Kubeflow Trainer v2 TrainJob, a Kubeflow PyTorchJob
        and an Indexed Job with a headless Service (what `fab export.k8s` writes)."""
        docs, warnings = manifests.k8s_manifests(inv, spec, restarts=restarts)
        texts = {file: manifests.k8s_text(inv, spec, file, documents) for file, documents in docs.items()}
        return texts, warnings

    def serves(self, inv: Inventory) -> bool:
        """No job runs there, so fab status and fab stop have nothing to ask."""
        return False

    def refuse_if_running(self, inv: Inventory, job_id: str, how: str) -> None:
        """No job runs there (run refuses), so none is still running."""

    def dry_run(self, launch: Launch) -> str:
        """The manifests, each under its file name; the warnings (settings the manifests cannot give
        every node) to the console, as fab export.k8s says them."""
        texts, warnings = self.render(launch.inv, launch.spec, restarts=launch.policy.restarts)
        for warning in warnings:
            launch.console.print(f"warning: {hostile.text(warning)}", markup=False, highlight=False)
        head = (f"job {launch.spec.job_id} as Kubernetes manifests (fab export.k8s writes these files; "
                "kubectl apply -f one of them):")
        return "\n".join([head, *(f"\n--- {file} ---\n{text}" for file, text in texts.items())])

    def run(self, launch: Launch) -> Finished:
        raise render_only()

    def detach(self, launch: Launch) -> Finished:
        raise render_only()

    def take_over(self, launch: Launch) -> Finished:
        raise render_only()

    def attach(
        self, inv: Inventory, job_id: str | None, runs: Path, console: Console, live: bool
    ) -> Finished:
        raise render_only()

    def stop(self, inv: Inventory, job_id: str | None, everyone: bool, yes: bool, grace: float,
             runs: Path) -> Stopped:
        raise render_only()

    def status(self, inv: Inventory, runs: Path) -> Status:
        raise render_only()


if TYPE_CHECKING:  # the class has everything base.Backend asks for
    from orchestrator.backends.base import Backend

    _checked: Backend = KubernetesBackend()
