"""The live status view: host lines parsed into a board, rendered to fixed text; stragglers named
once; log lines printed above a rich Live display."""

import io

import pytest
from rich.console import Console
from rich.live import Live

from orchestrator.progress.live import Board
from orchestrator.transport.logs import Multiplexer


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def step(node, rank, s, compute, loss=2.5):
    return (
        f"[{node} rank{rank}] epoch 0 | step {s} | loss {loss:.4f} | lr 3.00e-03 | 81,877 tok/s "
        f"| step {compute + 4:.1f} ms | compute {compute:.1f} ms"
    ).encode()


def text(renderable, width=110):
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_board_renders_a_fixed_state():
    clock = Clock()
    board = Board([("node1", 0), ("node2", 1), ("node3", 2)], clock=clock)
    board.observe(
        "node1",
        step("node1", 0, 20, 20.4)
        + b"\n"
        + step("node1", 1, 20, 20.0, 2.4)
        + b"\n[node1 rank0] progress [##########          ]  50.0% epoch 1/2 step 20/40 eta 1s",
    )
    clock.now += 2
    board.observe("node2", step("node2", 2, 10, 21.0))
    clock.now += 40
    board.observe("node3", b"my own script says hello")
    clock.now += 1
    assert [line.rstrip() for line in text(board.render()).splitlines()] == [
        "node1  r0  step 20/40    loss 2.4000  81,877 tok/s  compute 20.4 ms  last output 43s ago",
        "node2  r1  step 10/40    loss 2.5000  81,877 tok/s  compute 21.0 ms  last output 41s ago",
        "node3  r2  no step info                                              last output 1s ago",
    ]


def run_board(compute, seconds, every=2.0, board=None, clock=None):
    """Step lines from node1 (ranks 0, 1) and node2 (ranks 2, 3) every `every` seconds for `seconds`;
    compute(rank, i) is the rank's compute ms in the i-th line. The straggler lines named, by when."""
    clock = clock or Clock()
    board = board or Board([("node1", 0), ("node2", 1)], clock=clock)
    named = []
    for i in range(int(seconds / every)):
        s = 10 * (i + 1)
        for node, ranks in (("node1", (0, 1)), ("node2", (2, 3))):
            board.observe(node, b"\n".join(step(node, r, s, compute(r, i)) for r in ranks))
        named += [(clock.now - 1000, line) for line in board.new_stragglers()]
        clock.now += every
    return board, named


def test_a_rank_twice_as_slow_is_named_once_after_5_of_its_lines():
    board, named = run_board(lambda r, i: 42.0 if r == 2 else 20.0 + r / 10, seconds=60)
    # Slow from its first lines; tested from the 3rd (every rank has 3, at 4 s); the 7th is its 5th
    # slow one in a row.
    assert named == [
        (
            12.0,
            "straggler: node2 rank2 takes 42.0 ms of compute per step, 2.1x the median rank "
            "(more than 50% slower); the job runs at its pace",
        )
    ]
    assert "compute 42.0 ms, straggler 2.1x" in text(board.render())


def test_a_rank_that_logs_rarely_is_named_after_30_seconds():
    """A line every 20 s: tested slow at the 3rd (40 s), still so at the 4th (60 s), named at the
    5th (80 s): 40 s slow, 3 lines."""
    _, named = run_board(lambda r, i: 42.0 if r == 2 else 20.0, seconds=200, every=20.0)
    assert [(t, line.split(" takes")[0]) for t, line in named] == [(80.0, "straggler: node2 rank2")]


def test_a_starved_node_in_a_short_run_is_still_named():
    """The node limited to 0.3 CPU (docs/observability.md, tests/integration/test_skeleton.py): its
    two ranks 4.5x and 3.7x the median rank, a line every 0.7 s, 12 lines in all: both named while
    the run lasts, slowest first."""
    _, named = run_board(lambda r, i: {2: 130.5, 3: 106.8}.get(r, 29.0), seconds=12 * 0.7, every=0.7)
    assert [line for _, line in named] == [
        "straggler: node2 rank2 takes 130.5 ms of compute per step, 4.5x the median rank (more than 50% "
        "slower); the job runs at its pace",
        "straggler: node2 rank3 takes 106.8 ms of compute per step, 3.7x the median rank (more than 50% "
        "slower); the job runs at its pace",
    ]
    assert named[0][0] == pytest.approx(6 * 0.7)  # its 7th line of 12


def test_jitter_of_20_percent_is_never_a_straggler():
    """Ranks on a busy 2-CPU machine: one rank 1.2x (and at times 1.45x) the others for ten minutes."""
    board, named = run_board(lambda r, i: (29.0 if i % 3 == 0 else 24.0) if r == 2 else 20.0, seconds=600)
    assert named == [] and board.stragglers() == []
    assert "straggler" not in text(board.render())


def test_one_slow_step_is_no_straggler():
    """A single slow line (a pause: a snapshot, a page fault storm) among normal ones, then 60 s more:
    the median of the rank's recent lines never moves."""
    board, named = run_board(lambda r, i: 200.0 if (r, i) == (2, 5) else 20.0, seconds=90)
    assert named == [] and board.stragglers() == []


def test_short_slow_spells_are_not_added_up():
    """A rank twice as slow for 3 lines (6 s) in every 15 (30 s), for 2 minutes: 24 slow lines in all,
    but never 5 in a row nor 30 s on end, so never named."""
    board, named = run_board(lambda r, i: 45.0 if r == 2 and i % 15 < 3 else 20.0, seconds=120)
    assert named == [] and board.slow_since == {} and board.named == set()


def test_lines_go_above_the_live_display_whole(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    board = Board([("node1", 0)], clock=Clock())
    mux = Multiplexer(tmp_path, console=console, board=board, colour=False)
    sink = mux.sink("node1", 0)
    with Live(get_renderable=board.render, console=console, auto_refresh=False, transient=True):
        sink.feed(step("node1", 0, 10, 20.0) + b"\nhalf")
        sink.feed(b" a line\n")
        mux.note("straggler: x")
    sink.close()
    shown = out.getvalue()
    assert "node1 r0 | [node1 rank0] epoch 0 | step 10 |" in shown
    assert "node1 r0 | half a line\n" in shown and "[fabtrain] straggler: x\n" in shown
    assert "step 10  loss 2.5000" in shown  # the status line was drawn below
    assert (tmp_path / "node1.log").read_bytes().endswith(b"half a line\n")


def test_hostile_step_lines_are_no_steps_and_never_raise():
    """A line is hostile input: malformed or absurd numbers are no step at all (the follower thread
    that feeds the board must never die on one), and a good line after them still counts."""
    b = Board([("node1", 0)])
    for line in (
        b"[node1 rank0] epoch 1 | step 3 | loss 1.2.3 | lr 0.1 | 1,,2 tok/s\n",
        b"[node1 rank0] epoch 1 | step " + b"9" * 5000 + b" | loss 1.2 | lr 0.1 | 12 tok/s\n",
        b"[node1 rank" + b"7" * 5000 + b"] epoch 1 | step 4 | loss 1.2 | lr 0.1 | 12 tok/s\n",
        b"progress [##  ] 50.0% epoch 1/2 step " + b"9" * 5000 + b"/40\n",
    ):
        b.observe("node1", line)
    assert b.hosts["node1"].step is None and b.ranks("node1") == []
    b.observe(
        "node1",
        b"[node1 rank1] epoch 0 | step 10 | loss 2.1234 | lr 3.00e-03 | 12,345 tok/s | "
        b"step 24.0 ms | compute 20.5 ms\n",
    )
    assert b.ranks("node1") == [
        {"rank": 1, "step": 10, "loss": 2.1234, "tokens_per_s": 12345.0, "step_ms": 24.0, "compute_ms": 20.5}
    ]
