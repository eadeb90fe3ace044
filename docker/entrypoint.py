#!/usr/bin/env python3
"""The one entrypoint of a training image, driven by the environment, whoever launches it.

- This orchestrator sets NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT, and
  FABTRAIN_CONSOLE: the file that receives the node's output (see redirect_output).
- A platform (a Kubernetes PyTorchJob, a Slurm wrapper) sets WORLD_SIZE = number of nodes and
  RANK = this node's rank, with MASTER_ADDR and MASTER_PORT; Kubeflow Trainer's torch runtime (a
  TrainJob) sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_NPROC_PER_NODE.
- A Slurm step with one task per node (srun in a container, e.g. pyxis) gives SLURM_JOB_NUM_NODES
  and SLURM_NODEID; MASTER_ADDR and MASTER_PORT come from its batch script (fab export.slurm).

The arguments are the training script and its arguments (or -m MODULE and its arguments), handed
to torchrun verbatim. So an image launched by hand, by fabtrain or by a platform forms the same job.
fabtrain does not rely on an image holding this file: it brings it to each host with the job, with
the modules beside it (fabtrain_*.py: fabtrain_generations, a node's generations, warm or not;
fabtrain_hook, what every worker finds on its path; fabtrain_memory and the modules it imports), and
runs it with the image's python3, so a stock image (NGC, ROCm) runs as it is.
"""

import os
import socket
import subprocess
import sys
from typing import NoReturn

# The modules beside this file: importable even where Python puts no script's directory on its path
# (python -P, PYTHONSAFEPATH=1 in an image's environment), and where this file is loaded by its path.
MODULES_DIR = os.path.dirname(os.path.abspath(__file__))
if MODULES_DIR not in sys.path:
    sys.path.insert(0, MODULES_DIR)

from fabtrain_generations import (  # noqa: E402
    EXIT_LINE,
    LEAVING,
    SPARE,
    Ahead,
    Worker,
    kill_tree,
    launch_direct,
    listen_for_stop,
    run_node,
    spawn_standbys,
    wait_warm,
)
from fabtrain_hook import install_hook, start_memory  # noqa: E402

SECRETS_PATH = "/run/fabtrain/secrets.env"


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch or no driver: a CPU node
        return 0


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def pick_interface(address: str, route: str, addrs: str) -> str | None:
    """The interface NCCL and gloo must use to reach `address`, from `ip -o route get ADDRESS` and
    `ip -o -4 addr show`. On the master itself the route to its own address is loopback: then the
    interface is the one holding the address, never lo (workers could not reach it)."""
    fields = route.split()
    dev = fields[fields.index("dev") + 1] if "dev" in fields else None
    if dev == "lo" and not address.startswith("127."):
        for line in addrs.splitlines():
            f = line.split()
            if len(f) >= 4 and f[2] == "inet" and f[3].split("/")[0] == address:
                return f[1]
    return dev


def route_interface(address: str) -> str | None:
    try:
        address = socket.gethostbyname(address)  # a platform may give a name (job-master-0)
    except OSError:
        return None
    return pick_interface(
        address, _run(["ip", "-o", "route", "get", address]), _run(["ip", "-o", "-4", "addr", "show"])
    )


def read_secrets(path: str = SECRETS_PATH) -> dict[str, str]:
    """KEY=VALUE lines (values may hold anything but a newline) from a file mounted read-only."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line)


def plan(env: dict[str, str], args: list[str], gpus: int) -> tuple[list[str], dict[str, str], str]:
    """(torchrun argv, the workers' environment, a banner) from the node-level environment."""
    # PET_*: what Kubeflow Trainer's torch runtime gives torchrun (a TrainJob, fab export.k8s).
    nnodes = int(
        env.get("NNODES")
        or env.get("PET_NNODES")
        or env.get("WORLD_SIZE")
        or env.get("SLURM_JOB_NUM_NODES")
        or 1
    )
    node_rank = int(
        env.get("NODE_RANK") or env.get("PET_NODE_RANK") or env.get("RANK") or env.get("SLURM_NODEID") or 0
    )
    master_addr = env.get("MASTER_ADDR") or env.get("PET_MASTER_ADDR") or "127.0.0.1"
    master_port = env.get("MASTER_PORT") or env.get("PET_MASTER_PORT") or "29500"
    nproc = env.get("NPROC_PER_NODE") or env.get("PET_NPROC_PER_NODE") or "auto"
    nproc = str(gpus or 1) if nproc == "auto" else nproc
    child = child_env(env, nproc, node_rank)
    module = args[:1] in (["-m"], ["--module"])
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node_rank",
        str(node_rank),
        "--nproc_per_node",
        nproc,
        "--master_addr",
        master_addr,
        "--master_port",
        master_port,
        *(["--module"] if module else []),
        # Without "--", torchrun's parser takes a script option such as --node for an
        # abbreviation of its own --node-rank and fails.
        "--",
        *(args[1:] if module else args),
    ]
    banner = (
        f"[fabtrain] nodes={nnodes} node_rank={node_rank} master={master_addr}:{master_port} "
        f"gpus_per_node={gpus} procs_per_node={nproc} world_size={nnodes * int(nproc)} "
        f"ifname={child.get('GLOO_SOCKET_IFNAME', 'default')}"
    )
    return argv, child, banner


def child_env(env: dict[str, str], nproc: str, node_rank: int) -> dict[str, str]:
    """The environment of this node's workers (torchrun and those it starts, or this entrypoint's own:
    launch_direct), from the node-level one."""
    child = dict(env)
    child["FABTRAIN_NPROC"] = nproc
    # torchrun gives each worker its own RANK and WORLD_SIZE; node-level values must not leak in.
    child.pop("RANK", None)
    child.pop("WORLD_SIZE", None)
    # Fail a collective waiting on a dead peer in bounded time, not NCCL's 10 or gloo's 30 minutes.
    child.setdefault("FABTRAIN_PG_TIMEOUT", "60")
    child.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # torch's flight recorder: the last collectives of every rank, dumped when the watchdog calls a
    # hang (SITECUSTOMIZE) and by NCCL on its own timeout, into the job's output (.flight/).
    # (Its name since torch 2.5; the older TORCH_NCCL_TRACE_BUFFER_SIZE is not set: every rank of a
    # newer torch warned that it is deprecated, in every first run. An image with an older torch
    # runs without the recorder, unless its job sets that name in job.env.)
    child.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    child.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if env.get("FABTRAIN_OUTPUT"):
        child.setdefault(
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
            os.path.join(env["FABTRAIN_OUTPUT"], ".flight", f"node-{node_rank}-rank-"),
        )
    child.setdefault("OMP_NUM_THREADS", "1")
    return child


def redirect_output(env: dict[str, str], path: str | None = None) -> None:
    """With FABTRAIN_CONSOLE (set by fabtrain), this process and every worker write their output
    (both streams) to that file, which fabtrain follows from the host, instead of to Docker's
    log. `docker logs` then shows where the output went. A warm node's next generation opens the
    file again (`path`): fabtrain removed the last one's before it said go."""
    path = path or env.pop("FABTRAIN_CONSOLE", None)
    if not path:
        return
    env["FABTRAIN_CONSOLE_PATH"] = path
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        print(f"[fabtrain] cannot write {path} ({exc}); the output stays here", flush=True)
        return
    print(
        f"[fabtrain] this container's output goes to {path} (in the job's output directory on the "
        "host; `fab logs` follows it)",
        flush=True,
    )
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1:] in (["-m"], ["--module"]):
        sys.exit("usage: fabtrain-entrypoint SCRIPT [ARGS...] | -m MODULE [ARGS...]  (torchrun-compatible)")
    env = dict(os.environ)
    redirect_output(env)
    env.update(read_secrets())
    install_hook(env)
    start_memory(env)
    socket_interfaces(env)
    gpus = gpu_count() if env.get("NPROC_PER_NODE", "auto") == "auto" else 0
    argv, child, banner = plan(env, sys.argv[1:], gpus)
    spare = env.get("FABTRAIN_SPARE") == "1"  # a hot spare: no rank yet, it waits for one
    if not spare:
        heartbeat(child)
    flight_dir(child)
    link_code(env)
    print(
        "[fabtrain] hot spare: waiting for a node rank, its workers started ahead" if spare else banner,
        flush=True,
    )
    direct = env.get("FABTRAIN_LAUNCH") == "direct" and not spare
    procs = launch_direct(child, sys.argv[1:], []) if direct else None
    if env.get("FABTRAIN_WARM") != "1":
        sys.exit(run_node(argv, child, procs=procs))
    run_warm(env, gpus, argv, child, procs, spare)


def socket_interfaces(env: dict[str, str]) -> None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, where they are not both set: the interface that
    reaches MASTER_ADDR (route_interface)."""
    master = env.get("MASTER_ADDR", "127.0.0.1")
    if not (env.get("GLOO_SOCKET_IFNAME") and env.get("NCCL_SOCKET_IFNAME")):
        dev = route_interface(master)
        if dev:
            env.setdefault("GLOO_SOCKET_IFNAME", dev)
            env.setdefault("NCCL_SOCKET_IFNAME", "=" + dev)  # exactly this one, not a prefix match


def run_warm(
    env: dict[str, str],
    gpus: int,
    argv: list[str],
    child: dict[str, str],
    procs: list[Worker] | None,
    spare: bool,
) -> NoReturn:
    """A warm node (FABTRAIN_WARM=1): one generation after another, the container kept between
    them, until one ends with 0, the node is told to stop, or no go comes (wait_warm); then the
    node's last line (EXIT_LINE), and the container ends with its code. `argv`, `child`, `procs`:
    the first generation's (main), or none but a hot spare's (`spare`)."""
    while True:
        if spare:
            listen_for_stop()
            code, spare = SPARE, False
            standbys = spawn_standbys(child, int(child["FABTRAIN_NPROC"]))
        else:
            # The next generation's workers, started while this one trains (Ahead): a restart finds
            # torch imported and waits for nothing but fabtrain's decision.
            ahead = Ahead(child, int(child["FABTRAIN_NPROC"]))
            code = run_node(argv, child, warm=True, procs=procs)
            standbys = ahead.take(wanted=code not in (0, LEAVING))
        go = None if code in (0, LEAVING) else wait_warm(env, code)
        if go is None:
            for p in standbys:
                kill_tree(p.pid)
            final = 0 if code in (LEAVING, SPARE) else code
            print(f"{EXIT_LINE}{final}", flush=True)
            sys.exit(final)
        env.update(go)
        redirect_output(env, env.get("FABTRAIN_CONSOLE_PATH"))
        argv, child, banner = plan(env, sys.argv[1:], gpus)
        heartbeat(child)
        direct = env.get("FABTRAIN_LAUNCH") == "direct"
        kept = (
            "hot spare: this container waited for a rank"
            if code == SPARE
            else "warm: this container was kept"
        )
        print(
            banner
            + f" generation={env['FABTRAIN_ATTEMPT']} ({kept}"
            + ("; its workers started ahead)" if direct else ")"),
            flush=True,
        )
        if direct:
            procs = launch_direct(child, sys.argv[1:], standbys)
        else:
            for p in standbys:
                kill_tree(p.pid)
            procs = None


def link_code(env: dict[str, str]) -> None:
    """FABTRAIN_CODE: the job's code, mounted read-only. The working directory (writable, in the
    job's outputs) gets its directories and a link to each of its files, so the program runs as
    from its own folder and its relative writes (checkpoints/, outputs/) land in the outputs. A link
    into the code left by an earlier attempt whose file is gone (the code changed) is removed; a
    file the program wrote is never touched. Every node of a shared output directory may do this at
    once."""
    code, here = env.get("FABTRAIN_CODE"), os.getcwd()
    if not code or not os.path.isdir(code):
        return
    for dirpath, dirnames, filenames in os.walk(here):
        for name in filenames + dirnames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) and os.readlink(path).startswith(code + "/") and not os.path.exists(path):
                os.unlink(path)
    for dirpath, _dirnames, filenames in os.walk(code):
        rel = os.path.relpath(dirpath, code)
        target_dir = os.path.normpath(os.path.join(here, rel))
        os.makedirs(target_dir, exist_ok=True)
        for name in filenames:
            link = os.path.join(target_dir, name)
            if not os.path.lexists(link):
                try:
                    os.symlink(os.path.join(dirpath, name), link)
                except FileExistsError:  # another node of a shared directory was first
                    pass


def flight_dir(env: dict[str, str]) -> None:
    """The directory NCCL's own dump on timeout writes to (TORCH_NCCL_DEBUG_INFO_TEMP_FILE)."""
    path = env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if path:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError:
            pass


def heartbeat(env: dict[str, str]) -> None:
    """FABTRAIN_HEARTBEAT: a file the workers may touch to show progress during a long silent
    phase (an evaluation, a checkpoint write); fabtrain reads its age before calling a node hung."""
    out = env.get("FABTRAIN_OUTPUT")
    if out and "FABTRAIN_HEARTBEAT" not in env:
        node = env.get("NODE_RANK") or env.get("RANK") or env.get("SLURM_NODEID") or "0"
        env["FABTRAIN_HEARTBEAT"] = os.path.join(out, ".progress", f"node-{node}")
        try:
            os.makedirs(os.path.dirname(env["FABTRAIN_HEARTBEAT"]), exist_ok=True)
        except OSError:
            pass


if __name__ == "__main__":
    main()
