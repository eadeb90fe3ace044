"""Where each host of a running job is, read from its output as it streams by: one status line
per host (node rank, step, last loss, tokens/s, compute time of its slowest rank, seconds since its
last output), kept at the bottom of the terminal by rich while the log lines scroll above, and
stragglers named once their recent steps have shown it for long enough (Board.stragglers).

Only our trainers' step and progress lines carry step information (steps.STEP_LINE); a user's
script shows "no step info" and is still watched for silence.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.progress.steps import STEP_LINE, rank_of, rate_of, step_of, straggler_line, stragglers

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

# "[node1 rank0] progress [####      ]  50.0% epoch 1/2 step 20/40 eta 1s" (trainers/gpt.py)
# Progress for the hang watchdog: a step number in a node's output.
# Not "step 169.2 ms" (a step time). Numbers bounded: a 5000-digit step is none (int() would fail).
STEP = re.compile(rb"(?i)\bstep\s*[:=]?\s*(\d{1,15})(?![.\d])")
PROGRESS = re.compile(
    r"progress \[[# ]{0,100}\] +[\d.]{1,10}% epoch \d{1,9}/\d{1,9} "
    r"step (?P<step>\d{1,15})/(?P<total>\d{1,15})"
)
RECENT = 5  # a rank's straggler test uses the median of its last RECENT compute times
MIN_SAMPLES = 3  # and only once every rank has reported this many
# How long a rank must stay slow before it is named (whichever comes first): a pause of a few steps
# is no straggler. Lines, for a short job that logs often (a starved node shows in its first
# minute); seconds, for a job that logs rarely.
SUSTAIN_LINES = 5  # its own step lines in a row
SUSTAIN = 30.0  # seconds
SILENT_AFTER = 30.0  # seconds without output before a host's status line turns yellow
# Host lines the board shows at most: a taller live display than the terminal is cropped by rich
# and pushes the log lines out of sight (64 hosts). Beyond it, the hosts worth a look (stragglers,
# silent, furthest behind) and one line summing up the others.
MAX_ROWS = 16


@dataclass
class HostState:
    name: str
    node_rank: int
    last_output: float
    step: int | None = None
    loss: float | None = None
    rate: float | None = None
    compute_ms: dict[str, deque] = field(default_factory=dict)  # rank name -> recent compute times
    ranks: dict[int, dict] = field(default_factory=dict)  # rank -> its newest step line (steps.step_of)


class Board:
    def __init__(self, hosts: list[tuple[str, int]], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        now = clock()
        self.hosts = {name: HostState(name, rank, now) for name, rank in hosts}
        self.total: int | None = None
        self.named: set[str] = set()
        self.slow: list[tuple[str, float, float]] = []  # steps.stragglers as of the newest step line
        self.slow_since: dict[str, float] = {}  # rank -> since when its step lines have shown it slow
        self.slow_lines: dict[str, int] = {}  # rank -> how many of its own step lines in a row did
        self._lock = threading.Lock()

    def observe(self, host: str, block: bytes) -> None:
        """Complete lines a host sent (called by its follower thread for every chunk)."""
        st = self.hosts.get(host)
        if st is None:
            return
        steps = b" tok/s" in block
        progress = b"progress [" in block
        with self._lock:
            st.last_output = self.clock()
            if not (steps or progress):  # the common case, decided without decoding
                return
            text = block.decode(errors="replace")
            timed = set()  # the ranks with a new compute time
            for m in STEP_LINE.finditer(text) if steps else ():
                st.step, st.loss, st.rate = int(m["step"]), float(m["loss"]), rate_of(m)
                st.ranks[int(m["rank"])] = step_of(m)
                if m["compute_ms"]:
                    timed.add(rank_of(m))
                    st.compute_ms.setdefault(rank_of(m), deque(maxlen=RECENT)).append(float(m["compute_ms"]))
            if timed:
                self._judge(st.last_output, timed)
            for m in PROGRESS.finditer(text) if progress else ():
                self.total = int(m["total"])
                st.step = max(st.step or 0, int(m["step"]))

    def ranks(self, host: str) -> list[dict]:
        """The host's ranks, each as its newest step line said (steps.step_of), by rank."""
        with self._lock:
            st = self.hosts.get(host)
            return [{"rank": r, **v} for r, v in sorted(st.ranks.items())] if st is not None else []

    def _recent(self) -> dict[str, float]:
        recent = {
            rank: statistics.median(times)
            for st in self.hosts.values()
            for rank, times in st.compute_ms.items()
        }
        enough = all(len(t) >= MIN_SAMPLES for st in self.hosts.values() for t in st.compute_ms.values())
        return recent if enough else {}

    def _judge(self, now: float, fresh: set[str]) -> None:
        """Which ranks the step lines heard so far show slow, since when, and for how many of their
        own lines in a row (`fresh`: the ranks whose line just came). A test that finds a rank no
        longer slow starts both again."""
        self.slow = stragglers(self._recent())
        self.slow_since = {rank: self.slow_since.get(rank, now) for rank, _, _ in self.slow}
        self.slow_lines = {rank: self.slow_lines.get(rank, 0) + (rank in fresh) for rank, _, _ in self.slow}

    def stragglers(self) -> list[tuple[str, float, float]]:
        """(rank, compute ms, times the median rank's), slowest first, for each rank slow enough and
        for long enough to matter.
        Slow enough: the median of its last RECENT compute times is more than 1.5 times the median
        rank's (steps.STRAGGLER_MARGIN), tested at every step line once every rank has printed
        MIN_SAMPLES. Long enough: the test has found it slow at each of its own last SUSTAIN_LINES
        step lines, or for SUSTAIN seconds with no line since saying otherwise; a spell that ends
        sooner counts for nothing.
        So a rank 20% slower (scheduling jitter on a few busy CPUs) is never named, nor one slow step
        among normal ones (it never moves a median of RECENT); a rank twice as slow is, after
        SUSTAIN_LINES of its lines or SUSTAIN seconds."""
        with self._lock:
            now = self.clock()
            return [
                s
                for s in self.slow
                if self.slow_lines[s[0]] >= SUSTAIN_LINES or now - self.slow_since[s[0]] >= SUSTAIN
            ]

    def new_stragglers(self) -> list[str]:
        """A line for each rank that has become a straggler since the last call (each named once)."""
        lines = []
        for rank, ms, times in self.stragglers():
            if rank not in self.named:
                self.named.add(rank)
                lines.append(straggler_line(rank, ms, times))
        return lines

    def render(self, max_rows: int = MAX_ROWS) -> Table | Group:
        """The status lines, one per host (at most `max_rows`, see MAX_ROWS), as a rich renderable."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        slow = {rank: times for rank, _, times in self.stragglers()}
        now = self.clock()
        table = Table.grid(padding=(0, 2))
        with self._lock:
            states = sorted(self.hosts.values(), key=lambda s: s.node_rank)
            shown = states if len(states) <= max_rows else self._worth_a_look(states, slow, now, max_rows - 1)
            for st in shown:
                silent = now - st.last_output
                cells: list[Text | str] = [Text(st.name, style="bold"), f"r{st.node_rank}"]
                if st.step is None:
                    cells += ["no step info", "", "", ""]
                else:
                    cells += [
                        f"step {st.step}/{self.total}" if self.total else f"step {st.step}",
                        f"loss {st.loss:.4f}" if st.loss is not None else "",
                        f"{st.rate:,.0f} tok/s" if st.rate is not None else "",
                        self._compute_cell(st, slow),
                    ]
                cells.append(
                    Text(f"last output {silent:.0f}s ago", style="yellow" if silent > SILENT_AFTER else "dim")
                )
                table.add_row(*cells)
            if len(shown) == len(states):
                return table
            rest = [st for st in states if st not in shown]
            summary = self._summary(rest, len(states), now)
        return Group(table, Text(summary, style="dim"))

    @staticmethod
    def _worth_a_look(
        states: list[HostState], slow: dict[str, float], now: float, rows: int
    ) -> list[HostState]:
        """The `rows` hosts to show when not all fit, in rank order: stragglers first, then silent
        hosts, then those furthest behind (no step info counts as furthest)."""

        def urgency(st: HostState):
            straggling = any(r in slow for r in st.compute_ms)
            silent = now - st.last_output > SILENT_AFTER
            return (
                not straggling,
                not silent,
                -1 if st.step is None else st.step,
                st.last_output,
                st.node_rank,
            )

        return sorted(sorted(states, key=urgency)[:rows], key=lambda s: s.node_rank)

    def _summary(self, rest: list[HostState], total: int, now: float) -> str:
        steps = [st.step for st in rest if st.step is not None]
        of = f"/{self.total}" if self.total else ""
        where = (
            (f"step {min(steps)}{of}" if min(steps) == max(steps) else f"steps {min(steps)}-{max(steps)}{of}")
            if steps
            else "no step info"
        )
        quiet = max(now - st.last_output for st in rest)
        return f"... and {len(rest)} more of {total} hosts: {where}, last output at most {quiet:.0f}s ago"

    @staticmethod
    def _compute_cell(st: HostState, slow: dict[str, float]) -> str | Text:
        from rich.text import Text

        if not st.compute_ms:
            return ""
        ms = max(statistics.median(times) for times in st.compute_ms.values())  # the host's slowest rank
        worst = max((slow[r] for r in st.compute_ms if r in slow), default=None)
        if worst is None:
            return f"compute {ms:.1f} ms"
        return Text(f"compute {ms:.1f} ms, straggler {worst:.1f}x", style="bold red")
