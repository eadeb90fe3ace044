"""What keeping each rank's state in memory (fabtrain_memory, K = 1) costs a step, on this machine:
no Docker, no cluster, loopback only.

    .venv/bin/python tests/bench/memory_loopback.py --repeat 8
    .venv/bin/python tests/bench/memory_loopback.py --repeat 8 --variant before=/tmp/fabtrain_memory_old.py

Each run is what tests/trainers/test_memory_warm.py starts: fabtrain's real entrypoint, warm
(FABTRAIN_WARM=1, so each "node" runs its keeper), two nodes of two workers on 127.0.0.1 (gloo,
CPU), gpt.py --model tiny --exact, --epochs epochs of --steps steps, no snapshots, no next
generation's workers started ahead. The ways, run one after the other inside each round (their
order turned by one every round, so a noisy neighbour spreads over all of them):
  off       FABTRAIN_MEMORY_EVERY=0 (no keeper, save keeps nothing)
  on        FABTRAIN_MEMORY_EVERY=1 with docker/fabtrain_memory.py
  NAME      (each --variant NAME=PATH) FABTRAIN_MEMORY_EVERY=1 with the module at PATH instead
Measured per run, over every rank's step lines past the first --skip of each epoch:
  timer ms  the median of the trainer's own `step N ms` (its timer ends before memory.save: it sees
            the background work's contention only)
  wall ms   wall time per step from each rank's cumulative tok/s (elapsed at step n of an epoch =
            n x tokens a step / rate): includes the save itself; the median of the ranks
  cpu s     user + system seconds of every process of the run (both entrypoints, their keepers
            and workers), start to end: what a shared 2-core machine really pays
Prints a Markdown table: per way the median over the rounds, and against off the median over the
rounds of each round's own ratio (way / off - 1, the two runs minutes apart at most: a machine
whose load comes and goes compares better so), the extra cpu as ms per step, and every run.
"""

from __future__ import annotations

import argparse
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from orchestrator.testbed import loopback

STEP_LINE = re.compile(
    r"\[\S+ rank(\d+)\] epoch (\d+) \| step (\d+) \| .*?([\d,]+) tok/s \| step ([\d.]+) ms"
)
MODEL_LINE = re.compile(r"block=(\d+); world (\d+), batch (\d+) x accum (\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(root: Path, module: Path | None, steps: int, epochs: int) -> tuple[str, float]:
    """Both nodes' console output of one run (module None: memory off), and the CPU seconds all its
    processes took (user and system: both entrypoints, their keepers and workers)."""
    port, procs, consoles = free_port(), [], []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for rank in (0, 1):
        node = root / f"n{rank}"
        runtime, out = node / "runtime", node / "out"
        loopback.runtime_dir(runtime, module)
        out.mkdir()
        console = out / ".console" / f"node-{rank}.log"
        consoles.append(console)
        env = loopback.warm_env(
            rank,
            port,
            out,
            console,
            # no next generation's workers importing torch meanwhile
            FABTRAIN_STANDBY_AHEAD="3600",
            FABTRAIN_MEMORY_EVERY="1" if module else "0",
        )
        args = ["--model", "tiny", "--epochs", str(epochs), "--max-steps-per-epoch", str(steps)]
        args += ["--log-every", "1"]
        args += ["--sample-chars", "0", "--snapshot-every", "0", "--exact", "--out", str(out)]
        cmd = [sys.executable, str(runtime / "entrypoint.py"), str(ROOT / "trainers" / "gpt.py"), *args]
        procs.append(
            subprocess.Popen(cmd, cwd=node, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    try:
        for p in procs:
            if p.wait(timeout=300) != 0:
                raise RuntimeError("a node failed:\n" + "\n".join(c.read_text()[-3000:] for c in consoles))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return "\n".join(c.read_text() for c in consoles), cpu


def measure(text: str, skip: int) -> dict[str, float]:
    """The median timer ms of every rank's step lines past the first `skip` of each epoch, and the
    median of the ranks' wall ms per step over those steps (an epoch's rate counts from its start;
    the evaluation between epochs is in neither)."""
    model = MODEL_LINE.search(text)
    if model is None:
        raise RuntimeError("no model line in the output")
    block, world, batch, accum = map(int, model.groups())
    per_step = block * world * batch * accum
    timer, elapsed = [], {}
    for m in STEP_LINE.finditer(text):
        rank, epoch, step, rate, ms = (
            int(m[1]),
            int(m[2]),
            int(m[3]),
            float(m[4].replace(",", "")),
            float(m[5]),
        )
        first = elapsed.setdefault((rank, epoch), {"first": step})["first"]
        i = step - first + 1  # steps of this epoch so far
        if i > skip:
            timer.append(ms)
        elapsed[(rank, epoch)][i] = i * per_step / rate
    wall: dict[int, list[float]] = {}
    for (rank, _epoch), e in elapsed.items():
        last = max(k for k in e if k != "first")
        if last > skip:
            wall.setdefault(rank, [0.0, 0.0])
            wall[rank][0] += e[last] - e[skip]
            wall[rank][1] += last - skip
    return {
        "timer": statistics.median(timer),
        "wall": statistics.median(1000 * t / n for t, n in wall.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5, help="rounds (each runs every way once)")
    p.add_argument("--steps", type=int, default=40, help="steps of each epoch (tiny has 43)")
    p.add_argument("--epochs", type=int, default=3, help="epochs of each run")
    p.add_argument("--skip", type=int, default=5, help="steps not measured at the start of each epoch")
    p.add_argument("--variant", action="append", default=[], help="NAME=PATH: another fabtrain_memory.py")
    p.add_argument("--keep-logs", help="a directory to copy each run's console output to")
    p.add_argument("--no-on", action="store_true", help="leave the way `on` out (only off and --variant)")
    args = p.parse_args()
    ways: dict[str, Path | None] = {"off": None, "on": ROOT / "docker" / "fabtrain_memory.py"}
    if args.no_on:
        del ways["on"]
    for v in args.variant:
        name, _, path = v.partition("=")
        ways[name] = Path(path).resolve()
    names = list(ways)
    got: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.repeat):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            with tempfile.TemporaryDirectory(prefix="fabtrain-membench-") as tmp:
                began = time.monotonic()
                text, cpu = run_once(Path(tmp), ways[name], args.steps, args.epochs)
            if args.keep_logs:
                Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                (Path(args.keep_logs) / f"round{r}-{name}.log").write_text(text)
            got[name].append({**measure(text, args.skip), "cpu": cpu})
            m = got[name][-1]
            print(
                f"round {r + 1} {name}: timer {m['timer']:.1f} ms, wall {m['wall']:.1f} ms, cpu {cpu:.1f} s "
                f"({time.monotonic() - began:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    med = {n: {k: statistics.median(x[k] for x in got[n]) for k in ("timer", "wall", "cpu")} for n in names}
    steps = args.steps * args.epochs

    def paired(n: str, k: str) -> float:
        return statistics.median(x[k] / o[k] - 1 for x, o in zip(got[n], got["off"], strict=True))

    print(
        f"\n{args.repeat} rounds, gpt.py --model tiny --exact, 2 nodes x 2 workers on loopback, "
        f"{args.epochs} epochs of {args.steps} steps, the first {args.skip} of each epoch not timed. "
        "Medians over the rounds; vs off: the median of each round's way / off - 1; cpu +ms/step: "
        f"that of cpu, times off's cpu, over {steps} steps\n"
    )
    print("| way | timer ms | vs off | wall ms/step | vs off | cpu s | cpu +ms/step | each: timer/wall/cpu |")
    print("|---|---|---|---|---|---|---|---|")
    for n in names:
        t, w, c = med[n]["timer"], med[n]["wall"], med[n]["cpu"]
        each = ", ".join(f"{x['timer']:.0f}/{x['wall']:.0f}/{x['cpu']:.1f}" for x in got[n])
        extra = 1000 * paired(n, "cpu") * med["off"]["cpu"] / steps
        print(
            f"| {n} | {t:.1f} | {paired(n, 'timer'):+.1%} | {w:.1f} | {paired(n, 'wall'):+.1%} | {c:.1f} "
            f"| {extra:+.1f} | {each} |"
        )


if __name__ == "__main__":
    main()
