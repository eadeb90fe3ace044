"""Our trainers' step lines, read: one line's figures (live.py reads each as it streams by), every
rank's lines in a run's fetched logs and their step times (report.py's summary.json and end-of-run
table), and the stragglers among the ranks. A line is hostile input: every number in it is bounded.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from orchestrator.core import hostile

# "[node1 rank0] epoch 0 | step 10 | loss 2.1234 | lr 3.00e-03 | 12,345 tok/s | step 24.0 ms |
# compute 20.5 ms" (trainers/gpt.py; the two times are the log interval's mean per step)
# Every number bounded (a line is hostile input): int() and float() of a match never fail, and a
# 5000-digit "step" is no step at all.
_NUM = r"\d{1,15}(?:\.\d{1,15})?"
_RATE = r"\d{1,3}(?:,\d{3}){0,5}|\d{1,18}"
STEP_LINE = re.compile(
    rf"\[(?P<node>\S{{1,255}}) rank(?P<rank>\d{{1,6}})\] epoch \d{{1,9}} \| step (?P<step>\d{{1,15}}) \| "
    rf"loss (?P<loss>{_NUM}) \| lr \S+ \| (?P<rate>{_RATE}) tok/s"
    rf"(?: \| step (?P<step_ms>{_NUM}) ms \| compute (?P<compute_ms>{_NUM}) ms)?"
)
# A rank whose median compute time per step is more than this much above the median rank's is a
# straggler: the whole job runs at its speed. 50%, not less: ranks on an idle machine with few CPUs
# differ by 20% or so from scheduling alone, which no one can act on (live.py adds "for long enough").
STRAGGLER_MARGIN = 0.5


def file_lines(path: Path) -> Iterator[str]:
    """A file's lines one at a time (what a container wrote may be any size; a line at most
    hostile.LINE_MAX in a host's log, a bounded read each in a fetched file)."""
    with path.open(errors="replace") as fh:
        while line := fh.readline(hostile.LINE_MAX + 64):
            yield line


def rank_of(m: re.Match) -> str:
    """A step line's rank, as 'node1 rank0'."""
    return f"{m['node']} rank{m['rank']}"


def rate_of(m: re.Match) -> float:
    """A step line's tokens/s."""
    return float(m["rate"].replace(",", ""))


def step_of(m: re.Match) -> dict:
    """A step line's figures: step, loss, tokens/s, and the interval's step and compute ms (None
    when the line has no times)."""
    return {
        "step": int(m["step"]),
        "loss": float(m["loss"]),
        "tokens_per_s": rate_of(m),
        "step_ms": float(m["step_ms"]) if m["step_ms"] else None,
        "compute_ms": float(m["compute_ms"]) if m["compute_ms"] else None,
    }


def rank_steps(run_dir: Path) -> dict[str, list[re.Match]]:
    """'node1 rank0' -> its step lines (STEP_LINE matches) from every host's log, by rank."""
    steps: dict[str, list[re.Match]] = {}
    for log in sorted(run_dir.glob("*.log")):
        for m in filter(None, map(STEP_LINE.search, file_lines(log))):
            # A rank's name is what its program printed: made plain text once, here, for the
            # table, the straggler line, the figure's legend and summary.json alike.
            steps.setdefault(hostile.text(rank_of(m)), []).append(m)
    return dict(sorted(steps.items(), key=lambda kv: int(kv[0].rsplit("rank", 1)[1])))


def rank_rates(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """'node1 rank0' -> [(step, tokens/s)] from every host's log."""
    return {name: [(int(m["step"]), rate_of(m)) for m in ms] for name, ms in rank_steps(run_dir).items()}


def percentile(values: list[float], q: float) -> float:
    """The q-th quantile (0..1) of values, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def stragglers(compute: dict[str, float], margin: float = STRAGGLER_MARGIN) -> list[tuple[str, float, float]]:
    """(rank, its compute time, times the median rank's) for each rank slower than the median rank
    by more than margin (STRAGGLER_MARGIN: more than 1.5 times its compute time), slowest first. The
    median is the lower one, so that with two hosts the faster host is the reference. Each rank's
    time is a median over its step lines (the whole run's at the end: slow for more than half the
    run; the recent ones while it runs, where live.Board.stragglers also asks that it last)."""
    if len(compute) < 2:
        return []
    median = statistics.median_low(compute.values())
    if median <= 0:
        return []
    slow = [(name, t, t / median) for name, t in compute.items() if t > (1 + margin) * median]
    return sorted(slow, key=lambda x: -x[2])


def host_of(rank_name: str) -> str:
    return rank_name.rsplit(" rank", 1)[0]


def _stats(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "p95": round(percentile(values, 0.95), 1)}


def timings(run_dir: Path) -> dict:
    """Per rank and per host: step time and compute time (ms, median and p95 over the logged
    intervals), tokens/s, samples; and the stragglers."""
    ranks: dict[str, dict[str, float]] = {}
    by_host: dict[str, dict[str, list[Any]]] = {}  # ranks (names), step_ms, compute_ms, rates
    for name, ms in rank_steps(run_dir).items():
        rates = [rate_of(m) for m in ms]
        entry = {
            "tokens_per_s_median": round(statistics.median(rates), 1),
            "tokens_per_s_p5": round(percentile(rates, 0.05), 1),
            "samples": len(ms),
        }
        timed = [m for m in ms if m["compute_ms"]]
        if timed:
            step_ms = [float(m["step_ms"]) for m in timed]
            compute_ms = [float(m["compute_ms"]) for m in timed]
            entry.update({f"step_ms_{k}": v for k, v in _stats(step_ms).items()})
            entry.update({f"compute_ms_{k}": v for k, v in _stats(compute_ms).items()})
            host = by_host.setdefault(
                host_of(name), {"ranks": [], "step_ms": [], "compute_ms": [], "rates": []}
            )
            host["ranks"].append(name)
            host["step_ms"] += step_ms
            host["compute_ms"] += compute_ms
            host["rates"] += rates
        ranks[name] = entry
    hosts = {
        h: {
            "ranks": v["ranks"],
            **{f"step_ms_{k}": x for k, x in _stats(v["step_ms"]).items()},
            **{f"compute_ms_{k}": x for k, x in _stats(v["compute_ms"]).items()},
            "tokens_per_s_median": round(statistics.median(v["rates"]), 1),
        }
        for h, v in by_host.items()
    }
    slow = stragglers({n: r["compute_ms_median"] for n, r in ranks.items() if "compute_ms_median" in r})
    return {
        "ranks": ranks,
        "per_host": hosts,
        "straggler_margin": STRAGGLER_MARGIN,
        "stragglers": [
            {"rank": n, "host": host_of(n), "compute_ms_median": t, "times_median": round(x, 2)}
            for n, t, x in slow
        ],
    }


def straggler_line(rank: str, compute_ms: float, times: float) -> str:
    return (
        f"straggler: {rank} takes {compute_ms:.1f} ms of compute per step, {times:.1f}x the median rank "
        f"(more than {STRAGGLER_MARGIN:.0%} slower); the job runs at its pace"
    )
