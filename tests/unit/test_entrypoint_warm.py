"""The entrypoint's generations for real, on this machine (loopback only, gloo on CPU): a warm node
whose first generation (torchrun) fails waits, says so in its end file, starts its next workers
ahead, and runs them itself when told (FABTRAIN_LAUNCH=direct); a SIGTERM while it waits ends it."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.hostcmds import dockerargs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """\
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
print(f"gen {os.environ['FABTRAIN_ATTEMPT']} rank {rank} of {dist.get_world_size()} sum {t.item():g} "
      f"agent store {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}", flush=True)
dist.destroy_process_group()
if os.environ["FABTRAIN_ATTEMPT"] == "1" and rank == 1:
    sys.exit(3)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A hang guard, not a bound on speed: these tests start torch in several processes, and share the
# machine with the suite's other worker and, on a new machine, with both clusters' start (hosts
# made, the trainer image loaded into each): 60 s was passed there.
HANG = 300


def wait_for(path: Path, timeout: float = HANG) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.05)


def start(tmp_path: Path, console: str, **extra: str):
    runtime, out = tmp_path / "runtime", tmp_path / "out"
    runtime.mkdir()
    out.mkdir()
    for name, source in dockerargs.RUNTIME_SOURCES.items():  # what fabtrain brings to the runtime directory
        shutil.copy(source, runtime / name)
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {
        **os.environ,
        "NNODES": "1",
        "NODE_RANK": "0",
        "NPROC_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "FABTRAIN_WARM": "1",
        "FABTRAIN_ATTEMPT": "1",
        "FABTRAIN_OUTPUT": str(out),
        "FABTRAIN_CONSOLE": str(out / ".console" / console),
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "=lo",
        **extra,
    }
    proc = subprocess.Popen(
        [sys.executable, str(runtime / "entrypoint.py"), "script.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, runtime, out / ".console" / console


@pytest.fixture
def node(tmp_path):
    proc, runtime, console = start(tmp_path, "node-0.log")
    yield proc, runtime, console
    proc.kill()
    proc.wait()


@pytest.fixture
def spare(tmp_path):
    proc, runtime, console = start(tmp_path, "spare.log", FABTRAIN_SPARE="1")
    yield proc, runtime, console
    proc.kill()
    proc.wait()


def test_a_warm_node_runs_its_next_generation_with_workers_started_ahead(node):
    proc, runtime, console = node
    end = Path(str(console) + ".end")
    wait_for(end)
    assert end.read_text() == "1\n"  # torchrun's code when a worker failed
    first = console.read_text()
    assert "gen 1 rank 1 of 2 sum 3" in first and "generation 1 ended with code 1" in first
    # fabtrain's warm start: the old console and end file gone, then the go file, written whole.
    console.unlink()
    end.unlink()
    (runtime / "warm-0.env.tmp").write_text(
        f"MASTER_ADDR=127.0.0.1\nMASTER_PORT={free_port()}\nNNODES=1\nNODE_RANK=0\nFABTRAIN_ATTEMPT=2\n"
        "FABTRAIN_LAUNCH=direct\n"
    )
    (runtime / "warm-0.env.tmp").rename(runtime / "warm-0.env")
    assert proc.wait(timeout=HANG) == 0
    second = console.read_text()
    assert "generation=2 (warm: this container was kept; its workers started ahead)" in second
    for rank in (0, 1):  # no torchrun agent: rank 0's worker served the rendezvous
        assert f"gen 2 rank {rank} of 2 sum 3 agent store False" in second
    assert second.rstrip().endswith("[fabtrain] node exit code 0") and not end.exists()


def test_a_warm_node_told_to_stop_while_it_waits_ends_at_once(node):
    proc, _, console = node
    wait_for(Path(str(console) + ".end"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 1
    assert console.read_text().rstrip().endswith("[fabtrain] node exit code 1")


def test_a_hot_spare_waits_then_runs_the_rank_it_is_given_with_workers_started_ahead(spare):
    proc, runtime, console = spare
    end = Path(str(console) + ".end")
    wait_for(end)  # waiting, no generation of its own: its end file is what fabtrain looks for
    assert "hot spare: waiting for a node rank" in console.read_text() and proc.poll() is None
    node0 = console.parent / "node-0.log"
    (runtime / "warm-spare.env.tmp").write_text(
        f"MASTER_ADDR=127.0.0.1\nMASTER_PORT={free_port()}\nNNODES=1\nNODE_RANK=0\nFABTRAIN_ATTEMPT=2\n"
        f"FABTRAIN_LAUNCH=direct\nFABTRAIN_SPARE=0\nFABTRAIN_CONSOLE_PATH={node0}\n"
    )
    (runtime / "warm-spare.env.tmp").rename(runtime / "warm-spare.env")
    assert proc.wait(timeout=HANG) == 0
    ran = node0.read_text()  # the rank's console, not the spare's
    assert (
        "node_rank=0" in ran
        and "generation=2 (hot spare: this container waited for a rank; its workers started ahead)" in ran
    )
    for rank in (0, 1):
        assert f"gen 2 rank {rank} of 2 sum 3 agent store False" in ran
    assert "gen 2" not in console.read_text()


def test_a_hot_spare_told_to_stop_ends_at_once_with_0(spare):
    proc, _, console = spare
    wait_for(Path(str(console) + ".end"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert console.read_text().rstrip().endswith("[fabtrain] node exit code 0")


AHEAD_SCRIPT = """\
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
# One write per line: the workers started ahead run unbuffered (python -u), where print() writes the
# text and its newline apart, so two ranks' lines could interleave in the shared console.
sys.stdout.write(f"gen {os.environ['FABTRAIN_ATTEMPT']} rank {rank} pid {os.getpid()}\\n")
sys.stdout.flush()
if os.environ["FABTRAIN_ATTEMPT"] == "1":
    open(f"started-{rank}", "w").close()
    time.sleep(60 if rank == 0 else 3)  # rank 0 is ended by the others' failure
    sys.exit(3)
dist.destroy_process_group()
"""


def children(pid: int) -> dict[int, str]:
    """pid -> name (comm) of every process whose parent is `pid`."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        except (OSError, ValueError):
            continue
        if int(rest[1]) == pid:
            found[int(entry)] = name
    return found


def test_a_warm_node_launched_directly_starts_its_next_workers_during_the_generation(tmp_path):
    """A warm job's first generation without torchrun: its workers are named by rank; the next
    generation's workers start FABTRAIN_STANDBY_AHEAD seconds in, while it still runs (torch and
    torch._dynamo imported), and those very processes run the next generation. The node ends with
    the failed worker's own code, and the other worker is ended at once."""
    proc, runtime, console = start(
        tmp_path, "node-0.log", FABTRAIN_LAUNCH="direct", FABTRAIN_STANDBY_AHEAD="0.5"
    )
    (tmp_path / "script.py").write_text(AHEAD_SCRIPT)
    try:
        wait_for(tmp_path / "started-1")
        deadline = time.monotonic() + HANG
        while len(kids := children(proc.pid)) < 4:  # 2 workers + 2 waiting for the next generation
            assert time.monotonic() < deadline and proc.poll() is None, kids
            time.sleep(0.05)
        assert sorted(kids.values())[:2] == ["fabtrain-r0", "fabtrain-r1"], kids
        waiting = {pid for pid, name in kids.items() if not name.startswith("fabtrain-r")}
        end = Path(str(console) + ".end")
        wait_for(end)
        assert end.read_text() == "3\n"  # the worker's own code: no torchrun in between
        assert "[fabtrain] worker rank 1 exited with code 3" in console.read_text()
        console.unlink()
        end.unlink()
        (runtime / "warm-0.env").write_text(
            f"MASTER_ADDR=127.0.0.1\nMASTER_PORT={free_port()}\nNNODES=1\nNODE_RANK=0\nFABTRAIN_ATTEMPT=2\n"
            "FABTRAIN_LAUNCH=direct\n"
        )
        assert proc.wait(timeout=HANG) == 0
        ran = {
            int(line.rsplit(" ", 1)[1])
            for line in console.read_text().splitlines()
            if line.startswith("gen 2 rank")
        }
        assert ran == waiting, (ran, waiting)  # the workers started ahead ran generation 2
    finally:
        proc.kill()
        proc.wait()


KEEPER_SCRIPT = """\
import os, stat
import torch, torch.distributed as dist
import fabtrain_memory as memory
dist.init_process_group("gloo")
path = os.environ.get("FABTRAIN_KEEPER")
mode = oct(stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)) if path else None
kept = memory.save(1, {"w": torch.ones(2)})
print(f"rank {dist.get_rank()} keeper {mode} kept {kept} resumed {memory.load() is not None}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("warm", [True, False])
def test_every_worker_can_import_fabtrain_memory_and_a_warm_node_keeps_states(tmp_path, warm):
    """A warm node's supervisor runs the keeper (a socket in a directory only its user can enter);
    a node that is not warm (its container ends with its workers) has none, and save keeps nothing."""
    proc, _, console = start(tmp_path, "node-0.log", **({} if warm else {"FABTRAIN_WARM": "0"}))
    (tmp_path / "script.py").write_text(KEEPER_SCRIPT)
    try:
        assert proc.wait(timeout=HANG) == 0, console.read_text()
        out = console.read_text()
        for rank in (0, 1):
            expect = "keeper 0o700 kept True resumed True" if warm else "keeper None kept False resumed False"
            assert f"rank {rank} {expect}" in out, out
    finally:
        proc.kill()
        proc.wait()


def test_a_node_gives_its_workers_their_ranks_once_rank_0s_store_answers():
    """wait_for_master: rank 0's node waits for nothing; another node returns as soon as a listener
    is at MASTER_ADDR:MASTER_PORT (not after torch's back-off), and gives up at its deadline."""
    import importlib.util
    import threading

    spec = importlib.util.spec_from_file_location(
        "entrypoint_wait", ROOT / "docker" / "fabtrain_generations.py"
    )
    assert spec is not None and spec.loader is not None
    e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e)
    port = free_port()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "NODE_RANK": "1",
        "FABTRAIN_PG_TIMEOUT": "20",
    }
    t0 = time.monotonic()
    e.wait_for_master({**env, "NODE_RANK": "0"})
    assert time.monotonic() - t0 < 5  # not the rendezvous' 20 s
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(1.0)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    t0 = time.monotonic()
    e.wait_for_master(env)
    took = time.monotonic() - t0
    server.close()
    assert 0.9 < took < 5, took
    t0 = time.monotonic()
    e.wait_for_master({**env, "FABTRAIN_PG_TIMEOUT": "1"})  # nobody listens: it gives up at the deadline
    assert 0.9 < time.monotonic() - t0 < 4
