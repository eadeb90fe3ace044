"""Docker flags that give a container a chosen subset of a host's GPUs, by index.

Pure functions: the facts they need (CDI or runtime hook, the render nodes of an AMD host) are
read on the host by the probes that plan.py runs, and passed in.

- NVIDIA (https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/docker-specialized.html,
  .../cdi-support.html): with the runtime hook, `--gpus '"device=0,1"'`; on a host with CDI specs and
  no hook, one CDI device per GPU, named `nvidia.com/gpu=<index>` by nvidia-ctk's default naming.
- AMD (https://rocm.docs.amd.com/projects/install-on-linux/en/latest/how-to/docker.html): every
  container needs /dev/kfd, and sees only the GPUs whose /dev/dri/renderD<minor> it is given. The
  minor of each GPU comes from the KFD topology in sysfs, whose node order is the device order of
  ROCm's runtime (ROCr makes a GPU agent of each node with SIMDs, in node order; HIP numbers them
  in that order), so index i of the job's GPUs is the i-th GPU node.
"""

from __future__ import annotations

KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"

# One line, 'render M0 M1 ...': the render minor of each GPU node, nodes in numeric order (10
# after 9). A CPU node's gpu_id file holds 0; a host without KFD prints 'render' alone.
AMD_PROBE = (
    f"printf render; for kfd_node in $(ls {KFD_NODES} 2>/dev/null | sort -n); do "
    f'[ "$(cat {KFD_NODES}/$kfd_node/gpu_id 2>/dev/null)" -gt 0 ] 2>/dev/null && '
    f"printf ' %s' \"$(awk '$1 == \"drm_render_minor\" {{print $2}}' {KFD_NODES}/$kfd_node/properties)\"; "
    "done; echo"
)


def nvidia_device_args(gpus: tuple[int, ...] | None, cdi: bool) -> list[str]:
    """`gpus` None means every GPU; `cdi` means the host has CDI specs and no NVIDIA runtime hook.
    The docker CLI reads --gpus as CSV, so a comma list must be one quoted field: the double
    quotes are part of the argv element."""
    _require_some(gpus)
    if gpus is None:
        return ["--device", "nvidia.com/gpu=all"] if cdi else ["--gpus", "all"]
    if cdi:
        return [arg for gpu in gpus for arg in ("--device", f"nvidia.com/gpu={gpu}")]
    return ["--gpus", '"device=' + ",".join(str(gpu) for gpu in gpus) + '"']


def parse_amd_render(text: str) -> tuple[int, ...]:
    """The minors from AMD_PROBE's 'render ...' line, in GPU index order; other lines are ignored.
    A malformed minor raises ValueError: dropping it would shift every later GPU's index."""
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["render"]:
            return tuple(int(word) for word in words[1:])
    return ()


def parse_kfd_properties(nodes: dict[int, str]) -> tuple[int, ...]:
    """AMD_PROBE's rule in Python, on the text of each node's `properties` file (node number ->
    text): the drm_render_minor of the GPU nodes, in numeric node order. A GPU node is one with
    SIMDs (simd_count > 0), as ROCr decides; a CPU node has none, and a gpu_id of 0, which is what
    AMD_PROBE reads (the recorded topologies in the tests show both agree)."""
    minors = []
    for node in sorted(nodes):
        fields = dict(line.split(None, 1) for line in nodes[node].splitlines() if " " in line)
        if int(fields.get("simd_count", "0")) > 0:
            minors.append(int(fields["drm_render_minor"]))
    return tuple(minors)


def amd_device_args(gpus: tuple[int, ...] | None, render: tuple[int, ...]) -> list[str]:
    """`gpus` None means every GPU: /dev/kfd and all of /dev/dri. Otherwise /dev/kfd and the render
    node of each chosen GPU, `render` being parse_amd_render's minors."""
    _require_some(gpus)
    if gpus is None:
        return ["--device", "/dev/kfd", "--device", "/dev/dri"]
    if not render:
        raise ValueError(f"GPU {gpus[0]} was asked for, but the KFD topology listed no GPU")
    args = ["--device", "/dev/kfd"]
    for gpu in gpus:
        if not 0 <= gpu < len(render):
            raise ValueError(
                f"there is no GPU {gpu}: the KFD topology lists {len(render)} GPUs (0 to {len(render) - 1})"
            )
        args += ["--device", f"/dev/dri/renderD{render[gpu]}"]
    return args


def _require_some(gpus: tuple[int, ...] | None) -> None:
    """An empty selection would start a container with no GPU at all: a caller's mistake."""
    if gpus is not None and not gpus:
        raise ValueError("no GPU chosen: give at least one index, or None for all")
