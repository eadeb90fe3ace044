"""The watcher's decisions without a cluster: progress per node, the node's own exit line, blame."""
from orchestrator.backends.ssh.watch import Progress, worker_failure
from orchestrator.core import recovery


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
    p.observe("n1", b"still alive, waiting\n" * 50)   # a chatty thread while the ranks are stuck
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
        "rank 1: all_reduce (distributed_c10d.py:2501) called from tests/integration/scripts/hang.py:15"]


def test_torchrun_root_cause_names_the_worker():
    tail = (
        "Root Cause (first observed failure):\n[0]:\n  time : x\n  rank : 3 (local_rank: 1)\n  exitcode : -9"
    )
    assert worker_failure(tail) == " (worker rank 3 exited with code -9)"
