"""What `fab dashboard` costs: CPU seconds of the dashboard process and SSH commands per host, per
minute, with no browser and with one browser open, at each cluster size, while a job runs on every
host of the local cluster.

    flock /tmp/fabtrain-cluster.lock .venv/bin/python tests/bench/dashboard.py --hosts 2,8 --repeat 3

The browser is the page's own polling, made here at the page's rate (app.js POLL_MS, every 3 s):
the overview, the past runs and the running job's page, every endpoint either view of the page
reads. CPU: user + system time of the dashboard's process (/proc/PID/stat) over --seconds after a
warm-up; SSH commands: the count the dashboard keeps of its own (its /api/overview `cost`). Prints a
table of medians per size. Only the project's own test hosts and loopback are contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from orchestrator.testbed import cluster  # noqa: E402

FAB = str(Path(sys.executable).parent / "fab")
POLL = 3.0  # seconds between two polls of the page (app.js POLL_MS)
REFRESH = 5.0  # the dashboard's default look at the hosts
WARMUP = 15.0
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def commands(base: str) -> int:
    return json.loads(get(base + "api/overview"))["cost"]["ssh_commands"]


def measure(inv: Path, job: str, hosts: int, browser: bool, seconds: float) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}/"
    proc = subprocess.Popen(
        [FAB, "dashboard", "--port", str(port), "--refresh", f"{REFRESH:g}", "--inventory", str(inv)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                get(base)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the dashboard never answered") from None
                time.sleep(0.3)
        time.sleep(WARMUP)
        c0, n0, t0 = cpu_seconds(proc.pid), commands(base), time.monotonic()
        while time.monotonic() - t0 < seconds:
            started = time.monotonic()
            if browser:
                for path in ("api/overview", "api/runs", f"api/job/{job}"):
                    get(base + path)
            time.sleep(max(0.0, POLL - (time.monotonic() - started)))
        c1, n1, t1 = cpu_seconds(proc.pid), commands(base), time.monotonic()
    finally:
        proc.terminate()
        proc.wait(30)
    minutes = (t1 - t0) / 60
    return {"cpu_s_per_min": (c1 - c0) / minutes, "ssh_per_host_per_min": (n1 - n0) / hosts / minutes}


def stop(job: str | None, job_proc: subprocess.Popen, inv: Path) -> None:
    """The bench's job stopped (fab stop --job, again if it still runs), its fab train ended."""
    for _ in range(3):
        if job is not None:
            r = subprocess.run(
                [FAB, "stop", "--job", job, "--grace", "0", "--inventory", str(inv)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if r.returncode != 0:
                print(f"  fab stop --job {job}: {r.stderr.strip()[-500:]}", flush=True)
        try:
            job_proc.wait(60)
            return
        except subprocess.TimeoutExpired:
            continue
    job_proc.kill()
    job_proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="2,8")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seconds", type=float, default=60.0)
    a = p.parse_args()
    results: dict[int, dict[str, list[dict]]] = {}
    for n in [int(x) for x in a.hosts.split(",")]:
        inv = Path(tempfile.mkdtemp(prefix="bench-dashboard-")) / "inventory.yaml"
        cluster.up(n, inventory_out=str(inv), log=lambda *_: None)
        name = f"dashbench{n}"
        earlier = {p.name for p in (ROOT / "runs").glob(f"{name}-*")}
        job_proc = subprocess.Popen(
            [
                FAB,
                "train",
                "--script",
                "tests/integration/scripts/dashboard_job.py",
                "--skip-preflight",
                "--plain",
                "--args",
                "--steps 100000 --step-time 0.5",
                "--name",
                name,
                "--inventory",
                str(inv),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        job = None
        try:
            deadline = time.monotonic() + 300
            while not (
                started := [
                    p.parent.name
                    for p in (ROOT / "runs").glob(f"{name}-*/events.jsonl")
                    if p.parent.name not in earlier
                ]
            ):
                if time.monotonic() > deadline or job_proc.poll() is not None:
                    raise RuntimeError(f"the {n}-host job never started")
                time.sleep(1)
            job = started[0]
            got: dict[str, list[dict]] = {"no browser": [], "one browser": []}
            for _ in range(a.repeat):
                for way in got:  # alternately, so that drift on the machine hits both alike
                    got[way].append(measure(inv, job, n, way == "one browser", a.seconds))
            results[n] = got
        finally:
            stop(job, job_proc, inv)
        print(
            f"\n{n} hosts, a job on every host, medians of {a.repeat} windows of {a.seconds:g} s "
            f"(looks every {REFRESH:g} s, the page polled every {POLL:g} s)"
        )
        print("| dashboard | CPU s per minute | SSH commands per host per minute |")
        print("|---|---|---|")
        for way, runs in got.items():
            print(
                f"| {way} | {statistics.median(r['cpu_s_per_min'] for r in runs):.2f} | "
                f"{statistics.median(r['ssh_per_host_per_min'] for r in runs):.1f} |",
                flush=True,
            )
    out = ROOT / "runs" / "bench-dashboard.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
