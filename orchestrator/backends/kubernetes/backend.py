"""--on kubernetes: the job as Kubernetes manifests (manifests.py) to hand to kubectl. A Renderer and
not a Runner: fabtrain runs nothing there. `fab export.k8s` writes the manifests to files, `fab train
--on kubernetes --dry-run` prints them, and running a job there is refused (registry.as_runner)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrator.backends.base import Option, Rendered, train_options
from orchestrator.backends.kubernetes import manifests

if TYPE_CHECKING:
    from orchestrator.backends.base import Launch

DECLINES = (
    "fabtrain does not run jobs there; it writes manifests to hand to kubectl: use fab export.k8s, "
    "or fab train --on kubernetes --dry-run"
)
RENDER_ONLY = f"--on kubernetes: {DECLINES}"  # what asking it to run, follow or stop a job says


class KubernetesBackend:
    name = "kubernetes"
    # What reaches the manifests: the pods' retries and which hosts' nodes (their count, the first one
    # as the template). Nothing that reaches the hosts or follows a running job.
    accepts: tuple[Option, ...] = (
        Option("restarts", int, 0, "pod failures the job tolerates (backoffLimit)"),
        *train_options("include", "exclude"),
    )
    declines = DECLINES
    settings: tuple[Option, ...] = ()

    def render(self, launch: Launch, settings: dict[str, Any]) -> Rendered:
        """A Kubeflow Trainer v2 TrainJob, a Kubeflow PyTorchJob and an Indexed Job with a headless
        Service (what `fab export.k8s` writes), with the settings the manifests cannot give every node
        as warnings."""
        inv, spec = launch.inv, launch.spec
        docs, warnings = manifests.k8s_manifests(inv, spec, restarts=launch.policy.restarts)
        texts = {file: manifests.k8s_text(inv, spec, file, documents) for file, documents in docs.items()}
        title = (
            f"job {spec.job_id} as Kubernetes manifests (fab export.k8s writes these files; "
            "kubectl apply -f one of them):"
        )
        return Rendered(spec.job_id, texts, tuple(warnings), title=title)


if TYPE_CHECKING:  # the class has everything base.Renderer asks for, and is no Runner
    from orchestrator.backends.base import Renderer

    _checked: Renderer = KubernetesBackend()
