"""Detached jobs against foreground ones, side by side on the local cluster (two hosts).

    .venv/bin/python tests/bench/detach.py --repeat 5

Alternately, the same tiny GPT job (one epoch of 20 steps):
  foreground  `fab train`: seconds from the command to its first training step in the terminal
  detached    `fab train --detach`: seconds until the command returned, and from the command to the
              first training step written on rank 0's host (read there every 0.2 s); then
              `fab logs --job` follows it to its end and fetches its run (not timed)
Prints medians (and every sample) and writes them as JSON (--out). Only the project's own test
hosts are contacted.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from orchestrator.core import jobspec  # noqa: E402
from orchestrator.testbed import cluster  # noqa: E402

FAB = str(ROOT / ".venv" / "bin" / "fab")
JOB = [
    "train",
    "--model",
    "tiny",
    "--epochs",
    "1",
    "--args",
    "--max-steps-per-epoch 20 --sample-chars 0",
    "--skip-preflight",
]
STEP = re.compile(r"\| step \d+ \|")


def foreground(inventory: str) -> float:
    start = time.monotonic()
    proc = subprocess.Popen(
        [FAB, *JOB, "--plain", "--inventory", inventory],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    first = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if first is None and STEP.search(line):
            first = time.monotonic() - start
    if proc.wait() != 0 or first is None:
        raise SystemExit("the foreground job failed")
    return first


def detached(inventory: str) -> tuple[float, float]:
    start = time.monotonic()
    r = subprocess.run(
        [FAB, *JOB, "--detach", "--inventory", inventory], cwd=ROOT, text=True, capture_output=True
    )
    returned = time.monotonic() - start
    found = re.search(r"job (\S+) detached", r.stdout)
    if r.returncode != 0 or not found:
        raise SystemExit(f"--detach failed: {r.stderr[-2000:]}")
    job = found.group(1)
    console = f"/opt/fabtrain/output/{job}/{jobspec.console_name(0)}"
    while True:
        out = subprocess.run(
            ["docker", "exec", "fabtrain-node1", "cat", console], capture_output=True, text=True
        ).stdout
        if STEP.search(out):
            first = time.monotonic() - start
            break
        if time.monotonic() - start > 300:
            raise SystemExit(f"job {job} never reached a step")
        time.sleep(0.2)
    done = subprocess.run(
        [FAB, "logs", "--job", job, "--plain", "--inventory", inventory],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"job {job} did not finish: {done.stderr[-2000:]}")
    return returned, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-detach.json"))
    args = ap.parse_args()
    nodes = cluster.up(2)
    inventory = ROOT / "runs" / "bench-detach.yaml"
    inventory.parent.mkdir(exist_ok=True)
    inventory.write_text(cluster.render_inventory(nodes))
    fg, ret, first = [], [], []
    for i in range(args.repeat):
        fg.append(foreground(str(inventory)))
        r, f = detached(str(inventory))
        ret.append(r)
        first.append(f)
        print(
            f"run {i + 1}: foreground first step {fg[-1]:.1f}s; --detach returned {r:.1f}s, "
            f"first step {f:.1f}s",
            flush=True,
        )
    med = statistics.median
    print(f"\n| measure (median of {args.repeat}, seconds) | value |\n|---|---|")
    print(f"| `fab train --detach` returns | {med(ret):.2f} |")
    print(f"| first step, foreground `fab train` | {med(fg):.2f} |")
    print(f"| first step, detached | {med(first):.2f} |")
    pairs = [b - a for a, b in zip(fg, first, strict=True)]
    print(f"| detached minus foreground (median of pairs) | {med(pairs):+.2f} |")
    Path(args.out).write_text(
        json.dumps({"foreground_first": fg, "detach_return": ret, "detached_first": first}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
