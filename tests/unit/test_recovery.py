"""Recovery helpers: reading stacks and the flight recorder, the job record, the trainer's global-batch rule."""

import json
import sys
from pathlib import Path

import pytest

from orchestrator.config.inventory import parse
from orchestrator.core import jobspec, recovery
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import dockerargs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainers"))


def inv():
    return parse("hosts: [{name: a, address: 10.0.0.1, interface: eth0}]\n", Path("inv.yaml"))


STACKS = """\
--- rank 0 (local rank 0, pid 41), most recent call first ---
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000000 (most recent call first):
  File "/usr/local/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/usr/local/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/workspace/tests/hang.py", line 20 in main
  File "/workspace/tests/hang.py", line 24 in <module>
--- rank 1 (local rank 1, pid 42), most recent call first ---
Current thread 0x00007f0000000002 (most recent call first):
  File "/workspace/tests/hang.py", line 17 in main
  File "/workspace/tests/hang.py", line 24 in <module>
"""


def test_stack_summary_names_each_rank_and_where():
    assert recovery.stack_summary(STACKS) == [
        "rank 0: all_reduce (distributed_c10d.py:2501) called from tests/hang.py:20",
        "rank 1: tests/hang.py:17 in main",
    ]


def test_source_line(tmp_path):
    (tmp_path / "x.py").write_text("a = 1\ntime.sleep(3600)\n")
    assert recovery.source_line(str(tmp_path), "x.py:2") == "time.sleep(3600)"
    assert recovery.source_line(str(tmp_path), "missing.py:2") == ""


def test_job_record_round_trip_keeps_the_spec(tmp_path):
    spec = jobspec.JobSpec(job_id="gpt-1", script="trainers/gpt.py", args=("--lr", "a b"), env=(("K", "v"),))
    rec = recovery.JobRecord.new(spec, inv(), restarts=2, min_nodes=1, hang_timeout=30)
    rec.attempts.append(recovery.Attempt(1, ["a", "b"], 1.0, 2.0, "a exited with code 137"))
    (tmp_path / "gpt-1").mkdir()
    rec.save(tmp_path / "gpt-1")
    back = recovery.JobRecord.load(tmp_path, "gpt-1")
    assert back.spec == spec and back.restarts == 2 and back.attempts[0].outcome.endswith("137")
    back.state = "finished"
    back.save(tmp_path / "gpt-1")
    assert recovery.JobRecord.load(tmp_path, "gpt-1").state == "finished"  # cli.resumed_spec decides
    with pytest.raises(UserError, match="no .*job.json"):
        recovery.JobRecord.load(tmp_path, "gpt-2")
    with pytest.raises(UserError, match="not a job id"):
        recovery.JobRecord.load(tmp_path, "../etc")


def test_newest_complete_snapshot_ignores_partial_files():
    from orchestrator.snapshots import listings as snapshots

    assert (
        snapshots.newest(
            [
                "snapshot-000000020.pt",
                ".snapshot-000000030.pt.7.tmp",
                "snapshot-000000010.pt",
                ".snapshot-000000040.pt.copy.tmp",
                "notes.txt",
            ]
        )
        == "snapshot-000000020.pt"
    )


CASES = [
    # planned: batch, accum, nodes x procs; new world -> batch, accum, exact
    ((16, 2, 2, 2), 4, None),  # same world: unchanged
    ((16, 2, 2, 2), 2, (16, 4, True)),  # 4 -> 2 ranks: accumulate twice as much
    ((16, 1, 3, 2), 4, (12, 2, True)),  # 3 -> 2 nodes: 96 sequences kept exactly (was 128)
    ((16, 1, 4, 2), 6, (7, 3, False)),  # 4 -> 3 nodes: 128 / 6 is no whole number: 126
    ((8, 2, 2, 2), 3, (7, 3, False)),  # 64 / 3 ranks: 21 a rank (7 x 3), 63 with a warning
    ((16, 1, 2, 2), 8, (8, 1, True)),  # more ranks than planned (a larger spare pool): smaller batch
]


@pytest.mark.parametrize("planned,world,want", CASES)
def test_gpt_global_batch_rule(planned, world, want):
    import gpt

    batch, accum, nodes, procs = planned
    tc = gpt.TrainConfig(batch_size=batch, grad_accum=accum)
    got, note = gpt.keep_global_batch(
        tc, world, {"FABTRAIN_TARGET_NODES": str(nodes), "LOCAL_WORLD_SIZE": str(procs)}
    )
    if want is None:
        assert got is tc and note is None
        return
    G = batch * accum * nodes * procs
    assert got.batch_size <= batch  # a micro-batch never grows: memory holds
    assert got.batch_size * got.grad_accum * world == (G if want[2] else round(G / world) * world)
    assert (f"keeps the global batch of {G} sequences" in note) is want[2]
    assert ("WARNING" in note) is (not want[2])
    assert (got.batch_size, got.grad_accum) == want[:2]


def test_resumed_epoch_on_fewer_ranks_skips_exactly_what_was_trained():
    """s steps at 6 ranks, then the rest of the epoch at 4 with the rule: every sequence of the
    epoch is trained on once (DistributedSampler's padding aside), none skipped, none twice."""
    import gpt
    from torch.utils.data import DistributedSampler

    n, seed, epoch = 960, 7, 3
    tc = gpt.TrainConfig(batch_size=16, grad_accum=1)
    seen = []
    steps_done = 4

    def rank_indices(world, rank):
        s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    for r in range(6):
        seen += rank_indices(6, r)[: steps_done * tc.batch_size * tc.grad_accum]
    new, _ = gpt.keep_global_batch(tc, 4, {"FABTRAIN_TARGET_NODES": "3", "LOCAL_WORLD_SIZE": "2"})
    per_step = new.batch_size * new.grad_accum
    steps_per_epoch = (n // 4 // new.batch_size) // new.grad_accum
    for r in range(4):
        seen += rank_indices(4, r)[steps_done * per_step : steps_per_epoch * per_step]
    assert sorted(seen) == list(range(n))


FLIGHT = Path(__file__).parent / "recorded" / "flight-gloo"


def flight_lines(docs: dict[int, dict]) -> str:
    """What the flight step prints for these dumps (dockerargs.FLIGHT_SUMMARY, as in the container)."""
    scope: dict = {}
    exec(dockerargs.FLIGHT_SUMMARY, scope)  # noqa: S102 - our own constant, as the container runs it
    return "".join(json.dumps({"rank": str(r), "pgs": scope["summarize"](d)}) + "\n" for r, d in docs.items())


def test_the_flight_recorder_names_the_rank_missing_from_a_collective():
    # Recorded with torch 2.13 + gloo (README there): rank 1 sleeps while rank 0 waits in all_reduce #5.
    docs = {r: json.loads((FLIGHT / f"rank{r}.json").read_text()) for r in (0, 1)}
    got = recovery.flight_summaries("node1", flight_lines({0: docs[0]})) + recovery.flight_summaries(
        "node2", flight_lines({1: docs[1]})
    )
    assert [(h, r) for h, r, _ in got] == [("node1", 0), ("node2", 1)]
    assert recovery.flight_verdict(got) == [
        (
            "node2",
            "flight recorder: rank 1 on node2 never entered gloo:all_reduce #5 of process group "
            "default_pg, which rank(s) 0 wait in (its newest: gloo:barrier #4)",
        )
    ]


def test_a_collective_every_rank_is_in_blames_no_rank_and_hostile_lines_are_skipped():
    # Constructed from the recorder's schema (not recorded: no GPU here): NCCL ranks all in #9.
    doc = {
        "entries": [
            {
                "pg_id": 0,
                "process_group": ["0", "default_pg"],
                "collective_seq_id": 9,
                "profiling_name": "nccl:all_reduce",
                "state": "started",
            }
        ],
        "pg_status": {"0": {"last_completed_collective": "8"}},
    }
    text = (
        flight_lines({0: doc, 1: doc})
        + "not json\n"
        + '{"rank": "x", "pgs": {}}\n'
        + '{"rank": 5, "pgs": {"0": {"seq": "\\u001b[31mnine"}}}\n'
    )
    got = recovery.flight_summaries("node1", text)
    assert [r for _, r, _ in got] == [0, 1]
    assert recovery.flight_verdict(got) == [
        (
            "",
            "flight recorder: every rank is in nccl:all_reduce #9 of process "
            "group default_pg and none is missing: the collective itself is "
            "stuck (network, device or a rank's GPU)",
        )
    ]
    # A rank with no collective at all in the default group is behind the others in it.
    got = recovery.flight_summaries("node1", flight_lines({0: doc, 1: doc})) + recovery.flight_summaries(
        "node2", flight_lines({3: {"entries": []}})
    )
    assert recovery.flight_verdict(got)[0] == (
        "node2",
        "flight recorder: rank 3 on node2 never entered "
        "nccl:all_reduce #9 of process group default_pg, which rank(s) "
        "0, 1 wait in (its newest: no collective yet)",
    )
    # A finished collective everywhere is no verdict.
    done = dict(doc, pg_status={"0": {"last_completed_collective": "9"}})
    assert recovery.flight_verdict(recovery.flight_summaries("n", flight_lines({0: done, 1: done}))) == []
