"""What telemetry costs: the same tiny GPT job with telemetry off (job.telemetry_every: 0), at its
default (every 10 s) and every 2 s, alternately, on the local cluster at each size.

    .venv/bin/python tests/bench/telemetry.py --hosts 2,8 --repeat 3

Per way, medians of --repeat runs: the job's tokens/s (the median over ranks of each rank's median
logged interval, summary.json), CPU seconds of the fab process (user + system, its children
included: rsync, ssh), its wall time, and the telemetry commands run per host per minute of
watching (runs/JOB/telemetry.jsonl). Prints a table per size. Only the project's own test hosts and
loopback are contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from orchestrator.testbed import cluster  # noqa: E402

FAB = str(Path(sys.executable).parent / "fab")
WAYS = {"off": 0, "every 10 s (default)": 10, "every 2 s": 2}
JOB = [
    "train",
    "--plain",
    "--model",
    "tiny",
    "--epochs",
    "8",
    "--skip-preflight",
    "--args",
    "--max-steps-per-epoch 120 --sample-chars 0 --snapshot-every 0 --log-every 5",
]


def inventory_with(base: Path, every: float) -> Path:
    """The cluster's inventory with job.telemetry_every set."""
    text = base.read_text()
    out = base.parent / f"inventory-telemetry-{every:g}.yaml"
    out.write_text(re.sub(r"^job:\n", f"job:\n  telemetry_every: {every:g}\n", text, count=1, flags=re.M))
    return out


def run_once(inv: Path) -> dict:
    before = os.times()
    start = time.monotonic()
    proc = subprocess.run(
        [FAB, *JOB, "--inventory", str(inv)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    wall = time.monotonic() - start
    after = os.times()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = proc.stdout.split("job ", 1)[1].split()[0]
    run_dir = ROOT / "runs" / job
    summary = json.loads((run_dir / "summary.json").read_text())
    rates = [r["tokens_per_s_median"] for r in summary["ranks"].values()]
    samples = []
    path = run_dir / "telemetry.jsonl"
    if path.exists():
        samples = [json.loads(line) for line in path.read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    watch = [e["time"] for e in events if e["event"] == "stage" and e["stage"] in ("watch", "teardown")]
    watched = (watch[-1] - watch[0]) if len(watch) >= 2 else wall
    hosts = max(1, len({s["host"] for s in samples}))
    cpu = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    return {
        "tokens_per_s": statistics.median(rates),
        "cpu_s": cpu,
        "wall_s": wall,
        "per_host_per_min": len(samples) / hosts / (watched / 60) if samples else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="2,8")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    results: dict[int, dict[str, list[dict]]] = {}
    for n in [int(x) for x in a.hosts.split(",")]:
        base = Path(tempfile.mkdtemp(prefix="bench-telemetry-")) / "inventory.yaml"
        cluster.up(n, inventory_out=str(base), log=lambda *_: None)
        invs = {way: inventory_with(base, every) for way, every in WAYS.items()}
        subprocess.run([FAB, "sync", "--inventory", str(base)], cwd=ROOT, check=True, capture_output=True)
        got: dict[str, list[dict]] = {way: [] for way in WAYS}
        for _ in range(a.repeat):
            for way in WAYS:  # alternately, so that drift on the machine hits every way alike
                got[way].append(run_once(invs[way]))
        results[n] = got
        print(f"\n{n} hosts, medians of {a.repeat} runs (tiny GPT, 8 epochs, 2 ranks a host)")
        print("| telemetry | tokens/s | vs off | fab CPU s | wall s | commands per host per minute |")
        print("|---|---|---|---|---|---|")
        off = statistics.median(r["tokens_per_s"] for r in got["off"])
        for way, runs in got.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(
                f"| {way} | {med['tokens_per_s']:,.0f} | {med['tokens_per_s'] / off:.3f} | "
                f"{med['cpu_s']:.1f} | {med['wall_s']:.1f} | {med['per_host_per_min']:.1f} |",
                flush=True,
            )
    out = ROOT / "runs" / "bench-telemetry.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
