"""What `fab --help TASK` says of each option: one dict per task (its options' names, as the task's
parameters spell them, to their help), and the texts several tasks share. fabfile.py's tasks take
theirs (`@task(help=taskhelp.TRAIN)`); their docstrings stay with them.
"""

from __future__ import annotations

from orchestrator.commandline.cli import TRAINERS
from orchestrator.core.policy import HANG_TIMEOUT

# The texts several tasks share.
INV_HELP = "inventory file (default: $FABTRAIN_INVENTORY, else inventory.yaml here)"

CODE_HELP = (
    "your project's folder, with --script/--module: synced to job.code_dir/KEY (KEY names its "
    "contents) and linked into the job's writable working directory (default: the current directory)"
)

TREE_HELP = "your project's folder (default: this project's built-in trainers)"

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

# Each task's options, by task (fab image.push: IMAGE_PUSH).
SYNC = {
    "inventory": INV_HELP,
    "code": TREE_HELP,
    "json": "print where the code went and how long each host took, as JSON",
}

PREFLIGHT = {
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
}

TRAIN = {
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
    "num_nodes": "run on the first N hosts (of --include's, or hosts:) where the job fits beside other jobs",
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
}

STOP = {
    "inventory": INV_HELP,
    "job": "stop this job only (an id from 'fab status')",
    "all": "stop every fabtrain job on the hosts, other people's too (asks first)",
    "yes": "with --all: do not ask",
    "grace": "seconds between SIGTERM and SIGKILL (default: job.stop_grace)",
    "json": "print what was stopped as JSON",
}

STATUS = {"inventory": INV_HELP, "json": "print the jobs as JSON"}

TOP = {"inventory": INV_HELP, "json": "print one snapshot as JSON and exit"}

LOGS = {
    "inventory": INV_HELP,
    "job": "job id (default: the one running)",
    "plain": PLAIN_HELP,
    "json": "events as JSON lines on stdout instead of the hosts' log lines",
}

ATTACH = {
    "inventory": "the inventory (default: the one the job was started with)",
    "job": "the job to take over (an id from 'fab status')",
    "plain": PLAIN_HELP,
    "json": "events as JSON lines on stdout",
}

RUNS = {"json": "print the runs as JSON"}

PLOT = {
    "jobs": "one or more job ids, comma-separated (see fab runs)",
    "out": "PNG to write (default: runs/JOB/loss.png for one job, runs/compare.png for several)",
}

METRICS = {"job": "job id (default: the newest run in runs/)", "json": "print the figures as JSON"}

EXPORT_SLURM = {
    **JOB_HELP,
    "out": "file to write (default: JOB.sbatch)",
    "pyxis": "run the image with pyxis/enroot (srun --container-image) instead of docker run",
    "partition": "#SBATCH --partition",
    "time": "#SBATCH --time (e.g. 12:00:00)",
}

EXPORT_K8S = {
    **JOB_HELP,
    "out": "directory to write trainjob.yaml, pytorchjob.yaml and indexed-job.yaml to (default: JOB-k8s)",
    "restarts": "pod failures the job tolerates (backoffLimit, default 0)",
}

CLUSTER_UP = {
    "nodes": "number of test hosts (default 2)",
    "spares": "number of spare hosts, listed under spares: (default 0)",
    "write_inventory": "also write the matching inventory to this path",
    "slurm": "also make the hosts a Slurm cluster (slurmctld on the first), for fab export.slurm",
    "json": "print the hosts and the inventory's path as JSON (progress goes to stderr)",
}

IMAGE_PUSH = {
    "inventory": INV_HELP,
    "image": "image to push (default: job.image)",
    "only": "comma-separated host names (default: every host)",
    "method": "chain (hosts forward to each other, only the layers they lack; default) or direct "
    "(one stream per host from here)",
}

IMAGE_BUILD = {
    "base": "base image (e.g. nvcr.io/nvidia/pytorch:24.01-py3)",
    "requirements": "a pip requirements file",
    "tag": "name of the new image",
    "pip_args": "extra pip arguments, split like a shell would",
    "wheels": "install only from the wheels in this directory (pip download -r REQS -d DIR): no index needed",
}

DASHBOARD = {
    "inventory": INV_HELP,
    "port": "TCP port to serve on (default 8765; 0: any free one)",
    "address": "address to listen on (default 127.0.0.1: this machine only, no token; any other, "
    "0.0.0.0 included: a token is asked for, printed in the URL to open)",
    "refresh": "seconds between two looks at the hosts (default 5; every browser shares each look)",
    "token_file": "ask for the token on this file's first line (default: a new random one at each "
    "start, printed; on 127.0.0.1, none unless this is given)",
    "allow_host": "a name the browser reaches the dashboard by, beyond this machine's own (its Host "
    "header; a proxy's name, a DNS alias); repeat it or separate names with commas",
}

SHELL = {
    "job": "the job (an id from 'fab status')",
    "rank": "the node of this rank (default 0)",
    "host": "the job's node on this host (instead of --rank)",
    "inventory": "the inventory (default: the one the job was started with, else as fab status)",
}

FORWARD = {
    "job": "the job (an id from 'fab status')",
    "port": "the port on rank 0's host (its container's)",
    "local": "the port on 127.0.0.1 here (default: PORT)",
    "inventory": "the inventory (default: the one the job was started with, else as fab status)",
}
