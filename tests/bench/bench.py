"""Benchmarks: fabtrain against the ways teams launch today, side by side in one run.

    .venv/bin/python tests/bench/bench.py --hosts 2,4,8 --repeat 5

Brings the local cluster up at each size and measures, as medians of --repeat runs:
  launch   rank 0 then all: fabtrain's start (SSH connect + docker run per host) vs pdsh and a
           serial ssh loop running the same docker run; then to all ranks initialised and to all
           containers gone
  sync     no-change sync and sync after rewriting 50 MB, vs one rsync per host all at once
  preflight  `fab preflight --no-smoke`, the whole command line
  stop     stopping a running job on every host vs pdsh running docker rm -f
  failure  from `docker kill` of one container to every container of the job gone
  logs     every host prints 200k lines (one process under the entrypoint and torchrun): lines/s
           from starting the containers to the last line in the terminal stream and files, vs pdsh
           running the same container attached; lines lost, per-host order
  frozen   (--only frozen) one host's Docker engine frozen: preflight, status and stop (whole CLI)
           until they name it, beside a healthy preflight
  recovery (--only recovery) `fab train --restarts 1`, one worker process or one container killed
           at step 20, warm and cold restarts alternately: seconds from the kill to the failure
           being seen, to the restart, to the first step after resume
  hang     (--only hang) a script hung in all_reduce: seconds from its last output to the watchdog's
           stacks, against --hang-timeout
  deep     (--only deep) `fab preflight --deep --no-smoke` against `fab preflight --no-smoke`, whole
           command lines; at 2 hosts also the deep check's node1 -> node2 bandwidth (both directions
           at once, in the job's image) against iperf3 --bidir on the same pair, alternately
  slurm    (--only slurm) the same tiny GPT job, alternately: `fab train` (sync, preflight, start),
           `fab train --on slurm` (sync to the login node, sbatch, following the output file from
           this machine) and `sbatch` of the `fab export.slurm` script typed on the login node, on
           the hosts' own Slurm (cluster.up --slurm): seconds from the command to the first
           training step in the terminal, and to the end
Prints a table per size and writes the raw numbers as JSON. Only the project's own test hosts and
loopback are contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from orchestrator.backends.ssh import steps
from orchestrator.backends.ssh.watch import watch  # noqa: E402
from orchestrator.config.inventory import load  # noqa: E402
from orchestrator.core import jobspec
from orchestrator.hostcmds import dockerargs, hostfiles, node, sshargs
from orchestrator.hosts import hostops
from orchestrator.testbed import cluster, faults  # noqa: E402
from orchestrator.transport.remote import Session  # noqa: E402

FAB = str(Path(sys.executable).parent / "fab")


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def timed(fn, *a, **k):
    t = time.perf_counter()
    out = fn(*a, **k)
    return time.perf_counter() - t, out


class Baselines:
    """The same remote commands, run the way teams do by hand: pdsh fan-out and a serial ssh loop."""

    def __init__(self, inv):
        self.inv = inv
        h = inv.hosts[0]
        self.ssh_opts = sshargs.ssh_argv(h)[1:]  # same key, known_hosts and strict host-key checking
        self.env = dict(
            os.environ,
            PDSH_RCMD_TYPE="ssh",
            PDSH_SSH_ARGS_APPEND=" ".join(shlex.quote(x) for x in self.ssh_opts[2:]),
        )
        self.hostlist = ",".join(f"{x.ssh.user}@{x.address}" for x in inv.hosts)

    def pdsh(self, command: str, capture=False):
        return subprocess.run(
            ["pdsh", "-f", str(len(self.inv.hosts)), "-w", self.hostlist, command],
            env=self.env,
            capture_output=True,
            text=not capture,
            check=False,
        )

    def serial(self, commands: dict[str, str]):
        for h in self.inv.hosts:
            subprocess.run(
                ["ssh", *self.ssh_opts, f"{h.ssh.user}@{h.address}", commands[h.name]],
                capture_output=True,
                check=False,
            )


def rm_all(session, inv):
    hostops.stop(session, inv, None, 0)


def bench_launch(inv, base: Baselines, repeat: int) -> dict:
    res = {
        "fabtrain_started": [],
        "pdsh_started": [],
        "serial_started": [],
        "all_initialised": [],
        "all_gone": [],
    }
    for i in range(repeat):
        spec = jobspec.JobSpec(
            job_id=jobspec.new_job_id("bench"), script="tests/bench/scripts/init_exit.py", nproc_per_node="1"
        )
        t0 = time.perf_counter()
        wall0 = time.time()
        with Session(inv.hosts) as session:
            a = steps.start_quiet(session, inv, spec)
            started = time.perf_counter() - t0
            run_dir = Path(tempfile.mkdtemp(prefix="bench-launch-"))
            result = watch(session, a, run_dir, echo=False)
            steps.end_quiet(session, a)
            gone = time.perf_counter() - t0
        inits = [
            float(line.split()[1])
            for f in run_dir.glob("*.log")
            for line in f.read_text().splitlines()
            if line.startswith("INIT ")
        ]
        assert result.ok and len(inits) == len(inv.hosts), (result, inits)
        res["fabtrain_started"].append(started)
        res["all_initialised"].append(max(inits) - wall0)
        res["all_gone"].append(gone)
        # The same docker run through pdsh and through a serial ssh loop (containers removed after).
        argv = node.docker_run_argv(inv, inv.hosts[0], spec)
        name_at = argv.index("--name") + 1
        pdsh_argv = list(argv)
        pdsh_argv[name_at] = f"bench-pdsh-{i}"
        dt, _ = timed(base.pdsh, sshargs.shell(pdsh_argv))
        res["pdsh_started"].append(dt)
        serial_cmds = {}
        for h in inv.hosts:
            a = list(argv)
            a[name_at] = f"bench-serial-{i}"
            serial_cmds[h.name] = sshargs.shell(a)
        dt, _ = timed(base.serial, serial_cmds)
        res["serial_started"].append(dt)
        base.pdsh("docker rm -f $(docker ps -aq --filter name=bench-) >/dev/null 2>&1; true")
    return res


def bench_sync(inv, base: Baselines, repeat: int) -> dict:
    src = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    (src / "data").mkdir()
    for j in range(50):
        (src / "data" / f"blob{j}.bin").write_bytes(os.urandom(1 << 20))
    code_dir = "/opt/fabtrain/bench-sync"
    inv_b = type(inv)(
        path=inv.path, hosts=inv.hosts, job=type(inv.job)(**{**inv.job.__dict__, "code_dir": code_dir})
    )
    session = Session(inv.hosts)
    fab_sync = lambda: hostops.sync(session, inv_b, src)  # noqa: E731 - one open session, as fab sync
    fab_sync()
    res = {"fabtrain_nochange": [], "rsync_loop_nochange": [], "fabtrain_50mb": [], "rsync_loop_50mb": []}

    def rsync_loop():
        procs = [
            subprocess.Popen(
                sshargs.rsync_argv(h, str(src), code_dir),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for h in inv.hosts
        ]
        for p in procs:
            p.wait()

    def rewrite():
        for j in range(50):
            (src / "data" / f"blob{j}.bin").write_bytes(os.urandom(1 << 20))

    for _ in range(repeat):
        res["fabtrain_nochange"].append(timed(fab_sync)[0])
        res["rsync_loop_nochange"].append(timed(rsync_loop)[0])
        rewrite()
        res["fabtrain_50mb"].append(timed(fab_sync)[0])
        rewrite()
        res["rsync_loop_50mb"].append(timed(rsync_loop)[0])
    session.close()
    return res


def bench_preflight(inv_path, repeat: int) -> dict:
    res = {"fab_preflight_no_smoke": []}
    for _ in range(repeat):
        dt, p = timed(
            subprocess.run,
            [FAB, "preflight", "--no-smoke", "--inventory", str(inv_path)],
            cwd=ROOT,
            capture_output=True,
        )
        res["fab_preflight_no_smoke"].append(dt)
    return res


def bench_frozen(inv, inv_path, repeat: int) -> dict:
    """The last host's Docker engine frozen (SIGSTOP dockerd and containerd; SSH still answers):
    how long the whole CLI of preflight, status and stop takes to name it, beside a healthy
    preflight measured in the same run."""
    victim = f"fabtrain-{inv.hosts[-1].name}"
    res: dict[str, list] = {
        "healthy_preflight": [],
        "frozen_preflight": [],
        "frozen_status": [],
        "frozen_stop": [],
        "named": [],
    }

    def cli(*args):
        return timed(
            subprocess.run,
            [FAB, *args, "--inventory", str(inv_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    for _ in range(repeat):
        res["healthy_preflight"].append(cli("preflight", "--no-smoke")[0])
        subprocess.run(
            ["docker", "exec", victim, "sh", "-c", "pkill -STOP -x dockerd; pkill -STOP -x containerd"],
            check=True,
        )
        try:
            for key, args in (
                ("frozen_preflight", ("preflight", "--no-smoke")),
                ("frozen_status", ("status",)),
                ("frozen_stop", ("stop", "--grace", "0")),
            ):
                dt, p = cli(*args)
                res[key].append(dt)
                res["named"].append(p.returncode != 0 and inv.hosts[-1].name in p.stdout + p.stderr)
        finally:
            subprocess.run(
                ["docker", "exec", victim, "sh", "-c", "pkill -CONT -x containerd; pkill -CONT -x dockerd"],
                check=True,
            )
    return res


def _sleep_job(session, inv):
    spec = jobspec.JobSpec(
        job_id=jobspec.new_job_id("bench"),
        script="tests/integration/scripts/report.py",
        args=("--sleep", "300"),
        nproc_per_node="1",
    )
    return steps.start_quiet(session, inv, spec)


def bench_stop(inv, inv_path, base: Baselines, repeat: int) -> dict:
    res = {"fabtrain_stop": [], "fab_stop_cli": [], "pdsh_rm": []}
    for _ in range(repeat):
        with Session(inv.hosts) as s:
            _sleep_job(s, inv)
        t0 = time.perf_counter()
        with Session(inv.hosts) as s:
            hostops.stop(s, inv, None, 0)
        res["fabtrain_stop"].append(time.perf_counter() - t0)
        with Session(inv.hosts) as s:
            _sleep_job(s, inv)
        res["fab_stop_cli"].append(
            timed(
                subprocess.run,
                [FAB, "stop", "--grace", "0", "--inventory", str(inv_path)],
                cwd=ROOT,
                capture_output=True,
            )[0]
        )
        with Session(inv.hosts) as s:
            _sleep_job(s, inv)
        res["pdsh_rm"].append(timed(base.pdsh, dockerargs.stop_script())[0])
    return res


def _time_to_rest_gone(inv, fault, undo=None) -> float:
    """Start a job, watch it, apply `fault` to the last host; seconds until no container of the
    job runs on any other host (the watcher has torn the job down)."""
    victim = inv.hosts[-1]
    with Session(inv.hosts) as session:
        a = _sleep_job(session, inv)
        spec = a.spec
        time.sleep(2)
        holder = {}
        t = threading.Thread(
            target=lambda: holder.update(
                r=watch(session, a, Path(tempfile.mkdtemp(prefix="bench-fault-")), echo=False)
            )
        )
        t.start()
        time.sleep(1)
        t_fault = time.perf_counter()
        fault(victim, spec)
        try:
            t.join()
            rest = tuple(h for h in inv.hosts if h.name != victim.name)
            left = session.fan_out(
                lambda h: session.run(
                    h, sshargs.shell(["docker", "ps", "-q", *dockerargs.label_filter(spec.job_id)])
                ).stdout.strip(),
                rest,
            )
            took = time.perf_counter() - t_fault
            assert not any(left.values()) and not holder["r"].ok, left
        finally:
            if undo:
                undo(victim)
    with Session(inv.hosts) as session:
        steps.end_quiet(session, a)
    return took


def bench_failure(inv, repeat: int) -> dict:
    """One container killed: time until every other container of the job is gone."""

    def kill(victim, spec):
        subprocess.run(
            [
                "docker",
                "exec",
                f"fabtrain-{victim.name}",
                "docker",
                "kill",
                jobspec.container_name(spec.job_id, victim.rank),
            ],
            capture_output=True,
        )

    return {"kill_to_all_gone": [_time_to_rest_gone(inv, kill) for _ in range(repeat)]}


def bench_paused(inv, repeat: int) -> dict:
    """A frozen host (its whole test-host container paused): time until the rest of the job is gone."""

    def pause(victim, spec):
        faults.freeze(victim.name)

    def unpause(victim):
        faults.thaw(victim.name)

    return {"pause_to_rest_gone": [_time_to_rest_gone(inv, pause, unpause) for _ in range(repeat)]}


def bench_logs(inv, base: Baselines, repeat: int, lines: int) -> dict:
    res = {"fabtrain_lines_per_s": [], "pdsh_lines_per_s": [], "lost": [], "order_kept": []}
    n_hosts = len(inv.hosts)
    for _ in range(repeat):
        # One process per node (the entrypoint and torchrun as in any job, then the printing script).
        spec = jobspec.JobSpec(
            job_id=jobspec.new_job_id("bench"),
            script="tests/bench/scripts/spew.py",
            args=(str(lines),),
            nproc_per_node="1",
        )
        term = tempfile.NamedTemporaryFile(prefix="bench-term-", delete=False)
        run_dir = Path(tempfile.mkdtemp(prefix="bench-logs-"))
        with Session(inv.hosts) as session:
            t0 = time.perf_counter()  # from the start of the containers, as for pdsh below
            a = steps.start_quiet(session, inv, spec)
            result = watch(session, a, run_dir, out=term, echo=True)
            dt = time.perf_counter() - t0
            hostops.stop(session, inv, [spec.job_id], 0)
        term.close()
        got = Path(term.name).read_bytes().splitlines()
        per_host: dict[str, list[int]] = {}
        for line in got:
            prefix, _, body = line.partition(b" | ")
            parts = body.split()
            if len(parts) > 1 and parts[1].isdigit():
                per_host.setdefault(prefix.split()[0].decode(), []).append(int(parts[1]))
        file_lines = sum(
            (run_dir / f"{h.name}.log").read_bytes().count(b" the quick brown fox ") for h in inv.hosts
        )
        expected = lines * n_hosts
        res["fabtrain_lines_per_s"].append(expected / dt)
        res["lost"].append(expected - sum(len(v) for v in per_host.values()) + (expected - file_lines))
        res["order_kept"].append(
            all(v == list(range(lines)) for v in per_host.values()) and len(per_host) == n_hosts
        )
        assert result.ok, result
        # pdsh: the same container (entrypoint, torchrun, script), attached, its output carried by
        # `docker run` over ssh. Each node is a job of its own there (no rendezvous across nodes).
        cmd = sshargs.shell(
            [
                "docker",
                "run",
                "--rm",
                "--network",
                "host",
                "-v",
                f"{hostfiles.code_path(inv, a.spec)}:/workspace:ro",
                "-v",
                f"{hostfiles.runtime_dir(inv, spec)}:{jobspec.RUNTIME_MOUNT}:ro",
                "-e",
                "NPROC_PER_NODE=1",
                "-w",
                "/workspace",
                "--entrypoint",
                "python3",
                inv.job.image,
                jobspec.ENTRYPOINT_PATH,
                "tests/bench/scripts/spew.py",
                str(lines),
            ]
        )
        dt, p = timed(base.pdsh, cmd, capture=True)
        with Session(inv.hosts) as session:
            steps.end_quiet(session, a)
        pdsh_lines = sum(1 for line in p.stdout.splitlines() if b" the quick brown fox " in line)
        res["pdsh_lines_per_s"].append(pdsh_lines / dt)
        res.setdefault("pdsh_lost", []).append(expected - pdsh_lines)
    return res


def table(n: int, r: dict) -> str:
    def ms(x):
        return f"{med(x) * 1000:.0f} ms"

    rows = [
        (
            "launch: all containers started",
            ms(r["launch"]["fabtrain_started"]),
            f"pdsh {ms(r['launch']['pdsh_started'])}, serial {ms(r['launch']['serial_started'])}",
            f"{med(r['launch']['fabtrain_started']) / med(r['launch']['pdsh_started']):.2f}x pdsh (target "
            "<= 1.2x)",
        ),
        ("launch: all ranks initialised", ms(r["launch"]["all_initialised"]), "", ""),
        ("launch: all containers gone", ms(r["launch"]["all_gone"]), "", ""),
        (
            "sync, no change",
            ms(r["sync"]["fabtrain_nochange"]),
            f"rsync loop {ms(r['sync']['rsync_loop_nochange'])}",
            f"{med(r['sync']['fabtrain_nochange']) / med(r['sync']['rsync_loop_nochange']):.2f}x (target <= "
            "1.2x)",
        ),
        (
            "sync, 50 MB changed",
            ms(r["sync"]["fabtrain_50mb"]),
            f"rsync loop {ms(r['sync']['rsync_loop_50mb'])}",
            f"{med(r['sync']['fabtrain_50mb']) / med(r['sync']['rsync_loop_50mb']):.2f}x",
        ),
        (
            "preflight --no-smoke (CLI)",
            ms(r["preflight"]["fab_preflight_no_smoke"]),
            "",
            "target <= 3 s at 8 hosts",
        ),
        (
            "stop a running job",
            ms(r["stop"]["fabtrain_stop"]),
            f"pdsh rm -f {ms(r['stop']['pdsh_rm'])}",
            f"{med(r['stop']['fabtrain_stop']) / med(r['stop']['pdsh_rm']):.2f}x (target <= 1.2x); CLI "
            f"{ms(r['stop']['fab_stop_cli'])}",
        ),
        ("failure: kill -> all gone", ms(r["failure"]["kill_to_all_gone"]), "", "target <= 5 s"),
        (
            "logs: lines/s (prefix + files)",
            f"{med(r['logs']['fabtrain_lines_per_s']):,.0f}",
            f"pdsh {med(r['logs']['pdsh_lines_per_s']):,.0f}",
            f"{med(r['logs']['fabtrain_lines_per_s']) / med(r['logs']['pdsh_lines_per_s']):.2f}x (target >= "
            "1.0x); "
            f"lost {max(r['logs']['lost'])}, order kept {all(r['logs']['order_kept'])}",
        ),
    ]
    w = max(len(x[0]) for x in rows)
    out = [
        f"\n## {n} hosts (medians of {len(r['launch']['fabtrain_started'])})",
        "",
        f"| {'measure'.ljust(w)} | fabtrain | baseline | ratio |",
        f"|{'-' * (w + 2)}|---|---|---|",
    ]
    out += [f"| {a.ljust(w)} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(out)


class Lines:
    """A command's output, with the moment each line arrived (polled every 20 ms)."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.seen: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.seen.append((time.monotonic(), line))

    def wait_event(self, pred, after: float = 0, timeout: float = 300) -> float:
        """When the first JSON event (fab train --json) matching `pred` arrived, after `after`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.seen):
                if t >= after and line.startswith("{"):
                    try:
                        if pred(json.loads(line)):
                            return t
                    except (ValueError, KeyError, TypeError):
                        pass
            time.sleep(0.02)
        raise RuntimeError(f"no such event; last lines: {''.join(text for _, text in self.seen[-20:])}")

    def wait_for(self, needle: str, after: float = 0, timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.seen):
                if t >= after and needle in line:
                    return t
            if self.proc.poll() is not None and not self.thread.is_alive():
                break
            time.sleep(0.02)
        last = "".join(text for _, text in self.seen[-20:])
        raise RuntimeError(f"{needle!r} never came; last lines: {last}")


# The recovery bench's ways (--ways): what is killed, and how the job recovers.
WAYS = ["worker-warm", "worker-cold", "container-warm", "container-cold", "container-hot"]


def bench_recovery(inv, inv_path: Path, repeat: int) -> dict:
    """Seconds from the kill, read from `fab train --json`'s events as they arrive: the failure seen,
    each stage of attempt 2 begun, its containers watched (the orchestrator's part ends there), and
    the first step after the resume (the first progress event of attempt 2). Five ways, one after
    the other in each round: a worker process or the whole container of the last host killed, with
    warm restarts (the default) and cold ones (job.warm_restarts: false), and the container killed
    with the inventory's spare kept hot (job.hot_spares: the spare takes the last host's rank)."""
    import yaml

    last = inv.hosts[-1].name
    doc = yaml.safe_load(inv_path.read_text())
    paths = {}
    for mode, setting in (("warm", {}), ("cold", {"warm_restarts": False}), ("hot", {"hot_spares": True})):
        changed = {**doc, "job": {**doc.get("job", {}), **setting}}
        if mode != "hot":  # the spare host is only the hot way's
            changed.pop("spares", None)
        paths[mode] = inv_path.with_name(f"inventory-{mode}.yaml")
        paths[mode].write_text(yaml.safe_dump(changed))
    kills = {
        "worker": faults.KILL_ONE_WORKER,
        "container": "docker kill $(docker ps -q --filter label=fabtrain.managed=1)",
    }
    ways = [
        w
        for w in (
            ("worker", "warm"),
            ("worker", "cold"),
            ("container", "warm"),
            ("container", "cold"),
            ("container", "hot"),
        )
        if f"{w[0]}-{w[1]}" in WAYS and (w[1] != "hot" or inv.spares)
    ]
    r: dict[str, list[float]] = {}
    for _ in range(repeat):
        for kill, mode in ways:
            one = recover_once(paths[mode], last, kills[kill])
            for k, v in one.items():
                r.setdefault(f"{kill}_{mode}_{k}", []).append(v)
    return r


def recovery_table(n: int, r: dict) -> str:
    """Medians (min - max) of bench_recovery's numbers, one row per way, seconds after the kill."""
    cols = ("detected", "stage_plan", "stage_start", "stage_watch", "first_step")
    rows = [
        f"| {n} hosts | " + " | ".join(c.removeprefix("stage_") for c in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for kill, mode in (
        ("worker", "warm"),
        ("worker", "cold"),
        ("container", "warm"),
        ("container", "cold"),
        ("container", "hot"),
    ):
        cells = []
        for c in cols:
            xs = r.get(f"{kill}_{mode}_{c}", [])
            cells.append(f"{med(xs):.2f} ({min(xs):.2f} - {max(xs):.2f})" if xs else "-")
        way = "hot spare" if mode == "hot" else mode
        rows.append(f"| {kill} killed, {way} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def recover_once(inv_path: Path, last: str, kill: str) -> dict[str, float]:
    run = Lines(
        [
            FAB,
            "train",
            "--inventory",
            str(inv_path),
            "--model",
            "tiny",
            "--epochs",
            "50",
            "--json",
            "--restarts",
            "1",
            "--skip-preflight",
            "--args",
            "--snapshot-every 10 --log-every 1",
        ]
    )
    r: dict[str, float] = {}
    try:
        run.wait_event(lambda e: e["event"] == "progress" and e["step"] >= 20)
        subprocess.run(["docker", "exec", f"fabtrain-{last}", "sh", "-c", kill], capture_output=True)
        killed = time.monotonic()
        r["detected"] = run.wait_event(lambda e: e["event"] == "host_failed", killed) - killed
        for stage in ("plan", "claim", "sync+preflight", "snapshot", "start", "watch"):

            def begun(e, stage=stage):
                return e["event"] == "stage" and e["attempt"] == 2 and e["stage"] == stage

            r[f"stage_{stage}"] = run.wait_event(begun, killed) - killed
        # The first step trained after the resume: a step past the snapshot's (the trainer's
        # "resumed from ... step N" line is a progress event of step N too, and comes first).
        resumed = (
            json.loads(
                next(
                    line
                    for _, line in run.seen
                    if line.startswith('{"event": "attempt"') and '"attempt": 2' in line
                )
            )["snapshot"]
            or "snapshot-0.pt"
        )
        after = int(re.sub(r"\D", "", resumed) or 0)
        r["first_step"] = (
            run.wait_event(
                lambda e: e["event"] == "progress" and e["attempt"] == 2 and e["step"] > after, killed
            )
            - killed
        )
    finally:
        run.proc.send_signal(2)
        run.proc.wait(timeout=120)
    return r


def bench_hang(inv_path: Path, repeat: int) -> dict:
    r = {}
    for timeout, times in ((10, repeat), (30, max(1, repeat // 2))):
        r[f"timeout_{timeout}"] = []
        for _ in range(times):
            run = Lines(
                [
                    FAB,
                    "train",
                    "--inventory",
                    str(inv_path),
                    "--script",
                    "tests/integration/scripts/hang.py",
                    "--hang-timeout",
                    str(timeout),
                    "--skip-preflight",
                ]
            )
            ready = run.wait_for("ready")
            quiet = max(t for t, line in run.seen if "ready" in line)
            dumped = run.wait_for("hang watchdog:", ready, timeout=timeout + 120)
            run.proc.wait(timeout=120)
            r[f"timeout_{timeout}"].append(dumped - quiet)
            r.setdefault(f"exit_{timeout}", []).append(time.monotonic() - quiet)
    return r


def bench_deep(inv, inv_path: Path, repeat: int) -> dict:
    r = {"preflight": [], "deep": [], "deep_mbit_s": [], "iperf3_mbit_s": [], "iperf3_1m_mbit_s": []}
    a, b = inv.hosts[0], inv.hosts[1]
    for _ in range(repeat):
        r["preflight"].append(
            timed(
                subprocess.run,
                [FAB, "preflight", "--no-smoke", "--inventory", str(inv_path)],
                cwd=ROOT,
                capture_output=True,
            )[0]
        )
        t, out = timed(
            subprocess.run,
            [FAB, "preflight", "--deep", "--no-smoke", "--json", "--inventory", str(inv_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        r["deep"].append(t)
        if len(inv.hosts) == 2:
            links = {(x, y): v for x, y, v in json.loads(out.stdout)["deep"]["network"]["mbit_s"]}
            r["deep_mbit_s"].append(links[(a.name, b.name)])
            # iperf3 with its default 128 KiB writes, and with 1 MiB writes as the deep check makes.
            for key, extra in (("iperf3_mbit_s", []), ("iperf3_1m_mbit_s", ["-l", "1M"])):
                subprocess.run(
                    ["docker", "exec", "-d", f"fabtrain-{b.name}", "iperf3", "-s", "-1", "-p", "5299"],
                    check=True,
                )
                time.sleep(0.5)
                got = subprocess.run(
                    [
                        "docker",
                        "exec",
                        f"fabtrain-{a.name}",
                        "iperf3",
                        "-c",
                        b.address,
                        "-p",
                        "5299",
                        "-t",
                        "2",
                        "--bidir",
                        "-J",
                        *extra,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                # The stream a -> b as b received it (the "sum_received" of the forward direction).
                r[key].append(json.loads(got.stdout)["end"]["sum_received"]["bits_per_second"] / 1e6)
    return r


SLURM_GPT = ["--model", "tiny", "--epochs", "1", "--args", "--max-steps-per-epoch 20 --sample-chars 0"]


def bench_slurm(inv_path: Path, repeat: int) -> dict:
    script = inv_path.parent / "job.sbatch"
    subprocess.run([FAB, "sync", "--inventory", str(inv_path)], cwd=ROOT, check=True, capture_output=True)
    r = {
        "fab_train_first_step": [],
        "fab_train_end": [],
        "sbatch_first_step": [],
        "sbatch_end": [],
        "on_slurm_first_step": [],
        "on_slurm_end": [],
    }
    for _ in range(repeat):
        run = Lines([FAB, "train", "--on", "slurm", "--plain", "--inventory", str(inv_path), *SLURM_GPT])
        start = time.monotonic()
        r["on_slurm_first_step"].append(run.wait_for("| step ") - start)
        run.proc.wait(timeout=300)
        r["on_slurm_end"].append(run.seen[-1][0] - start)
        run = Lines([FAB, "train", "--inventory", str(inv_path), *SLURM_GPT])
        start = time.monotonic()
        r["fab_train_first_step"].append(run.wait_for("| step ") - start)
        run.proc.wait(timeout=300)
        r["fab_train_end"].append(run.seen[-1][0] - start)
        out = subprocess.run(
            [FAB, "export.slurm", "--inventory", str(inv_path), *SLURM_GPT, "--out", str(script)],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        job = out.split("(job ", 1)[1].split(")")[0]
        subprocess.run(["docker", "cp", str(script), "fabtrain-node1:/root/job.sbatch"], check=True)
        # sbatch, then the job's output file as it grows, until the job has left the queue.
        run = Lines(
            [
                "docker",
                "exec",
                "fabtrain-node1",
                "sh",
                "-c",
                f"cd /root && id=$(sbatch --parsable job.sbatch) && f={job}-$id.out && "
                "while [ ! -e $f ]; do sleep 0.05; done; tail -s 0.05 -n +1 -F $f & "
                "while squeue -h -j $id | grep -q .; do sleep 0.2; done; sleep 0.3; kill $!; echo JOB-DONE",
            ]
        )
        start = time.monotonic()
        r["sbatch_first_step"].append(run.wait_for("| step ") - start)
        r["sbatch_end"].append(run.wait_for("JOB-DONE") - start)
        run.proc.wait(timeout=60)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="2,4,8")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--json", default=str(ROOT / "runs" / "bench.json"))
    p.add_argument("--only", default="launch,sync,preflight,stop,failure,logs")
    p.add_argument("--ways", default=",".join(WAYS), help="the recovery bench's ways: " + ", ".join(WAYS))
    a = p.parse_args()
    WAYS[:] = a.ways.split(",")
    only = set(a.only.split(","))
    results = {}
    for n in [int(x) for x in a.hosts.split(",")]:
        inv_path = Path(tempfile.mkdtemp(prefix="bench-inv-")) / "inventory.yaml"
        # The recovery bench keeps one spare host: its hot-spare way needs it (the others leave it idle).
        cluster.up(
            n,
            inventory_out=str(inv_path),
            log=lambda *_: None,
            slurm="slurm" in only,
            spares=1 if "recovery" in only else 0,
        )
        inv = load(inv_path)
        with Session(inv.hosts) as s:
            hostops.sync(s, inv, jobspec.PROJECT_ROOT)
        base = Baselines(inv)
        with Session(inv.hosts) as s:
            rm_all(s, inv)
        r = {}
        if "launch" in only:
            r["launch"] = bench_launch(inv, base, a.repeat)
        if "sync" in only:
            r["sync"] = bench_sync(inv, base, a.repeat)
        if "preflight" in only:
            r["preflight"] = bench_preflight(inv_path, a.repeat)
        if "stop" in only:
            r["stop"] = bench_stop(inv, inv_path, base, a.repeat)
        if "failure" in only:
            r["failure"] = bench_failure(inv, a.repeat)
        if "logs" in only:
            r["logs"] = bench_logs(inv, base, a.repeat, a.lines)
        if "paused" in only:
            r["paused"] = bench_paused(inv, a.repeat)
        if "frozen" in only:
            r["frozen"] = bench_frozen(inv, inv_path, a.repeat)
        if "recovery" in only:
            r["recovery"] = bench_recovery(inv, inv_path, a.repeat)
        if "hang" in only:
            r["hang"] = bench_hang(inv_path, a.repeat)
        if "slurm" in only:
            r["slurm"] = bench_slurm(inv_path, a.repeat)
        if "deep" in only:
            r["deep"] = bench_deep(inv, inv_path, a.repeat)
        results[n] = r
        if only >= {"launch", "sync", "preflight", "stop", "failure", "logs"}:
            print(table(n, r), flush=True)
        elif only == {"recovery"}:
            print(recovery_table(n, r["recovery"]), flush=True)
        else:
            print(
                json.dumps(
                    {
                        n: {
                            k: {m: (med(v) if m != "named" else all(v)) for m, v in d.items()}
                            for k, d in r.items()
                        }
                    },
                    indent=1,
                ),
                flush=True,
            )
    Path(a.json).parent.mkdir(exist_ok=True)
    Path(a.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
