"""A backend for the tests only, and the proof that a backend is one folder and one registration:
each node of the job is a local process (the node's command from its NodeSpec, with its
environment), its output in runs/JOB/HOST.log, its pid in runs/JOB/HOST.pid. Registered by the
tests as `local` (backends/registry.register)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.base import TRAIN_OPTIONS, Finished, Launch, Status, Stopped
from orchestrator.core.errors import UserError
from orchestrator.core.record import BackendPlace
from orchestrator.core.recovery import Attempt, JobRecord
from orchestrator.hostcmds.node import node_spec

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.config.inventory import Inventory


def argv(launch: Launch, host_rank: int) -> tuple[list[str], dict[str, str]]:
    """The node's command run by this machine's Python, and its environment (the NodeSpec's)."""
    node = node_spec(launch.inv, launch.inv.hosts[host_rank], launch.spec)
    env = {**os.environ, **{k: v for k, v in node.env if v is not None}}
    return [sys.executable, *node.command], env


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


class LocalBackend:
    name = "local"
    where = " locally"
    # Every train option but --health (no hosts to measure): a refusal derived from what it accepts.
    accepts = tuple(o for o in TRAIN_OPTIONS if o.name != "health")
    declines = "no hosts to measure"

    def serves(self, inv: Inventory) -> bool:
        return True

    def refuse_if_running(self, inv: Inventory, job_id: str, how: str) -> None:
        if any(alive(int(p.read_text())) for p in Path("runs", job_id).glob("*.pid")):
            raise UserError(f"job {job_id} is running here; {how} would hurt it", exit_code=2)

    def detach(self, launch: Launch) -> Finished:
        raise UserError("a local job ends with the fab train that runs it", exit_code=2)

    def take_over(self, launch: Launch) -> Finished:
        raise UserError("a local job ends with the fab train that runs it", exit_code=2)

    def dry_run(self, launch: Launch) -> str:
        return "\n".join(f"[{h.name}] " + " ".join(argv(launch, h.rank)[0][1:]) for h in launch.inv.hosts)

    def run(self, launch: Launch) -> Finished:
        spec = launch.spec
        run_dir = launch.runs / spec.job_id
        run_dir.mkdir(parents=True, exist_ok=True)
        record = launch.record or JobRecord.new(
            spec, launch.inv, launch.policy.restarts, launch.policy.min_nodes, launch.policy.hang_timeout
        )
        record.backend = BackendPlace(self.name)
        record.attempts.append(
            Attempt(len(record.attempts) + 1, [h.name for h in launch.inv.hosts], time.time())
        )
        record.state = "running"
        record.save(run_dir)
        procs = {}
        for h in launch.inv.hosts:
            cmd, env = argv(launch, h.rank)
            with open(run_dir / f"{h.name}.log", "ab") as log:
                procs[h.name] = subprocess.Popen(
                    cmd, cwd=spec.code, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            (run_dir / f"{h.name}.pid").write_text(str(procs[h.name].pid))
        codes = {name: p.wait() for name, p in procs.items()}
        for name in codes:
            (run_dir / f"{name}.pid").unlink(missing_ok=True)
        bad = {name: code for name, code in codes.items() if code}
        record.attempts[-1].ended = time.time()
        record.state = "failed" if bad else "finished"
        record.attempts[-1].outcome = record.state
        record.save(run_dir)
        error = None
        if bad:
            name, code = next(iter(bad.items()))
            error = UserError(f"job {spec.job_id} failed: {name} exited with code {code}; logs in {run_dir}")
        return Finished(
            spec.job_id, run_dir, error, f"job {spec.job_id} finished on every node; logs in {run_dir}"
        )

    def attach(
        self, inv: Inventory, job_id: str | None, runs: Path, console: Console, live: bool, json: bool = False
    ) -> Finished:
        if job_id is None:
            raise UserError("give --job JOB", exit_code=2)
        run_dir = runs / job_id
        while any(alive(int(p.read_text())) for p in run_dir.glob("*.pid")):
            time.sleep(0.1)
        for log in sorted(run_dir.glob("*.log")):
            for line in log.read_text().splitlines():
                console.print(f"{log.stem} | {line}", markup=False)
        state = JobRecord.load(runs, job_id).state
        error = None if state == "finished" else UserError(f"job {job_id} ended {state}")
        return Finished(job_id, run_dir, error)

    def stop(
        self, inv: Inventory, job_id: str | None, everyone: bool, yes: bool, grace: float, runs: Path
    ) -> Stopped:
        out = Stopped()
        for pid_file in sorted(runs.glob(f"{job_id or '*'}/*.pid")):
            pid = int(pid_file.read_text())
            if alive(pid):
                os.killpg(pid, signal.SIGTERM)
                out.lines.append(f"stopped {pid_file.parent.name} on {pid_file.stem}")
        return out

    def status(self, inv: Inventory, runs: Path) -> Status:
        rows = [
            {"job": p.parent.name, "host": p.stem}
            for p in sorted(Path("runs").glob("*/*.pid"))
            if alive(int(p.read_text()))
        ]
        return Status(doc={"local": rows}, lines=[f"{r['job']} runs on {r['host']}" for r in rows])


if TYPE_CHECKING:  # the class has everything base.Backend asks for
    from orchestrator.backends.base import Backend

    _checked: Backend = LocalBackend()
