"""The steps of an attempt's plan that run only when their When says so (attempt.build puts them
after the ALWAYS ones, stagesteps.py): the lease kept, snapshots copied off rank 0's host, the looks
into a node (its heartbeat, stacks, flight recorder, the output a follow missed), the stops on a
failure or an interruption, and the telemetry samples. Which of them run depends on what happens."""

from __future__ import annotations

from pathlib import Path

from orchestrator.backends.ssh.planstep import Step, When, local_step, remote_step
from orchestrator.backends.ssh.stagesteps import stop_command, stopped_command, stopping
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import jobspec
from orchestrator.hostcmds import dockerargs, hostfiles, sshargs
from orchestrator.snapshots.commands import layout, local_dir_name
from orchestrator.telemetry.commands import telemetry_script
from orchestrator.transport.deadlines import STATUS_TIMEOUT, STOP_MARGIN

STACKS_TIMEOUT = 15
TELEMETRY_TIMEOUT = 20  # seconds one host's sample may take (nvidia-smi and docker stats are bounded inside)


def conditional_steps(
    inv: Inventory, spec: jobspec.JobSpec, run_dir: str, warm: bool, hot: tuple[Host, ...] = ()
) -> list[Step]:
    """The steps that run only when their When says so: which run depends on what happens."""
    return [
        *lease_steps(inv, spec, hot),
        *snapshot_copy_steps(inv, spec, run_dir),
        *look_steps(inv, spec),
        *stop_steps(inv, spec, warm, hot),
    ]


def lease_steps(inv: Inventory, spec: jobspec.JobSpec, hot: tuple[Host, ...]) -> list[Step]:
    """ON_LEASE: the job's lease touched on its hosts and hot spares."""
    lease = sshargs.shell(["touch", f"{hostfiles.runtime_dir(inv, spec)}/{hostfiles.LEASE}"])
    return [
        remote_step(h, "lease", lease, STATUS_TIMEOUT, When.ON_LEASE, what="touching the job's lease")
        for h in (*inv.hosts, *hot)
    ]


def snapshot_copy_steps(inv: Inventory, spec: jobspec.JobSpec, run_dir: str) -> list[Step]:
    """ON_SNAPSHOT: rank 0's host's snapshots listed, and a new one copied here (runs/JOB)."""
    m = inv.master
    shape = layout(spec)
    local = Path(run_dir) / local_dir_name(spec)
    some = "NAME" if not spec.checkpoint else "00000000000000000000"  # the name found, when it runs
    return [
        remote_step(
            m,
            "snapshot-list",
            shape.list_command(inv, spec),
            STATUS_TIMEOUT,
            When.ON_SNAPSHOT,
            what="listing snapshots",
        ),
        local_step(
            m,
            "snapshot-fetch",
            sshargs.fetch_file_argv(m, shape.remote(inv, spec, some), str(shape.local(local, some))),
            When.ON_SNAPSHOT,
            what="copying a snapshot",
        ),
    ]


def look_steps(inv: Inventory, spec: jobspec.JobSpec) -> list[Step]:
    """The looks into each node: its heartbeat (ON_SILENT), every rank's stacks and flight recorder
    (ON_HANG), the rest of an output the follow missed (ON_MISSED)."""
    hosts = inv.hosts
    steps = [
        remote_step(
            h,
            "progress",
            hostfiles.progress_script(inv, spec, h.rank),
            STATUS_TIMEOUT,
            When.ON_SILENT,
            what="reading the heartbeat",
        )
        for h in hosts
    ]
    looks = (
        ("stacks", dockerargs.STACKS_PY, "reading stacks"),
        ("flight", dockerargs.FLIGHT_PY, "reading the flight recorder"),
    )
    for h in hosts:
        steps += [
            remote_step(
                h,
                key,
                sshargs.shell(dockerargs.python_in_node(spec, h.rank, code)),
                STACKS_TIMEOUT,
                When.ON_HANG,
                what=what,
            )
            for key, code, what in looks
        ]
    return steps + [
        remote_step(
            h,
            "remainder",
            hostfiles.remainder_logs_script(inv, spec, h.rank, "OFFSET"),
            STATUS_TIMEOUT + 20,
            When.ON_MISSED,
            what="reading the rest of the output",
        )
        for h in hosts
    ]


def stop_steps(inv: Inventory, spec: jobspec.JobSpec, warm: bool, hot: tuple[Host, ...]) -> list[Step]:
    """A look for fab stop's marker after a failed attempt (ON_FAILED), the other hosts' part
    ended when a node fails (ON_FAILURE), and every container stopped on an interruption
    (ON_INTERRUPT), hot spares' too."""
    hosts, job = inv.hosts, inv.job
    steps = [
        remote_step(
            h,
            "stopped",
            stopped_command(inv, spec.job_id),
            STATUS_TIMEOUT,
            When.ON_FAILED,
            what="checking for fab stop",
        )
        for h in hosts
    ]
    steps += [
        remote_step(
            h,
            "stop-on-failure",
            stop_command(inv, spec, h, warm),
            STOP_MARGIN,
            When.ON_FAILURE,
            what=stopping(warm),
        )
        for h in hosts
    ]
    return steps + [
        remote_step(
            h,
            "stop-on-interrupt",
            dockerargs.stop_script(spec.job_id, job.stop_grace),
            job.stop_grace + STOP_MARGIN,
            When.ON_INTERRUPT,
            what="stopping containers",
        )
        for h in (*hosts, *hot)
    ]


def telemetry_steps(inv: Inventory, spec: jobspec.JobSpec) -> list[Step]:
    """WATCH's samples of every host (telemetry/sampler.py), when job.telemetry_every is not 0."""
    if not inv.job.telemetry_every:
        return []
    return [
        remote_step(
            h,
            "telemetry",
            telemetry_script(inv, spec.job_id),
            TELEMETRY_TIMEOUT,
            When.ON_SAMPLE,
            what="sampling the host's telemetry",
        )
        for h in inv.hosts
    ]
