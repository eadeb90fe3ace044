"""Lose at most one step (issue 48): each rank's state kept in memory against disk snapshots only.

    .venv/bin/python tests/bench/memory.py --repeat 5

On 2 test hosts (node1, node2), GPT with --exact and a warm job (--restarts 1, so each node has its
keeper), memory on and off alternated inside each round; medians of --repeat rounds:
  lost      a worker of node2 killed (faults.KILL_ONE_WORKER) once step N is printed (N varies by
            round); 2 epochs of 40 steps, --snapshot-every 10. Memory on (--memory-every 1): the L of
            "[fabtrain] resumed from memory at step S ..., L steps lost"; cross-check for both ways:
            the newest step printed before attempt 2 minus the step resumed from (memory off: the
            disk snapshot's step, from rank 0's "resumed from /output/snapshots/..." line).
  recovery  the same jobs: seconds from the kill (the kill command returned) to the first step line
            of attempt 2 past the step resumed from.
  overhead  --models, 1 epoch of --max-steps-per-epoch (tiny 40; small 22, all its epoch has
            with 4 ranks: about 0.5 s a step on this machine's 2 CPUs), --snapshot-every 0; memory
            on (K = 1) against off:
            the median `step NN.N ms` of every rank's step lines past step 10 (the trainer's timer,
            which ends before memory.save is called: it sees the background copy's contention only),
            and the wall time per step over steps 11..last from the cumulative tok/s (includes the
            save); overhead = (on - off) / off. Before them the automatic K (no --memory-every),
            stopped at its "[fabtrain] memory: ... kept every K steps (a step took X ms keeping it,
            Y ms not, +Z%" line; after them, memory on at that K (--memory-every K), measured as on
            and off are: the overhead the automatic choice costs.
Every job is stopped once measured (Ctrl+C, then fab stop). Prints a markdown table per measure
(median and every sample) and writes the samples as JSON (--out). Only the project's own test
hosts are contacted.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docker"))  # fabtrain_memory: the probe's length

import fabtrain_memory

from orchestrator.testbed import cluster, faults
from tests.bench.bench import FAB, Lines, med
from tests.bench.failover import on, stop

WAYS = ("lost", "overhead", "recovery")
COMMON = "--sample-chars 0 --exact --log-every 1"
KILL_JOB = f"--snapshot-every 10 --max-steps-per-epoch 40 {COMMON}"  # 2 epochs: 80 steps
KILL_AT = (25, 33, 47, 28, 56)  # step N (printed) at which the worker is killed, by round
# The overhead jobs' steps in their one epoch (tiny has 43; small has 22 with 4 ranks).
STEPS = {"tiny": 40, "small": 22, "medium": 20}
STEP_LINE = re.compile(
    r"\[\w+ rank(\d+)\] epoch (\d+) \| step (\d+) \| .*?([\d,]+) tok/s "
    r"\| step ([\d.]+) ms"
)
MODEL_LINE = re.compile(r"block=(\d+); world (\d+), batch (\d+) x accum (\d+)")
RESUMED = re.compile(r"rank0\] resumed from (\S+) .*\(epoch \d+, step (\d+)\)")
LOST = re.compile(r"\[fabtrain\] resumed from (?:memory|the disk snapshot) at step \d+.*?(\d+) steps? lost")
AUTO = re.compile(
    r"\[fabtrain\] memory: each rank's state kept every (\d+) steps?"
    r" \(a step took ([\d.]+) ms keeping it, ([\d.]+) ms not, ([+-][\d.]+)%"
)


def wait_re(run: Lines, pattern: re.Pattern, after: float = 0, timeout: float = 300, ok=lambda m: True):
    """(arrival, match) of the first line after `after` that matches `pattern` and `ok`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t, line in list(run.seen):
            if t >= after and (m := pattern.search(line)) and ok(m):
                return t, m
        if run.proc.poll() is not None and not run.thread.is_alive():
            break
        time.sleep(0.02)
    raise RuntimeError(f"{pattern.pattern!r} never came; last lines: {''.join(x for _, x in run.seen[-20:])}")


def train(inv: Path, model: str, epochs: int, args: str) -> Lines:
    return Lines(
        [
            FAB,
            "train",
            "--inventory",
            str(inv),
            "--model",
            model,
            "--epochs",
            str(epochs),
            "--restarts",
            "1",
            "--skip-preflight",
            "--args",
            args,
        ]
    )


def end(run: Lines, inv: Path) -> None:
    """Ctrl+C (fab train stops its job), then fab stop of the job (or of every job, if unnamed)."""
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGINT)
    try:
        run.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        run.proc.kill()
    named = [m.group(1) for _, x in run.seen if (m := re.search(r"job (\S+) attempt \d+: starting", x))]
    if named:
        stop(inv, named[0])
    else:
        subprocess.run(
            [FAB, "stop", "--grace", "0", "--inventory", str(inv)], cwd=ROOT, capture_output=True, timeout=300
        )


def killed_once(inv: Path, every: int, kill_at: int) -> dict:
    """One warm job, a worker of node2 killed at step `kill_at`: steps lost and time to train again."""
    run = train(inv, "tiny", 2, f"{KILL_JOB} --memory-every {every}")
    try:
        wait_re(run, re.compile(rf"\| step {kill_at} \|"))
        pid = on("node2", faults.KILL_ONE_WORKER).stdout.strip()
        killed = time.monotonic()
        if not pid.isdigit():
            raise RuntimeError(f"no worker killed on node2: {pid!r}")
        again, _ = wait_re(run, re.compile(r"attempt 2: starting"), killed)
        t_res, res = wait_re(run, RESUMED, again)
        step = int(res.group(2))
        first, _ = wait_re(run, STEP_LINE, again, ok=lambda m: int(m.group(3)) > step)
        printed = max(int(m.group(3)) for t, x in run.seen if t < again and (m := STEP_LINE.search(x)))
        said = [int(m.group(1)) for t, x in run.seen if t >= again and (m := LOST.search(x))]
        return {
            "kill_at": kill_at,
            "printed": printed,
            "resumed": step,
            "from": res.group(1),
            "lost_said": said[0] if said else None,
            "lost_printed": printed - step,
            "to_training": first - killed,
        }
    finally:
        end(run, inv)


def steps_of(run: Lines, last: int) -> dict:
    """Median timer step ms over every rank's step lines past step 10, and wall ms per step over
    steps 11..last from each rank's cumulative tok/s (elapsed at step n = n x tokens a step / rate)."""
    block, world, batch, accum = (int(x) for x in wait_re(run, MODEL_LINE)[1].groups())
    per_step = block * world * batch * accum
    timer, elapsed = [], {}
    for _, x in run.seen:
        if (m := STEP_LINE.search(x)) and m.group(2) == "0" and int(m.group(3)) >= 10:
            rank, n, rate = int(m.group(1)), int(m.group(3)), float(m.group(4).replace(",", ""))
            elapsed.setdefault(rank, {})[n] = n * per_step / rate
            if n > 10:
                timer.append(float(m.group(5)))
    wall = [1000 * (e[last] - e[10]) / (last - 10) for e in elapsed.values() if 10 in e and last in e]
    return {"timer_ms": med(timer), "wall_ms": med(wall), "lines": len(timer)}


def overhead_once(inv: Path, model: str, every: int | None) -> dict:
    last = STEPS[model]
    more = "" if every is None else f" --memory-every {every}"
    # The automatic K is chosen at the probe's last step: enough epochs of `last` steps to reach it.
    epochs = -(-(fabtrain_memory.PROBE_STEPS + 1) // last) if every is None else 1
    run = train(inv, model, epochs, f"--snapshot-every 0 --max-steps-per-epoch {last} {COMMON}{more}")
    try:
        if every is None:  # the automatic K: its probe's line is all that is wanted
            _, m = wait_re(run, AUTO, timeout=600)
            k, kept, not_kept, pct = m.groups()
            return {"k": int(k), "kept_ms": float(kept), "not_kept_ms": float(not_kept), "pct": float(pct)}
        done, deadline = re.compile(rf"\| step {last} \|"), time.monotonic() + 900
        while sum(bool(done.search(x)) for _, x in list(run.seen)) < 4:  # every rank's last step
            if time.monotonic() > deadline or run.proc.poll() is not None:
                raise RuntimeError(
                    f"{model}: step {last} not printed by 4 ranks; last lines: "
                    f"{''.join(x for _, x in run.seen[-20:])}"
                )
            time.sleep(0.2)
        return steps_of(run, last)
    finally:
        end(run, inv)


def pct(on_: float, off: float) -> float:
    return 100 * (on_ - off) / off


def row(name: str, xs: list, fmt: str = "{:.2f}") -> str:
    xs = [x for x in xs if x is not None]
    return f"| {name} | {fmt.format(med(xs)) if xs else '-'} | {', '.join(fmt.format(x) for x in xs)} |"


def tables(r: dict, repeat: int) -> str:
    out = []
    head = f"| medians of {repeat} | median | samples |\n|---|---|---|"
    if "kill" in r:
        on_, off = r["kill"]["on"], r["kill"]["off"]
        out += [
            "\n### Steps lost per failure (tiny, a worker killed, warm restart)",
            head,
            row("memory on (K = 1): L of the resume line", [s["lost_said"] for s in on_], "{:.0f}"),
            row("memory on: newest step printed - step resumed", [s["lost_printed"] for s in on_], "{:.0f}"),
            row(
                "memory off: newest step printed - snapshot's step",
                [s["lost_printed"] for s in off],
                "{:.0f}",
            ),
            row(
                "newest step printed before the restart (on, then off)",
                [s["printed"] for s in on_ + off],
                "{:.0f}",
            ),
            "\n### Kill -> training again (s, to the first step past the one resumed from)",
            head,
            row("memory on (K = 1)", [s["to_training"] for s in on_]),
            row("memory off (disk snapshot, today's warm restart)", [s["to_training"] for s in off]),
        ]
    for model, o in r.get("overhead", {}).items():
        t_on, t_off = [s["timer_ms"] for s in o["on"]], [s["timer_ms"] for s in o["off"]]
        w_on, w_off = [s["wall_ms"] for s in o["on"]], [s["wall_ms"] for s in o["off"]]
        out += [
            f"\n### Overhead per step, --model {model} ({STEPS[model]} steps, ms)",
            head,
            row("timer step, memory on (K = 1)", t_on, "{:.1f}"),
            row("timer step, memory off", t_off, "{:.1f}"),
            row("timer overhead %", [pct(a, b) for a, b in zip(t_on, t_off, strict=True)], "{:+.1f}"),
            row("wall per step, memory on (K = 1)", w_on, "{:.1f}"),
            row("wall per step, memory off", w_off, "{:.1f}"),
            row("wall overhead %", [pct(a, b) for a, b in zip(w_on, w_off, strict=True)], "{:+.1f}"),
            row("automatic K", [s["k"] for s in o["auto"]], "{:.0f}"),
            row(
                "automatic: its probe's step keeping a state (ms)",
                [s["kept_ms"] for s in o["auto"]],
                "{:.1f}",
            ),
            row(
                "automatic: its probe's step keeping none (ms)",
                [s["not_kept_ms"] for s in o["auto"]],
                "{:.1f}",
            ),
            row("automatic: its probe's overhead at K = 1 %", [s["pct"] for s in o["auto"]], "{:+.1f}"),
            row("wall per step at the automatic K", [s["wall_ms"] for s in o["at_k"]], "{:.1f}"),
            row(
                "wall overhead at the automatic K %",
                [pct(a["wall_ms"], b) for a, b in zip(o["at_k"], w_off, strict=True)],
                "{:+.1f}",
            ),
        ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-memory.json"))
    ap.add_argument("--ways", default=",".join(WAYS), help="which measures: " + ", ".join(WAYS))
    ap.add_argument("--models", default="tiny,small", help="the overhead measure's GPT presets")
    a = ap.parse_args()
    ways, models = set(a.ways.split(",")), a.models.split(",")
    if ways - set(WAYS) or set(models) - set(STEPS):
        ap.error(f"--ways from {', '.join(WAYS)}; --models from {', '.join(STEPS)}")
    nodes = cluster.up(2)  # the test suite's cluster, reused as it is
    inv = ROOT / "runs" / "bench-memory.yaml"
    inv.parent.mkdir(exist_ok=True)
    inv.write_text(cluster.render_inventory(nodes[:2]))
    r: dict = {}
    for i in range(a.repeat):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")  # neither way always first
        if ways & {"lost", "recovery"}:
            for way in order:
                s = killed_once(inv, 1 if way == "on" else 0, KILL_AT[i % len(KILL_AT)])
                r.setdefault("kill", {}).setdefault(way, []).append(s)
                print(f"round {i + 1} kill, memory {way}: {s}", flush=True)
        if "overhead" in ways:
            for model in models:
                o = r.setdefault("overhead", {}).setdefault(
                    model, {"on": [], "off": [], "auto": [], "at_k": []}
                )
                for way in ("auto", *order, "at_k"):  # auto first: at_k runs at the K it chose
                    every = o["auto"][-1]["k"] if way == "at_k" else {"on": 1, "off": 0, "auto": None}[way]
                    s = overhead_once(inv, model, every)
                    o[way].append(s)
                    print(f"round {i + 1} {model}, memory {way}: {s}", flush=True)
    print(tables(r, a.repeat), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"repeat": a.repeat, "results": r}, indent=1) + "\n")


if __name__ == "__main__":
    main()
