"""The inventory's job: section: the defaults every job of the inventory gets (JobDefaults), and
its reader. Every validation error names the file, the line, the field and how to fix it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from orchestrator.config.fields import (
    CONTAINER_FIELDS,
    read_checkpoint,
    read_container_options,
    read_metrics_port,
    read_notify_url,
    read_secret_files,
    remote_path,
)
from orchestrator.config.yamlloader import show
from orchestrator.config.yamlreader import Reader

# The most snapshots a job may keep (a value past it is a typo, not a setting).
MAX_SNAPSHOTS = 1_000_000
PRIVATE_SHM = "8g"  # job.ipc: private's /dev/shm when no shm_size is given (Docker's own is 64 MB)

# The fields a job: section may have.
JOB_FIELDS = (
    "image",
    "master_port",
    "nproc_per_node",
    "code_dir",
    "output_dir",
    "shm_size",
    "ipc",
    "env",
    "secret_files",
    "stop_grace",
    "keep_snapshots",
    "checkpoint",
    "notify",
    "notify_url",
    "warm_restarts",
    "hot_spares",
    "metrics_port",
    "telemetry_every",
    "idle_gpu_after",
    "stop_idle",
    *CONTAINER_FIELDS,
)


@dataclass(frozen=True)
class JobDefaults:
    image: str = "fabtrain/trainer:latest"
    master_port: int = 29500
    nproc_per_node: str = "auto"
    code_dir: str = "/opt/fabtrain/code"
    output_dir: str = "/opt/fabtrain/output"
    shm_size: str | None = None
    # host: the host's IPC namespace (/dev/shm shared with every --ipc host container there, any
    # job's); private: the job's own, /dev/shm of shm_size (PRIVATE_SHM unless given).
    ipc: str = "host"
    env: tuple[tuple[str, str], ...] = ()
    # Files read on the orchestrator machine whose contents reach containers as env vars, never on
    # a command line: NAME -> local path.
    secret_files: tuple[tuple[str, str], ...] = ()
    stop_grace: float = 30.0
    # How many of the newest snapshots of a job are kept on every host and on this machine.
    keep_snapshots: int = 2
    # Where a program writes its own checkpoints (fab train --checkpoint), as jobspec.checkpoint_pattern
    # gives it; "" for none.
    checkpoint: str = ""
    # Container options for every host: name -> "soft[:hard]" (-1: unlimited), capabilities,
    # security options (docker run --ulimit / --cap-add / --security-opt).
    ulimits: tuple[tuple[str, str], ...] = ()
    cap_add: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = ()
    # Notifications (progress/notify.py): a command given each event as JSON on stdin, a URL POSTed it.
    notify: str | None = None
    notify_url: str | None = None
    # A job with restarts keeps the containers of the nodes that did not fail and restarts only
    # their workers (the entrypoint's generations, docs/recovery.md); false: every restart is cold.
    warm_restarts: bool = True
    # With warm restarts, the spares' containers are started with the job and wait, workers warm,
    # claimed by it (their GPUs held): a lost or failed node's rank goes to one without a cold start.
    hot_spares: bool = False
    # While a job runs: its /metrics for Prometheus ("[ADDR:]PORT", ADDR 127.0.0.1 unless given),
    # its hosts sampled every telemetry_every seconds (0: never), a GPU it holds idle for
    # idle_gpu_after seconds named (and, with stop_idle, the job stopped).
    metrics_port: str | None = None
    telemetry_every: float = 10.0
    idle_gpu_after: float = 600.0
    stop_idle: bool = False


def read_ipc(reader: Reader) -> tuple[str | None, str]:
    """job.shm_size and job.ipc: a size alone means a private namespace of that size (as before
    ipc existed); private alone, one of PRIVATE_SHM; host with a size is a contradiction."""
    shm_size = reader.get("shm_size", str, None)
    ipc = reader.get("ipc", str, "private" if shm_size else "host")
    if ipc not in ("host", "private"):
        reader.fail(
            reader._field("ipc"),
            f"{show(ipc)} is not an IPC mode",
            "use host (the host's /dev/shm, shared with other jobs there) or private (the job's own)",
            reader.line_of("ipc"),
        )
    if ipc == "host" and shm_size:
        reader.fail(
            reader._field("shm_size"),
            "sizes a private /dev/shm, but job.ipc is host",
            "set job.ipc: private, or remove shm_size",
            reader.line_of("shm_size"),
        )
    return (shm_size or PRIVATE_SHM) if ipc == "private" else None, ipc


def read_nproc(reader: Reader) -> str:
    """job.nproc_per_node: a positive number of processes, or auto."""
    nproc = str(reader.get("nproc_per_node", (int, str), "auto"))
    # [0-9], not isdigit(): '²' is a digit to isdigit() but not to int().
    if nproc != "auto" and not (re.fullmatch(r"[0-9]+", nproc) and int(nproc) > 0):
        reader.fail(
            reader._field("nproc_per_node"),
            f"{show(nproc)} is not a process count",
            "use a positive number, or auto (GPU count, 1 on CPU)",
            reader.line_of("nproc_per_node"),
        )
    return nproc


def read_job(reader: Reader) -> JobDefaults:
    """The job: section (an empty or absent one: every default)."""
    reader.check_keys(JOB_FIELDS)
    nproc = read_nproc(reader)
    secret_files = read_secret_files(reader.sub("secret_files"))
    shm_size, ipc = read_ipc(reader)
    return JobDefaults(
        image=reader.get("image", str, JobDefaults.image),
        master_port=reader.port("master_port", JobDefaults.master_port),
        nproc_per_node=nproc,
        code_dir=remote_path(reader, "code_dir", JobDefaults.code_dir),
        output_dir=remote_path(reader, "output_dir", JobDefaults.output_dir),
        shm_size=shm_size,
        ipc=ipc,
        env=reader.env("env"),
        secret_files=secret_files,
        stop_grace=reader.seconds("stop_grace", JobDefaults.stop_grace, 0),
        keep_snapshots=reader.integer(
            "keep_snapshots", JobDefaults.keep_snapshots, 1, MAX_SNAPSHOTS, "a number of snapshots to keep"
        ),
        checkpoint=read_checkpoint(reader),
        notify=reader.get("notify", str, None),
        notify_url=read_notify_url(reader),
        warm_restarts=reader.get("warm_restarts", bool, JobDefaults.warm_restarts),
        hot_spares=reader.get("hot_spares", bool, JobDefaults.hot_spares),
        metrics_port=read_metrics_port(reader),
        telemetry_every=reader.seconds("telemetry_every", JobDefaults.telemetry_every, 0),
        idle_gpu_after=reader.seconds("idle_gpu_after", JobDefaults.idle_gpu_after, 0),
        stop_idle=reader.get("stop_idle", bool, JobDefaults.stop_idle),
        **read_container_options(reader),
    )
