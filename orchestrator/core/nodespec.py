"""One node of a job as a container, whatever starts it: built once from the inventory and the job's
options (hostcmds/node.py), then rendered as `docker run` argv (hostcmds/dockerargs.py), into the
sbatch script (backends/slurm/script.py) and as a Kubernetes container (backends/kubernetes/manifests.py).
A renderer reads fields; none
parses another's output. Pure data: no I/O, no other layer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mount:
    """A directory of the host in the container (the inventory's mounts: SOURCE:TARGET[:ro])."""

    source: str
    target: str
    read_only: bool = False


# What a mount of the node is for: the job's own four (code, working directory, outputs, runtime
# files: each backend provides them its own way) and the inventory's (HOST).
CODE, WORK, OUTPUT, RUNTIME, HOST = "code", "work", "output", "runtime", "host"


@dataclass(frozen=True)
class NodeMount:
    kind: str
    mount: Mount


@dataclass(frozen=True)
class NodeSpec:
    """Everything one node's container is started with."""

    name: str  # the container's name
    labels: tuple[tuple[str, str], ...]  # fabtrain.* labels: how stop and status find it
    image: str
    program: tuple[str, ...]  # run first, in place of the image's own ENTRYPOINT
    command: tuple[str, ...]  # the job's: script (or -m MODULE) and its arguments
    workdir: str
    env: tuple[tuple[str, str | None], ...]  # None: passed on from the caller (Slurm fills it in)
    secrets: tuple[str, ...]  # names only: values travel in a file, never here
    mounts: tuple[NodeMount, ...]
    shm_size: str | None  # None: the host's IPC namespace
    devices: tuple[str, ...]  # docker flags that hand over the GPUs and devices
    gpu_vendor: str = "none"
    gpu_count: int = 0
    cpuset: str | None = None  # CPUs of a CPU host's slots (--cpuset)
    ulimits: tuple[tuple[str, str], ...] = ()
    cap_add: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = ()
    network: str = "host"  # NCCL and gloo see the real interfaces

    def mounts_of(self, kind: str) -> tuple[Mount, ...]:
        return tuple(m.mount for m in self.mounts if m.kind == kind)

    @property
    def seccomp_unconfined(self) -> bool:
        return "seccomp=unconfined" in self.security_opt
