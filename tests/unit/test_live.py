"""The live status view: host lines parsed into a board, rendered to fixed text; stragglers named
once; log lines printed above a rich Live display."""
import io

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
    return (f"[{node} rank{rank}] epoch 0 | step {s} | loss {loss:.4f} | lr 3.00e-03 | 81,877 tok/s "
            f"| step {compute + 4:.1f} ms | compute {compute:.1f} ms").encode()


def text(renderable, width=110):
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_board_renders_a_fixed_state():
    clock = Clock()
    board = Board([("node1", 0), ("node2", 1), ("node3", 2)], clock=clock)
    board.observe("node1", step("node1", 0, 20, 20.4) + b"\n" + step("node1", 1, 20, 20.0, 2.4)
                  + b"\n[node1 rank0] progress [##########          ]  50.0% epoch 1/2 step 20/40 eta 1s")
    clock.now += 2
    board.observe("node2", step("node2", 2, 10, 21.0))
    clock.now += 40
    board.observe("node3", b"my own script says hello")
    clock.now += 1
    assert [line.rstrip() for line in text(board.render()).splitlines()] == [
        "node1  r0  step 20/40    loss 2.4000  81,877 tok/s  compute 20.4 ms  last output 43s ago",
        "node2  r1  step 10/40    loss 2.5000  81,877 tok/s  compute 21.0 ms  last output 41s ago",
        "node3  r2  no step info                                              last output 1s ago"]


def test_a_slow_rank_is_named_once_when_every_rank_has_enough_samples():
    board = Board([("node1", 0), ("node2", 1)], clock=Clock())
    for s in range(10, 40, 10):
        board.observe("node1", step("node1", 0, s, 20.0) + b"\n" + step("node1", 1, s, 21.0))
        assert board.new_stragglers() == []  # node2 has not reported enough yet
        board.observe("node2", step("node2", 2, s, 70.0) + b"\n" + step("node2", 3, s, 22.0))
    lines = board.new_stragglers()
    assert lines == ["straggler: node2 rank2 takes 70.0 ms of compute per step, 3.3x the median rank "
                     "(more than 20% slower); the job runs at its pace"]
    assert board.new_stragglers() == []
    assert "compute 70.0 ms, straggler 3.3x" in text(board.render())


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
    b.observe("node1", b"[node1 rank1] epoch 0 | step 10 | loss 2.1234 | lr 3.00e-03 | 12,345 tok/s | "
                       b"step 24.0 ms | compute 20.5 ms\n")
    assert b.ranks("node1") == [{"rank": 1, "step": 10, "loss": 2.1234, "tokens_per_s": 12345.0,
                                 "step_ms": 24.0, "compute_ms": 20.5}]
