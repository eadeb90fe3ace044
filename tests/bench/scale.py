"""The control plane at growing host counts: how each operation's time grows with N.

    flock /tmp/fabtrain-cluster.lock .venv/bin/python tests/bench/scale.py --hosts 8,16,32,64 --repeat 3

(one size per run, --json runs/scale-N.json, then --table runs/scale-*.json, to share the cluster
between runs)

For each size N it brings the local cluster up to N test hosts (cluster.up: Docker-in-Docker
containers, each with its own sshd and Docker engine; timed) and loads a tiny image on each (a few
MB: sh, seq, sleep and their libraries from this machine, `docker import`ed once and loaded on every
host with `docker save | docker load`, so every host holds the same image id). The inventory the
benchmark writes names that image as job.image. Then, medians of --repeat:

  preflight  `fab preflight --no-smoke`, the whole command line (its exit code and the checks that
             failed are recorded: the tiny image has no python3 and no torch, and the code tree is
             not synced, so those checks fail by design; every host is still probed)
  connect    a new remote.Session running `true` on every host (the SSH handshakes)
  idle       those connections left open and idle for 5 s: the CPU they cost here meanwhile, with
             connect.IDLE_WAKE and then with paramiko's own 0.1 s wake-up, side by side
  start      on that open session, `docker run -d` of the tiny image on every host with the job's
             labels (plan.LABEL_*), through Session.fan_out and Session.run: the fan-out and the
             engine's start of one container per host. NOT the full `fab train` start path (claim,
             secrets, entrypoint), which needs python3 in the image.
  status     `fab status`, the whole command line, with that job running on every host
  stop       `fab stop --grace 0`, the whole command line (every host's container removed)
  logs       every host's container writes --lines lines to its console file (the entrypoint's
             file, hostfiles.console_file) and exits; the project's Watcher (watch.watch, the code path of
             `fab train` and `fab logs`) follows every host until all have ended, echoing to a file:
             lines/s from the start of the containers to the last host's end, lines lost

  pdsh       baseline: the same `docker run -d` through pdsh (an ssh process per host, all at once),
             what the test rig costs by itself: every test host's engine and sshd share this
             machine's 2 CPUs, so work that runs in parallel on real hosts queues here

It also counts the CPU seconds each operation costs on this machine (the fab process, or this one),
samples this process's threads and open file descriptors during each operation. Prints a
table with seconds at each N and the growth per doubling of N, and writes the raw numbers as JSON
(--json). Only the project's own test hosts and loopback are contacted.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import Baselines  # noqa: E402 - tests/bench/bench.py: pdsh with the same SSH options

from orchestrator.backends.ssh import attempt as attempt_mod  # noqa: E402
from orchestrator.backends.ssh.watch import watch  # noqa: E402
from orchestrator.config.inventory import load  # noqa: E402
from orchestrator.core import jobspec  # noqa: E402
from orchestrator.hostcmds import sshargs  # noqa: E402
from orchestrator.hosts import claims, hostops  # noqa: E402
from orchestrator.testbed import cluster  # noqa: E402
from orchestrator.transport import connect  # noqa: E402
from orchestrator.transport.remote import Session  # noqa: E402

FAB = str(Path(sys.executable).parent / "fab")
TINY = "fabtrain/tiny:latest"
IDLE = 5.0  # seconds the open connections are left idle, for their CPU cost
TINY_TOOLS = ("/bin/sh", "/usr/bin/seq", "/bin/sleep", "/bin/cat", "/bin/mkdir")


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


class Sampler:
    """Peak threads and open file descriptors of this process while a block runs."""

    def __init__(self) -> None:
        self.threads = self.fds = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.threads = max(self.threads, threading.active_count())
            self.fds = max(self.fds, len(os.listdir("/proc/self/fd")))
            self._stop.wait(0.05)

    def __enter__(self) -> Sampler:
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def cpu(who: int) -> float:
    u = resource.getrusage(who)
    return u.ru_utime + u.ru_stime


def build_tiny() -> str:
    """The tiny image on this machine's engine: a handful of binaries and the libraries they load."""
    paths = set(TINY_TOOLS)
    for tool in TINY_TOOLS:
        out = subprocess.run(["ldd", tool], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            for word in line.split():
                if word.startswith("/"):
                    paths.add(word)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(paths):
            tar.add(os.path.realpath(p), arcname=p.lstrip("/"))  # the file itself, under its usual name
        for d in ("tmp", "out"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777
            tar.addfile(info)
    subprocess.run(["docker", "import", "-", TINY], input=buf.getvalue(), capture_output=True, check=True)
    return subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Id}}", TINY], capture_output=True, text=True, check=True
    ).stdout.strip()


def load_tiny(nodes, image_id: str) -> float:
    """`docker save | docker load` into every host whose engine lacks the image (8 at a time)."""
    saved = subprocess.run(["docker", "save", TINY], capture_output=True, check=True).stdout

    def one(node) -> None:
        have = subprocess.run(
            ["docker", "exec", node.container, "docker", "image", "inspect", "-f", "{{.Id}}", TINY],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if have != image_id:
            subprocess.run(
                ["docker", "exec", "-i", node.container, "docker", "load"],
                input=saved,
                capture_output=True,
                check=True,
            )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, nodes))
    return time.perf_counter() - t0


def bring_up(n: int, inv_path: Path, image_id: str) -> dict:
    t0 = time.perf_counter()
    for tries in range(1, 4):
        try:
            nodes = cluster.up(n, images=(), log=lambda line: print(f"  [cluster] {line}", flush=True))
            break
        except IndexError as exc:
            # cluster.up reads each new host's key with `docker exec cat`; under the load of dozens
            # of hosts starting at once, the engine now and then returns an empty output for it.
            print(f"  [cluster] try {tries} failed reading a host key ({exc!r}); again", flush=True)
    else:
        raise RuntimeError(f"cluster.up({n}) failed 3 times")
    up_s = time.perf_counter() - t0
    load_s = load_tiny(nodes, image_id)
    text = (cluster.STATE_DIR / "inventory.yaml").read_text()
    inv_path.write_text(text.replace(f"image: {cluster.TRAINER_IMAGE}", f"image: {TINY}"))
    return {"up_s": up_s, "load_tiny_s": load_s, "up_tries": tries}


CPU: dict[str, float] = {}  # the last cli() call's CPU seconds on this machine (the fab process)


def cli(*args, inv_path: Path, timeout: float = 600):
    c0, t0 = cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    p = subprocess.run(
        [FAB, *args, "--inventory", str(inv_path)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    CPU["last"] = cpu(resource.RUSAGE_CHILDREN) - c0
    return time.perf_counter() - t0, p


def run_argv(inv, host, spec: jobspec.JobSpec, command: list[str], out_dir: str) -> list[str]:
    """`docker run -d` of the tiny image, labelled as a job's node, its output dir at /out."""
    return [
        "docker",
        "run",
        "-d",
        "--name",
        jobspec.container_name(spec.job_id, host.rank),
        "--label",
        f"{jobspec.LABEL_MANAGED}=1",
        "--label",
        f"{jobspec.LABEL_JOB}={spec.job_id}",
        "--label",
        f"{jobspec.LABEL_RANK}={host.rank}",
        "--label",
        f"{jobspec.LABEL_HOST}={host.name}",
        "--label",
        f"{jobspec.LABEL_OWNER}={claims.me()}",
        "--label",
        f"{jobspec.LABEL_ATTEMPT}=1",
        "-v",
        f"{out_dir}:/out",
        TINY,
        *command,
    ]


def start_all(session: Session, inv, spec: jobspec.JobSpec, command_for) -> float:
    out_dir = f"{inv.job.output_dir}/{spec.job_id}"
    t0 = time.perf_counter()
    results = session.fan_out(
        lambda h: session.run(
            h, sshargs.shell(run_argv(inv, h, spec, command_for(h), out_dir)), timeout=120, what="docker run"
        )
    )
    dt = time.perf_counter() - t0
    bad = {n: r for n, r in results.items() if isinstance(r, BaseException) or not r.ok}
    if bad:
        raise RuntimeError(f"start failed on {len(bad)} host(s): {list(bad.items())[:3]}")
    return dt


def wake_every(session: Session, seconds: float) -> None:
    """How often each open connection's paramiko thread wakes when idle (its socket timeout)."""
    for conn in session._conns.values():
        conn.transport.sock.settimeout(seconds)


def one_round(inv, inv_path: Path, lines: int) -> dict:
    r: dict = {}
    # preflight, whole command line
    with Sampler():
        dt, p = cli("preflight", "--no-smoke", "--json", inv_path=inv_path)
    r["preflight"], r["preflight_cpu"] = dt, CPU["last"]
    try:
        doc = json.loads(p.stdout)
        failed = sorted({c.get("check", "?") for c in doc.get("checks", []) if c.get("status") == "fail"})
    except (ValueError, AttributeError):
        failed = [f"unparsed (exit {p.returncode}): {p.stderr[-300:]}"]
    r["preflight_failed_checks"] = failed

    # connect + start of one container per host, on one session
    spec = jobspec.JobSpec(job_id=jobspec.new_job_id("scale"), script="")
    with Sampler() as s_start:
        c0, t0 = cpu(resource.RUSAGE_SELF), time.perf_counter()
        with Session(inv.hosts) as session:
            got = session.fan_out(lambda h: session.run(h, "true", timeout=60, what="true"))
            r["connect"] = time.perf_counter() - t0
            assert all(not isinstance(v, BaseException) and v.ok for v in got.values()), got
            # Idle, as fab leaves them and with paramiko's own wake-up every 0.1 s, side by side.
            for key, wake in (("idle_cpu", connect.IDLE_WAKE), ("idle_cpu_wake_0.1", 0.1)):
                wake_every(session, wake)
                i0 = cpu(resource.RUSAGE_SELF)
                time.sleep(IDLE)
                r[key] = cpu(resource.RUSAGE_SELF) - i0
            wake_every(session, connect.IDLE_WAKE)
            r["start"] = start_all(session, inv, spec, lambda h: ["sleep", "600"])
        r["connect_start_cpu"] = cpu(resource.RUSAGE_SELF) - c0 - r["idle_cpu"] - r["idle_cpu_wake_0.1"]
    r["start_threads"], r["start_fds"] = s_start.threads, s_start.fds

    # status and stop, whole command lines
    dt, p = cli("status", inv_path=inv_path)
    r["status"], r["status_cpu"] = dt, CPU["last"]
    r["status_ok"] = (
        p.returncode == 0 and spec.job_id in p.stdout and f"hosts: {len(inv.hosts)} answering" in p.stdout
    )
    dt, p = cli("stop", "--grace", "0", inv_path=inv_path)
    r["stop"], r["stop_cpu"] = dt, CPU["last"]
    r["stop_removed"] = sum(
        int(line.split("removed ")[1].split()[0])
        for line in p.stdout.splitlines()
        if ": removed " in line and "container" in line
    )

    # log streaming through the Watcher
    spec = jobspec.JobSpec(job_id=jobspec.new_job_id("scale"), script="")
    a = attempt_mod.build(inv, spec, 1, inv.job.master_port)
    run_dir = Path(tempfile.mkdtemp(prefix="scale-logs-"))
    term_path = run_dir / "terminal.out"
    with Session(inv.hosts) as session, Sampler() as s_logs, term_path.open("wb") as term:
        c0, t0 = cpu(resource.RUSAGE_SELF), time.perf_counter()
        start_all(
            session,
            inv,
            spec,
            lambda h: [
                "sh",
                "-c",
                'mkdir -p "$1" && seq -f "line %g the quick brown fox" 0 "$3" > "$1/$2"',
                "sh",
                "/out/" + jobspec.console_name(h.rank).rsplit("/", 1)[0],
                jobspec.console_name(h.rank).rsplit("/", 1)[1],
                str(lines - 1),
            ],
        )
        result = watch(session, a, run_dir, echo=True, out=term)
        dt = time.perf_counter() - t0
        r["logs_cpu"] = cpu(resource.RUSAGE_SELF) - c0
        hostops.stop(session, inv, [spec.job_id], 0)
        session.fan_out(
            lambda h: session.run(
                h, sshargs.shell(["rm", "-rf", f"{inv.job.output_dir}/{spec.job_id}"]), timeout=60
            )
        )
    expected = lines * len(inv.hosts)
    got_term = term_path.read_bytes().count(b" the quick brown fox")
    got_files = sum(
        (run_dir / f"{h.name}.log").read_bytes().count(b" the quick brown fox") for h in inv.hosts
    )
    r["logs"] = dt
    r["logs_lines_per_s"] = expected / dt
    r["logs_lost"] = (expected - got_term) + (expected - got_files)
    r["logs_ok"] = result.ok
    r["logs_threads"], r["logs_fds"] = s_logs.threads, s_logs.fds

    # The same `docker run -d` through pdsh (one ssh process per host, all at once): what the test
    # rig itself costs (every host's engine shares this machine's CPUs), beside our start.
    base = Baselines(inv)
    name = f"scale-pdsh-{os.getpid()}"
    t0 = time.perf_counter()
    p = base.pdsh(sshargs.shell(["docker", "run", "-d", "--name", name, TINY, "sleep", "600"]))
    r["pdsh_start"] = time.perf_counter() - t0
    r["pdsh_started"] = p.stdout.count("\n")
    base.pdsh(sshargs.shell(["docker", "rm", "-f", name]))
    return r


OPS = (
    ("preflight", "fab preflight --no-smoke (CLI)"),
    ("connect", "connect (Session, true on all)"),
    ("start", "start: docker run -d on all"),
    ("status", "fab status (CLI)"),
    ("stop", "fab stop --grace 0 (CLI)"),
    ("logs", "logs: start + follow to the end"),
    ("pdsh_start", "baseline: pdsh docker run -d on all"),
)
CPU_OPS = (
    ("preflight_cpu", "CPU s here: fab preflight"),
    ("connect_start_cpu", "CPU s here: connect + start"),
    ("status_cpu", "CPU s here: fab status"),
    ("stop_cpu", "CPU s here: fab stop"),
    ("logs_cpu", "CPU s here: logs"),
    ("idle_cpu", f"CPU s here: connections idle {IDLE:.0f} s"),
    ("idle_cpu_wake_0.1", "  the same, paramiko waking every 0.1 s"),
)


def per_doubling(sizes: list[int], values: list[float]) -> str:
    """Growth per doubling of N between consecutive sizes, and over the whole range."""
    steps = []
    points = list(zip(sizes, values, strict=True))
    for (n1, v1), (n2, v2) in zip(points, points[1:], strict=False):
        steps.append(f"{(v2 / v1) ** (1 / math.log2(n2 / n1)):.2f}")
    if len(sizes) > 2:
        total = (values[-1] / values[0]) ** (1 / math.log2(sizes[-1] / sizes[0]))
        steps.append(f"overall {total:.2f}")
    return ", ".join(steps)


def table(results: dict[int, dict]) -> str:
    sizes = sorted(results)
    head = ["operation"] + [f"N={n}" for n in sizes] + ["x per doubling (goal <= 1.3)"]
    rows = [head]
    for key, label in OPS:
        vals = [med([x.get(key) for x in results[n]["rounds"]]) for n in sizes]
        rows.append([label] + [f"{v:.2f} s" for v in vals] + [per_doubling(sizes, vals)])
    for key, label in CPU_OPS:
        vals = [med([x.get(key) for x in results[n]["rounds"]]) for n in sizes]
        rows.append([label] + [f"{v:.2f}" for v in vals] + [per_doubling(sizes, vals)])
    lps = [med([x["logs_lines_per_s"] for x in results[n]["rounds"]]) for n in sizes]
    rows.append(["logs: lines/s received"] + [f"{v:,.0f}" for v in lps] + [""])
    rows.append(
        ["logs: lines lost"] + [str(sum(x["logs_lost"] for x in results[n]["rounds"])) for n in sizes] + [""]
    )
    for key, label in (
        ("start_threads", "threads (peak, start)"),
        ("logs_threads", "threads (peak, logs)"),
        ("logs_fds", "open fds (peak, logs)"),
    ):
        rows.append([label] + [str(max(x[key] for x in results[n]["rounds"])) for n in sizes] + [""])
    rows.append(["bring-up (cluster.up)"] + [f"{results[n]['up']['up_s']:.0f} s" for n in sizes] + [""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", default="8,16,32,64")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lines", type=int, default=10000, help="lines each host prints in the log test")
    ap.add_argument("--json", default=str(ROOT / "runs" / "bench-scale.json"))
    ap.add_argument(
        "--table",
        nargs="+",
        metavar="JSON",
        help="print the table from earlier runs' JSON files (one size per run) and exit",
    )
    args = ap.parse_args()
    if args.table:
        merged = {int(n): r for f in args.table for n, r in json.loads(Path(f).read_text()).items()}
        print(table(merged))
        return
    sizes = [int(x) for x in args.hosts.split(",")]
    image_id = build_tiny()
    results: dict[int, dict] = {}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in sizes:
        inv_path = cluster.STATE_DIR / f"scale-{n}.yaml"
        print(f"== {n} hosts: bringing the cluster up", flush=True)
        up = bring_up(n, inv_path, image_id)
        print(f"   up in {up['up_s']:.0f}s, tiny image loaded in {up['load_tiny_s']:.0f}s", flush=True)
        inv = load(inv_path)
        rounds = []
        for i in range(args.repeat):
            r = one_round(inv, inv_path, args.lines)
            print(
                f"   round {i + 1}: "
                + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                flush=True,
            )
            rounds.append(r)
        results[n] = {"up": up, "rounds": rounds}
        out.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"raw numbers: {out}")


if __name__ == "__main__":
    main()
