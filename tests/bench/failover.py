"""A detached job's failover on the local cluster: how long from the loss of its controller to a
new controller, and to training again.

    .venv/bin/python tests/bench/failover.py --repeat 5

Alternately:
  frozen   2 hosts + node3 as spare, the controller forced onto node1 (rank 0's host): node1
           frozen (docker pause) once a snapshot is in the standby's mirror. Seconds from the freeze
           to the standby's fence (`taken`: a new controller running on node3), and to the first
           step of the new attempt written on node3 (rank 0 from the snapshot).
  hot      the same with --hot-spares: node3's container already waits with its workers started.
  killed   2 hosts, the controller on node2, its standby on node1: the controller's container killed
           (docker kill) at step 20. Seconds from the kill to the standby's fence.
Each job is stopped once measured (fab stop), the frozen host thawed. Prints medians (and every
sample) and writes them as JSON (--out). Only the project's own test hosts are contacted.
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
from orchestrator.testbed import cluster, faults  # noqa: E402

FAB = str(ROOT / ".venv" / "bin" / "fab")
JOB = [
    "train",
    "--model",
    "tiny",
    "--epochs",
    "12",
    "--skip-preflight",
    "--args",
    "--snapshot-every 10 --max-steps-per-epoch 40 --sample-chars 0",
]
CONTROLLERS = "/opt/fabtrain/output/.controllers"
STEP = re.compile(r"\| step \d+ \|")


def on(node: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", "exec", f"fabtrain-{node}", "sh", "-c", script], capture_output=True, text=True, timeout=60
    )


def until(node: str, test: str, timeout: float, what: str, since: float) -> float:
    while on(node, test).returncode != 0:
        if time.monotonic() - since > timeout:
            raise SystemExit(f"{what}: not within {timeout}s")
        time.sleep(0.2)
    return time.monotonic() - since


def detach(inventory: Path, *more: str) -> str:
    r = subprocess.run(
        [FAB, *JOB, *more, "--detach", "--inventory", str(inventory)],
        cwd=ROOT,
        text=True,
        capture_output=True,
    )
    found = re.search(r"job (\S+) detached", r.stdout)
    if r.returncode != 0 or not found:
        raise SystemExit(f"--detach failed: {r.stderr[-2000:]}")
    return found.group(1)


def stop(inventory: Path, job: str) -> None:
    subprocess.run(
        [FAB, "stop", "--job", job, "--grace", "0", "--inventory", str(inventory)],
        cwd=ROOT,
        capture_output=True,
        timeout=300,
    )
    subprocess.run([FAB, "status", "--inventory", str(inventory)], cwd=ROOT, capture_output=True, timeout=300)


def frozen(inventory: Path, *more: str) -> tuple[float, float]:
    job = detach(inventory, "--restarts", "2", *more)
    try:
        until(
            "node3",
            f"ls {CONTROLLERS}/{job}/mirror/runs/{job}/snapshots | grep -q snapshot-",
            300,
            "a mirrored snapshot",
            time.monotonic(),
        )
        faults.freeze("node1")
        t0 = time.monotonic()
        ctl = until("node3", f"test -e {CONTROLLERS}/{job}/taken", 120, "the takeover", t0)
        console = f"/opt/fabtrain/output/{job}/{jobspec.console_name(0)}"
        train = until("node3", f"grep -q '| step [0-9]* |' {console} 2>/dev/null", 300, "training again", t0)
        return ctl, train
    finally:
        faults.thaw("node1")
        stop(inventory, job)


def killed(inventory: Path) -> float:
    job = detach(inventory)
    try:
        console = f"/opt/fabtrain/output/{job}/{jobspec.console_name(0)}"
        until("node1", f"grep -q '| step 20 |' {console} 2>/dev/null", 300, "step 20", time.monotonic())
        on("node2", f"docker kill fabtrain-ctl-{job}")
        return until("node1", f"test -e {CONTROLLERS}/{job}/taken", 120, "the takeover", time.monotonic())
    finally:
        stop(inventory, job)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-failover.json"))
    args = ap.parse_args()
    nodes = cluster.up(2, spares=2)  # the test suite's cluster, reused as it is
    folder = ROOT / "runs"
    folder.mkdir(exist_ok=True)
    two, spare = folder / "bench-failover-two.yaml", folder / "bench-failover-spare.yaml"
    two.write_text(cluster.render_inventory(nodes[:2]))
    spare.write_text(cluster.render_inventory(nodes[:2], spares=nodes[2:3]) + "controller: {host: node1}\n")
    ctl, train, hot_ctl, hot_train, back = [], [], [], [], []
    for i in range(args.repeat):
        c, t = frozen(spare)
        ctl.append(c)
        train.append(t)
        hc, ht = frozen(spare, "--hot-spares")
        hot_ctl.append(hc)
        hot_train.append(ht)
        back.append(killed(two))
        print(
            f"run {i + 1}: frozen -> new controller {c:.1f}s, training again {t:.1f}s; with a hot "
            f"spare {hc:.1f}s, {ht:.1f}s; killed -> new controller {back[-1]:.1f}s",
            flush=True,
        )
    med = statistics.median
    print(f"\n| measure (median of {args.repeat}, seconds) | value | target |\n|---|---|---|")
    print(f"| controller's host frozen -> a new controller running | {med(ctl):.1f} | 20 |")
    print(f"| controller's host frozen -> training again (spare as rank 0) | {med(train):.1f} | 45 |")
    print(f"| the same with --hot-spares: -> a new controller | {med(hot_ctl):.1f} | 20 |")
    print(f"| the same with --hot-spares: -> training again | {med(hot_train):.1f} | 45 |")
    print(f"| controller killed -> a new controller running | {med(back):.1f} | 15 |")
    Path(args.out).write_text(
        json.dumps(
            {
                "frozen_controller": ctl,
                "frozen_training": train,
                "hot_controller": hot_ctl,
                "hot_training": hot_train,
                "killed_controller": back,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
