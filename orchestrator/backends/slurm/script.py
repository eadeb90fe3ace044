"""The sbatch script: the job for Slurm, one task per node starting its container (docker run, or
pyxis/enroot's srun --container-image). `fab export.slurm` writes it for people to submit;
`fab train --on slurm` submits the same script (slurm.prepared). Shell words are quoted once; the
few that Slurm fills in at run time are double-quoted variables (var)."""

from __future__ import annotations

import math
import shlex
from dataclasses import replace

from orchestrator.backends import export
from orchestrator.backends.export import HEREDOC, comment
from orchestrator.config.inventory import SLURM_VALUE_RE, Host, Inventory
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import dockerargs, hostfiles, touched
from orchestrator.hostcmds.node import job_env, node_spec

# A word of a generated script that Slurm's environment fills in at run time: VAR + NAME + VAR.
VAR = "\x00"
RUNTIME_VARS = ("NODE_RANK", "FABTRAIN_NODE", "fabtrain_container", "fabtrain_attempt", "SLURM_NODEID")
# Set per node at run time, passed on to the container by name (docker run --env NAME).
PASSED_ON = ("MASTER_ADDR", "NNODES", "NODE_RANK", "FABTRAIN_NODE")
# Every fabtrain job's Slurm comment: how fab status and fab stop tell them from other jobs.
COMMENT = "fabtrain"


def var(name: str) -> str:
    return f"{VAR}{name}{VAR}"


def word(w: str) -> str:
    """One shell word: quoted once; var() markers become "${NAME}", expanded at run time."""
    parts = w.split(VAR)
    if len(parts) % 2 == 0:
        raise UserError(f"{w.replace(VAR, '')!r}: a value holds a NUL byte; remove it")
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            if part not in RUNTIME_VARS:
                raise UserError(f"{w!r}: a value holds a NUL byte; remove it")
            out.append(f'"${{{part}}}"')
        elif part:
            out.append(shlex.quote(part))
    return "".join(out) or "''"


def line(argv: list[str]) -> str:
    return " ".join(word(w) for w in argv)


def long_line(options: list[str], command: list[str], indent: str) -> str:
    """A long command: one option (with its value) per line, then what it runs on a line of its own."""
    out = word(options[0])
    for w in options[1:]:
        out += f" \\\n{indent}    " if w.startswith("--") else " "
        out += word(w)
    return out + f" \\\n{indent}    " + line(command)


def _secrets_note(inv: Inventory) -> list[str]:
    if not inv.job.secret_files:
        return []
    names = ", ".join(name for name, _ in inv.job.secret_files)
    return [
        f"#  - secrets ({names}): export FABTRAIN_SECRETS=FILE before sbatch, FILE holding NAME=VALUE",
        "#    lines and readable on every node; it reaches the containers as a mode-600 file,",
        "#    never this script or a command line.",
    ]


def slurm_script(
    inv: Inventory,
    spec: jobspec.JobSpec,
    pyxis: bool = False,
    partition: str | None = None,
    time_limit: str | None = None,
    account: str | None = None,
    nodes: int | None = None,
) -> tuple[str, list[str]]:
    """(the sbatch script, warnings). One task per node (`nodes`, default one per host); `pyxis`
    runs the image with pyxis/enroot (srun --container-image) instead of `docker run` on each node."""
    for name, value in (("--partition", partition), ("--time", time_limit), ("--account", account)):
        if value is not None and not SLURM_VALUE_RE.fullmatch(value):
            raise UserError(f"{name} {value!r}: use letters, digits and _.,:=+- only", exit_code=2)
    host, warnings = export.template_host(inv)
    nodes = nodes or len(inv.hosts)
    out_dir = f"{inv.job.output_dir}/{spec.job_id}"
    # One runtime directory per attempt: a requeued job's new tasks can start on a node while the
    # old task's cleanup there is still running, and must not lose their entrypoint to it. With
    # docker, one per node too: with job.output_dir shared between nodes, each keeps its own cidfile
    # and secrets there. (pyxis names the directory once, in its --container-mounts, and has no cidfile.)
    rt = f"{hostfiles.runtime_dir(inv, spec)}/{var('fabtrain_attempt')}" + (
        "" if pyxis else f".{var('SLURM_NODEID')}"
    )
    grace = str(max(1, math.ceil(inv.job.stop_grace)))  # docker stop --time takes whole seconds
    lines = _head(inv, spec, host, nodes, pyxis, out_dir)
    lines += _options(host, partition, time_limit, account)
    lines += _prepare(inv, spec, out_dir, rt)
    if pyxis:
        lines += _pyxis_steps(inv, spec, host, rt)
    else:
        lines += _docker_steps(inv, spec, host, rt, grace)
    return "\n".join(lines) + "\n", warnings


def _head(
    inv: Inventory, spec: jobspec.JobSpec, host: Host, nodes: int, pyxis: bool, out_dir: str
) -> list[str]:
    """The script's comments (what it runs, what to do before sbatch) and its fixed #SBATCH lines."""
    flavour = "pyxis/enroot (srun --container-image)" if pyxis else "docker run on each node"
    return [
        "#!/bin/bash",
        f"# fabtrain job {spec.job_id} for Slurm, written by `fab export.slurm` from "
        f"{comment(str(inv.path))}:",
        *export.summary(inv, spec, nodes, host),
        f"# Submit with: sbatch FILE (the output goes to {spec.job_id}-JOBID.out in the submit directory).",
        "# Before you submit:",
        f"#  - the code is at {comment(hostfiles.code_path(inv, spec))} on every node (fab sync --code DIR",
        "#    prints where it put DIR; or a shared filesystem);",
        "#  - the image is on every node (fab image.push, or a registry they pull from);"
        if not pyxis
        else "#  - enroot can import the image on every node (a registry they pull from);",
        *_secrets_note(inv),
        f"# One task per node starts the job ({flavour}); a task that fails ends the job",
        "# (--kill-on-bad-exit) and the other nodes' containers are stopped. After a node failure",
        "# Slurm requeues the job with the same output directory and the trainer resumes from its",
        f"# newest snapshot in {comment(out_dir)} on the node that runs rank 0: put job.output_dir",
        "# on a shared filesystem so that any node finds it. Submitting this file again continues",
        "# this job the same way; export again for a new job.",
        f"#SBATCH --job-name={spec.job_id}",
        f"#SBATCH --comment={COMMENT}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={spec.job_id}-%j.out",
    ]


def _options(host: Host, partition: str | None, time_limit: str | None, account: str | None) -> list[str]:
    """The #SBATCH lines that depend on the hosts' GPUs and the given partition, time and account."""
    lines: list[str] = []
    if host.gpu_count and host.gpu_vendor != "none":
        lines.append(f"#SBATCH --gpus-per-node={host.gpu_count}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    return lines


def _prepare(inv: Inventory, spec: jobspec.JobSpec, out_dir: str, rt: str) -> list[str]:
    """Rank 0's address, the job's environment, and fabtrain_prepare: what every node sets up."""
    return [
        "set -euo pipefail",
        "",
        "# Rank 0 runs on the allocation's first node; its address comes from Slurm (NodeAddr).",
        # sed reads to the end: `head -n 1` leaves scontrol writing into a closed pipe, and
        # pipefail turns its SIGPIPE into a failed job (seen now and then with two nodes).
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        "MASTER_ADDR=$(scontrol show node \"$first\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')",
        'export MASTER_ADDR="${MASTER_ADDR:-$first}" NNODES="$SLURM_JOB_NUM_NODES" '
        'FABTRAIN_SECRETS="${FABTRAIN_SECRETS:-}" fabtrain_attempt="$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"',
        f'echo "[fabtrain] job {spec.job_id}: slurm job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}),'
        ' $NNODES node(s), master $MASTER_ADDR"',
        "",
        "# On each node: the job's directories, the entrypoint and its memory module, the secrets file.",
        "fabtrain_prepare() {",
        f"  mkdir -p {line([out_dir, rt])} || return 1",
        # The job's container writes out_dir: its work directory (a mount source) is made and
        # checked without following a link it put there (hostcmds/touched.py).
        f"  {touched.make_dir(word(out_dir), jobspec.WORK)} || return 1",
        f"  {touched.mount_sources_check([out_dir, hostfiles.work_dir(inv, spec)])} || return 1",
        *(
            f"  cat > {word(rt + '/' + name)} <<'{HEREDOC}' || return 1\n{text}{HEREDOC}"
            for name, text in export.runtime_files().items()
        ),
        '  if [ -n "$FABTRAIN_SECRETS" ]; then',
        f'    install -m 600 "$FABTRAIN_SECRETS" {word(rt + "/secrets.env")} || return 1',
        "  fi",
        "}",
        "export -f fabtrain_prepare",
    ]


def _slurm_env(inv: Inventory, host: Host, spec: jobspec.JobSpec) -> list[tuple[str, str | None]]:
    """The container's environment: the inventory's, with the per-node values passed on by name
    (None). One interface for every node only when the inventory gives all hosts the same one."""
    same_interface = all(h.interface == host.interface for h in inv.hosts)
    env: list[tuple[str, str | None]] = []
    for key, value in job_env(inv, host, spec):
        if key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") and not same_interface:
            continue
        env.append((key, None if key in PASSED_ON else value))
    return env


def _docker_steps(inv: Inventory, spec: jobspec.JobSpec, host: Host, rt: str, grace: str) -> list[str]:
    container = f"fabtrain-{spec.job_id}-r" + var("NODE_RANK")
    # The node's name, rank and per-node variables are the Slurm task's, filled in at run time; the
    # host label names the Slurm node.
    n = node_spec(
        inv,
        replace(host, name=var("FABTRAIN_NODE")),
        spec,
        name=var("fabtrain_container"),
        rank=var("NODE_RANK"),
        env=_slurm_env(inv, host, spec),
        runtime=rt,
    )
    run = [
        "docker",
        "run",
        "--rm",
        "--cidfile",
        f"{rt}/cid",
        *dockerargs.docker_options(n),
        *dockerargs.entry_options(n),
    ]
    return [
        "",
        "# One node's container, in the foreground of its task: stopped when the task ends or is",
        "# signalled (scancel, --kill-on-bad-exit), removed when it exits. The trap stops this",
        "# attempt's container by its id: after a requeue the next attempt's has the same name.",
        "fabtrain_node() {",
        "  # A node whose Docker engine does not answer fails its task at once, named, not later.",
        "  if ! timeout -k 5 30 docker info >/dev/null 2>&1; then",
        '    echo "[fabtrain] $SLURMD_NODENAME: no Docker engine answers (docker info, 30 s): start or fix '
        'it, or exclude the node (sbatch --exclude)" >&2; return 1',
        "  fi",
        f"  if [ ! -d {word(hostfiles.code_path(inv, spec))} ]; then",
        f'    echo "[fabtrain] $SLURMD_NODENAME: the code is not at" '
        f'{word(hostfiles.code_path(inv, spec) + ":")} "put '
        'job.code_dir on a filesystem the nodes share, or fab sync to the nodes" >&2; return 1',
        "  fi",
        "  fabtrain_prepare || return 1",
        '  export NODE_RANK="$SLURM_NODEID" FABTRAIN_NODE="$SLURMD_NODENAME"',
        f"  fabtrain_container={word(container)} fabtrain_rt={word(rt)}",
        '  docker rm --force "$fabtrain_container" >/dev/null 2>&1  # left by an earlier run of this job',
        f'  trap \'[ -s "$fabtrain_rt/cid" ] && docker stop --time {grace} "$(cat "$fabtrain_rt/cid")" '
        '>/dev/null 2>&1; rm -rf "$fabtrain_rt"; rmdir "${fabtrain_rt%/*}" 2>/dev/null\' EXIT',
        "  trap 'exit 143' TERM",
        "  trap 'exit 130' INT",
        f"  {long_line(run, dockerargs.image_and_command(n), '  ')} &",
        "  wait $!",
        "}",
        "export -f fabtrain_node",
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --label bash -c fabtrain_node",
    ]


def enroot_image(image: str) -> str:
    """An image reference as pyxis/enroot takes it: REGISTRY#PATH when the first part names a registry."""
    first, sep, rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return f"{first}#{rest}"
    return image


def _pyxis_steps(inv: Inventory, spec: jobspec.JobSpec, host: Host, rt: str) -> list[str]:
    n = node_spec(inv, host, spec, runtime=rt)
    mounts = [(m.mount.source, m.mount.target, m.mount.read_only) for m in n.mounts]
    for source, target, _ in mounts:
        if "," in source + target or ":" in source + target:
            raise UserError(
                f"{inv.path}: the mount {source}:{target} holds ',' or ':', which pyxis's "
                "--container-mounts cannot take; use the docker flavour or another path"
            )
    exports = [f"{k}={v}" for k, v in _slurm_env(inv, host, spec) if v is not None]
    srun = [
        "srun",
        "--kill-on-bad-exit=1",
        "--ntasks-per-node=1",
        "--label",
        f"--container-image={enroot_image(n.image)}",
        "--container-mounts=" + ",".join(f"{s}:{t}" + (":ro" if ro else "") for s, t, ro in mounts),
        f"--container-workdir={n.workdir}",
        "--no-container-entrypoint",
    ]
    notes = [
        "# pyxis gives the container the task's environment, so NODE_RANK comes from SLURM_NODEID",
        "# (docker/entrypoint.py) and GPUs from --gpus-per-node; Docker-only settings (ulimits,",
        "# capabilities, devices, shm size) are the cluster's enroot configuration here.",
    ]
    entry = long_line(srun, [*n.program, *n.command], "")
    return [
        "",
        "srun --ntasks-per-node=1 bash -c fabtrain_prepare",
        "",
        *notes,
        f"export {line(exports)}" if exports else "",
        "status=0",
        f"{entry} || status=$?",
        f"srun --ntasks-per-node=1 rm -rf {word(rt)}",
        "exit $status",
    ]
