"""The in-memory state for real, on this machine: fabtrain's entrypoint, warm, two "nodes" of two
workers each on loopback (gloo, CPU), running gpt.py. A worker killed at step N: both nodes keep
their containers (here: their entrypoint processes), the next generation resumes from memory at
step N - 1 or later, and the run ends with the same parameters, bit for bit, as one never
interrupted. A node lost whole and replaced by a hot spare (an empty keeper): its ranks take their
states from the replicas the other node holds."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from orchestrator.testbed import loopback

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
# dropout > 0: the RNG state is part of what must be resumed exactly.
CONFIG = "model:\n  dropout: 0.1\n"
ARGS = [
    "--model",
    "tiny",
    "--epochs",
    "1",
    "--max-steps-per-epoch",
    str(STEPS),
    "--log-every",
    "1",
    "--sample-chars",
    "0",
    "--snapshot-every",
    "0",
    "--exact",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.05)


class Node:
    """One entrypoint process: a warm node (its own runtime dir, output and working dir)."""

    def __init__(self, root: Path, name: str, port: int, rank: int | None, **extra: str) -> None:
        self.root, self.name = root / name, name
        self.runtime, self.out = self.root / "runtime", self.root / "out"
        loopback.runtime_dir(self.runtime)
        self.out.mkdir()
        (self.root / "config.yaml").write_text(CONFIG)
        spare = rank is None
        self.console = self.out / ".console" / ("spare.log" if spare else f"node-{rank}.log")
        env = loopback.warm_env(
            0 if rank is None else rank,
            port,
            self.out,
            self.console,
            FABTRAIN_STANDBY_AHEAD="0.5",
            FABTRAIN_PG_TIMEOUT="30",
            **({"FABTRAIN_SPARE": "1"} if spare else {}),
            **extra,
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(self.runtime / "entrypoint.py"),
                str(ROOT / "trainers" / "gpt.py"),
                *ARGS,
                "--config",
                str(self.root / "config.yaml"),
                "--out",
                str(self.out),
            ],
            cwd=self.root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def text(self) -> str:
        return self.console.read_text() if self.console.exists() else ""

    def ended(self) -> bool:
        return Path(str(self.console) + ".end").exists()

    def go(self, port: int, rank: int, attempt: int = 2) -> None:
        """What fabtrain does for a warm node's next generation: its old console and end file
        removed, then the go file written whole."""
        end = Path(str(self.console) + ".end")
        spare = self.console.name == "spare.log"
        if spare:
            self.console = self.console.parent / f"node-{rank}.log"
        else:
            self.console.unlink(missing_ok=True)
        end.unlink(missing_ok=True)
        lines = [
            "MASTER_ADDR=127.0.0.1",
            f"MASTER_PORT={port}",
            "NNODES=2",
            f"NODE_RANK={rank}",
            f"FABTRAIN_ATTEMPT={attempt}",
            "FABTRAIN_LAUNCH=direct",
        ]
        if spare:
            lines += ["FABTRAIN_SPARE=0", f"FABTRAIN_CONSOLE_PATH={self.console}"]
        go = self.runtime / ("warm-spare.env" if spare else f"warm-{rank}.env")
        Path(str(go) + ".tmp").write_text("\n".join(lines) + "\n")
        Path(str(go) + ".tmp").rename(go)

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()


def kill_tree(root: int) -> None:
    sys.path.insert(0, str(ROOT / "docker"))
    import entrypoint

    entrypoint.kill_tree(root)


def worker_pid(node: Node, rank: int) -> int:
    """The pid of the worker running global `rank` (named fabtrain-rRANK by the entrypoint)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if name == f"fabtrain-r{rank}" and int(rest[1]) == node.proc.pid:
            return int(entry)
    raise AssertionError(f"no worker of rank {rank} under {node.name}")


def logged_step(node: Node) -> int:
    steps = [
        int(line.split("| step ")[1].split()[0]) for line in node.text().splitlines() if "| step " in line
    ]
    return max(steps, default=0)


def final_model(node: Node) -> dict:
    snaps = sorted((node.out / "snapshots").glob("snapshot-*.pt"))
    assert snaps, f"{node.name} wrote no snapshot"
    state = torch.load(snaps[-1], weights_only=True)
    assert state["step"] == STEPS
    return state["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The same run, never interrupted."""
    root, port = tmp_path_factory.mktemp("reference"), free_port()
    nodes = [Node(root, f"n{r}", port, r, FABTRAIN_MEMORY_EVERY="1") for r in (0, 1)]
    try:
        for n in nodes:
            assert n.proc.wait(timeout=120) == 0, n.text()[-3000:]
        assert "memory: each rank's state kept every 1 step (FABTRAIN_MEMORY_EVERY=1)" in nodes[0].text()
        return final_model(nodes[0])
    finally:
        for n in nodes:
            n.stop()


def resumed_line(text: str) -> str:
    return next(line for line in text.splitlines() if "[fabtrain] resumed from" in line)


def test_a_killed_worker_resumes_from_memory_and_ends_bit_for_bit(tmp_path, reference):
    port = free_port()
    nodes = [Node(tmp_path, f"n{r}", port, r, FABTRAIN_MEMORY_EVERY="1") for r in (0, 1)]
    try:
        wait_for(lambda: logged_step(nodes[1]) >= 6, "step 6 on node 1")
        killed_at = logged_step(nodes[1])
        os.kill(worker_pid(nodes[1], 3), signal.SIGKILL)
        wait_for(lambda: all(n.ended() for n in nodes), "both nodes' end files")
        port = free_port()
        for r, n in enumerate(nodes):
            n.go(port, r)
        for n in nodes:
            assert n.proc.wait(timeout=120) == 0, n.text()[-3000:]
        line = resumed_line(nodes[0].text())
        step = int(line.split("at step ")[1].split()[0])
        lost = int(line.split("holds), ")[1].split()[0])
        assert step >= killed_at - 1 and lost <= 1, (killed_at, line)
        got = final_model(nodes[0])
        assert [k for k in reference if not torch.equal(reference[k], got[k])] == []
    finally:
        for n in nodes:
            n.stop()


def test_a_node_lost_whole_is_replaced_by_a_hot_spare_that_takes_its_ranks_states_from_replicas(
    tmp_path, reference
):
    """Node 1's container gone (its entrypoint, keeper and workers killed): the hot spare, whose keeper
    holds nothing, becomes node 1; ranks 2 and 3 get their states from node 0's keeper."""
    port = free_port()
    nodes = [Node(tmp_path, f"n{r}", port, r, FABTRAIN_MEMORY_EVERY="1") for r in (0, 1)]
    spare = Node(tmp_path, "spare", port, None, FABTRAIN_MEMORY_EVERY="1")
    try:
        wait_for(lambda: logged_step(nodes[0]) >= 6 and spare.ended(), "step 6, and the spare waiting")
        killed_at = logged_step(nodes[0])
        nodes[1].stop()
        wait_for(nodes[0].ended, "node 0's end file")
        port = free_port()
        nodes[0].go(port, 0)
        spare.go(port, 1)
        for n in (nodes[0], spare):
            assert n.proc.wait(timeout=120) == 0, n.text()[-3000:]
        line = resumed_line(nodes[0].text())
        assert "ranks 2, 3 from their replicas on another host" in line, line
        step = int(line.split("at step ")[1].split()[0])
        assert step >= killed_at - 1, (killed_at, line)
        got = final_model(nodes[0])
        assert [k for k in reference if not torch.equal(reference[k], got[k])] == []
    finally:
        for n in (*nodes, spare):
            n.stop()
