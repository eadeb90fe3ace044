"""Pure functions from (inventory, job options) to the exact commands run on each host.

Commands stay argv lists until the very edge, where `shell()` quotes them exactly once with
shlex.join. Nothing here touches the network, so a plan can be printed (dry run) and tested.
"""
from __future__ import annotations

import datetime as _dt
import os
import re
import secrets as _secrets
import shlex
from dataclasses import dataclass, replace

from . import devices, resources
from .errors import UserError
from .codetree import PROJECT_ROOT, rsync_filters
from .inventory import Host, Inventory
from .sshconf import SSH

LABEL_MANAGED = "fabtrain.managed"
LABEL_JOB = "fabtrain.job"
LABEL_RANK = "fabtrain.rank"
LABEL_HOST = "fabtrain.host"
LABEL_OWNER = "fabtrain.owner"    # user@machine that started the job (fab stop ends only its own)
LABEL_ATTEMPT = "fabtrain.attempt"
# Inside the container: the job's working directory (writable, in its outputs: WORK), its code
# (read-only, codetree.py; the entrypoint links its files into the working directory), its outputs,
# and its runtime directory (our entrypoint, and secrets as a file, never an env value on a command
# line), read-only.
WORKDIR = "/workspace"
CODE_MOUNT = "/run/fabtrain-code"
OUTDIR = "/output"
WORK = "work"  # the working directory, in the job's output directory on the host (/output/work)
RUNTIME_MOUNT = "/run/fabtrain"
SECRETS_PATH = f"{RUNTIME_MOUNT}/secrets.env"
CONSOLE_DIR = ".console"  # in the job's output directory: each node's output (console_file)
ENTRYPOINT_PATH = f"{RUNTIME_MOUNT}/entrypoint.py"
ENTRYPOINT_SOURCE = resources.entrypoint()
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# rsync gives up when no data moves for this long (a frozen disk or link), however long the copy.
RSYNC_IO_TIMEOUT = 60


@dataclass(frozen=True)
class JobSpec:
    """What to run: a script in the synced code (or, with module, a Python module in the image or
    the synced code) and its arguments, handed to torchrun verbatim."""

    job_id: str
    script: str
    module: bool = False
    args: tuple[str, ...] = ()
    image: str | None = None
    nproc_per_node: str | None = None
    master_port: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    # The local tree synced to job.code_dir/code_key (codetree.py): this project's trainers by
    # default, or the user's own code.
    code: str = str(PROJECT_ROOT)
    code_only: str = ""  # only this top folder of `code` (the built-in trainers': codetree.BUILTIN_ONLY)
    code_key: str = ""
    # A program's own checkpoints (fab train --checkpoint): a glob relative to the job's output
    # directory (work/... for the working directory); "" for our trainers' snapshots.
    checkpoint: str = ""
    # Sharing hosts (claims.py): GPUs (CPU slots) asked for per host, in --include's syntax
    # ("node1:0,1@node2:2,3"; hosts not named take `gpus` or the default), --gpus N, whether CPU
    # hosts' containers are pinned to their slots' CPUs, and who started the job (user@machine).
    units: str = ""
    gpus: int | None = None
    cpuset: bool = False
    owner: str = ""


def checkpoint_pattern(value: str) -> str:
    """A program's checkpoint path or glob as given (relative to the working directory, or under
    /output) -> JobSpec.checkpoint (relative to the job's output directory). ValueError says what
    is wrong with it."""
    v = value.strip()
    if v.startswith(OUTDIR + "/"):
        rel = v[len(OUTDIR) + 1:]
    elif v.startswith("/"):
        raise ValueError(f"{value!r} is outside the job's folders: give a path relative to the working "
                         f"directory (checkpoints/ckpt.pt) or under {OUTDIR}/")
    else:
        rel = f"{WORK}/{v.removeprefix('./')}"
    if rel.endswith("/"):
        rel += "*"  # a directory: every file in it
    parts = rel.split("/")
    if ".." in parts or "" in parts or "." in parts or any(c < " " or c in "\x7f\\" for c in rel):
        raise ValueError(f"{value!r} is not a plain path (no '..', no empty parts, no control characters "
                         "or backslashes)")
    # The first folder is named, not matched: a glob there would take in fabtrain's own folders
    # (.console, .progress, snapshots) and the temporary folders a checkpoint is placed through.
    if parts[0] in (CONSOLE_DIR, PROGRESS_DIR, "snapshots") or parts[0].startswith(".") \
            or any(c in parts[0] for c in "*?["):
        raise ValueError(f"{value!r} is fabtrain's own folder or a pattern over the whole output folder; "
                         f"name the folder your program writes its checkpoints in ({OUTDIR}/ckpt/*)")
    return rel


def new_job_id(name: str = "job") -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{_secrets.token_hex(2)}"


JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def valid_job_id(job_id: str) -> bool:
    """A job id that is safe as a local directory name (it may come from a remote label)."""
    return bool(JOB_ID_RE.match(job_id)) and ".." not in job_id


def shell(argv: list[str] | tuple[str, ...]) -> str:
    """The one place an argv becomes a remote command string."""
    return shlex.join(argv)


def container_name(job_id: str, rank: int) -> str:
    return f"fabtrain-{job_id}-r{rank}"


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
        return ["sh", "-c", "echo runtimes $(timeout -k 2 8 docker info --format '{{json .Runtimes}}' 2>/dev/null); "
                "echo cdi $(cat /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json "
                "2>/dev/null | grep -c 'nvidia.com/gpu')"]
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


def device_args(host: Host, access: GpuAccess | None = None, gpus: tuple[int, ...] | None = None) -> list[str]:
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


def job_env(inv: Inventory, host: Host, spec: JobSpec, units: tuple[int, ...] | None = None) -> list[tuple[str, str]]:
    """Environment of one node's container, in a stable order (inventory, host, then command line).
    GPUs or slots asked for (--include HOST:i,j, --gpus N) set the node's processes, one per unit,
    unless --nproc says otherwise."""
    asked = units is not None and not spec.nproc_per_node and (bool(spec.units) or spec.gpus is not None)
    env = [
        ("MASTER_ADDR", inv.master.hostname),
        ("MASTER_PORT", str(spec.master_port or inv.job.master_port)),
        ("NNODES", str(len(inv.hosts))),
        ("NODE_RANK", str(host.rank)),
        ("NPROC_PER_NODE", str(len(units)) if asked else spec.nproc_per_node or inv.job.nproc_per_node),
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
    argv += device_args(host, access, None if whole else tuple(units))
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


def code_path(inv: Inventory, spec: JobSpec) -> str:
    """The job's code on each host: job.code_dir/KEY, never changed once filled (codetree.py)."""
    return f"{inv.job.code_dir}/{spec.code_key}"


def work_dir(inv: Inventory, spec: JobSpec) -> str:
    """The job's working directory on each host, in its outputs (fetched at the end)."""
    return f"{inv.job.output_dir}/{spec.job_id}/{WORK}"


def runtime_dir(inv: Inventory, spec: JobSpec) -> str:
    """The job's directory on each host for our entrypoint and the secrets file; removed at the end."""
    return f"{inv.job.output_dir}/.runtime/{spec.job_id}"


def secrets_file(inv: Inventory, spec: JobSpec) -> str:
    return f"{runtime_dir(inv, spec)}/secrets.env"


def stopped_marker(inv: Inventory, job_id: str) -> str:
    """Left by `fab stop` (hostops.mark_stopped) for the job: it was ended on purpose, so a failure
    it causes is not restarted (fab train --restarts). Beside the job's runtime directory, in one
    the group shares (STOPPED_DIR), so another account of the group that stops the job can leave it
    and the job's own account can remove it."""
    return f"{inv.job.output_dir}/.runtime/{STOPPED_DIR}/{job_id}"


# Directories on a host that several Unix accounts of one group share (the admin gives output_dir
# to the group, `chgrp GROUP DIR; chmod 2775 DIR`): the group can write them and what is made in
# them takes their group (setgid). `.claims` and `.claims/HOSTNAME` have no sticky bit: a stale
# claim of an account that left is removed by the next claim of any account (claims.py). `.runtime`
# has one: only a job's own account (or root) renames or removes its runtime directory, which is
# 0711: no one else lists it, reads the secrets file (0600) or writes there, while everyone can
# still stat its lease by name (hostops.survey, the claim script) and a container's non-root user
# can read the entrypoint (0644) through the read-only mount. STOPPED_DIR (in `.runtime`, no
# sticky bit) holds the stop markers any account of the group leaves and removes. Any member can put
# a link where one of these directories or files goes: the scripts refuse a link for a directory
# (not_link_script), change modes only of what they entered or opened and found their own
# (own_dir_chmod, claims.claim_script) and make files new (noclobber). The owner of a directory
# holding others' (output_dir, `.runtime`) can still rename what they hold, the sticky bit
# notwithstanding, so the admin makes those root's (README: install -d -o root -g GROUP -m 3775),
# and the scripts use them as they are.
SHARED_MODE = "g+rwxs"           # only added, by the directory's owner: what it took from others stays taken
RUNTIME_MODE = "0711"
STOPPED_DIR = ".stopped"
NOT_WRITABLE = 6   # exit status: a shared directory this account cannot write (made narrower by another)
NOT_OWN = 7        # ... the job's runtime directory is there and not this account's (or not a directory)


def not_link_script(path: str) -> str:
    """End with NOT_WRITABLE, naming the path and the fix, when the shared directory `path` (a shell
    word) is a symbolic link: any member of the group can put one where a shared directory goes
    (in a directory the group writes), and what this account then did there (chmod, files) would
    land where the link points: its own ~/.ssh, say."""
    return (f"if [ -L {path} ]; then printf '%s is a symbolic link, not a directory: another account may have "
            f"put it there; remove it (rm %s) and run again\\n' {path} {path} >&2; exit {NOT_WRITABLE}; fi; ")


def enter_script(path: str) -> str:
    """`cd` into the shared directory `path` (an absolute path, a shell word), then check that the
    path, no link, still names the directory entered (else NOT_WRITABLE): what follows works in `.`,
    which stays that directory whatever another account renames or links in its place meanwhile."""
    return (f"cd -P {path} && [ ! -L {path} ] && [ {path} -ef . ] || {{ printf '%s changed while this command "
            f"entered it (another account may have put a link there): run again\\n' {path} >&2; "
            f"exit {NOT_WRITABLE}; }}; ")


def own_dir_chmod(path: str, mode: str, then: str = "") -> str:
    """`chmod mode` of the directory `path` (an absolute path, a shell word) only when it is this
    account's own and no link, without a race: a subshell enters it (`cd -P`), checks that the path,
    still no link, names the directory it is in, and changes `.` (then runs `then` there), so a link
    another account swaps in meanwhile is never followed."""
    return f"( cd -P {path} && [ ! -L {path} ] && [ {path} -ef . ] && [ -O . ] && chmod {mode} .{then} )"


def shared_dir_script(path: str, sticky: bool = False, check: bool = True) -> str:
    """Make the directory `path` (an absolute path, a shell word, expanded on the host) if missing,
    refusing a link there (not_link_script); when this account owns it, add the group's rights and
    setgid (and the sticky bit); with `check`, end with NOT_WRITABLE, naming its owner and the fix,
    when this account still cannot write it (one an older version, or another account with a narrow
    umask, made). One root made (the admin's setup, README) is used as it is."""
    mode = SHARED_MODE + (",+t" if sticky else "")
    fix = f"{mode} %s; chgrp GROUP %s"
    return (not_link_script(path) + f"mkdir -p {path} || exit {NOT_WRITABLE}; "
            f"{{ {own_dir_chmod(path, mode)}; }} 2>/dev/null; "
            + (f"[ -w {path} ] || {{ printf '%s is not writable by %s (owner %s): its owner can share it with "
               f"the group: chmod {fix}\\n' {path} \"$(id -un)\" \"$(stat -c %U {path})\" {path} {path} >&2; "
               f"exit {NOT_WRITABLE}; }}; " if check else ""))


def own_runtime_script(inv: Inventory, job_id: str) -> str:
    """Make the job's runtime directory (mode RUNTIME_MODE) in the shared `.runtime`, or end with
    NOT_OWN when it is there and not this account's own directory (another account made it first,
    or put a link there), then touch the job's lease (in the directory entered: own_dir_chmod)."""
    rt, own = shell([f"{inv.job.output_dir}/.runtime"]), shell([f"{inv.job.output_dir}/.runtime/{job_id}"])
    return (shared_dir_script(rt, sticky=True) + f"mkdir -m {RUNTIME_MODE} {own} 2>/dev/null; "
            f"if [ -L {own} ] || [ ! -d {own} ] || [ ! -O {own} ]; then printf '%s is not a directory of %s; "
            f"another account made it: job ids are never reused, so remove it (its owner or root)\\n' {own} "
            f"\"$(id -un)\" >&2; exit {NOT_OWN}; fi; {own_dir_chmod(own, RUNTIME_MODE, f' && touch {LEASE}')}")


def stop_mark_script(inv: Inventory, job_ids: list[str] | tuple[str, ...]) -> str:
    """Leave the stop marker (stopped_marker) of these jobs on the host, in the shared STOPPED_DIR
    (an existing marker, of any account, is kept); made new (noclobber), so a link another account
    put at its name is never written through."""
    d = shell([f"{inv.job.output_dir}/.runtime/{STOPPED_DIR}"])
    marks = "; ".join(f"[ -e {m} ] || ( set -C; : > {m} )" for m in (shell([stopped_marker(inv, j)]) for j in job_ids))
    return (shared_dir_script(shell([f"{inv.job.output_dir}/.runtime"]), sticky=True, check=False)
            + shared_dir_script(d) + f"umask 022; {marks}")


# Not a job: the preflight's cache of image facts (python, torch, CUDA per image id), kept in the
# runtime directory's parent beside the jobs' own directories.
IMAGE_CACHE = "images"
LEASE = "lease"        # in the job's runtime directory: touched while `fab train` looks after the job
LEASE_EVERY = 5.0      # seconds between touches
# A lease younger than this means a `fab train` looks after the job right now (it missed at most
# two touches): `fab stop` ends that job, and a new job on the same hosts is refused. A host lost
# mid-job keeps an older lease, which blocks nobody.
LEASE_LIVE = 3 * LEASE_EVERY
# A runtime directory whose lease is this old, with no container of its job, is left over
# (FABTRAIN_LEASE_STALE: tests wait seconds, not a minute).
LEASE_STALE = float(os.environ.get("FABTRAIN_LEASE_STALE", "60"))


# A command that starts something is ended on the host too when fab stops waiting for it: sshd
# does not end a command whose channel closes (no pty), so a `docker run` that returned after its
# deadline would leave a container running, untracked, on GPUs the job has released. GNU timeout
# (coreutils, on every host) sends SIGTERM to the command's process group a margin before fab's
# deadline, SIGKILL a few seconds later, and exits TIMED_OUT; the teardown and the job's finish
# then remove by label whatever the engine made of a request cut short.
HOST_MARGIN = 10.0    # seconds before fab's deadline that the host's SIGTERM comes (at most)
KILL_AFTER = 5.0      # seconds from that SIGTERM to the SIGKILL (at most)
TIMED_OUT = (124, 137)  # timeout's exit status: SIGTERM sent, or SIGKILL needed


def host_deadline(timeout: float) -> tuple[float, float]:
    """(seconds to the host's SIGTERM, seconds more to its SIGKILL) for a command fab waits `timeout`
    s for: both before fab gives up (half of a short deadline is kept as the margin)."""
    margin = min(HOST_MARGIN, timeout / 2)
    return timeout - margin, min(KILL_AFTER, margin / 2)


def bounded(argv: list[str], timeout: float) -> list[str]:
    """argv run under GNU timeout on the host, ended there before fab's own `timeout` passes."""
    term, kill = host_deadline(timeout)
    return ["timeout", "-k", f"{kill:g}", f"{term:g}", *argv]


def timed_out_note(timeout: float) -> str:
    """Shell text after a bounded command: when timeout ended it, say so on stderr (fab quotes it),
    keeping the exit status."""
    term, _ = host_deadline(timeout)
    why = f"not done within {term:g}s: ended on the host (timeout); check its Docker engine and disks"
    return (f" || {{ rc=$?; case $rc in {'|'.join(map(str, TIMED_OUT))}) echo {shell([why])} >&2;; esac; "
            "exit $rc; }")


def start_script(inv: Inventory, host: Host, spec: JobSpec, access: GpuAccess | None = None,
                 units: tuple[int, ...] | None = None, timeout: float | None = None) -> str:
    """One node's start, one SSH round trip: make the job's directories, write our entrypoint from
    the command's stdin (ENTRYPOINT_SOURCE; never a command line), start the container. With the
    step's `timeout`, `docker run` is ended on the host before it passes (bounded)."""
    rt = runtime_dir(inv, spec)
    console = console_file(inv, spec, host.rank)
    dirs = ["mkdir", "-p", f"{inv.job.output_dir}/{spec.job_id}", console.rsplit("/", 1)[0], rt, work_dir(inv, spec)]
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


def console_name(rank: int) -> str:
    """Node `rank`'s console file, relative to the job's output directory (/output inside)."""
    return f"{CONSOLE_DIR}/node-{rank}.log"


def console_file(inv: Inventory, spec: JobSpec, rank: int) -> str:
    """Where node `rank`'s container writes its output (both streams), on the host. The entrypoint
    sends it there (FABTRAIN_CONSOLE) instead of Docker's log: the follower reads plain bytes
    with `tail`, with no JSON encoding by the engine and decoding by `docker logs` in between
    (BENCHMARKS.md: the log path). The file stays with the job's outputs on the host."""
    return f"{inv.job.output_dir}/{spec.job_id}/{console_name(rank)}"


def follow_logs_script(inv: Inventory, spec: JobSpec, rank: int) -> str:
    """Stream node `rank`'s output from its start until its container exits: `tail -F` on its
    console file (waiting for the file to appear), ended by `--pid` on a `docker wait` for the
    container; tail reads the file to its end before it leaves."""
    name = container_name(spec.job_id, rank)
    return (f"{shell(['docker', 'wait', name])} >/dev/null 2>&1 & "
            f"{shell(['tail', '-c', '+1', '-s', '0.2', '-F'])} --pid=$! {shell([console_file(inv, spec, rank)])} "
            "2>/dev/null; wait")


# The end of a node's output read after it exits, in bytes, not lines: one line can be any size.
TAIL_BYTES = 256 * 1024


def finish_logs_script(inv: Inventory, spec: JobSpec, rank: int) -> str:
    """After following ends: print the container's exit code (255 if it is gone) on the first
    line, then the last TAIL_BYTES bytes of its output: of its console file, or of Docker's log
    when the container ended before the entrypoint made the file (an image without python3).
    `logs.missing_output` finds in this tail anything the follow did not deliver."""
    name, f = container_name(spec.job_id, rank), shell([console_file(inv, spec, rank)])
    return (f"code=$({shell(['docker', 'wait', name])} 2>/dev/null); echo \"${{code:-255}}\"; "
            f"if [ -f {f} ]; then {shell(['tail', '-c', str(TAIL_BYTES)])} {f}; "
            f"elif [ -n \"$code\" ]; then {shell(['docker', 'logs', '--tail', '1000', name])} 2>&1 "
            f"| {shell(['tail', '-c', str(TAIL_BYTES)])}; fi")


def remainder_logs_script(inv: Inventory, spec: JobSpec, rank: int, start: int | str) -> str:
    """All output from byte `start` on, counted from 1 (when the follow missed more than the tail).
    A plan renders it with a placeholder word, replaced by the number when it runs."""
    name, f = container_name(spec.job_id, rank), shell([console_file(inv, spec, rank)])
    rest = shell(['tail', '-c', f'+{start}'])
    return f"if [ -f {f} ]; then {rest} {f}; else {shell(['docker', 'logs', name])} 2>&1 | {rest}; fi"


PROGRESS_DIR = ".progress"  # in the job's output directory: each node's heartbeat file


def heartbeat_name(rank: int) -> str:
    """Node `rank`'s heartbeat file, relative to the job's output directory: the entrypoint gives
    its path to the workers as FABTRAIN_HEARTBEAT; touching it is progress (README: progress)."""
    return f"{PROGRESS_DIR}/node-{rank}"


def progress_script(inv: Inventory, spec: JobSpec, rank: int) -> str:
    """Seconds since node `rank`'s heartbeat file was last touched, by the host's own clock
    ('none' when the job never touched it)."""
    f = shell([f"{inv.job.output_dir}/{spec.job_id}/{heartbeat_name(rank)}"])
    return f'if [ -e {f} ]; then echo $(( $(date +%s) - $(stat -c %Y {f}) )); else echo none; fi'


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
    return ["docker", "ps", "--all", *label_filter(job_id), "--format",
            "{{.Label \"" + LABEL_JOB + "\"}}\t{{.Label \"" + LABEL_RANK + "\"}}\t{{.Names}}\t"
            "{{.State}}\t{{.Status}}\t{{.Label \"" + LABEL_OWNER + "\"}}\t{{.Label \"" + LABEL_ATTEMPT + "\"}}"]


def ssh_argv(host: Host) -> list[str]:
    """The OpenSSH client command rsync uses to reach a host (its target not included): built from
    the same resolved settings as paramiko's connection (remote.connect_kwargs), so both reach the
    same host with the same keys and the same trust."""
    return ssh_options(host.ssh)


def ssh_options(ssh: SSH) -> list[str]:
    # -F none: every setting is here, already resolved from the user's ssh_config (sshconf), so
    # OpenSSH must not apply that file a second time.
    argv = ["ssh", "-F", "none", "-p", str(ssh.port), "-l", ssh.user,
            # Never prompt; a host whose key is unknown or changed is refused, not trusted.
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", "UserKnownHostsFile=" + " ".join(_ssh_escape(k) for k in ssh.known_hosts),
            # The system-wide files too, the same ones paramiko reads (remote.host_trust); none
            # is /dev/null, as ssh would open a file named 'none'.
            "-o", "GlobalKnownHostsFile=" + (" ".join(_ssh_escape(k, False) for k in ssh.global_known_hosts)
                                             or "/dev/null"),
            "-o", f"ConnectTimeout={int(ssh.connect_timeout)}",
            # Notice a dead link during a long transfer instead of hanging.
            "-o", f"ServerAliveInterval={int(ssh.keepalive)}", "-o", "ServerAliveCountMax=3"]
    for key in ssh.keys:
        argv += ["-i", key]
    if ssh.keys_only:
        argv += ["-o", "IdentitiesOnly=yes"]
    if ssh.jump:
        # Each hop is dialled by its own ssh (same checks) through the hops before it; -W carries
        # the stream on. '%' is ssh's token character, so it is doubled in the command.
        *before, last = ssh.jump
        proxy = [*ssh_options(replace(last, jump=tuple(before))), "-W", f"[{ssh.hostname}]:{ssh.port}",
                 last.hostname]
        argv += ["-o", "ProxyCommand=" + shell(proxy).replace("%", "%%")]
    return argv


def _ssh_escape(path: str, tokens: bool = True) -> str:
    """A known_hosts path for ssh's option parser, which splits on spaces and honours quotes and
    backslashes; with `tokens` (UserKnownHostsFile, not GlobalKnownHostsFile) ssh also reads '%' as
    a token, so it is doubled."""
    if tokens:
        path = path.replace("%", "%%")
    if any(c in path for c in ' \t"\\\''):
        path = '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return path


# In every rsync argv, before --rsh: the remote paths (names from hosts among them: snapshots,
# outputs) go to the host's rsync through rsync's protocol, never through the host's shell, so
# no '$(...)', quote or space in one is read by a shell. rsync 3.2.4 and later escape them by
# default, but RSYNC_OLD_ARGS in this machine's environment, or an older rsync here, turns that
# off; an explicit -s wins over both variables (and over RSYNC_PROTECT_ARGS=0) and works back to
# rsync 3.0. A server rsync reads neither variable. ('-s': rsync's most compatible spelling of
# --protect-args, called --secluded-args since 3.2.6.) Preflight's rsync check judges versions.
RSYNC_PROTECT = ("-s",)


def rsync_argv(host: Host, source: str, dest: str, only: str = "") -> list[str]:
    """Mirror the local tree `source` (with `only`, its top folder of that name) to `dest` on the
    host (same path on every host), with codetree's filters."""
    return ["rsync", "--archive", "--compress", "--delete", "--mkpath", f"--timeout={RSYNC_IO_TIMEOUT}",
            *RSYNC_PROTECT, "--rsh", shell(ssh_argv(host)), *rsync_filters(only),
            source.rstrip("/") + "/", rsync_remote(host, dest + "/")]


def rsync_remote(host: Host, path: str) -> str:
    """rsync's HOST:PATH for a remote path (the user comes from ssh's -l). The path reaches the
    host's rsync through rsync's protocol, never its shell (RSYNC_PROTECT in every argv)."""
    address = host.ssh.hostname
    return f"[{address}]:{path}" if ":" in address else f"{address}:{path}"


def fetch_file_argv(host: Host, remote_file: str, dest: str) -> list[str]:
    """Copy one file (a snapshot) from a host; rsync writes a temporary file and renames it."""
    return ["rsync", "--times", f"--timeout={RSYNC_IO_TIMEOUT}", *RSYNC_PROTECT, "--rsh", shell(ssh_argv(host)),
            rsync_remote(host, remote_file), dest]


def push_file_argv(host: Host, source: str, remote_file: str, first: str = "") -> list[str]:
    """Copy one local file (a snapshot) to a host, its directory made if missing; `first`: a shell
    command the host runs before its rsync starts, which ends the copy when it fails."""
    return ["rsync", "--times", "--mkpath", f"--timeout={RSYNC_IO_TIMEOUT}", *RSYNC_PROTECT,
            *(["--rsync-path", f"{first} && rsync"] if first else []),
            "--rsh", shell(ssh_argv(host)), source, rsync_remote(host, remote_file)]


# The job's snapshots, complete (snapshot-NNNNNNNNN.pt) and being written or copied (.snapshot-*):
# the newest complete one is already in runs/JOB/snapshots, copied and verified while the job ran
# (snapshots.py), so the end-of-job fetch leaves them out. Anything else a script writes there is
# still fetched.
SNAPSHOT_EXCLUDES = ("/snapshots/snapshot-[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9].pt",
                     "/snapshots/.snapshot-*")


def fetch_argv(host: Host, remote_dir: str, dest: str) -> list[str]:
    """Copy a job's outputs from a host, safely: a host (or a container writing its outputs) may be
    hostile, so no owners, groups, permissions bits beyond the umask (no setuid), devices or special
    files are kept, and symlinks pointing outside the copied tree are skipped. The nodes' console
    files and the snapshots are left out: both are already on this machine."""
    return ["rsync", "--recursive", "--times", "--links", "--safe-links", f"--timeout={RSYNC_IO_TIMEOUT}",
            f"--exclude=/{CONSOLE_DIR}/",  # the nodes' output: already here, in runs/JOB/HOST.log
            *(f"--exclude={pattern}" for pattern in SNAPSHOT_EXCLUDES),
            *RSYNC_PROTECT, "--rsh", shell(ssh_argv(host)),
            rsync_remote(host, remote_dir.rstrip("/") + "/"), dest]
