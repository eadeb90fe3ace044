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
fabtrain does not rely on an image holding this file: it brings it to each host with the job and
runs it with the image's python3, so a stock image (NGC, ROCm) runs as it is.
"""

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

SECRETS_PATH = "/run/fabtrain/secrets.env"
# The hang watchdog's hook (fab train --hang-timeout): every worker registers faulthandler on
# SIGRTMIN+7 (not SIGUSR1, which programs take for their own: PyTorch Lightning's requeue, Slurm's
# --signal), appending its stacks to STACKS_DIR/rank-RANK-PID.txt, a file in the container's own /tmp
# (never shared between nodes, fresh in every container). faulthandler writes from C, so a worker
# blocked inside a collective still answers; its handler restarts interrupted system calls. The
# watchdog looks this way every few seconds (where the ranks are is how it judges a hang). The
# image's own sitecustomize, if any, still runs.
HOOK_DIR = "/tmp/fabtrain-hook"
STACKS_DIR = "/tmp/fabtrain-stacks"
SITECUSTOMIZE = """\
import os
def _fabtrain_stacks():
    import faulthandler, signal
    # Ignored first: faulthandler restores what it found when the interpreter finalizes, and a look
    # at that moment (or before the file below is registered) must not end the rank.
    signal.signal(signal.SIGRTMIN + 7, signal.SIG_IGN)
    _d = os.environ["FABTRAIN_STACKS"]
    os.makedirs(_d, exist_ok=True)
    stacks = open(os.path.join(_d, "rank-%s-%d.txt" % (os.environ["RANK"], os.getpid())), "a")
    stacks.write("--- rank %s (local rank %s, pid %d), most recent call first ---\\n"
                 % (os.environ["RANK"], os.environ.get("LOCAL_RANK", "?"), os.getpid()))
    stacks.flush()
    faulthandler.register(signal.SIGRTMIN + 7, file=stacks, all_threads=True)
def _fabtrain_flight():
    # torch's flight recorder (TORCH_FR_BUFFER_SIZE, set by the entrypoint), dumped on request: the
    # watchdog touches STACKS_DIR/flight-request and this thread writes the JSON dump to
    # flight-RANK-PID.json. A thread, because a main thread blocked in a collective runs no Python.
    import sys, threading, time
    _d = os.environ["FABTRAIN_STACKS"]
    _req = os.path.join(_d, "flight-request")
    _out = os.path.join(_d, "flight-%s-%d.json" % (os.environ["RANK"], os.getpid()))
    def _loop():
        seen = 0.0
        while True:
            time.sleep(0.5)
            try:
                asked = os.stat(_req).st_mtime
            except OSError:
                continue
            if asked <= seen:
                continue
            seen = asked
            c10d = sys.modules.get("torch._C._distributed_c10d")
            dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
            try:
                data = dump(True, False)
                with open(_out + ".tmp", "wb") as fh:
                    fh.write(data if isinstance(data, bytes) else data.encode())
                os.replace(_out + ".tmp", _out)
            except Exception:
                pass
    threading.Thread(target=_loop, daemon=True, name="fabtrain-flight").start()
def _fabtrain_destroy():
    # A script that ends without destroy_process_group() leaves gloo's threads to the C++ static
    # destructors, which abort now and then ("terminate called without an active exception"),
    # failing a rank whose work was done. Registered first, this runs after the script's own
    # exit handlers.
    import sys
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
def fabtrain_register():
    # For a rank: at its start, or once a standby worker (the entrypoint's) is given its rank.
    import atexit
    atexit.register(_fabtrain_destroy)
    if os.environ.get("FABTRAIN_STACKS"):
        for hook in (_fabtrain_stacks, _fabtrain_flight):
            try:
                hook()
            except Exception:
                pass
def _fabtrain_lines():
    # Unbuffered output (PYTHONUNBUFFERED, which many images set, or python -u) makes print() write
    # its text and its newline apart, so the lines of the ranks that share a node's console
    # interleave (two texts on one line, then two newlines). Each such stream becomes line-buffered:
    # one write per line, still written at once. The descriptor is never closed by it.
    import io, sys
    for name in ("stdout", "stderr"):
        s = getattr(sys, name, None)
        if s is None or not isinstance(getattr(s, "buffer", None), io.FileIO) or s.line_buffering:
            continue
        raw = io.FileIO(s.fileno(), "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw), encoding=s.encoding,
                                            errors=s.errors, line_buffering=True))
try:
    _fabtrain_lines()
except Exception:
    pass
if os.environ.get("RANK") is not None:
    fabtrain_register()
def _fabtrain_chain():
    import importlib.machinery, importlib.util, sys
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if entry and os.path.abspath(entry) != here:
            spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
            if spec is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
                return
_fabtrain_chain()
"""


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


def install_hook(env: dict[str, str]) -> None:
    """Put the watchdog's sitecustomize first on the workers' path (best effort: a read-only /tmp
    only loses the stacks)."""
    try:
        os.makedirs(HOOK_DIR, exist_ok=True)
        with open(os.path.join(HOOK_DIR, "sitecustomize.py"), "w", encoding="utf-8") as fh:
            fh.write(SITECUSTOMIZE)
    except OSError:
        return
    env["PYTHONPATH"] = HOOK_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["FABTRAIN_STACKS"] = STACKS_DIR


# fabtrain_memory.py, beside this file where fabtrain brought it: the API any worker imports to keep
# its training state in memory (save, load), and the keeper that holds those states in this process.
MEMORY_MODULE = "fabtrain_memory.py"


def start_memory(env: dict[str, str]) -> None:
    """Put fabtrain_memory on the workers' path (HOOK_DIR, beside the sitecustomize), so a script can
    import it in any container fabtrain starts; in a warm node, whose supervisor (this process)
    outlives its workers, also start its keeper and tell the workers where it listens
    (FABTRAIN_KEEPER). FABTRAIN_MEMORY_EVERY=0 starts none. Without the file (an image run by hand
    with an older fabtrain), nothing: a script's save() then keeps nothing."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), MEMORY_MODULE)
    if not os.path.isfile(source) or not env.get("PYTHONPATH", "").startswith(HOOK_DIR):
        return
    try:
        tmp = os.path.join(HOOK_DIR, f".{MEMORY_MODULE}.{os.getpid()}")
        with open(source, "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read())
        os.replace(tmp, os.path.join(HOOK_DIR, MEMORY_MODULE))
    except OSError:
        return
    if env.get("FABTRAIN_WARM") != "1" or env.get("FABTRAIN_MEMORY_EVERY", "").strip() == "0":
        return
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location("fabtrain_memory", source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["fabtrain_memory"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        keeper = module.Keeper().start()
    except Exception as exc:  # noqa: BLE001 - a node without its keeper still trains (from disk snapshots)
        print(
            f"[fabtrain] the in-memory state keeper did not start ({exc!r}); restarts resume from disk "
            "snapshots only",
            flush=True,
        )
        return
    env["FABTRAIN_KEEPER"] = keeper.path


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
    master = env.get("MASTER_ADDR", "127.0.0.1")
    if not (env.get("GLOO_SOCKET_IFNAME") and env.get("NCCL_SOCKET_IFNAME")):
        dev = route_interface(master)
        if dev:
            env.setdefault("GLOO_SOCKET_IFNAME", dev)
            env.setdefault("NCCL_SOCKET_IFNAME", "=" + dev)  # exactly this one, not a prefix match
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
    while True:  # a warm node: one generation after another, the container kept between them
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


# A worker of the next generation, started ahead (Ahead, spawn_standbys): it imports torch, and
# torch._dynamo, which every torch.optim optimizer imports when it is made (1-2 s of a restart
# otherwise), then waits on stdin for its rank (launch_direct) and runs the script as torchrun's
# worker would. About 300 MB of memory per worker while it waits (CPU torch).
STANDBY_PY = """\
import json, os, sys
import torch, torch.distributed
try:
    import torch._dynamo
except Exception:
    pass
line = sys.stdin.readline()
if not line.strip():
    sys.exit(0)
go = json.loads(line)
os.environ.update(go["env"])
try:  # named for ps and top, and told from a worker still waiting: fabtrain-rN
    import ctypes
    ctypes.CDLL(None).prctl(15, ("fabtrain-r" + go["env"]["RANK"]).encode()[:15], 0, 0, 0)
except Exception:
    pass
fd = os.open(go["console"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.dup2(fd, 1)
os.dup2(fd, 2)
try:
    import sitecustomize
    sitecustomize.fabtrain_register()
except Exception:
    pass
sys.argv = list(go["argv"])
import runpy
if go["module"]:
    sys.path.insert(0, os.getcwd())
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Worker(subprocess.Popen):
    """A worker started ahead (spawn_standbys). launch_direct marks it with its global rank, which
    wait_group names when it fails."""

    fabtrain_rank: str


def spawn_standbys(env: dict[str, str], nproc: int) -> list[Worker]:
    try:
        return [
            Worker([sys.executable, "-u", "-c", STANDBY_PY], stdin=subprocess.PIPE, env=env)
            for _ in range(nproc)
        ]
    except OSError:
        return []


STANDBY_AHEAD = 5.0  # seconds into a generation before the next one's workers start (FABTRAIN_STANDBY_AHEAD)


class Ahead:
    """The next generation's workers (spawn_standbys), started STANDBY_AHEAD seconds into this one:
    they import torch while it trains rather than while it starts, and a generation that ends
    sooner gets them at its end."""

    def __init__(self, env: dict[str, str], nproc: int) -> None:
        import threading

        self.env, self.nproc, self.taken = env, nproc, False
        self.procs: list[Worker] | None = None
        self.lock = threading.Lock()
        self.timer = threading.Timer(float(env.get("FABTRAIN_STANDBY_AHEAD") or STANDBY_AHEAD), self.spawn)
        self.timer.daemon = True
        self.timer.start()

    def spawn(self) -> None:
        with self.lock:
            if not self.taken:
                self.procs = spawn_standbys(self.env, self.nproc)

    def take(self, wanted: bool) -> list[Worker]:
        """The workers for the next generation, started now if they were not yet; none (any started
        ended) when no generation follows."""
        self.timer.cancel()
        with self.lock:
            self.taken = True
            procs = self.procs
        if not wanted:
            for p in procs or ():
                kill_tree(p.pid)
            return []
        return spawn_standbys(self.env, self.nproc) if procs is None else procs


def worker_env(env: dict[str, str], local_rank: int) -> dict[str, str]:
    """A worker's environment as torchrun gives it, from the node's (NNODES, NODE_RANK, MASTER_*):
    its ranks, and no agent store (rank 0's worker serves the rendezvous: env://)."""
    nnodes, node_rank = int(env.get("NNODES", "1")), int(env.get("NODE_RANK", "0"))
    nproc = int(env["FABTRAIN_NPROC"])
    rank, world = node_rank * nproc + local_rank, nnodes * nproc
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def wait_for_master(env: dict[str, str], poll: float = 0.1) -> None:
    """On every node but rank 0's: wait (FABTRAIN_PG_TIMEOUT at most, default 60 s) until rank 0's
    store answers at MASTER_ADDR:MASTER_PORT before the workers are given their ranks. A worker that
    finds no store there retries after torch's back-off, which grows to 15-20 s between tries: a warm
    node whose master is a spare still starting cold waited that long after the store was up."""
    import time

    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if env.get("NODE_RANK", "0") == "0" or not addr or not port.isdigit():
        return
    deadline = time.monotonic() + float(env.get("FABTRAIN_PG_TIMEOUT") or 60)
    while time.monotonic() < deadline and not TOLD:
        try:
            with socket.create_connection((addr, int(port)), timeout=1.0):
                return
        except OSError:
            time.sleep(poll)


def launch_direct(env: dict[str, str], args: list[str], standbys: list[Worker]) -> list[Worker]:
    """A generation without torchrun (FABTRAIN_LAUNCH=direct, when every node of it is warm): this
    entrypoint gives each standby worker its rank and supervises them itself (run_node), once rank
    0's store answers (wait_for_master)."""
    wait_for_master(env)
    nproc = int(env["FABTRAIN_NPROC"])
    procs = [p for p in standbys if p.poll() is None]
    if len(procs) != nproc:
        for p in procs:
            kill_tree(p.pid)
        procs = spawn_standbys(env, nproc)
    module = args[:1] in (["-m"], ["--module"])
    console = env.get("FABTRAIN_CONSOLE_PATH") or "/dev/stdout"
    for local_rank, p in enumerate(procs):
        wenv = worker_env(env, local_rank)
        go = {"env": wenv, "console": console, "argv": args[1:] if module else args, "module": module}
        p.fabtrain_rank = wenv["RANK"]
        assert p.stdin is not None  # spawn_standbys opens every worker with stdin=PIPE
        try:
            p.stdin.write((json.dumps(go) + "\n").encode())
            p.stdin.close()
        except OSError:  # it died: the generation fails at once (run_node)
            pass
    return procs


# The node's last line, read by fabtrain from the console file: how its ranks ended, even when the
# host's Docker engine cannot say (a frozen engine never answers `docker wait`).
EXIT_LINE = "[fabtrain] node exit code "


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


def run_node(
    argv: list[str], env: dict[str, str], warm: bool = False, procs: Sequence[subprocess.Popen] | None = None
) -> int:
    """torchrun as a child, the signals a container gets (docker stop's SIGTERM) passed on, and
    its exit written as the node's last line (EXIT_LINE) before leaving with the same code. A warm
    node (FABTRAIN_WARM=1) leaves that line to main, and SIGUSR2 (fabtrain: another node failed)
    ends this generation at once: torchrun and every process under it killed, the container kept.
    LEAVING: it was told to stop (SIGTERM, SIGINT, SIGHUP) and its torchrun ended cleanly."""
    import signal

    procs = procs or [subprocess.Popen(argv, env=env)]

    def forward(signum: int, frame: object) -> None:
        TOLD.append(signum)
        for p in procs:
            p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    def end_generation(signum: int, frame: object) -> None:
        for p in procs:
            kill_tree(p.pid)

    signal.signal(signal.SIGUSR2, end_generation)
    code = procs[0].wait() if len(procs) == 1 else wait_group(procs)
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # between generations there is nothing to end
    if not warm:
        print(f"{EXIT_LINE}{code}", flush=True)
    return LEAVING if warm and TOLD and code == 0 else code


def wait_group(procs: Sequence[subprocess.Popen]) -> int:
    """Workers launched directly, as torchrun's agent would judge them: the first to fail ends the
    others and gives the code; all ending with 0 is 0."""
    import time

    while True:
        codes = [p.poll() for p in procs]
        failed = next(((i, c) for i, c in enumerate(codes) if c is not None and c != 0), None)
        if failed is not None:
            first, bad = failed
            for p in procs:
                kill_tree(p.pid)
            for p in procs:
                p.wait()
            print(
                f"[fabtrain] worker rank {getattr(procs[first], 'fabtrain_rank', first)} exited with code "
                f"{128 - bad if bad < 0 else bad}; the node's other workers were stopped",
                flush=True,
            )
            return bad
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.02)


TOLD: list[int] = []  # the stop signals this node got (a warm node told to stop waits for nothing)
LEAVING = -1000  # run_node's answer for a warm node told to stop whose torchrun ended with 0
WARM_WAIT = 900.0  # seconds a warm node waits for its next generation (FABTRAIN_WARM_WAIT)
SPARE = -1001  # a hot spare's "generation": none ran, it waits for its first rank (FABTRAIN_SPARE)


def listen_for_stop() -> None:
    """A hot spare runs no torchrun to pass signals to: a stop signal only ends its wait (TOLD)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: TOLD.append(signum))


def kill_tree(root: int) -> None:
    """SIGKILL `root` and every process below it (torchrun's workers run in sessions of their own,
    so a process group would miss them), children first found, all killed."""
    import signal

    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    todo, tree = [root], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def warm_paths(env: dict[str, str]) -> tuple[str, str]:
    """(the go file fabtrain writes for this node's next generation, in the runtime mount beside
    this file; the end file this node writes when a generation ends, beside its console file)."""
    rank = "spare" if env.get("FABTRAIN_SPARE") == "1" else env.get("NODE_RANK", "0")
    console = env.get("FABTRAIN_CONSOLE_PATH") or os.path.join(env.get("FABTRAIN_OUTPUT", "/tmp"), "node.log")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"warm-{rank}.env"), console + ".end"


def wait_warm(env: dict[str, str], code: int) -> dict[str, str] | None:
    """A warm node's generation ended with `code`: say so (the end file, which ends fabtrain's
    follow of this generation), then wait for fabtrain's go, the next generation's variables
    (KEY=VALUE lines, FABTRAIN_ATTEMPT greater than this one's). None after FABTRAIN_WARM_WAIT
    seconds without one: the container ends."""
    import time

    go, end = warm_paths(env)
    if code != SPARE:
        print(
            f"[fabtrain] generation {env.get('FABTRAIN_ATTEMPT', '?')} ended with code {code}; this "
            "container stays for the next one",
            flush=True,
        )
    try:
        with open(end + ".tmp", "w", encoding="ascii") as fh:
            fh.write(f"{code}\n")
        os.replace(end + ".tmp", end)
    except OSError as exc:
        print(f"[fabtrain] cannot write {end} ({exc}); leaving", flush=True)
        return None
    current = int(env.get("FABTRAIN_ATTEMPT") or 0)
    # A hot spare waits as long as the job may need it: the job's end (or fab stop) removes it.
    wait = float("inf") if code == SPARE else float(env.get("FABTRAIN_WARM_WAIT") or WARM_WAIT)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not TOLD:
        try:
            with open(go, encoding="utf-8") as fh:
                values = dict(line.split("=", 1) for line in fh.read().splitlines() if "=" in line)
            if int(values.get("FABTRAIN_ATTEMPT", "0")) > current:
                return values
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return None


if __name__ == "__main__":
    main()
