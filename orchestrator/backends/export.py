"""What the two scheduler exports share: the sbatch script (slurm/script.py) and the Kubernetes
manifests (kubernetes/manifests.py) render the same job.

The job is described once (inventory, trainer or script, arguments, image) and runs the same way
everywhere: one container per node whose entrypoint (docker/entrypoint.py) forms the torchrun job
from the environment. Under Slurm the script carries that entrypoint to each node; under Kubernetes
a ConfigMap does. Every value from the inventory or the command line stays data: shell words are
quoted once (the few that Slurm fills in at run time are double-quoted variables), YAML is written
by a YAML library, and secrets are referenced by name, never written out.
"""

from __future__ import annotations

import re

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import jobspec
from orchestrator.hostcmds import dockerargs
from orchestrator.hostcmds.node import node_spec

# Ends the sbatch script's heredoc of the entrypoint: no line of the entrypoint may be this.
HEREDOC = "FABTRAIN_ENTRYPOINT"
# Per-host fields a Slurm job cannot vary (Slurm, not the inventory, picks the nodes).
UNIFORM_FIELDS = (
    "gpu_vendor",
    "gpu_count",
    "interface",
    "image",
    "env",
    "mounts",
    "devices",
    "ulimits",
    "cap_add",
    "security_opt",
)


def comment(text: str) -> str:
    """Text for a `#` comment: a newline or other control character in a value cannot end it."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", "?", text)


def template_host(inv: Inventory) -> tuple[Host, list[str]]:
    """The settings every node gets, the first host's, and a warning for each host that differs."""
    first = inv.hosts[0]
    warnings = [
        f"{h.name}: {f} differs from {first.name}'s; the export gives every node {first.name}'s"
        for h in inv.hosts[1:]
        for f in UNIFORM_FIELDS
        if getattr(h, f) != getattr(first, f)
    ]
    return first, warnings


def runtime_files() -> dict[str, str]:
    """Each file every node's start ships (docker/entrypoint.py and, beside it, fabtrain_memory.py,
    which a script imports to keep its state in memory, and the modules they import) by name, its
    text ending in a newline: the script's heredocs, the ConfigMap's keys (mounted as one directory)."""
    texts = {}
    for name, source in dockerargs.RUNTIME_SOURCES.items():
        text = source.read_text()
        if any(line == HEREDOC for line in text.splitlines()):
            raise AssertionError(f"{source} holds the heredoc delimiter {HEREDOC}")
        texts[name] = text if text.endswith("\n") else text + "\n"
    return texts


def summary(inv: Inventory, spec: jobspec.JobSpec, nodes: int, host: Host) -> list[str]:
    """The header's lines saying what the job runs and on how many nodes."""
    nproc = spec.nproc_per_node or inv.job.nproc_per_node
    n = node_spec(inv, host, spec)
    what = " ".join(n.command)
    return [
        f"#   {nodes} node(s) x {comment(nproc)} process(es), image {comment(n.image)}",
        f"#   runs: {comment(what)}",
    ]
