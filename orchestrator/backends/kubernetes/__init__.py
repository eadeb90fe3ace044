"""The Kubernetes backend, render only: the job as manifests to hand to kubectl; fabtrain runs
nothing there."""
