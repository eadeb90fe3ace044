"""fabtrain: launch, check, watch and stop multi-node PyTorch training in Docker over SSH.

fab cluster.up                       # a local cluster of Docker-in-Docker hosts (the default inventory)
fab preflight                        # every check on every host, as a table
fab train --model tiny --epochs 5    # sync, preflight, start in rank order, stream logs
fab stop                             # stop and remove this project's containers everywhere

Each task: its options (their help: orchestrator/commandline/taskhelp.py), one call that does its work.
"""

from __future__ import annotations

import logging
from pathlib import Path

from invoke import Collection
from rich.console import Console

from orchestrator.commandline import cli, control, exports, observe, prepare, requests, taskhelp, usage
from orchestrator.commandline.taskerrors import user_errors
from orchestrator.commandline.typed import task
from orchestrator.config import inventory as _inventory

# paramiko logs a host that drops a connection as a traceback on stderr; fabtrain names the host.
logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)
cli.quiet_on_closed_pipe()
usage.install()  # a mistyped task or option: exit 2, with the nearest spelling
RUNS = Path("runs")
console = Console(highlight=False, soft_wrap=True)  # long lines stay whole in logs and pipes


@task(auto_shortflags=False, help=taskhelp.SYNC)
@user_errors
def sync(c, inventory=None, code=None, json=False):
    """Copy the code (rsync, in parallel) to job.code_dir/KEY on every host (fab train does this itself)."""
    prepare.sync(inventory, code, json, console)


@task(auto_shortflags=False, kinds={"clock_warn": float, "clock_fail": float}, help=taskhelp.PREFLIGHT)
@user_errors
def preflight(
    c,
    inventory=None,
    json=False,
    strict=False,
    smoke=True,
    clock_warn=0.05,
    clock_fail=0.5,
    code=None,
    deep=False,
):
    """Run every check on every host in parallel; print a table and the fixes; non-zero if any fails.

    SSH and host key, Docker engine and GPU runtime, image present and identical everywhere, GPUs
    on the host and in a container, interface, route and MTU, a master port (the first free one from
    job.master_port, as fab train takes it) reachable from every worker, clock offset and NTP,
    shared memory, disk, synced code, and an all_reduce across every host in the real containers
    (--no-smoke skips it)."""
    prepare.preflight(inventory, json, strict, smoke, clock_warn, clock_fail, code, deep, console)


@task(
    auto_shortflags=False,
    kinds={
        "epochs": int,
        "restarts": int,
        "min_nodes": int,
        "hang_timeout": float,
        "num_nodes": int,
        "gpus": int,
    },
    help=taskhelp.TRAIN,
)
@user_errors
def train(
    c,
    inventory=None,
    model=None,
    epochs=None,
    trainer=None,
    script=None,
    args=None,
    image=None,
    nproc=None,
    dry_run=False,
    skip_preflight=False,
    name=None,
    smoke=False,
    code=None,
    module=None,
    resume=None,
    restarts=None,
    min_nodes=None,
    hang_timeout=None,
    plain=False,
    json=False,
    checkpoint=None,
    continue_=False,
    include=None,
    exclude=None,
    num_nodes=None,
    gpus=None,
    cpuset=False,
    health=False,
    on=None,
    notify=None,
    notify_url=None,
    detach=False,
    queue=False,
    hot_spares=False,
    metrics_port=None,
    stop_idle=False,
):
    """Run a job on every host, its logs streamed here; exits as the job does.

    It runs in stages: plan, claim, sync + preflight, snapshot, start (one container per host,
    rank 0's first), watch (every host's log prefixed host/rank, in the terminal and runs/JOB/HOST.log),
    teardown, decide; with --restarts, again from the newest snapshot (spares take failed hosts'
    places); then finish (outputs fetched, runtime files removed). --dry-run prints the plan that
    would run; runs/JOB/plan.txt holds it for every attempt. Progress, for the hang watchdog, is a
    node's step number rising (a `step N` line) or its $FABTRAIN_HEARTBEAT file touched; until it
    shows either, any output. Snapshots: the newest job.keep_snapshots (2) kept on every host and
    in runs/JOB/snapshots, copies checked by SHA-256. Exits 0 when every node exits 0; otherwise
    names the host. Ctrl+C stops the job."""
    text = requests.train(requests.TrainRequest.of(locals()), RUNS, console, cli.TRAINERS)
    if text is not None:
        print(text)


@task(auto_shortflags=False, kinds={"grace": float}, help=taskhelp.STOP)
@user_errors
def stop(c, inventory=None, job=None, all=False, yes=False, grace=None, json=False):
    """Stop your jobs (--job one, --all everyone's): containers removed, GPUs released.

    The jobs you started (user@machine) on every host: their containers, found by label,
    removed and their GPUs released; a `fab train` watching one (between two attempts too) ends it
    without restarting. Jobs of others are listed and left alone; --job JOB stops that one, --all
    every one. Left-over runtime files (secrets included) of jobs no longer looked after are
    removed. Safe to repeat. A host whose engine does not answer within grace + 15 s is named;
    the others are still served."""
    control.print_stopped(control.stop(inventory, job, all, yes, grace, RUNS), json)


@task(auto_shortflags=False, help=taskhelp.STATUS)
@user_errors
def status(c, inventory=None, json=False):
    """List the jobs on the hosts (and on Slurm): who, where, state, attempt, last step.

    Per job: id, who started it, hosts with their GPUs (CPU slots), state,
    attempt, last step seen, since when. A host that does not answer within 10 s (SSH down, or a
    stuck Docker engine) is named; exits non-zero then."""
    control.print_status(control.status(inventory, RUNS), json, console)


@task(auto_shortflags=False, help=taskhelp.TOP)
@user_errors
def top(c, inventory=None, json=False):
    """Watch every host live: who holds each GPU (CPU slot), how busy it is, each job's step rate.

    Per host: its GPUs (or CPU slots) with the job and owner holding each and each GPU's
    utilisation and memory; each job container's CPU and memory; each job's last step and steps
    per second. Refreshes every 2 s until Ctrl+C. A host that does not answer within 20 s is named
    (with --json, exits non-zero then)."""
    observe.top(inventory, json, console)


@task(auto_shortflags=False, help=taskhelp.LOGS)
@user_errors
def logs(c, inventory=None, job=None, plain=False, json=False):
    """Re-attach to a running job: stream every host's log from the start. Ctrl+C detaches only."""
    say = cli.stderr_console() if json else console
    control.print_followed(control.logs(inventory, job, RUNS, say, plain, json), json, say)


@task(auto_shortflags=False, positional=["job"], help=taskhelp.ATTACH)
@user_errors
def attach(c, job=None, inventory=None, plain=False, json=False):
    """Take over a running job whose fab train (or controller) is gone: fab attach JOB.

    The job goes on here as under fab train: every node's log from the start of its output, the hang
    watchdog, restarts, snapshot copies, and the outputs fetched at the end; no container is started
    again. A job whose fab train still renews its lease is left alone (fab logs follows it)."""
    control.print_taken_over(control.attach(inventory, job, RUNS, console, json, plain), json, console)


@task(auto_shortflags=False, help=taskhelp.RUNS)
@user_errors
def runs(c, json=False):
    """List past runs (runs/*/job.json), newest first: job, state, attempts, duration, eval loss, hosts."""
    observe.runs(RUNS, json, console)


@task(auto_shortflags=False, help=taskhelp.PLOT)
@user_errors
def plot(c, jobs, out=None):
    """Draw loss (train per step, eval per epoch) and tokens/s per rank of one or several runs."""
    observe.plot(RUNS, jobs, out)


@task(auto_shortflags=False, help=taskhelp.METRICS)
@user_errors
def metrics(c, job=None, json=False):
    """Show a job's newest figures, per rank and per host, while it runs or after.

    Each rank's step, loss, tokens/s, step and compute ms, and each host's newest telemetry (GPUs,
    containers, load), read from runs/JOB's files (their last 4 MB)."""
    observe.metrics(RUNS, job, json)


@task(auto_shortflags=False, kinds={"epochs": int}, help=taskhelp.EXPORT_SLURM)
@user_errors
def slurm(
    c,
    inventory=None,
    model=None,
    epochs=None,
    trainer=None,
    script=None,
    args="",
    image=None,
    nproc=None,
    name=None,
    code=None,
    module=None,
    out=None,
    pyxis=False,
    partition=None,
    time=None,
):
    """Write the job as an sbatch script for Slurm.

    One task per node starting the same container (devices, env,
    mounts, shm, entrypoint), rank 0 on the allocation's first node, --kill-on-bad-exit, requeued
    after a node failure to resume from the newest snapshot. Submit it with sbatch."""
    job = requests.job_options(locals())
    rendered = exports.export(
        "slurm", inventory, job, cli.TRAINERS, RUNS, console, pyxis=pyxis, partition=partition, time=time
    )
    exports.write_sbatch(rendered, out)


@task(auto_shortflags=False, kinds={"epochs": int}, help=taskhelp.EXPORT_K8S)
@user_errors
def k8s(
    c,
    inventory=None,
    model=None,
    epochs=None,
    trainer=None,
    script=None,
    args="",
    image=None,
    nproc=None,
    name=None,
    code=None,
    module=None,
    out=None,
    restarts=0,
):
    """Write the job as Kubernetes manifests.

    A Kubeflow Trainer v2 TrainJob (trainjob.yaml, on the
    cluster's torch-distributed runtime), a Kubeflow PyTorchJob (Training Operator v1, deprecated), and
    an Indexed Job with a headless Service for clusters with neither. Same image, env, GPUs and
    entrypoint, outputs on a PersistentVolumeClaim; secrets as references to a Secret, never values."""
    job = requests.job_options(locals())
    rendered = exports.export("kubernetes", inventory, job, cli.TRAINERS, RUNS, console, restarts=restarts)
    exports.write_manifests(rendered, out)


@task(auto_shortflags=False, help=taskhelp.CLUSTER_UP)
@user_errors
def up(c, nodes=2, spares=0, write_inventory=None, slurm=False, json=False):
    """Start (or reuse) the local cluster of Docker-in-Docker test hosts.

    N hosts with sshd and their own Docker
    engine on a private network, the trainer image loaded in each, host keys recorded."""
    prepare.cluster_up(nodes, spares, write_inventory, slurm, json)


@task(auto_shortflags=False)
@user_errors
def down(c):
    """Remove the local cluster's hosts, their volumes and the network."""
    from orchestrator.testbed import cluster  # the Docker library: only for the local cluster's tasks

    cluster.down()


@task(auto_shortflags=False, help=taskhelp.IMAGE_PUSH)
@user_errors
def push(c, inventory=None, image=None, only=None, method="chain"):
    """Copy a local image to every host over SSH, without a registry.

    By a chain of hosts forwarding to each other,
    sending only the layers they lack (--method direct: one stream per host), skipping hosts that
    hold the same image id and verifying the id after."""
    prepare.push(inventory, image, only, method, console)


@task(auto_shortflags=False, help=taskhelp.IMAGE_BUILD)
@user_errors
def build(c, base, requirements, tag, pip_args="", wheels=None):
    """Build a job image: a base image, your requirements file and fabtrain's entrypoint.

    On
    this machine's Docker engine; then 'fab image.push --image TAG' puts it on every host."""
    prepare.build(base, requirements, tag, pip_args, wheels, console)


@task(auto_shortflags=False)
@user_errors
def images(c):
    """Build the base, test-host and trainer images locally (no registry); reuses what exists."""
    from orchestrator.testbed import cluster

    cluster.build_images()


@task(
    auto_shortflags=False,
    kinds={"port": int, "refresh": float},
    iterable=["allow_host"],
    help=taskhelp.DASHBOARD,
)
@user_errors
def dashboard(
    c, inventory=None, port=8765, address="127.0.0.1", refresh=5.0, token_file=None, allow_host=None
):
    """Serve a read-only web page of the cluster: hosts and who holds each GPU, the queue, the jobs.

    Hosts with the job and owner of each GPU (CPU slot) and their use, as fab top shows them; jobs
    as fab status lists them, with loss and tokens/s; the queue; and per job run here its loss and
    throughput curves, telemetry, attempts and failures, plan and each host's log tail. One look at
    the hosts every --refresh seconds, however many browsers are open. Runs until Ctrl+C. Answers
    only this machine's names (and --allow-host's); on any address but loopback, only a browser
    that opened the printed URL with its token once (kept in a cookie)."""
    from orchestrator.dashboard import server as _dashboard

    _dashboard.serve(
        _inventory.load(inventory), RUNS, address, port, refresh, print, token_file, allow_host or ()
    )


@task(auto_shortflags=False, positional=["job"], kinds={"rank": int}, help=taskhelp.SHELL)
@user_errors
def shell(c, job, rank=None, host=None, inventory=None):
    """Open a shell in a job's container: fab shell JOB [--rank K | --host H] [-- CMD ...].

    docker exec in that node's container over the SSH path fabtrain uses for its host (jump hosts,
    ssh_config, the inventory's keys and known_hosts), with a terminal when stdin and stdout are
    terminals. With -- CMD, runs CMD there instead and exits with its exit status."""
    from orchestrator.commandline import access

    access.shell(inventory, job, rank, host, access.command_of(c), RUNS)


@task(
    auto_shortflags=False,
    positional=["job", "port"],
    kinds={"port": int, "local": int},
    help=taskhelp.FORWARD,
)
@user_errors
def forward(c, job, port, local=None, inventory=None):
    """Forward a port of a job's rank 0 (TensorBoard, Jupyter) to 127.0.0.1 here until Ctrl+C.

    fab forward JOB PORT [--local LOCAL]: the container runs on its host's network, so PORT is its
    host's; the tunnel takes the SSH path fabtrain uses for that host. Only this machine can connect."""
    from orchestrator.commandline import access

    access.forward(inventory, job, port, local, RUNS, print)


ns = Collection(
    sync,
    preflight,
    train,
    attach,
    stop,
    status,
    top,
    logs,
    runs,
    plot,
    metrics,
    images,
    dashboard,
    shell,
    forward,
)
ns.add_collection(Collection("image", push, build))
ns.add_collection(Collection("cluster", up, down))
ns.add_collection(Collection("export", slurm, k8s))
