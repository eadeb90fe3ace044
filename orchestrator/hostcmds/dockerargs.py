"""The job's container as `docker run` argv and the docker commands around it (probe a host's
GPU access, stop, list, dump stacks). Pure functions from (inventory, host, JobSpec) to argv; they
stay argv until the edge, where sshargs.shell quotes them exactly once."""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from functools import cache

from orchestrator.config import resources
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import devices
from orchestrator.core.errors import UserError
from orchestrator.core.jobspec import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_MANAGED,
    LABEL_OWNER,
    LABEL_RANK,
    JobSpec,
    container_name,
)
from orchestrator.core.nodespec import NodeSpec
from orchestrator.hostcmds.sshargs import shell

ENTRYPOINT_SOURCE = resources.entrypoint()
# What a node's start writes into the job's runtime directory (mounted read-only at RUNTIME_MOUNT):
# the entrypoint and, beside it, the in-memory state module its workers import and its keeper runs,
# then the modules those two import, which they find beside them (fabtrain_hook.start_memory copies
# fabtrain_memory's with it onto the workers' path).
RUNTIME_MODULES = (
    "fabtrain_generations.py",
    "fabtrain_hook.py",
    "fabtrain_keeper.py",
    "fabtrain_state.py",
    "fabtrain_policy.py",
    "fabtrain_exchange.py",
)
RUNTIME_SOURCES = {
    "entrypoint.py": ENTRYPOINT_SOURCE,
    "fabtrain_memory.py": resources.memory_module(),
    **{name: resources.docker_file(name) for name in RUNTIME_MODULES},
}
RUNTIME_NOTE = (
    f"{resources.ENTRYPOINT_NAME}, {resources.MEMORY_NAME} and the modules they import (a tar archive)"
)


@cache
def runtime_files() -> bytes:
    """RUNTIME_SOURCES as one tar archive, the start step's stdin (never a command line): plain
    members, mode 0644, owner 0 and time 0, so the same sources give the same bytes."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, path in RUNTIME_SOURCES.items():
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@dataclass(frozen=True)
class GpuAccess:
    """How a GPU host hands its GPUs to containers, read on the host (gpu_probe_argv)."""

    nvidia_runtime: bool = True  # the NVIDIA runtime hook, which `--gpus` needs
    cdi: bool = False  # CDI specs for nvidia.com/gpu (/etc/cdi, /var/run/cdi)
    gids: tuple[int, ...] = ()  # AMD: the groups owning /dev/kfd and the render nodes
    render: tuple[int, ...] = ()  # AMD: each GPU's render node minor, in ROCm's GPU order


def gpu_probe_argv(host: Host) -> list[str] | None:
    """What decides a GPU host's device flags: NVIDIA's runtime hook and CDI specs, or the numeric
    groups of AMD's device nodes (a group name such as `render` may not exist in the image)."""
    if host.gpu_vendor == "nvidia":
        # Bounded like every Docker call of the preflight: a stuck engine must not hold the start.
        return [
            "sh",
            "-c",
            "echo runtimes $(timeout -k 2 8 docker info --format '{{json .Runtimes}}' 2>/dev/null); "
            "echo cdi $(cat /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json "
            "2>/dev/null | grep -c 'nvidia.com/gpu')",
        ]
    if host.gpu_vendor == "amd":
        return [
            "sh",
            "-c",
            "echo gids $(stat -c %g /dev/kfd /dev/dri/renderD* 2>/dev/null | sort -un); " + devices.AMD_PROBE,
        ]
    return None


def parse_gpu_probe(text: str) -> GpuAccess:
    fields = {line.split(" ", 1)[0]: line.partition(" ")[2].strip() for line in text.splitlines() if line}
    gids = tuple(sorted({int(g) for g in fields.get("gids", "").split() if g.isdigit() and g != "0"}))
    cdi = fields.get("cdi", "0")
    return GpuAccess(
        nvidia_runtime='"nvidia"' in fields.get("runtimes", ""),
        cdi=cdi.isdigit() and int(cdi) > 0,
        gids=gids,
        render=devices.parse_amd_render(text),
    )


def device_args(
    host: Host, access: GpuAccess | None = None, gpus: tuple[int, ...] | None = None
) -> list[str]:
    """Docker flags that expose the host's accelerators (`gpus`: only these; None: all) and the
    inventory's devices to the container. `access` comes from gpu_probe_argv on the host; None
    assumes NVIDIA's runtime hook."""
    access = access or GpuAccess()
    args: list[str] = []
    if host.gpu_vendor == "nvidia":
        # https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/cdi-support.html:
        # a host with CDI specs and no runtime hook (nvidia-container-toolkit-base) takes GPUs as
        # CDI devices; `--gpus` needs the hook.
        args += devices.nvidia_device_args(gpus, cdi=access.cdi and not access.nvidia_runtime)
    elif host.gpu_vendor == "amd":
        # https://rocm.docs.amd.com/projects/install-on-linux/en/latest/how-to/docker.html: the compute
        # interface (kfd) and the render nodes (dri), with the host's groups owning them, by number.
        try:
            args += devices.amd_device_args(gpus, access.render)
        except ValueError as exc:
            raise UserError(f"{host.name}: {exc}") from None
        for gid in access.gids:
            args += ["--group-add", str(gid)]
    for dev in host.devices:
        args += ["--device", dev]
    return args


# Per vendor, what its documentation runs containers with:
# - NVIDIA (https://docs.nvidia.com/deeplearning/frameworks/user-guide/index.html, NGC images):
#   --ulimit memlock=-1 --ulimit stack=67108864 (pinned memory for NCCL/InfiniBand, deep stacks);
# - AMD (ROCm Docker guide above): --security-opt seccomp=unconfined (memory mapping for HPC work).
# InfiniBand verbs pin memory: a host given /dev/infiniband devices also gets IPC_LOCK.
VENDOR_ULIMITS = {"nvidia": (("memlock", "-1"), ("stack", "67108864"))}
VENDOR_SECURITY = {"amd": ("seccomp=unconfined",)}


def container_options_of(
    inv: Inventory, host: Host
) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...], tuple[str, ...]]:
    """(ulimits, added capabilities, security options) of a node's container: the vendor's defaults,
    then job:, then the host's; IPC_LOCK first on an InfiniBand host."""
    ulimits = dict(VENDOR_ULIMITS.get(host.gpu_vendor, ()))
    ulimits.update(inv.job.ulimits)
    ulimits.update(host.ulimits)
    caps = list(inv.job.cap_add) + list(host.cap_add)
    if host.infiniband:
        caps.insert(0, "IPC_LOCK")
    security = [*VENDOR_SECURITY.get(host.gpu_vendor, ()), *inv.job.security_opt, *host.security_opt]
    return tuple(ulimits.items()), tuple(dict.fromkeys(caps)), tuple(dict.fromkeys(security))


def docker_options(node: NodeSpec) -> list[str]:
    """The options of a node's `docker run` (the Slurm script's too), from its NodeSpec."""
    argv = ["--name", node.name]
    for key, value in node.labels:
        argv += ["--label", f"{key}={value}"]
    # Host networking: NCCL/gloo see the real interfaces, no port mapping, no NAT.
    argv += ["--network", node.network]
    # Shared memory for DataLoader workers and NCCL: the host's IPC namespace (job.ipc: host), or
    # the job's own of a size (private: no other container's /dev/shm or SysV IPC is reachable).
    argv += ["--ipc", "private", "--shm-size", node.shm_size] if node.shm_size else ["--ipc", "host"]
    argv += node.devices
    if node.cpuset is not None:
        argv += ["--cpuset-cpus", node.cpuset]
    for name, value in node.ulimits:
        argv += ["--ulimit", f"{name}={value}"]
    for cap in node.cap_add:
        argv += ["--cap-add", cap]
    for opt in node.security_opt:
        argv += ["--security-opt", opt]
    for key, env_value in node.env:
        argv += ["--env", key if env_value is None else f"{key}={env_value}"]
    for m in node.mounts:
        argv += ["--volume", f"{m.mount.source}:{m.mount.target}" + (":ro" if m.mount.read_only else "")]
    return argv


def entry_options(node: NodeSpec) -> list[str]:
    """The working directory and the program run in place of the image's own ENTRYPOINT: python3
    runs the entrypoint this orchestrator put in the job's runtime directory, so any image with
    python3 and torch runs as it is."""
    return ["--workdir", node.workdir, "--entrypoint", node.program[0]]


def image_and_command(node: NodeSpec) -> list[str]:
    """The image, then the program's arguments (our entrypoint) and the job's command."""
    return [node.image, *node.program[1:], *node.command]


def docker_run(node: NodeSpec, *head: str) -> list[str]:
    """`docker run HEAD...` of the node: every option, the image, then what runs in it."""
    return ["docker", "run", *head, *docker_options(node), *entry_options(node), *image_and_command(node)]


# Run in a container of the job (docker exec ... python3 -c STACKS_PY): sends SIGRTMIN+7 to every
# worker that registered the watchdog hook (docker/fabtrain_hook.py), waits up to 3 s for their dumps,
# prints each rank's header line and its new dump only. Only registered processes are signalled:
# the signal would end any other. The watchdog looks every few seconds, so a file past 1 MiB is cut
# back to its header (the hook appends).
STACKS_PY = """\
import glob, os, signal, time
sizes = {}
for f in sorted(glob.glob("/tmp/fabtrain-stacks/rank-*.txt")):
    try:
        sizes[f] = os.path.getsize(f)
        os.kill(int(f.rsplit("-", 1)[1][:-4]), signal.SIGRTMIN + 7)
    except (OSError, ValueError):
        sizes.pop(f, None)
end = time.time() + 3
while time.time() < end and any(os.path.getsize(f) == n for f, n in sizes.items()):
    time.sleep(0.05)
time.sleep(0.3)
for f, n in sizes.items():
    with open(f, "rb+") as fh:
        head = fh.readline()
        fh.seek(max(n, len(head)))
        print((head + fh.read(1 << 20)).decode(errors="replace"), end="", flush=True)
        if n > 1 << 20:
            fh.truncate(len(head))
"""


def python_in_node(spec: JobSpec, rank: int, code: str) -> list[str]:
    """`docker exec` of python3 running `code` (STACKS_PY, FLIGHT_PY) in node `rank`'s container."""
    return ["docker", "exec", container_name(spec.job_id, rank), "python3", "-c", code]


# Run in a container of the job when a hang is called: asks every live rank's hook thread for
# torch's flight recorder (docker/fabtrain_hook.py), waits up to 3 s, and prints per rank one JSON line
# of what a verdict needs (the dump itself, up to 2000 entries, stays in the container): for each
# process group its newest collective (sequence number, op, state) and the last one completed.
FLIGHT_SUMMARY = """\
def summarize(doc):
    pgs = {}
    for e in doc.get("entries") or []:
        if e.get("is_p2p"):
            continue
        pg = str(e.get("pg_id"))
        if pg not in pgs or (e.get("collective_seq_id") or 0) >= pgs[pg]["seq"]:
            pgs[pg] = {"seq": e.get("collective_seq_id") or 0, "op": e.get("profiling_name"),
                       "state": e.get("state"), "name": (e.get("process_group") or ["", ""])[-1]}
    for pg, st in (doc.get("pg_status") or {}).items():
        if str(pg) in pgs:
            pgs[str(pg)]["completed"] = st.get("last_completed_collective")
    return pgs
"""
FLIGHT_PY = (
    FLIGHT_SUMMARY
    + """\
import glob, json, os, time
d = "/tmp/fabtrain-stacks"
live = {}
for f in glob.glob(d + "/rank-*-*.txt"):
    rank, _, pid = f[len(d) + 6:-4].rpartition("-")
    if os.path.exists("/proc/" + pid):
        live[pid] = rank
start = time.time()
req = d + "/flight-request"
open(req, "a").close()
os.utime(req)
def fresh(pid):
    f = "%s/flight-%s-%s.json" % (d, live[pid], pid)
    return f if os.path.exists(f) and os.path.getmtime(f) >= start - 0.01 else None
end = time.time() + 3
while time.time() < end and not all(fresh(p) for p in live):
    time.sleep(0.1)
for pid, rank in sorted(live.items()):
    try:
        doc = json.load(open(fresh(pid)))
    except Exception:
        continue
    print(json.dumps({"rank": rank, "pgs": summarize(doc)}), flush=True)
"""
)


def label_filter(job_id: str | None) -> list[str]:
    args = ["--filter", f"label={LABEL_MANAGED}=1"]
    if job_id:
        args += ["--filter", f"label={LABEL_JOB}={job_id}"]
    return args


def stop_script(job_id: str | list[str] | None = None, grace: float = 0) -> str:
    """Stop (SIGTERM, grace seconds, then SIGKILL) and remove this project's containers, by label:
    a job's, several jobs' (all at once, one grace), or every one (None)."""
    jobs = [job_id] if isinstance(job_id, str) or job_id is None else job_id
    lists = [shell(["docker", "ps", "--all", "--quiet", *label_filter(j)]) for j in jobs]
    ids = lists[0] if len(lists) == 1 else "{ " + "; ".join(lists) + "; }"
    parts = []
    if grace > 0:
        parts.append(f"{ids} | xargs -r {shell(['docker', 'stop', '--time', str(int(grace))])} >/dev/null")
    # Another party removing the same container at once (the watcher of a failing job while the
    # user runs fab stop) is success, not an error: the container is going either way.
    parts.append(f"{ids} | xargs -r {shell(['docker', 'rm', '--force'])} 2>&1 | {shell(['awk', RM_FILTER])}")
    return "; ".join(parts)


# Removed ids to stdout; "already being removed" / "already gone" dropped; any other line to
# stderr and a non-zero exit.
RM_FILTER = (
    "/is already in progress|No such container/ {next} /^[0-9a-f]+$/ {print; next} "
    '{print > "/dev/stderr"; bad = 1} END {exit bad}'
)


def status_argv(job_id: str | None = None) -> list[str]:
    return [
        "docker",
        "ps",
        "--all",
        *label_filter(job_id),
        "--format",
        '{{.Label "' + LABEL_JOB + '"}}\t{{.Label "' + LABEL_RANK + '"}}\t{{.Names}}\t'
        '{{.State}}\t{{.Status}}\t{{.Label "' + LABEL_OWNER + '"}}\t{{.Label "' + LABEL_ATTEMPT + '"}}',
    ]
