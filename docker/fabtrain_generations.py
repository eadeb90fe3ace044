"""A node's generations, for fabtrain's entrypoint: one run (torchrun as a child, or the workers
launched directly when every node of the generation is warm) supervised to its end, the stop
signals passed on, its code written as the node's last line (run_node); and a warm node's life
between generations: the next generation's workers started ahead (Ahead, spawn_standbys), the wait
for fabtrain's go (wait_warm), a hot spare's wait for its first rank.
"""

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

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


def run_node(
    argv: list[str], env: dict[str, str], warm: bool = False, procs: Sequence[subprocess.Popen] | None = None
) -> int:
    """torchrun as a child, the signals a container gets (docker stop's SIGTERM) passed on, and
    its exit written as the node's last line (EXIT_LINE) before leaving with the same code. A warm
    node (FABTRAIN_WARM=1) leaves that line to the entrypoint's run_warm, and SIGUSR2 (fabtrain:
    another node failed) ends this generation at once: torchrun and every process under it killed,
    the container kept. LEAVING: it was told to stop (SIGTERM, SIGINT, SIGHUP) and its torchrun
    ended cleanly."""
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
    this file and the entrypoint; the end file this node writes when a generation ends, beside its
    console file)."""
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
