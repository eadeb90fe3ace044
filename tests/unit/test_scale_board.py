"""The live board at many hosts: no taller than MAX_ROWS lines plus a summary, showing the hosts
that need a look."""

import io

from rich.console import Console

from orchestrator.progress.live import Board


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def text(renderable, width=120):
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return [line.rstrip() for line in console.export_text().splitlines()]


def step(node, rank, s, compute):
    return (
        f"[{node} rank{rank}] epoch 0 | step {s} | loss 2.5000 | lr 3.00e-03 | 1,000 tok/s "
        f"| step {compute + 4:.1f} ms | compute {compute:.1f} ms"
    ).encode()


def test_64_hosts_show_the_ones_worth_a_look_and_sum_up_the_rest():
    clock = Clock()
    names = [(f"node{i}", i - 1) for i in range(1, 65)]
    board = Board(names, clock=clock)
    for s in (10, 20, 30):
        for name, rank in names:
            if name == "node40":
                continue  # silent from the start
            at = 5 if name == "node7" and s == 30 else s  # node7 is behind
            board.observe(name, step(name, rank, at, 70.0 if name == "node12" else 20.0))
    clock.now += 45
    for name, _rank in names:
        if name not in ("node40",):
            board.observe(name, b"still here")
    lines = text(board.render(max_rows=4))
    assert len(lines) == 4
    assert [line.split()[0] for line in lines[:3]] == ["node7", "node12", "node40"]
    assert "straggler" in lines[1] and "last output 45s ago" in lines[2]
    assert lines[3] == "... and 61 more of 64 hosts: step 30, last output at most 0s ago"


def test_few_hosts_are_all_shown_as_before():
    board = Board([("node1", 0), ("node2", 1)], clock=Clock())
    assert len(text(board.render(max_rows=4))) == 2


def test_by_default_64_hosts_take_at_most_max_rows_lines_and_the_summary():
    from orchestrator.progress.live import MAX_ROWS

    board = Board([(f"node{i}", i) for i in range(64)], clock=Clock())
    lines = text(board.render())
    assert len(lines) == MAX_ROWS and lines[-1].startswith(f"... and {64 - MAX_ROWS + 1} more of 64 hosts")
