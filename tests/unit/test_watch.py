"""The watcher's decisions without a cluster: progress per node, the node's own exit line, blame
(a node whose ranks a broken peer connection brought down is not blamed when the peer failed of
itself; on the local cluster: tests/integration/test_recovery.py's killed worker)."""

import time
from pathlib import Path

import pytest

from orchestrator.backends.ssh import attempt
from orchestrator.backends.ssh.hangs import Progress
from orchestrator.backends.ssh.nodefollow import NodeEnd, brought_down_by_a_peer, worker_failure
from orchestrator.backends.ssh.watch import SETTLE, watch
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec, recovery
from orchestrator.core.policy import Failure
from orchestrator.transport.remote import Result


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_output_counts_until_a_node_shows_steps_then_only_steps_do():
    clock = Clock()
    p = Progress(["n1", "n2"], clock)
    clock.t += 50
    p.observe("n1", b"loading data\n")
    assert p.last["n1"] == 1050 and "n1" not in p.signalled
    p.observe("n1", b"[n1 rank0] epoch 0 | step 7 | loss 2.1 | 9 tok/s | step 100.0 ms\n")
    assert p.step["n1"] == 7 and "n1" in p.signalled
    clock.t += 100
    p.observe("n1", b"still alive, waiting\n" * 50)  # a chatty thread while the ranks are stuck
    p.observe("n1", b"[n1 rank0] epoch 0 | step 7 | loss 2.1\n")  # the same step again is no progress
    assert p.last["n1"] == 1050
    assert p.stale({"n1", "n2"}, 60) == ["n1"]  # alone: it showed progress and stopped


def test_a_whole_job_is_stale_only_when_every_node_is():
    clock = Clock()
    p = Progress(["n1", "n2"], clock)
    clock.t += 30
    p.observe("n1", b"rank 0 ready\n")
    clock.t += 40
    # n2 printed nothing for 70 s but never showed steps: not judged alone (a silent worker is normal).
    assert p.stale({"n1", "n2"}, 60) == []
    clock.t += 30
    assert p.stale({"n1", "n2"}, 60) == ["n1", "n2"]


def dump(pid, *frames, chatter=True):
    """A faulthandler dump of one rank (the hook's header), its main thread innermost first."""
    lines = [f"--- rank 0 (local rank 0, pid {pid}), most recent call first ---"]
    if chatter:  # a logging thread, wherever it is, does not count
        lines += [
            "Thread 0x00007f01 (most recent call first):",
            '  File "/workspace/train.py", line 9 in chatter',
            '  File "/usr/lib/python3.11/threading.py", line 982 in run',
        ]
    lines.append("Current thread 0x00007f00 (most recent call first):")
    lines += [f'  File "{f}", line {n} in {fn}' for f, n, fn in frames]
    lines.append('  File "/workspace/train.py", line 40 in <module>')
    return "\n".join(lines) + "\n"


WAIT = ("/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py", 2800, "all_reduce")


def test_where_the_ranks_are_decides_not_a_chatty_thread():
    clock = Clock()
    p = Progress(["n1", "n2"], clock)
    clock.t += 5
    p.observe("n1", b"rank 0: waiting for data...\n")  # before any look or step: output counts
    assert p.last["n1"] == 1005
    p.stacks("n1", recovery.stack_signature(dump(7, WAIT)))
    p.stacks("n2", recovery.stack_signature(dump(8, ("/workspace/train.py", 30, "<module>"))))
    assert p.last["n1"] == 1005 and {"n1", "n2"} <= p.signalled
    for _ in range(12):  # 60 s: the chatty thread prints, the main threads stay where they are
        clock.t += 5
        p.observe("n1", b"rank 0: waiting for data...\n")
        p.stacks("n1", recovery.stack_signature(dump(7, WAIT, chatter=False)))
        p.stacks("n2", recovery.stack_signature(dump(8, ("/workspace/train.py", 30, "<module>"))))
    assert p.stale({"n1", "n2"}, 10) == ["n1", "n2"]
    # A main thread that moves (a tokenizing loop) is progress, printed or not.
    p.stacks("n2", recovery.stack_signature(dump(8, ("/workspace/tok.py", 12, "encode"))))
    assert p.stale({"n1", "n2"}, 10) == ["n1"]
    # A restarted rank (another pid) has moved; a look that shows no rank says nothing.
    clock.t += 30
    p.stacks("n1", recovery.stack_signature(dump(9, WAIT)))
    p.stacks("n2", recovery.stack_signature("Traceback: docker exec failed\n"))
    assert p.stale({"n1", "n2"}, 10) == ["n2"]


def test_a_stack_signature_is_each_ranks_main_thread():
    two = dump(7, WAIT) + dump(8, ("/workspace/train.py", 30, "<module>")).replace("rank 0", "rank 1")
    sig = recovery.stack_signature(two)
    assert [pid for pid, _ in sig] == ["7", "8"]
    assert sig[0][1][0] == (WAIT[0], "2800", WAIT[2]) and sig[0][1][-1] == (
        "/workspace/train.py",
        "40",
        "<module>",
    )
    assert recovery.stack_signature("") == ()
    # Only the main thread: another thread moving changes nothing.
    assert recovery.stack_signature(dump(7, WAIT)) == recovery.stack_signature(
        dump(7, WAIT).replace("line 9 in chatter", "line 11 in chatter")
    )


def test_a_fresh_heartbeat_is_progress():
    clock = Clock()
    p = Progress(["n1"], clock)
    p.observe("n1", b"Step: 3\n")
    clock.t += 120
    assert p.stale({"n1"}, 60) == ["n1"]
    p.heartbeat("n1", age=4)  # touched 4 s ago (a long evaluation)
    assert p.stale({"n1"}, 60) == []
    assert p.last["n1"] == 1116


def test_generic_step_forms_are_progress():
    clock = Clock()
    p = Progress(["n"], clock)
    for i, line in enumerate([b"step=1 loss=3\n", b"Step: 2/100\n", b"global step 3\n", b"STEP 4\n"]):
        clock.t += 1
        p.observe("n", line)
        assert p.step["n"] == i + 1 and p.last["n"] == clock.t


def test_the_nodes_own_exit_line_is_kept_with_when_it_came():
    clock = Clock()
    p = Progress(["n"], clock)
    p.observe("n", b"done\n[fabtrain] node exit code 0\n")
    assert p.exits["n"] == (0, 1000.0)
    p.observe("n", b"[fabtrain] node exit code 137\n")
    assert p.exits["n"][0] == 137


def test_collective_frames_are_told_from_the_culprit():
    assert recovery.in_collective("all_reduce (distributed_c10d.py:2501) called from hang.py:15")
    assert recovery.in_collective("wrapper (c10d_logger.py:81) called from train.py:9")
    assert not recovery.in_collective("hang.py:14 in <module>")


MODULE_STACKS = """\
--- rank 1 (local rank 1, pid 88), most recent call first ---
Current thread 0x00007f (most recent call first):
  File "/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/workspace/tests/integration/scripts/hang.py", line 15 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""


def test_a_module_started_by_runpy_is_summarised_like_a_script():
    assert recovery.stack_summary(MODULE_STACKS) == [
        "rank 1: all_reduce (distributed_c10d.py:2501) called from tests/integration/scripts/hang.py:15"
    ]


def test_torchrun_root_cause_names_the_worker():
    tail = (
        "Root Cause (first observed failure):\n[0]:\n  time : x\n  rank : 3 (local_rank: 1)\n  exitcode : -9"
    )
    assert worker_failure(tail) == " (worker rank 3 exited with code -9)"
    # The entrypoint's direct launch (a warm job's restart) names it in one line.
    direct = "[fabtrain] worker rank 3 exited with code 3; the node's other workers were stopped\n"
    assert worker_failure(direct) == " (worker rank 3 exited with code 3)"


def test_only_quiet_nodes_are_looked_at():
    clock = Clock()
    p = Progress(["n1", "n2"], clock)
    clock.t += 3
    p.observe("n1", b"[n1 rank0] epoch 0 | step 1 | loss 2.0\n")  # steps: never signalled
    p.observe("n2", b"rank 2: waiting for data...\n")  # output alone is not a move
    assert p.unsure({"n1", "n2"}, 2) == ["n2"]
    p.stacks("n2", recovery.stack_signature(dump(8, WAIT)))  # its ranks moved (a first look)
    assert p.unsure({"n1", "n2"}, 2) == []
    clock.t += 3
    assert p.unsure({"n1", "n2"}, 2) == ["n1", "n2"]


# Tails as the local cluster printed them (a worker of node2 killed mid-step; node1's ranks abort).
RESET = (
    "[rank1]: RuntimeError: Got the following error when running the callback: RuntimeError: "
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[172.28.5.12]:30353: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application.\n"
    "terminate called after throwing an instance of 'gloo::IoException'\n"
    "[fabtrain] worker rank 1 exited with code 134; the node's other workers were stopped\n"
)
KILLED = "[fabtrain] worker rank 2 exited with code 137; the node's other workers were stopped\n"
NCCL = "torch.distributed.DistBackendError: NCCL error: remote process exited or there was a network error\n"
OOM_NEXT_TO_A_RESET = (
    "Connection closed by peer [10.0.0.2]:4000\n[fabtrain] worker rank 0 exited with code 137\n"
)
TORCHRUN = (
    "Connection reset by peer\nRoot Cause (first observed failure):\n  rank      : 3\n  exitcode  : -9\n"
)


def inv(hosts=3):
    text = "ssh: {config: none}\nhosts:\n" + "".join(
        f"  - {{name: node{i + 1}, address: 10.0.0.{i + 1}, interface: eth0}}\n" for i in range(hosts)
    )
    return parse(text, Path("inv.yaml"))


@pytest.mark.parametrize(
    "tail, code, by_a_peer",
    [
        (RESET, 134, True),
        (KILLED, 137, False),
        (NCCL, 1, True),
        (OOM_NEXT_TO_A_RESET, 137, False),  # killed (OOM) whatever its neighbour printed
        (TORCHRUN, 1, False),  # torchrun's agent exits 1; its worker died of SIGKILL
        ("ValueError: bad batch\n", 1, False),
    ],
)
def test_a_node_brought_down_by_a_peer_is_told_from_one_that_failed_of_itself(tail, code, by_a_peer):
    host = inv().hosts[0]
    end = NodeEnd(host, exit_code=code, failure=Failure.EXIT, detail=f"exited with code {code}", tail=tail)
    assert brought_down_by_a_peer(end) is by_a_peer
    assert not brought_down_by_a_peer(NodeEnd(host, failure=Failure.LOST, tail=RESET))


class Ending:
    """Stands in for the SSH session of a watch: each host's follow prints its text after its delay
    and its node ends with its code (read by the finish step)."""

    def __init__(self, nodes: dict[str, tuple[float, str, int]]):
        self.nodes = nodes
        self.started = time.monotonic()

    def stream(self, host, command, feed, timeout=None):
        delay, text, _ = self.nodes[host.name]
        time.sleep(max(0.0, self.started + delay - time.monotonic()))
        feed(text.encode())

    def run(self, host, command, timeout=60, stdin=None, what=""):
        return Result(f"{self.nodes[host.name][2]} warm\n", "", 0, 0.0)

    def alive_since(self, host):
        return None

    def fan_out(self, fn, hosts):
        return {h.name: fn(h) for h in hosts}


def watched(tmp_path, nodes):
    i = inv(len(nodes))
    a = attempt.build(i, jobspec.JobSpec(job_id="j-1", script="x.py"), len(nodes), 29500)
    began = time.monotonic()
    w = watch(Ending(nodes), a, tmp_path, echo=False)
    return w, time.monotonic() - began


def test_the_node_whose_worker_was_killed_is_named_though_its_peer_reported_first(tmp_path):
    w, _ = watched(tmp_path, {"node1": (0.0, RESET, 134), "node2": (0.5, KILLED, 137), "node3": (1.0, "", 0)})
    (blamed,) = w.failures
    assert (blamed.host.name, blamed.failure, blamed.exit_code) == ("node2", Failure.EXIT, 137)
    assert w.ends["node1"].failure is None and w.ends["node1"].by_us


def test_a_failure_of_its_own_is_named_at_once_and_a_peer_that_never_fails_leaves_the_first(tmp_path):
    w, took = watched(tmp_path, {"node1": (0.0, KILLED, 137), "node2": (0.3, RESET, 134)})
    assert [e.host.name for e in w.failures] == ["node1"] and took < SETTLE
    w, took = watched(
        tmp_path, {"node1": (0.0, RESET, 134), "node2": (0.2, RESET, 134), "node3": (3.0, "", 0)}
    )
    assert [e.host.name for e in w.failures] == ["node1"] and w.ends["node2"].failure is None
    assert SETTLE <= took
