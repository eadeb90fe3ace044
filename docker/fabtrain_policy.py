"""fabtrain_memory's decisions, pure functions of what the ranks report: the step every rank resumes
from and where each rank's state comes from (`agree`, at a load), and K, every how many steps a state
is kept, from the step times of the probe (`probe_keeps`, `probe_overhead`, `choose_every`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

BUDGET = 0.03  # how much longer a step may take with memory on (a fraction of a step without)
# The probe: SETTLE steps keeping a state at each (groups made, the first steps' warm-up), then PAIRS
# pairs of BLOCK steps keeping none and BLOCK steps keeping one at each; a step's time is from its
# save() call to the next one, the first of each block not counted (the other block's work may end
# in it). At most BLOCK steps are not kept in memory while it lasts.
SETTLE = 2
BLOCK = 4
PAIRS = 4
PROBE_STEPS = SETTLE + 2 * BLOCK * PAIRS
MAX_EVERY = 100  # the largest K chosen


@dataclass(frozen=True)
class Agreement:
    step: int | None  # the newest step held somewhere for every rank; None: none is
    newest: int | None  # the newest step any keeper holds (for any rank)
    source: dict[int, int] = field(default_factory=dict)  # rank -> the rank whose keeper sends it
    digest: dict[int, str | None] = field(default_factory=dict)  # rank -> the digest to expect


def agree(reports: list[list[list]], world: int) -> Agreement:
    """From each rank's list of what its keeper holds ([rank, step, world, size, digest] rows, the
    same list from every rank of a node), the step to resume from and where each rank's state
    comes from: its own keeper when that holds it, else the lowest rank whose keeper does."""
    where: dict[int, dict[int, list[tuple[int, str | None]]]] = {r: {} for r in range(world)}
    newest = None
    for reporter, rows in enumerate(reports):
        for rank, step, w, _size, digest in rows:
            if w != world or not 0 <= rank < world:
                continue  # a state of another world (the job shrank or grew): of no use now
            where[rank].setdefault(step, []).append((reporter, digest))
            newest = step if newest is None else max(newest, step)
    common = set.intersection(*(set(steps) for steps in where.values())) if world else set()
    if not common:
        return Agreement(None, newest)
    step = max(common)
    source, digests = {}, {}
    for rank in range(world):
        holders = where[rank][step]
        own = [h for h in holders if h[0] == rank]
        pick = own[0] if own else min(holders)
        source[rank] = pick[0]
        digests[rank] = next((d for _, d in holders if d), None)  # the origin's, carried by its replica
    return Agreement(step, newest, source, digests)


def choose_every(overhead: float, budget: float = BUDGET) -> int:
    """The smallest K whose overhead per step (the overhead at K = 1, a fraction of a step, / K) is
    at most `budget`; MAX_EVERY at most."""
    if not overhead > 0:  # none measured (or NaN)
        return 1
    return max(1, min(MAX_EVERY, math.ceil(overhead / budget - 1e-9)))


def probe_keeps(call: int) -> bool:
    """Whether the probe's `call`-th save() (0-based) keeps a state: its settling steps and its
    blocks that keep one."""
    return call < SETTLE or ((call - SETTLE) // BLOCK) % 2 == 1


def probe_overhead(began: list[float]) -> tuple[float, float, float]:
    """(the median step keeping a state, the median step keeping none, in seconds; the overhead at
    K = 1 as a fraction of the latter) from the times the probe's save() calls began, one more than
    PROBE_STEPS: step i runs from call i to call i + 1."""
    kept: list[float] = []
    not_kept: list[float] = []
    for i in range(SETTLE, PROBE_STEPS):
        if (i - SETTLE) % BLOCK:  # the first of each block is not counted
            (kept if probe_keeps(i) else not_kept).append(began[i + 1] - began[i])
    on, off = statistics.median(kept), statistics.median(not_kept)
    return on, off, (on - off) / off if off > 0 else 0.0
