"""What fabtrain's entrypoint puts on every worker's path (HOOK_DIR, first on PYTHONPATH): the hang
watchdog's sitecustomize (install_hook), and fabtrain_memory with the modules it imports
(start_memory), whose keeper a warm node runs in the entrypoint's own process.
"""

import os
import sys

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
# What it imports, beside it too: copied to the workers' path before it, so that where it is, they are.
MEMORY_IMPORTS = ("fabtrain_keeper.py", "fabtrain_state.py", "fabtrain_policy.py", "fabtrain_exchange.py")


def start_memory(env: dict[str, str]) -> None:
    """Put fabtrain_memory on the workers' path (HOOK_DIR, beside the sitecustomize), so a script can
    import it in any container fabtrain starts; in a warm node, whose supervisor (this process)
    outlives its workers, also start its keeper and tell the workers where it listens
    (FABTRAIN_KEEPER). FABTRAIN_MEMORY_EVERY=0 starts none. Without the file (an image run by hand
    with an older fabtrain), nothing: a script's save() then keeps nothing."""
    here = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(here, MEMORY_MODULE)
    if not os.path.isfile(source) or not env.get("PYTHONPATH", "").startswith(HOOK_DIR):
        return
    try:
        for name in (*MEMORY_IMPORTS, MEMORY_MODULE):
            tmp = os.path.join(HOOK_DIR, f".{name}.{os.getpid()}")
            with open(os.path.join(here, name), "rb") as src, open(tmp, "wb") as dst:
                dst.write(src.read())
            os.replace(tmp, os.path.join(HOOK_DIR, name))
    except OSError:
        return
    if env.get("FABTRAIN_WARM") != "1" or env.get("FABTRAIN_MEMORY_EVERY", "").strip() == "0":
        return
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location("fabtrain_memory", source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["fabtrain_memory"] = module  # as an import would: a dataclass looks its module up there
        spec.loader.exec_module(module)  # its modules: beside it, on this process's path (entrypoint.py)
        keeper = module.Keeper().start()
    except Exception as exc:  # noqa: BLE001 - a node without its keeper still trains (from disk snapshots)
        print(
            f"[fabtrain] the in-memory state keeper did not start ({exc!r}); restarts resume from disk "
            "snapshots only",
            flush=True,
        )
        return
    env["FABTRAIN_KEEPER"] = keeper.path
