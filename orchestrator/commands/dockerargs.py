"""The job's container as `docker run` argv and the docker commands around it (probe a host's
GPU access, stop, list, dump stacks). Pure functions from (inventory, host, JobSpec) to argv; they
stay argv until the edge, where sshargs.shell quotes them exactly once."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.commands.hostfiles import (
    code_path,
    console_file,
    runtime_dir,
    work_dir,
)
from orchestrator.commands.sshargs import bounded, shell, timed_out_note
from orchestrator.config import resources
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import devices
from orchestrator.core.errors import UserError
from orchestrator.core.jobspec import (
    CODE_MOUNT,
    ENTRYPOINT_PATH,
    LABEL_ATTEMPT,
    LABEL_HOST,
    LABEL_JOB,
    LABEL_MANAGED,
    LABEL_OWNER,
    LABEL_RANK,
    OUTDIR,
    RUNTIME_MOUNT,
    WORKDIR,
    JobSpec,
    console_name,
    container_name,
)

ENTRYPOINT_SOURCE = resources.entrypoint()


@dataclass(frozen=True)
class GpuAccess:
    """How a GPU host hands its GPUs to containers, read on the host (gpu_probe_argv)."""

    nvidia_runtime: bool = True   # the NVIDIA runtime hook, which `--gpus` needs
    cdi: bool = False             # CDI specs for nvidia.com/gpu (/etc/cdi, /var/run/cdi)
    gids: tuple[int, ...] = ()    # AMD: the groups owning /dev/kfd and the render nodes
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
        return ["sh", "-c", "echo gids $(stat -c %g /dev/kfd /dev/dri/renderD* 2>/dev/null | sort -un); "
                + devices.AMD_PROBE]
    return None


def parse_gpu_probe(text: str) -> GpuAccess:
    fields = {line.split(" ", 1)[0]: line.partition(" ")[2].strip() for line in text.splitlines() if line}
    gids = tuple(sorted({int(g) for g in fields.get("gids", "").split() if g.isdigit() and g != "0"}))
    cdi = fields.get("cdi", "0")
    return GpuAccess(nvidia_runtime='"nvidia"' in fields.get("runtimes", ""),
                     cdi=cdi.isdigit() and int(cdi) > 0, gids=gids, render=devices.parse_amd_render(text))


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


def container_options(inv: Inventory, host: Host) -> list[str]:
    """--ulimit, --cap-add and --security-opt: the vendor's defaults, then job:, then the host's."""
    ulimits = dict(VENDOR_ULIMITS.get(host.gpu_vendor, ()))
    ulimits.update(inv.job.ulimits)
    ulimits.update(host.ulimits)
    caps = list(inv.job.cap_add) + list(host.cap_add)
    if host.infiniband:
        caps.insert(0, "IPC_LOCK")
    security = [*VENDOR_SECURITY.get(host.gpu_vendor, ()), *inv.job.security_opt, *host.security_opt]
    args: list[str] = []
    for name, value in ulimits.items():
        args += ["--ulimit", f"{name}={value}"]
    for cap in dict.fromkeys(caps):
        args += ["--cap-add", cap]
    for opt in dict.fromkeys(security):
        args += ["--security-opt", opt]
    return args


def job_env(
    inv: Inventory, host: Host, spec: JobSpec, units: tuple[int, ...] | None = None
) -> list[tuple[str, str]]:
    """Environment of one node's container, in a stable order (inventory, host, then command line).
    GPUs or slots asked for (--include HOST:i,j, --gpus N) set the node's processes, one per unit,
    unless --nproc says otherwise."""
    asked = units is not None and not spec.nproc_per_node and (bool(spec.units) or spec.gpus is not None)
    env = [
        ("MASTER_ADDR", inv.master.hostname),
        ("MASTER_PORT", str(spec.master_port or inv.job.master_port)),
        ("NNODES", str(len(inv.hosts))),
        ("NODE_RANK", str(host.rank)),
        ("NPROC_PER_NODE", str(len(units)) if asked and units is not None
         else spec.nproc_per_node or inv.job.nproc_per_node),
        # NCCL matches a name as a prefix (eth0 would take eth0.100 too); '=' asks for exactly it.
        # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-socket-ifname
        ("NCCL_SOCKET_IFNAME", "=" + host.interface),
        ("GLOO_SOCKET_IFNAME", host.interface),
        ("FABTRAIN_JOB", spec.job_id),
        ("FABTRAIN_NODE", host.name),
        ("FABTRAIN_OUTPUT", OUTDIR),
        ("FABTRAIN_CODE", CODE_MOUNT),
    ]
    merged = dict(env)
    for key, value in (*inv.job.env, *host.env, *spec.env):
        merged[key] = value
    return list(merged.items())


def docker_run_argv(inv: Inventory, host: Host, spec: JobSpec, access: GpuAccess | None = None,
                    units: tuple[int, ...] | None = None) -> list[str]:
    """`docker run` of one node of a job, detached so the job outlives a lost SSH session. `units`:
    the GPUs (CPU slots) the job holds on the host (claims.py); None: the whole host."""
    console = ("FABTRAIN_CONSOLE", f"{OUTDIR}/{console_name(host.rank)}")  # console_file() on the host
    return ["docker", "run", "--detach",
            *run_options(inv, host, spec, container_name(spec.job_id, host.rank), str(host.rank),
                         [*job_env(inv, host, spec, units), console], access, units=units),
            *image_and_command(inv, host, spec)]


def run_options(inv: Inventory, host: Host, spec: JobSpec, name: str, rank: str,
                env: list[tuple[str, str | None]], access: GpuAccess | None = None,
                runtime: str | None = None, units: tuple[int, ...] | None = None) -> list[str]:
    """The options of one node's `docker run`, shared with the Slurm export (which gives the name,
    rank and some variables at run time: a None value passes the variable on from the caller, and
    its own `runtime` directory, one per attempt)."""
    argv = ["--name", name,
            "--label", f"{LABEL_MANAGED}=1", "--label", f"{LABEL_JOB}={spec.job_id}",
            "--label", f"{LABEL_RANK}={rank}", "--label", f"{LABEL_HOST}={host.name}",
            *(["--label", f"{LABEL_OWNER}={spec.owner}"] if spec.owner else []),
            *(["--label", f"{LABEL_ATTEMPT}={dict(spec.env)['FABTRAIN_ATTEMPT']}"]
              if "FABTRAIN_ATTEMPT" in dict(spec.env) else []),
            # Host networking: NCCL/gloo see the real interfaces, no port mapping, no NAT.
            "--network", "host"]
    # Shared memory for DataLoader workers and NCCL: the host's IPC namespace unless a size is set.
    argv += ["--shm-size", inv.job.shm_size] if inv.job.shm_size else ["--ipc", "host"]
    whole = units is None or host.gpu_vendor == "none" or tuple(units) == tuple(range(host.gpu_count))
    argv += device_args(host, access, None if whole or units is None else tuple(units))
    if spec.cpuset and units is not None and host.gpu_vendor == "none":
        argv += ["--cpuset-cpus", ",".join(map(str, units))]  # a CPU host's slot i is its CPU i
    argv += container_options(inv, host)
    for key, value in env:
        argv += ["--env", key if value is None else f"{key}={value}"]
    argv += ["--volume", f"{code_path(inv, spec)}:{CODE_MOUNT}:ro",
             "--volume", f"{work_dir(inv, spec)}:{WORKDIR}",
             "--volume", f"{inv.job.output_dir}/{spec.job_id}:{OUTDIR}",
             "--volume", f"{runtime or runtime_dir(inv, spec)}:{RUNTIME_MOUNT}:ro"]
    for m in host.mounts:
        argv += ["--volume", f"{m.source}:{m.target}" + (":ro" if m.read_only else "")]
    return argv


def image_and_command(inv: Inventory, host: Host, spec: JobSpec) -> list[str]:
    """The image and what runs in it. The image's own ENTRYPOINT is set aside: python3 runs the
    entrypoint this orchestrator put in the job's runtime directory, so any image with python3 and
    torch runs as it is."""
    return ["--workdir", WORKDIR, "--entrypoint", "python3", spec.image or inv.image_for(host),
            ENTRYPOINT_PATH, *command(spec)]


def command(spec: JobSpec) -> list[str]:
    """The entrypoint's arguments: the script (or -m MODULE) and its arguments."""
    return [*(["-m", spec.script] if spec.module else [spec.script]), *spec.args]


def start_script(inv: Inventory, host: Host, spec: JobSpec, access: GpuAccess | None = None,
                 units: tuple[int, ...] | None = None, timeout: float | None = None) -> str:
    """One node's start, one SSH round trip: make the job's directories, write our entrypoint from
    the command's stdin (ENTRYPOINT_SOURCE; never a command line), start the container. With the
    step's `timeout`, `docker run` is ended on the host before it passes (bounded)."""
    rt = runtime_dir(inv, spec)
    console = console_file(inv, spec, host.rank)
    dirs = [
        "mkdir",
        "-p",
        f"{inv.job.output_dir}/{spec.job_id}",
        console.rsplit("/", 1)[0],
        rt,
        work_dir(inv, spec),
    ]
    run = docker_run_argv(inv, host, spec, access, units)
    # An earlier attempt's console file goes first: the follower must not read it as this one's.
    # (The stop marker stays: `fab stop` between two attempts must end the job; see claims.claim_script.)
    return (f"{shell(dirs)} && {shell(['rm', '-f', console])} && "
            f"(umask 022 && cat > {shell([f'{rt}/entrypoint.py'])}) && "
            + (f"{shell(run)} >/dev/null" if timeout is None else
               f"{shell(bounded(run, timeout))} >/dev/null{timed_out_note(timeout)}"))


# Run in a container of the job (docker exec ... python3 -c STACKS_PY): sends SIGUSR1 to every
# worker that registered the watchdog hook (docker/entrypoint.py), waits up to 3 s for their dumps,
# prints them. Only registered processes are signalled: SIGUSR1 would end any other.
STACKS_PY = """\
import glob, os, signal, time
sizes = {}
for f in sorted(glob.glob("/tmp/fabtrain-stacks/rank-*.txt")):
    try:
        os.kill(int(f.rsplit("-", 1)[1][:-4]), signal.SIGUSR1)
        sizes[f] = os.path.getsize(f)
    except (OSError, ValueError):
        pass
end = time.time() + 3
while time.time() < end and any(os.path.getsize(f) == n for f, n in sizes.items()):
    time.sleep(0.1)
time.sleep(0.3)
for f in sizes:
    print(open(f, errors="replace").read(), end="", flush=True)
"""


def stacks_argv(spec: JobSpec, rank: int) -> list[str]:
    return ["docker", "exec", container_name(spec.job_id, rank), "python3", "-c", STACKS_PY]


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
RM_FILTER = ('/is already in progress|No such container/ {next} /^[0-9a-f]+$/ {print; next} '
             '{print > "/dev/stderr"; bad = 1} END {exit bad}')


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
