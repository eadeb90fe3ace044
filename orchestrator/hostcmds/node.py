"""The one place a node's container is described: node_spec() turns the inventory, one host and the
job's options into a NodeSpec (core/nodespec.py) that every backend renders: `docker run` here and
in dockerargs, the sbatch script in backends/slurm/script.py and the Kubernetes container in
backends/kubernetes/manifests.py."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import jobspec
from orchestrator.core.jobspec import (
    CODE_MOUNT,
    CONSOLE_DIR,
    ENTRYPOINT_PATH,
    LABEL_ATTEMPT,
    LABEL_HOST,
    LABEL_JOB,
    LABEL_MANAGED,
    LABEL_OWNER,
    LABEL_RANK,
    LABEL_WARM,
    OUTDIR,
    RUNTIME_MOUNT,
    SPARE,
    WORKDIR,
    JobSpec,
    console_name,
    container_name,
)
from orchestrator.core.nodespec import CODE, HOST, OUTPUT, RUNTIME, WORK, Mount, NodeMount, NodeSpec
from orchestrator.hostcmds import touched
from orchestrator.hostcmds.dockerargs import GpuAccess, container_options_of, device_args, docker_run
from orchestrator.hostcmds.hostfiles import code_path, end_rel, job_dir, runtime_dir, warm_go_file, work_dir
from orchestrator.hostcmds.sshargs import bounded, shell, timed_out_note

PROGRAM = "python3"  # runs our entrypoint, whatever the image's own ENTRYPOINT is


def command(spec: JobSpec) -> list[str]:
    """The entrypoint's arguments: the script (or -m MODULE) and its arguments."""
    return [*(["-m", spec.script] if spec.module else [spec.script]), *spec.args]


# A run id W&B takes as it is (https://docs.wandb.ai/models/runs/run-identifiers: letters, digits,
# - and _), kept to 64 characters, well within the length its SDK accepts.
WANDB_RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def wandb_run_id(job_id: str) -> str:
    """The job's W&B run id: the job id itself where W&B takes it as it is, else its W&B-safe
    characters and a hash of the whole id, so two job ids never share a run."""
    if WANDB_RUN_ID_RE.fullmatch(job_id):
        return job_id
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_-]", "-", job_id)[:55] + "-" + digest


def job_env(
    inv: Inventory, host: Host, spec: JobSpec, units: tuple[int, ...] | None = None
) -> list[tuple[str, str]]:
    """Environment of one node's container, in a stable order (inventory, host, then command line).
    GPUs or slots asked for (--include HOST:i,j, --gpus N) set the node's processes, one per unit,
    unless --nproc says otherwise. A W&B run of any script is the job's: grouped under the job id,
    and one run across restarts and --resume (a stable id, resumed when it exists); a value the
    user gives (job.env, a host's env, job.secret_files: the entrypoint reads those last) wins over
    each of these on its own."""
    asked = units is not None and not spec.nproc_per_node and (bool(spec.units) or spec.gpus is not None)
    env = [
        ("MASTER_ADDR", inv.master.hostname),
        ("MASTER_PORT", str(spec.master_port or inv.job.master_port)),
        ("NNODES", str(len(inv.hosts))),
        ("NODE_RANK", str(host.rank)),
        (
            "NPROC_PER_NODE",
            str(len(units)) if asked and units is not None else spec.nproc_per_node or inv.job.nproc_per_node,
        ),
        # NCCL matches a name as a prefix (eth0 would take eth0.100 too); '=' asks for exactly it.
        # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-socket-ifname
        ("NCCL_SOCKET_IFNAME", "=" + host.interface),
        ("GLOO_SOCKET_IFNAME", host.interface),
        ("FABTRAIN_JOB", spec.job_id),
        ("FABTRAIN_NODE", host.name),
        ("FABTRAIN_OUTPUT", OUTDIR),
        ("FABTRAIN_CODE", CODE_MOUNT),
        ("WANDB_RUN_GROUP", spec.job_id),
        ("WANDB_RUN_ID", wandb_run_id(spec.job_id)),
        ("WANDB_RESUME", "allow"),
    ]
    merged = dict(env)
    for key, value in (*inv.job.env, *host.env, *spec.env):
        merged[key] = value
    return list(merged.items())


def node_spec(
    inv: Inventory,
    host: Host,
    spec: JobSpec,
    *,
    name: str | None = None,
    rank: str | None = None,
    env: list[tuple[str, str | None]] | None = None,
    access: GpuAccess | None = None,
    runtime: str | None = None,
    units: tuple[int, ...] | None = None,
) -> NodeSpec:
    """One node of the job on `host`. The Slurm script gives `name`, `rank` and some variables at run
    time (a None value in `env` passes the variable on from the caller) and its own `runtime`
    directory, one per attempt. `units`: the GPUs (CPU slots) the job holds on the host
    (hosts/claims.py); None: all of it."""
    labels = [
        (LABEL_MANAGED, "1"),
        (LABEL_JOB, spec.job_id),
        (LABEL_RANK, str(host.rank) if rank is None else rank),
        (LABEL_HOST, host.name),
    ]
    if spec.owner:
        labels.append((LABEL_OWNER, spec.owner))
    if "FABTRAIN_ATTEMPT" in dict(spec.env):
        labels.append((LABEL_ATTEMPT, dict(spec.env)["FABTRAIN_ATTEMPT"]))
    whole = units is None or host.gpu_vendor == "none" or tuple(units) == tuple(range(host.gpu_count))
    cpuset = None
    if spec.cpuset and units is not None and host.gpu_vendor == "none":
        cpuset = ",".join(map(str, units))  # a CPU host's slot i is its CPU i
    ulimits, caps, security = container_options_of(inv, host)
    mounts = (
        NodeMount(CODE, Mount(code_path(inv, spec), CODE_MOUNT, True)),
        NodeMount(WORK, Mount(work_dir(inv, spec), WORKDIR)),
        NodeMount(OUTPUT, Mount(job_dir(inv, spec), OUTDIR)),
        # The same directory again where it lies in /output, so no container of the job can
        # rename it or put a link in its place (a mount point: EBUSY): hostfiles.work_dir.
        NodeMount(WORK, Mount(work_dir(inv, spec), f"{OUTDIR}/{jobspec.WORK}")),
        NodeMount(RUNTIME, Mount(runtime or runtime_dir(inv, spec), RUNTIME_MOUNT, True)),
        *(NodeMount(HOST, m) for m in host.mounts),
    )
    return NodeSpec(
        name=container_name(spec.job_id, host.rank) if name is None else name,
        labels=tuple(labels),
        image=spec.image or inv.image_for(host),
        program=(PROGRAM, ENTRYPOINT_PATH),
        command=tuple(command(spec)),
        workdir=WORKDIR,
        env=tuple(job_env(inv, host, spec, units) if env is None else env),
        secrets=tuple(secret for secret, _ in inv.job.secret_files),
        mounts=mounts,
        shm_size=inv.job.shm_size or None,
        devices=tuple(device_args(host, access, None if whole or units is None else tuple(units))),
        gpu_vendor=host.gpu_vendor,
        gpu_count=host.gpu_count,
        cpuset=cpuset,
        ulimits=ulimits,
        cap_add=caps,
        security_opt=security,
    )


# What a warm node's next generation is told (its go file); everything else about the node must be
# the same for its container to be kept (warm_key).
WARM_KEYS = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "FABTRAIN_ATTEMPT", "FABTRAIN_LAUNCH")


def warm_key(node: NodeSpec) -> str:
    """What a node's container is, but for what changes between generations and which rank it runs:
    a container whose key differs from the next attempt's (another image, code, GPUs, variables)
    is started cold. A hot spare's key is that of any rank on its host, so it can take one."""
    import hashlib

    env = tuple((k, v) for k, v in node.env if k not in (*WARM_KEYS, "FABTRAIN_CONSOLE", "FABTRAIN_SPARE"))
    labels = tuple((k, v) for k, v in node.labels if k not in (LABEL_ATTEMPT, LABEL_RANK))
    return hashlib.sha256(repr(replace(node, name="", env=env, labels=labels)).encode()).hexdigest()[:16]


def docker_run_argv(
    inv: Inventory,
    host: Host,
    spec: JobSpec,
    access: GpuAccess | None = None,
    units: tuple[int, ...] | None = None,
    warm: bool = False,
    direct: bool = False,
) -> list[str]:
    """`docker run` of one node of a job, detached so the job outlives a lost SSH session; a warm
    node's (FABTRAIN_WARM) labelled with its warm_key."""
    node = node_of(inv, host, spec, access, units, warm, direct)
    return docker_run(node, "--detach", *(["--label", f"{LABEL_WARM}={warm_key(node)}"] if warm else []))


def node_of(
    inv: Inventory,
    host: Host,
    spec: JobSpec,
    access: GpuAccess | None = None,
    units: tuple[int, ...] | None = None,
    warm: bool = False,
    direct: bool = False,
) -> NodeSpec:
    """The node as the SSH backend starts it: its console file, FABTRAIN_WARM when warm, and
    FABTRAIN_LAUNCH=direct when its workers start without torchrun (start_script)."""
    console = ("FABTRAIN_CONSOLE", f"{OUTDIR}/{console_name(host.rank)}")  # console_file() on the host
    env: list[tuple[str, str | None]] = [
        *job_env(inv, host, spec, units),
        console,
        *([("FABTRAIN_WARM", "1")] if warm else []),
        *([("FABTRAIN_LAUNCH", "direct")] if direct else []),
    ]
    return node_spec(inv, host, spec, env=env, access=access, units=units)


def start_script(
    inv: Inventory,
    host: Host,
    spec: JobSpec,
    access: GpuAccess | None = None,
    units: tuple[int, ...] | None = None,
    timeout: float | None = None,
    warm: bool = False,
    direct: bool = False,
    hot: bool = False,
) -> str:
    """One node's start, one SSH round trip: make the job's directories, write our entrypoint and its
    memory module from the command's stdin (dockerargs.runtime_files, a tar; never a command line),
    start the container.
    With the step's `timeout`, `docker run` is ended on the host before it passes (bounded).

    `warm`: when this rank's container is there, running, between generations (its end file) and
    of the same warm_key, it is told to start its next generation instead (the go file, written
    whole, then renamed); else it is removed and the node started cold. `direct`: the attempt's
    workers are launched by the entrypoint itself, without torchrun, on every node alike (a warm
    one's were started ahead, torch imported; a cold one starts its own): a node run by torchrun
    and one without could not share a rendezvous. Else a new torchrun runs in the kept container.
    `hot` (the job keeps hot spares): else, when the job's hot spare waits on this host with the same
    key, it takes this rank: renamed to the rank's container and told the rank, its console and go.
    Whatever fails there, the node is started cold as without a spare."""
    cold = fresh_start(
        inv,
        spec,
        docker_run_argv(inv, host, spec, access, units, warm, direct),
        [console_name(host.rank)],
        timeout,
    )
    if not warm:
        return cold
    name, root = container_name(spec.job_id, host.rank), shell([job_dir(inv, spec)])
    console, end = console_name(host.rank), end_rel(host.rank)
    key = warm_key(node_of(inv, host, spec, access, units, warm, direct))
    values = [f"{k}={v}" for k, v in job_env(inv, host, spec, units) if k in WARM_KEYS]
    values.append(f"FABTRAIN_LAUNCH={'direct' if direct else 'torchrun'}")
    if any("\n" in v for v in values):
        raise ValueError(f"a warm node's variables hold a newline: {values!r}")
    waiting = f'[ "$({waiting_state(name)} 2>/dev/null)" = {shell([key + " true"])} ]'
    kept = (
        f"if {waiting} && {touched.is_file(root, end)}; then {_remove(root, console, end)} && "
        f"{write_go(warm_go_file(inv, spec, host.rank), values)} && echo warm; "
    )
    remove = f"{shell(['docker', 'rm', '--force', name])} >/dev/null 2>&1"
    if hot:
        spare, spare_end = container_name(spec.job_id, SPARE), end_rel(SPARE)
        told = [*values, "FABTRAIN_SPARE=0", f"FABTRAIN_CONSOLE_PATH={OUTDIR}/{console_name(host.rank)}"]
        kept += (
            f'elif [ "$({waiting_state(spare)} 2>/dev/null)" = {shell([key + " true"])} ] && '
            f"{touched.is_file(root, spare_end)} && "
            f"{{ {remove}; {shell(['docker', 'rename', spare, name])}; }}; "
            f"then {_remove(root, console, spare_end)} && "
            f"{write_go(warm_go_file(inv, spec, SPARE), told)} && echo hot; "
        )
    return f"{kept}else {remove}; {cold}; fi"


def fresh_start(inv: Inventory, spec: JobSpec, run: list[str], old: list[str], timeout: float | None) -> str:
    """A container started anew: the job's directories made (the ones a container writes through
    touched.py), the `old` files (an earlier console and end file, relative to the job's directory)
    removed, the mount sources checked, our runtime files unpacked from the command's stdin (a tar:
    -o, owned by the SSH user; the runtime directory is fabtrain's, read-only in containers), then `run`
    (bounded by `timeout`: ended on the host before fabtrain stops waiting)."""
    rt, out = runtime_dir(inv, spec), job_dir(inv, spec)
    root = shell([out])
    # An earlier attempt's console file goes first: the follower must not read it as this one's.
    # (The stop marker stays: `fab stop` between two attempts must end the job; see claims.claim_script.)
    return (
        f"{shell(['mkdir', '-p', out, rt])} && {touched.make_dir(root, jobspec.WORK)} && "
        f"{touched.make_dir(root, CONSOLE_DIR)} && {_remove(root, *old)} && "
        f"{touched.mount_sources_check([out, work_dir(inv, spec)])} && "
        f"(umask 022 && tar -x -o -f - -C {shell([rt])}) && "
        + (
            f"{shell(run)} >/dev/null"
            if timeout is None
            else f"{shell(bounded(run, timeout))} >/dev/null{timed_out_note(timeout)}"
        )
    )


def _remove(root: str, *rels: str) -> str:
    """These files of the job's console directory removed (touched.remove: no link followed)."""
    assert all(r.startswith(CONSOLE_DIR + "/") for r in rels), rels
    return touched.remove(root, CONSOLE_DIR, [r.rpartition("/")[2] for r in rels])


def waiting_state(name: str) -> str:
    """A container's warm key and whether it runs: 'KEY true' for one that can be told to go on."""
    return shell(
        ["docker", "inspect", "-f", '{{index .Config.Labels "' + LABEL_WARM + '"}} {{.State.Running}}', name]
    )


def write_go(go: str, values: list[str]) -> str:
    """A go file written whole (then renamed), world-readable: the container reads it as its user."""
    return (
        f"(umask 022 && printf '%s\\n' {shell(values)} > {shell([go + '.tmp'])} && "
        f"mv -f {shell([go + '.tmp', go])})"
    )


def spare_node(
    inv: Inventory,
    host: Host,
    spec: JobSpec,
    access: GpuAccess | None = None,
    units: tuple[int, ...] | None = None,
) -> NodeSpec:
    """A hot spare on `host`: the node any rank would be there (warm, launched direct), named and
    labelled as the job's spare, with the spare's console; FABTRAIN_SPARE makes it wait for a rank."""
    console = ("FABTRAIN_CONSOLE", f"{OUTDIR}/{console_name(SPARE)}")
    env: list[tuple[str, str | None]] = [
        *job_env(inv, host, spec, units),
        console,
        ("FABTRAIN_WARM", "1"),
        ("FABTRAIN_LAUNCH", "direct"),
        ("FABTRAIN_SPARE", "1"),
    ]
    return node_spec(
        inv,
        host,
        spec,
        name=container_name(spec.job_id, SPARE),
        rank=SPARE,
        env=env,
        access=access,
        units=units,
    )


def spare_script(
    inv: Inventory,
    host: Host,
    spec: JobSpec,
    access: GpuAccess | None = None,
    units: tuple[int, ...] | None = None,
    timeout: float | None = None,
) -> str:
    """Keep the job's hot spare on `host`: when one of the same key waits there (its end file),
    nothing; else (none, another key, ended) it is started again, the entrypoint from stdin."""
    node = spare_node(inv, host, spec, access, units)
    key = warm_key(node)
    name, end = container_name(spec.job_id, SPARE), end_rel(SPARE)
    run = docker_run(node, "--detach", "--label", f"{LABEL_WARM}={key}")
    start = (
        f"{shell(['docker', 'rm', '--force', name])} >/dev/null 2>&1; "
        f"{fresh_start(inv, spec, run, [console_name(SPARE), end], timeout)} && echo started"
    )
    return (
        f'if [ "$({waiting_state(name)} 2>/dev/null)" = {shell([key + " true"])} ] && '
        f"{touched.is_file(shell([job_dir(inv, spec)]), end)}; "
        f"then cat > /dev/null && echo hot; else {start}; fi"
    )


def end_generation_script(inv: Inventory, spec: JobSpec, rank: int, wait: float = 5.0) -> str:
    """End a warm node's generation, its container kept: SIGUSR2 to the entrypoint (which kills
    torchrun and every worker), then up to `wait` seconds for its end file (or its container gone)."""
    name = container_name(spec.job_id, rank)
    until = touched.until(shell([job_dir(inv, spec)]), end_rel(rank), "$w")
    return (
        f"{shell(['docker', 'kill', '--signal', 'USR2', name])} >/dev/null 2>&1; "
        f"{shell(['docker', 'wait', name])} >/dev/null 2>&1 & w=$!; "
        f"{shell(['timeout', str(wait)])} {until}; kill $w 2>/dev/null; true"
    )
