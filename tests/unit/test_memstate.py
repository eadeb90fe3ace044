"""fabtrain_memory (docker/fabtrain_memory.py) in one process: a state's bytes round-trip exactly,
the keeper holds the newest states per rank and forgets a timeline the job went back from, the
ranks agree on the newest step every rank holds (and where each rank's state comes from), K is the
smallest that keeps the copy within 3% of a step, and without a keeper nothing is kept. The real
thing, warm nodes on loopback: tests/trainers/test_memory_warm.py."""

import importlib.util
import mmap
import os
import random
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fm(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "docker"))  # the modules it imports, beside it
    spec = importlib.util.spec_from_file_location("fabtrain_memory", ROOT / "docker" / "fabtrain_memory.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fabtrain_memory", module)
    spec.loader.exec_module(module)
    for key in ("FABTRAIN_KEEPER", "FABTRAIN_MEMORY_EVERY", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    return module


@pytest.fixture
def keeper(fm):
    k = fm.Keeper().start()
    yield k
    k.close()


def round_trip(fm, state):
    fd, size = fm.encode(state)
    try:
        with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mm:
            return fm.decode(mm)
    finally:
        os.close(fd)


def test_a_state_round_trips_bit_for_bit(fm):
    weight = torch.randn(5, 7)
    state = {
        "model": {
            "w": weight,
            "tied": weight,
            "t": weight.t(),
            "half": torch.randn(3).bfloat16(),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 4),
            "mask": torch.rand(4) > 0.5,
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(7.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "rng": torch.get_rng_state(),
        "python": random.getstate(),
        "epoch": 3,
        "dtype": torch.float16,
        "shape": torch.Size([2, 3]),
        "name": "run",
        "none": None,
    }
    got = round_trip(fm, state)
    for k, v in state["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k
    assert got["model"]["t"].is_contiguous() and torch.equal(got["rng"], state["rng"])
    assert got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert got["python"] == state["python"] and got["epoch"] == 3 and got["dtype"] is torch.float16
    assert got["shape"] == torch.Size([2, 3]) and got["name"] == "run" and got["none"] is None
    weight.add_(1)  # the copy is the state at the save, not a view of the live tensor
    assert not torch.equal(got["model"]["w"], weight)


def test_save_refuses_at_once_what_load_could_not_take(fm):
    class Schedule:
        pass

    with pytest.raises(TypeError, match="keep to tensors and plain Python values"):
        fm.encode({"scheduler": Schedule()})


def put(fm, keeper, rank, step, world=2, payload=b"x"):
    fd = os.memfd_create("test")
    os.write(fd, payload)
    ino = os.fstat(fd).st_ino
    client = fm.KeeperClient(keeper.path)
    try:
        reply, _ = client.call(
            {"op": "put", "rank": rank, "step": step, "world": world, "size": len(payload)}, fd
        )
    finally:
        os.close(fd)
        client.close()
    assert reply["ok"] and ino in reply["inos"]  # the memfds held for that rank


def held(fm, keeper):
    client = fm.KeeperClient(keeper.path)
    try:
        return sorted((r, s, w) for r, s, w, _size, _sha in client.held())
    finally:
        client.close()


def test_the_keeper_holds_the_newest_two_per_rank_and_forgets_a_timeline_gone_back(fm, keeper):
    for step in (1, 2, 3):
        put(fm, keeper, 0, step, payload=f"state {step}".encode())
    put(fm, keeper, 1, 3)
    assert held(fm, keeper) == [(0, 2, 2), (0, 3, 2), (1, 3, 2)]
    client = fm.KeeperClient(keeper.path)
    reply, fd = client.call({"op": "get", "rank": 0, "step": 3})
    assert os.pread(fd, reply["size"], 0) == b"state 3"
    os.close(fd)
    assert client.call({"op": "get", "rank": 0, "step": 1}) == ({"ok": False, "error": "not held"}, None)
    put(fm, keeper, 0, 2, payload=b"again")  # the job went back to step 1: its old step 2 and 3 are gone
    assert held(fm, keeper) == [(0, 2, 2), (1, 3, 2)]
    reply, fd = client.call({"op": "get", "rank": 0, "step": 2})
    assert os.pread(fd, reply["size"], 0) == b"again"
    os.close(fd)
    put(fm, keeper, 2, 5, world=3)
    client.call({"op": "trim", "above": 2, "world": 2})  # a resume from step 2, in a world of 2
    assert held(fm, keeper) == [(0, 2, 2)]
    client.close()


def row(rank, step, world=2, sha=None):
    return [rank, step, world, 10, sha]


@pytest.mark.parametrize(
    "reports,step,newest,source",
    [
        # Each rank's own keeper holds steps 3 and 4: step 4, each from its own.
        ([[row(0, 3), row(0, 4)], [row(1, 3), row(1, 4)]], 4, 4, {0: 0, 1: 1}),
        # Rank 1 got as far as step 5, rank 0 not: step 4, one step lost.
        ([[row(0, 3), row(0, 4)], [row(1, 4), row(1, 5)]], 4, 5, {0: 0, 1: 1}),
        # Rank 1's host was replaced (its keeper empty): its replica on rank 0's keeper.
        ([[row(0, 4), row(0, 5), row(1, 4), row(1, 5)], []], 5, 5, {0: 0, 1: 0}),
        # A state of another world (the job shrank) is of no use; no step common to every rank: none.
        ([[row(0, 4), row(1, 9, world=3)], [row(1, 3)]], None, 4, {}),
        ([[], []], None, None, {}),
    ],
)
def test_the_ranks_agree_on_the_newest_step_every_rank_holds(fm, reports, step, newest, source):
    got = fm.agree(reports, 2)
    assert (got.step, got.newest, got.source) == (step, newest, source)


def test_a_replica_carries_the_digest_its_origin_computed(fm):
    got = fm.agree([[row(0, 4, sha="a" * 32), row(1, 4, sha="b" * 32)], [row(1, 4, sha=None)]], 2)
    assert got.source == {0: 0, 1: 1} and got.digest == {0: "a" * 32, 1: "b" * 32}


@pytest.mark.parametrize(
    "overhead,k", [(-0.05, 1), (0.0, 1), (0.01, 1), (0.03, 1), (0.031, 2), (0.10, 4), (0.5, 17), (50.0, 100)]
)
def test_k_is_the_smallest_that_keeps_the_overhead_within_3_percent_of_a_step(fm, overhead, k):
    assert fm.choose_every(overhead) == k


def test_the_probe_alternates_blocks_and_compares_their_median_steps(fm):
    keeps = [fm.probe_keeps(i) for i in range(fm.PROBE_STEPS)]
    assert keeps[: fm.SETTLE] == [True] * fm.SETTLE
    blocks = [keeps[i : i + fm.BLOCK] for i in range(fm.SETTLE, fm.PROBE_STEPS, fm.BLOCK)]
    assert blocks == [[False] * fm.BLOCK, [True] * fm.BLOCK] * fm.PAIRS
    # Steps of 100 ms, 110 ms where a state is kept; the first of each block (here 1 s: the other
    # block's work ending in it) and the settling steps are not counted.
    steps = [
        1.0 if i < fm.SETTLE or (i - fm.SETTLE) % fm.BLOCK == 0 else 0.110 if keeps[i] else 0.100
        for i in range(fm.PROBE_STEPS)
    ]
    began = [sum(steps[:i]) for i in range(fm.PROBE_STEPS + 1)]
    on, off, overhead = fm.probe_overhead(began)
    assert (round(on, 6), round(off, 6), round(overhead, 6)) == (0.11, 0.1, 0.1)
    assert fm.choose_every(overhead) == 4


def test_without_a_keeper_save_keeps_nothing_and_load_returns_none(fm, capsys):
    assert fm.save(1, {"w": torch.ones(1)}) is False
    assert fm.load() is None and fm.every() is None
    assert capsys.readouterr().out == ""


def test_one_rank_keeps_every_kth_step_and_resumes_from_the_newest(fm, keeper, monkeypatch, capsys):
    monkeypatch.setenv("FABTRAIN_KEEPER", keeper.path)
    monkeypatch.setenv("FABTRAIN_MEMORY_EVERY", "2")
    kept = [
        fm.save(step, lambda step=step: {"w": torch.full((3,), float(step)), "step": step})
        for step in range(1, 8)
    ]
    assert kept == [False, True, False, True, False, True, False] and fm.every() == 2
    fm._memory().finish()
    assert [s for _, s, _ in held(fm, keeper)] == [4, 6]
    got = fm.load()
    assert got["step"] == 6 and torch.equal(got["w"], torch.full((3,), 6.0))
    out = capsys.readouterr().out
    assert "kept every 2 steps (FABTRAIN_MEMORY_EVERY=2)" in out
    assert "[fabtrain] resumed from memory at step 6 (the newest every rank holds), 0 steps lost" in out


def test_a_disk_snapshot_as_new_as_memory_wins_an_older_one_does_not(fm, keeper, monkeypatch, capsys):
    monkeypatch.setenv("FABTRAIN_KEEPER", keeper.path)
    monkeypatch.setenv("FABTRAIN_MEMORY_EVERY", "1")
    for step in (5, 6):
        fm.save(step, {"step": step})
    fm._memory().finish()
    assert fm.load(disk_step=6) is None
    assert (
        "[fabtrain] resumed from the disk snapshot at step 6 (memory: every rank holds step 6), 0 steps lost"
    ) in capsys.readouterr().out
    assert fm.load(disk_step=5) == {"step": 6}
    assert "resumed from memory at step 6" in capsys.readouterr().out


def test_the_measured_k_is_stated_once(fm, keeper, monkeypatch, capsys):
    monkeypatch.setenv("FABTRAIN_KEEPER", keeper.path)
    kept = [fm.save(step, {"w": torch.zeros(10)}) for step in range(1, fm.PROBE_STEPS + 2)]
    assert kept[: fm.PROBE_STEPS] == [fm.probe_keeps(i) for i in range(fm.PROBE_STEPS)]
    assert fm.every() >= 1
    out = capsys.readouterr().out
    assert out.count("[fabtrain] memory: each rank's state kept every") == 1, out
    assert re.search(
        r"\(a step took [\d.]+ ms keeping it, [\d.]+ ms not, [+-][\d.]+%; at most 3% allowed", out
    )


def test_the_digest_catches_a_changed_word_bytes_moved_and_a_cut(fm, monkeypatch):
    data = bytearray(os.urandom(8 * 300 + 5))  # 4 blocks and a half, and 5 bytes past the last word
    digest = fm.digest_of(data, len(data))
    assert fm.digest_of(bytearray(data), len(data)) == digest
    flipped = bytearray(data)
    flipped[77] ^= 0x10
    moved = bytearray(data)  # a word of block 0 and one of block 2 change places
    moved[0:8], moved[8 * 130 : 8 * 131] = data[8 * 130 : 8 * 131], data[0:8]
    tail = bytearray(data)
    tail[-1] ^= 1
    got = {fm.digest_of(d, len(data)) for d in (flipped, moved, tail)}
    assert len(got) == 3 and digest not in got
    assert fm.digest_of(data, len(data) - 8) != digest
    state = sys.modules["fabtrain_state"]  # where digest_of reads it
    monkeypatch.setattr(state, "DIGEST_WORDS", 2 * state.DIGEST_BLOCK)  # a large state, taken in passes
    assert fm.digest_of(data, len(data)) == digest


def test_a_rank_writes_its_states_into_the_same_few_memfds_never_into_one_the_keeper_holds(
    fm, keeper, monkeypatch
):
    monkeypatch.setenv("FABTRAIN_KEEPER", keeper.path)
    monkeypatch.setenv("FABTRAIN_MEMORY_EVERY", "1")
    for step in range(1, 9):
        # The structure changes its size (a longer name) and at step 5 a tensor grows: the slot grows too.
        n = 4 if step < 5 else 5000
        fm.save(step, {"w": torch.full((n,), float(step)), "name": "x" * step, "step": step})
        memory = fm._memory()
        memory.finish()
        client = fm.KeeperClient(keeper.path)
        for _rank, held_step, _world, _size, digest in client.held():
            reply, fd = client.call({"op": "get", "rank": 0, "step": held_step})
            with mmap.mmap(fd, reply["size"], access=mmap.ACCESS_COPY) as mm:
                assert fm.digest_of(mm, reply["size"]) == digest
                got = fm.decode(mm)
            os.close(fd)
            assert got["step"] == held_step and torch.equal(
                got["w"], torch.full(got["w"].shape, float(held_step))
            )
        client.close()
    assert len(memory.own) == fm.KEEP + 1
