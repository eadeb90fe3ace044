"""fabtrain: launch, check, watch and stop multi-node PyTorch training in Docker over SSH.

fab cluster.up                       # a local cluster of Docker-in-Docker hosts (the default inventory)
fab preflight                        # every check on every host, as a table
fab train --model tiny --epochs 5    # sync, preflight, start in rank order, stream logs
fab stop                             # stop and remove this project's containers everywhere
"""

from __future__ import annotations

import functools
import json as _json
import logging
import shlex
import sys
from pathlib import Path

from fabric import Connection
from invoke import Collection, Exit
from rich.console import Console

from orchestrator import preflight as _preflight
from orchestrator.backends.ssh import jobcontrol as _jobcontrol
from orchestrator.backends.ssh import steps as _steps
from orchestrator.commandline import cli, requests, usage
from orchestrator.commandline.typed import task
from orchestrator.config import inventory as _inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.policy import HANG_TIMEOUT
from orchestrator.hosts import hostops
from orchestrator.images import images as _images
from orchestrator.preflight import deep as _deep
from orchestrator.testbed import cluster as _cluster
from orchestrator.transport.remote import Session

# paramiko logs a host that drops a connection as a traceback on stderr; fabtrain names the host.
logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)
cli.quiet_on_closed_pipe()
usage.install()  # a mistyped task or option: exit 2, with the nearest spelling
RUNS = Path("runs")
console = Console(highlight=False, soft_wrap=True)  # long lines stay whole in logs and pipes
INV_HELP = "inventory file (default: $FABTRAIN_INVENTORY, else inventory.yaml here)"


def fabric_core_flags(c) -> None:
    """Fabric's -H, -i and -S choose hosts, keys and an ssh_config for Fabric's own connections;
    fabtrain takes all three from the inventory, so they stop with a clear error, never ignored."""
    if isinstance(c, Connection):
        raise UserError(
            f"-H/--hosts ({c.host}) is Fabric's host list; fabtrain's hosts come from the inventory "
            "(--inventory PATH). Leave -H out",
            exit_code=2,
        )
    if c.config.connect_kwargs.get("key_filename"):
        raise UserError(
            "-i/--identity is Fabric's key option; fabtrain takes keys from the inventory (ssh: key:, "
            "or per host) or your ssh-agent and ~/.ssh/config. Leave -i out",
            exit_code=2,
        )
    if getattr(c.config, "_runtime_ssh_path", None):
        raise UserError(
            "-S/--ssh-config is Fabric's option; fabtrain reads ~/.ssh/config, or the file named by the "
            "inventory's ssh: config: field. Leave -S out",
            exit_code=2,
        )


def user_errors(fn):
    """Print a user's mistake as one clear message and exit non-zero, never as a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            fabric_core_flags(args[0])
            return fn(*args, **kwargs)
        except UserError as exc:
            print(f"error: {hostile.text(str(exc))}", file=sys.stderr)
            raise Exit(code=exc.exit_code) from None

    return wrapper


CODE_HELP = (
    "your project's folder, with --script/--module: synced to job.code_dir/KEY (KEY names its "
    "contents) and linked into the job's writable working directory (default: the current directory)"
)


TREE_HELP = "your project's folder (default: this project's built-in trainers)"


@task(
    auto_shortflags=False,
    help={
        "inventory": INV_HELP,
        "code": TREE_HELP,
        "json": "print where the code went and how long each host took, as JSON",
    },
)
@user_errors
def sync(c, inventory=None, code=None, json=False):
    """Copy the code (rsync, in parallel) to job.code_dir/KEY on every host (fab train does this itself)."""
    from orchestrator.progress import bars

    inv = _inventory.load(inventory)
    tree = cli.code_tree(code)
    say = cli.stderr_console() if json else console
    for line in hostops.tree_lines(*tree):
        say.print(line, markup=False, highlight=False)
    with Session(inv.hosts) as session, bars.bar(say) as progress:
        dest, times = hostops.sync(session, inv, *tree, transfers=bars.Transfers(progress))
    if json:
        print(
            _json.dumps(
                {"destination": dest, "seconds": {h: round(t, 3) for h, t in times.items()}}, indent=2
            )
        )
        return
    for host, seconds in times.items():
        print(f"{host}: synced to {dest} in {seconds:.2f}s")


@task(
    auto_shortflags=False,
    kinds={"clock_warn": float, "clock_fail": float},
    help={
        "inventory": INV_HELP,
        "json": "print the results as JSON",
        "strict": "fail on warnings too",
        "smoke": "run the collective smoke test (all_reduce in the real containers; default on)",
        "clock_warn": "warn above this clock offset, seconds (default 0.05)",
        "clock_fail": "fail above this clock offset, seconds (default 0.5)",
        "code": TREE_HELP,
        "deep": "also measure: disk write speed and space, compute per host (GPU) against its peers, "
        "bandwidth and round trips between every pair of hosts, GPU health (ECC, XID, throttling, "
        "PCIe, dcgmi); kept in .fabtrain/health.json (or $XDG_STATE_HOME/fabtrain/) for fab train --health",
    },
)
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
    inv = _inventory.load(inventory)
    limits = _preflight.Limits(clock_warn=float(clock_warn), clock_fail=float(clock_fail))
    with Session(inv.hosts) as session:
        source, only = cli.code_tree(code)
        inv = hostops.with_free_port(session, inv)
        checks = _preflight.run(
            session, inv, limits=limits, run_job=_steps.run_quiet if smoke else None, source=source, only=only
        )
        measured = None
        if deep:
            more, measured = _deep.run_deep(session, inv)
            _deep.save(measured, more)
            checks = checks + more
    if json:
        out = _json.loads(_preflight.to_json(checks, strict))
        if measured is not None:
            out["deep"] = measured
        print(_json.dumps(out, indent=2))
    else:
        _preflight.render(checks, console)
        if measured is not None and len(inv.hosts) > 1:
            console.print(
                "network, Mbit/s (row sends to column):\n" + measured["network"]["matrix"], markup=False
            )
    bad = _preflight.failed(checks, strict)
    if bad:
        raise Exit(code=1)


TRAINERS = {"gpt": "trainers/gpt.py", "mlp-tp": "trainers/mlp_tp.py"}


PLAIN_HELP = (
    "no live status lines at the bottom of the terminal, only the hosts' log lines (always so "
    "when output is not a terminal)"
)

# The options that describe a job: fab train's and the exports'.
JOB_HELP = {
    "inventory": INV_HELP,
    "model": "GPT preset: tiny, small or medium (default tiny)",
    "epochs": "number of epochs (default 5)",
    "trainer": f"built-in trainer: {', '.join(TRAINERS)}",
    "script": "your own torchrun-compatible script (a path inside --code) instead of a trainer",
    "module": "run a Python module instead (torchrun -m NAME): one installed in the image, or in --code",
    "code": CODE_HELP,
    "args": "arguments for the script, one string split like a shell would: --args \"--lr 0.1 --name 'a b'\"",
    "image": "container image (default: job.image in the inventory)",
    "nproc": "processes per node (default: job.nproc_per_node; auto = GPU count, 1 on CPU)",
    "name": "job name prefix (default: the trainer or script name)",
}


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
    help={
        **JOB_HELP,
        "checkpoint": "where your program writes its checkpoints (a path or glob relative to its working "
        "directory, or under /output; default: job.checkpoint): kept here and put back on every host for a "
        "restart, --resume or --continue",
        "dry_run": "print the attempt's plan (every command per host, in order) and start nothing",
        "skip_preflight": "start without the preflight checks (code is still synced)",
        "smoke": "also run the collective smoke test before starting",
        "resume": "continue this job (id from runs/) with its id, arguments and output directory, from its "
        "newest snapshot; --restarts, --min-nodes, --hang-timeout, --epochs, --args, --image, --code and "
        "--checkpoint may change what was recorded (a finished job continues with new --epochs or --args)",
        "include": "run on these hosts only, joined by @ (DeepSpeed's syntax), each optionally with its GPUs "
        "(CPU slots on a host without GPUs): --include node1@node3, --include node1:0,1@node2:2,3",
        "exclude": "run on every host but these: --exclude node2",
        "num_nodes": "run on the first N hosts (of --include's, or hosts:) where the job fits beside other "
        "jobs",
        "gpus": "take N free GPUs on each host (N CPU slots on a host without GPUs); one process each unless "
        "--nproc says otherwise (default: every GPU of the host; one slot)",
        "cpuset": "pin each CPU host's container to the CPUs of its slots (docker --cpuset-cpus)",
        "health": "first the deep check (fab preflight --deep; results under an hour old are reused) of "
        "the hosts and spares: unhealthy hosts are left out and healthy spares take their places",
        "continue_": "continue the newest job of this --name (runs/NAME-*) in its own output directory, "
        "from its newest snapshot or checkpoint, finished or not; a new job when there is none",
        "restarts": "restart the whole job up to N times after a failure, lost host or hang (default 0)",
        "min_nodes": "with no spare host left, go on with at least this many nodes (default: all of hosts:)",
        "hang_timeout": f"seconds without progress (docs/recovery.md) before the stacks are dumped and the "
        f"attempt fails (default {HANG_TIMEOUT:g}; 0: off)",
        "plain": PLAIN_HELP,
        "json": "events as JSON lines on stdout (docs/how-train-works.md) instead of the hosts' log lines",
        "notify": "run this command for each notification (started, attempt_failed, restarted, hung, "
        "finished, failed, stopped) with the event as JSON on its stdin (docs/detached.md; default: "
        "job.notify)",
        "notify_url": "POST each notification as JSON to this http(s) URL (default: job.notify_url)",
        "queue": "when its hosts or GPUs are held, wait in line (first come, first served on each host; "
        "'fab status' shows the queue) and start by itself once they are free (docs/sharing.md)",
        "hot_spares": "with --restarts: start the inventory's spares with the job and keep them waiting, "
        "workers warm and their GPUs claimed, so a failed or lost node's rank goes to one without a cold "
        "start (default: job.hot_spares; docs/recovery.md)",
        "detach": "run the job's control in a container on the inventory's controller: host (default: a "
        "spare, else the last host), with a standby on another host that takes over if it is lost, and "
        "return at once; fab logs, status, stop and attach find it (docs/detached.md)",
        "metrics_port": "serve the job's metrics for Prometheus at http://127.0.0.1:PORT/metrics while it "
        "runs (ADDR:PORT to listen elsewhere, 0.0.0.0:PORT on every address; default: job.metrics_port; "
        "docs/observability.md)",
        "stop_idle": "stop the job when a GPU it holds stays idle for job.idle_gpu_after seconds (600); "
        "without it, the GPU is only named",
        "on": "ssh (default: the inventory's hosts), slurm: submit to the inventory's slurm: section's "
        "login node and follow the job there (docs/slurm-kubernetes.md), or kubernetes: with --dry-run, the "
        "manifests to hand to kubectl (render only)",
    },
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
    text = requests.train(requests.TrainRequest.of(locals()), RUNS, console, TRAINERS)
    if text is not None:
        print(text)


@task(
    auto_shortflags=False,
    kinds={"grace": float},
    help={
        "inventory": INV_HELP,
        "job": "stop this job only (an id from 'fab status')",
        "all": "stop every fabtrain job on the hosts, other people's too (asks first)",
        "yes": "with --all: do not ask",
        "grace": "seconds between SIGTERM and SIGKILL (default: job.stop_grace)",
        "json": "print what was stopped as JSON",
    },
)
@user_errors
def stop(c, inventory=None, job=None, all=False, yes=False, grace=None, json=False):
    """Stop your jobs (--job one, --all everyone's): containers removed, GPUs released.

    The jobs you started (user@machine) on every host: their containers, found by label,
    removed and their GPUs released; a `fab train` watching one (between two attempts too) ends it
    without restarting. Jobs of others are listed and left alone; --job JOB stops that one, --all
    every one. Left-over runtime files (secrets included) of jobs no longer looked after are
    removed. Safe to repeat. A host whose engine does not answer within grace + 15 s is named;
    the others are still served."""
    out = requests.stop(inventory, job, all, yes, grace, RUNS)
    for line in out.problems:
        print(line, file=sys.stderr)
    if json:
        print(_json.dumps(out.doc(), indent=2))
    else:
        for line in out.lines:
            print(line)
    if out.failed:
        raise UserError(f"stop failed on {', '.join(out.failed)}; run 'fab stop' again once they answer")


@task(auto_shortflags=False, help={"inventory": INV_HELP, "json": "print the jobs as JSON"})
@user_errors
def status(c, inventory=None, json=False):
    """List the jobs on the hosts (and on Slurm): who, where, state, attempt, last step.

    Per job: id, who started it, hosts with their GPUs (CPU slots), state,
    attempt, last step seen, since when. A host that does not answer within 10 s (SSH down, or a
    stuck Docker engine) is named; exits non-zero then."""
    found = requests.status(inventory, RUNS)
    if json:
        print(_json.dumps(found.doc, indent=2))
    else:
        # Piped or captured, rows stay whole (rich would fit the table to 80 columns).
        out = console if console.is_terminal else Console(highlight=False, width=250)
        for table in found.tables:
            out.print(table)
        for line in found.lines:
            out.print(line, markup=False)
    if found.errors:
        raise UserError("\n".join(found.errors))


@task(auto_shortflags=False, help={"inventory": INV_HELP, "json": "print one snapshot as JSON and exit"})
@user_errors
def top(c, inventory=None, json=False):
    """Watch every host live: who holds each GPU (CPU slot), how busy it is, each job's step rate.

    Per host: its GPUs (or CPU slots) with the job and owner holding each and each GPU's
    utilisation and memory; each job container's CPU and memory; each job's last step and steps
    per second. Refreshes every 2 s until Ctrl+C. A host that does not answer within 20 s is named
    (with --json, exits non-zero then)."""
    from orchestrator.progress import top as _top

    inv = _inventory.load(inventory)
    if not json:
        _top.live(inv, console)
        return
    snap = _top.once(inv)
    print(_json.dumps(snap, indent=2))
    if snap["errors"]:
        raise UserError("\n".join(snap["errors"]))


@task(
    auto_shortflags=False,
    help={
        "inventory": INV_HELP,
        "job": "job id (default: the one running)",
        "plain": PLAIN_HELP,
        "json": "events as JSON lines on stdout instead of the hosts' log lines",
    },
)
@user_errors
def logs(c, inventory=None, job=None, plain=False, json=False):
    """Re-attach to a running job: stream every host's log from the start. Ctrl+C detaches only."""
    say = cli.stderr_console() if json else console
    finished = requests.logs(inventory, job, RUNS, say, plain, json)
    if finished.run_dir is not None and (finished.run_dir / "job.json").is_file():  # a detached job, fetched
        cli.present(finished.run_dir, say)
    if finished.closing:
        print(finished.closing, file=sys.stderr if json else sys.stdout)
    if finished.error is not None:
        raise finished.error


@task(
    auto_shortflags=False,
    positional=["job"],
    help={
        "inventory": "the inventory (default: the one the job was started with)",
        "job": "the job to take over (an id from 'fab status')",
        "plain": PLAIN_HELP,
        "json": "events as JSON lines on stdout",
    },
)
@user_errors
def attach(c, job=None, inventory=None, plain=False, json=False):
    """Take over a running job whose fab train (or controller) is gone: fab attach JOB.

    The job goes on here as under fab train: every node's log from the start of its output, the hang
    watchdog, restarts, snapshot copies, and the outputs fetched at the end; no container is started
    again. A job whose fab train still renews its lease is left alone (fab logs follows it)."""
    if not job:
        raise UserError("give the job to take over: fab attach JOB ('fab status' lists them)", exit_code=2)
    finished = requests.attach(inventory, job, RUNS, console, json, plain)
    if finished.run_dir is not None:
        cli.present(finished.run_dir, cli.stderr_console() if json else console)
    if finished.error is not None:
        raise finished.error
    print(finished.closing)


@task(auto_shortflags=False, help={"json": "print the runs as JSON"})
@user_errors
def runs(c, json=False):
    """List past runs (runs/*/job.json), newest first: job, state, attempts, duration, eval loss, hosts."""
    import json as _json

    from rich.table import Table

    from orchestrator.progress import report

    if json:
        print(_json.dumps({"runs": report.runs(RUNS)}, indent=2, default=str))
        return
    table = Table(title=f"runs in {RUNS}/")
    table.add_column("job", no_wrap=True)  # a job id is what 'fab plot' and '--resume' take: never cut
    for col in ("state", "attempts", "duration", "eval loss", "hosts"):
        table.add_column(col)
    for r in report.runs(RUNS):
        loss = f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] is not None else "-"
        took = f"{r['seconds']:.0f}s" if r["seconds"] is not None else "-"
        table.add_row(
            *(
                hostile.rich_text(str(x))
                for x in (r["job"], r["state"] or "-", r["attempts"], took, loss, ", ".join(r["hosts"]))
            )
        )
    console.print(table)


@task(
    auto_shortflags=False,
    help={
        "jobs": "one or more job ids, comma-separated (see fab runs)",
        "out": "PNG to write (default: runs/JOB/loss.png for one job, runs/compare.png for several)",
    },
)
@user_errors
def plot(c, jobs, out=None):
    """Draw loss (train per step, eval per epoch) and tokens/s per rank of one or several runs."""
    from orchestrator.progress import report

    names = [j for j in jobs.replace(" ", ",").split(",") if j]
    dirs = []
    for name in names:
        if not jobspec.valid_job_id(name) or not (RUNS / name).is_dir():
            raise UserError(f"no run {hostile.text(name)!r} in {RUNS}/; 'fab runs' lists them", exit_code=2)
        dirs.append(RUNS / name)
    target = Path(out) if out else (dirs[0] / "loss.png" if len(dirs) == 1 else RUNS / "compare.png")
    print(f"wrote {report.write_plot(dirs, target)}")


@task(
    auto_shortflags=False,
    help={"job": "job id (default: the newest run in runs/)", "json": "print the figures as JSON"},
)
@user_errors
def metrics(c, job=None, json=False):
    """Show a job's newest figures, per rank and per host, while it runs or after.

    Each rank's step, loss, tokens/s, step and compute ms, and each host's newest telemetry (GPUs,
    containers, load), read from runs/JOB's files (their last 4 MB)."""
    from orchestrator.progress import latest, report

    if job is None:
        found = report.runs(RUNS)
        if not found:
            raise UserError(f"no runs in {RUNS}/ yet; start one with fab train", exit_code=2)
        job = found[0]["job"]
    if not jobspec.valid_job_id(job):
        raise _jobcontrol.unknown_job(job)
    if not (RUNS / job).is_dir():  # a detached job started elsewhere: fab logs --job copies it here
        raise _jobcontrol.unknown_job(job, f" in {RUNS}/")
    doc = latest.latest(RUNS / job)
    if json:
        print(_json.dumps(doc, indent=2))
        return
    for line in latest.lines(doc):
        print(line)


def _warn(warnings) -> None:
    for w in warnings:
        print(f"warning: {hostile.text(w)}", file=sys.stderr)


@task(
    auto_shortflags=False,
    kinds={"epochs": int},
    help={
        **JOB_HELP,
        "out": "file to write (default: JOB.sbatch)",
        "pyxis": "run the image with pyxis/enroot (srun --container-image) instead of docker run",
        "partition": "#SBATCH --partition",
        "time": "#SBATCH --time (e.g. 12:00:00)",
    },
)
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
    rendered = requests.export(
        "slurm",
        inventory,
        requests.job_options(locals()),
        TRAINERS,
        RUNS,
        console,
        pyxis=pyxis,
        partition=partition,
        time=time,
    )
    _warn(rendered.warnings)
    [(name, text)] = rendered.files.items()
    target = Path(out or name)
    target.write_text(text)
    target.chmod(0o755)
    print(
        f"wrote {target} (job {rendered.job_id}); put the code on every node (fab sync) and submit: "
        f"sbatch {target}"
    )


@task(
    auto_shortflags=False,
    kinds={"epochs": int},
    help={
        **JOB_HELP,
        "out": "directory to write trainjob.yaml, pytorchjob.yaml and indexed-job.yaml to (default: JOB-k8s)",
        "restarts": "pod failures the job tolerates (backoffLimit, default 0)",
    },
)
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
    rendered = requests.export(
        "kubernetes", inventory, requests.job_options(locals()), TRAINERS, RUNS, console, restarts=restarts
    )
    _warn(rendered.warnings)
    target = Path(out or f"{rendered.job_id}-k8s")
    target.mkdir(parents=True, exist_ok=True)
    for file, text in rendered.files.items():
        (target / file).write_text(text)
    print(
        f"wrote {', '.join(f'{target}/{f}' for f in rendered.files)} (job {rendered.job_id}); apply one with "
        f"kubectl apply -f (trainjob.yaml on Kubeflow Trainer v2)"
    )


@task(
    auto_shortflags=False,
    help={
        "nodes": "number of test hosts (default 2)",
        "spares": "number of spare hosts, listed under spares: (default 0)",
        "write_inventory": "also write the matching inventory to this path",
        "slurm": "also make the hosts a Slurm cluster (slurmctld on the first), for fab export.slurm",
        "json": "print the hosts and the inventory's path as JSON (progress goes to stderr)",
    },
)
@user_errors
def up(c, nodes=2, spares=0, write_inventory=None, slurm=False, json=False):
    """Start (or reuse) the local cluster of Docker-in-Docker test hosts.

    N hosts with sshd and their own Docker
    engine on a private network, the trainer image loaded in each, host keys recorded."""
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if json else print
    made = _cluster.up(int(nodes), write_inventory, spares=int(spares), slurm=slurm, log=log)
    if json:
        count = int(nodes)
        print(
            _json.dumps(
                {
                    "inventory": str(write_inventory or _cluster.STATE_DIR / "inventory.yaml"),
                    "hosts": [{"name": n.name, "address": n.address} for n in made[:count]],
                    "spares": [{"name": n.name, "address": n.address} for n in made[count:]],
                },
                indent=2,
            )
        )


@task(auto_shortflags=False)
@user_errors
def down(c):
    """Remove the local cluster's hosts, their volumes and the network."""
    _cluster.down()


@task(
    auto_shortflags=False,
    help={
        "inventory": INV_HELP,
        "image": "image to push (default: job.image)",
        "only": "comma-separated host names (default: every host)",
        "method": "chain (hosts forward to each other, only the layers they lack; default) or direct "
        "(one stream per host from here)",
    },
)
@user_errors
def push(c, inventory=None, image=None, only=None, method="chain"):
    """Copy a local image to every host over SSH, without a registry.

    By a chain of hosts forwarding to each other,
    sending only the layers they lack (--method direct: one stream per host), skipping hosts that
    hold the same image id and verifying the id after."""
    if method not in ("chain", "direct"):
        raise UserError(f"--method {hostile.text(str(method))!r}: give chain or direct", exit_code=2)
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    inv = _inventory.load(inventory)
    image = image or inv.job.image
    selected = inv.select(only.split(",") if only else None)
    with (
        Session(selected) as session,
        Progress(
            "{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console,
            transient=True,
        ) as progress,
    ):
        results = _images.push(session, image, progress=progress, method=method)
    for r in results:
        extra = f" ({r.bytes / 1e6:.0f} MB in {r.seconds:.1f}s)" if r.action == "sent" else ""
        print(hostile.text(f"{r.host}: {r.action}{extra}{': ' + r.detail if r.detail else ''}"))
    bad = [r.host for r in results if r.action == "failed"]
    if bad:
        raise UserError(f"image push failed on {', '.join(bad)}")


@task(
    auto_shortflags=False,
    help={
        "base": "base image (e.g. nvcr.io/nvidia/pytorch:24.01-py3)",
        "requirements": "a pip requirements file",
        "tag": "name of the new image",
        "pip_args": "extra pip arguments, split like a shell would",
        "wheels": "install only from the wheels in this directory (pip download -r REQS -d DIR): no index "
        "needed",
    },
)
@user_errors
def build(c, base, requirements, tag, pip_args="", wheels=None):
    """Build a job image: a base image, your requirements file and fabtrain's entrypoint.

    On
    this machine's Docker engine; then 'fab image.push --image TAG' puts it on every host."""
    from orchestrator.progress import bars

    with bars.bar(console, *bars.step_columns()) as progress:
        image_id = _images.build(
            base,
            Path(requirements),
            tag,
            tuple(shlex.split(pip_args)),
            Path(wheels) if wheels else None,
            progress=progress,
        )
    print(f"built {tag} ({image_id[7:19]}); push it with: fab image.push --image {tag}")


@task(auto_shortflags=False)
@user_errors
def images(c):
    """Build the base, test-host and trainer images locally (no registry); reuses what exists."""
    _cluster.build_images()


@task(
    auto_shortflags=False,
    kinds={"port": int, "refresh": float},
    iterable=["allow_host"],
    help={
        "inventory": INV_HELP,
        "port": "TCP port to serve on (default 8765; 0: any free one)",
        "address": "address to listen on (default 127.0.0.1: this machine only, no token; any other, "
        "0.0.0.0 included: a token is asked for, printed in the URL to open)",
        "refresh": "seconds between two looks at the hosts (default 5; every browser shares each look)",
        "token_file": "ask for the token on this file's first line (default: a new random one at each "
        "start, printed; on 127.0.0.1, none unless this is given)",
        "allow_host": "a name the browser reaches the dashboard by, beyond this machine's own (its Host "
        "header; a proxy's name, a DNS alias); repeat it or separate names with commas",
    },
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


@task(
    auto_shortflags=False,
    positional=["job"],
    kinds={"rank": int},
    help={
        "job": "the job (an id from 'fab status')",
        "rank": "the node of this rank (default 0)",
        "host": "the job's node on this host (instead of --rank)",
        "inventory": "the inventory (default: the one the job was started with, else as fab status)",
    },
)
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
    help={
        "job": "the job (an id from 'fab status')",
        "port": "the port on rank 0's host (its container's)",
        "local": "the port on 127.0.0.1 here (default: PORT)",
        "inventory": "the inventory (default: the one the job was started with, else as fab status)",
    },
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
