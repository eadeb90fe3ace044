"""The same job for a scheduler: an sbatch script for Slurm, manifests for Kubernetes.

The job is described once (inventory, trainer or script, arguments, image) and runs the same way
everywhere: one container per node whose entrypoint (docker/entrypoint.py) forms the torchrun job
from the environment. Under Slurm the script carries that entrypoint to each node; under Kubernetes
a ConfigMap does. Every value from the inventory or the command line stays data: shell words are
quoted once (the few that Slurm fills in at run time are double-quoted variables), YAML is written
by a YAML library, and secrets are referenced by name, never written out.
"""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import replace
from typing import Any

import yaml

from orchestrator.commands import dockerargs, hostfiles
from orchestrator.commands.node import job_env, node_spec
from orchestrator.config.inventory import SLURM_VALUE_RE, Host, Inventory
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.nodespec import HOST, NodeSpec

# A word of a generated script that Slurm's environment fills in at run time: VAR + NAME + VAR.
VAR = "\x00"
RUNTIME_VARS = ("NODE_RANK", "FABTRAIN_NODE", "fabtrain_container", "fabtrain_attempt", "SLURM_NODEID")
# Set per node at run time, passed on to the container by name (docker run --env NAME).
PASSED_ON = ("MASTER_ADDR", "NNODES", "NODE_RANK", "FABTRAIN_NODE")
HEREDOC = "FABTRAIN_ENTRYPOINT"
# Every fabtrain job's Slurm comment: how fab status and fab stop tell them from other jobs.
COMMENT = "fabtrain"
# Per-host fields a Slurm job cannot vary (Slurm, not the inventory, picks the nodes).
UNIFORM_FIELDS = ("gpu_vendor", "gpu_count", "interface", "image", "env", "mounts", "devices",
                  "ulimits", "cap_add", "security_opt")


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


def comment(text: str) -> str:
    """Text for a `#` comment: a newline or other control character in a value cannot end it."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", "?", text)


def template_host(inv: Inventory) -> tuple[Host, list[str]]:
    """The settings every node gets, the first host's, and a warning for each host that differs."""
    first = inv.hosts[0]
    warnings = [f"{h.name}: {f} differs from {first.name}'s; the export gives every node {first.name}'s"
                for h in inv.hosts[1:] for f in UNIFORM_FIELDS if getattr(h, f) != getattr(first, f)]
    return first, warnings


def _entrypoint() -> str:
    text = dockerargs.ENTRYPOINT_SOURCE.read_text()
    if any(line == HEREDOC for line in text.splitlines()):
        raise AssertionError(f"{dockerargs.ENTRYPOINT_SOURCE} holds the heredoc delimiter {HEREDOC}")
    return text if text.endswith("\n") else text + "\n"


def _summary(inv: Inventory, spec: jobspec.JobSpec, nodes: int, host: Host) -> list[str]:
    nproc = spec.nproc_per_node or inv.job.nproc_per_node
    n = node_spec(inv, host, spec)
    what = " ".join(n.command)
    return [
        f"#   {nodes} node(s) x {comment(nproc)} process(es), "
        f"image {comment(n.image)}",
        f"#   runs: {comment(what)}",
    ]


def _secrets_note(inv: Inventory) -> list[str]:
    if not inv.job.secret_files:
        return []
    names = ", ".join(name for name, _ in inv.job.secret_files)
    return [f"#  - secrets ({names}): export FABTRAIN_SECRETS=FILE before sbatch, FILE holding NAME=VALUE",
            "#    lines and readable on every node; it reaches the containers as a mode-600 file,",
            "#    never this script or a command line."]


def slurm_script(inv: Inventory, spec: jobspec.JobSpec, pyxis: bool = False, partition: str | None = None,
                 time_limit: str | None = None, account: str | None = None,
                 nodes: int | None = None) -> tuple[str, list[str]]:
    """(the sbatch script, warnings). One task per node (`nodes`, default one per host); `pyxis`
    runs the image with pyxis/enroot (srun --container-image) instead of `docker run` on each node."""
    for name, value in (("--partition", partition), ("--time", time_limit), ("--account", account)):
        if value is not None and not SLURM_VALUE_RE.fullmatch(value):
            raise UserError(f"{name} {value!r}: use letters, digits and _.,:=+- only", exit_code=2)
    host, warnings = template_host(inv)
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
    flavour = "pyxis/enroot (srun --container-image)" if pyxis else "docker run on each node"
    lines = [
        "#!/bin/bash",
        f"# fabtrain job {spec.job_id} for Slurm, written by `fab export.slurm` from "
        f"{comment(str(inv.path))}:",
        *_summary(inv, spec, nodes, host),
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
    if host.gpu_count and host.gpu_vendor != "none":
        lines.append(f"#SBATCH --gpus-per-node={host.gpu_count}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    lines += [
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
        "# On each node: the job's directories, the entrypoint, the secrets file.",
        "fabtrain_prepare() {",
        f"  mkdir -p {line([out_dir, hostfiles.work_dir(inv, spec), rt])} || return 1",
        f"  cat > {word(rt + '/entrypoint.py')} <<'{HEREDOC}' || return 1",
        _entrypoint() + HEREDOC,
        '  if [ -n "$FABTRAIN_SECRETS" ]; then',
        f'    install -m 600 "$FABTRAIN_SECRETS" {word(rt + "/secrets.env")} || return 1',
        "  fi",
        "}",
        "export -f fabtrain_prepare",
    ]
    if pyxis:
        lines += _pyxis_steps(inv, spec, host, rt)
    else:
        lines += _docker_steps(inv, spec, host, rt, grace)
    return "\n".join(lines) + "\n", warnings


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
    n = node_spec(inv, replace(host, name=var("FABTRAIN_NODE")), spec, name=var("fabtrain_container"),
                  rank=var("NODE_RANK"), env=_slurm_env(inv, host, spec), runtime=rt)
    run = ["docker", "run", "--rm", "--cidfile", f"{rt}/cid", *dockerargs.docker_options(n),
           *dockerargs.entry_options(n)]
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
            raise UserError(f"{inv.path}: the mount {source}:{target} holds ',' or ':', which pyxis's "
                            "--container-mounts cannot take; use the docker flavour or another path")
    exports = [f"{k}={v}" for k, v in _slurm_env(inv, host, spec) if v is not None]
    srun = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "--label",
            f"--container-image={enroot_image(n.image)}",
            "--container-mounts=" + ",".join(f"{s}:{t}" + (":ro" if ro else "") for s, t, ro in mounts),
            f"--container-workdir={n.workdir}", "--no-container-entrypoint"]
    notes = ["# pyxis gives the container the task's environment, so NODE_RANK comes from SLURM_NODEID",
             "# (docker/entrypoint.py) and GPUs from --gpus-per-node; Docker-only settings (ulimits,",
             "# capabilities, devices, shm size) are the cluster's enroot configuration here."]
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


# ---- Kubernetes ---------------------------------------------------------------------------------

SECRET_NAME = "fabtrain-secrets"
GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
PYTORCHJOB_PORT = "pytorchjob-port"  # the port name the Kubeflow training operator reads


def k8s_name(job_id: str) -> str:
    """A DNS-1123 label from a job id, short enough for `NAME-INDEX` pod hostnames (63)."""
    name = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-")[:52].strip("-")
    return name or "fabtrain"


def _quantity(docker_size: str) -> str:
    """Docker's size (64g, 512m, 1024) as a Kubernetes quantity (64Gi, 512Mi, 1024)."""
    m = re.fullmatch(r"(\d+)([bkmg]?)b?", docker_size.strip().lower())
    if not m:
        raise UserError(f"job.shm_size {docker_size!r}: write a size such as 64g or 512m")
    return m.group(1) + {"": "", "b": "", "k": "Ki", "m": "Mi", "g": "Gi"}[m.group(2)]


def _container(n: NodeSpec, env: list[dict]) -> dict:
    skip = {"MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "FABTRAIN_NODE",
            "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",  # the platform's, or found by the entrypoint
            "FABTRAIN_CODE"}  # the code is in the image
    env = env + [{"name": k, "value": v} for k, v in n.env if k not in skip]
    env += [{"name": name, "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": name}}}
            for name in n.secrets]
    c: dict = {
        "name": "pytorch",
        "image": n.image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(n.program),
        "args": list(n.command),
        "workingDir": n.workdir,
        "env": env,
        "volumeMounts": [
            {"name": "fabtrain", "mountPath": jobspec.RUNTIME_MOUNT, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "output", "mountPath": jobspec.OUTDIR},
        ],
    }
    if n.gpu_vendor in GPU_RESOURCE and n.gpu_count:
        c["resources"] = {"limits": {GPU_RESOURCE[n.gpu_vendor]: str(n.gpu_count)}}
    security: dict = {}
    if n.cap_add:
        security["capabilities"] = {"add": list(n.cap_add)}
    if n.seccomp_unconfined:
        security["seccompProfile"] = {"type": "Unconfined"}
    if security:
        c["securityContext"] = security
    for i, m in enumerate(n.mounts_of(HOST)):
        c["volumeMounts"].append({"name": f"mount{i}", "mountPath": m.target, "readOnly": m.read_only})
    return c


def _pod_spec(inv: Inventory, spec: jobspec.JobSpec, host: Host, config_map: str, env: list[dict],
              **extra: Any) -> dict:
    n = node_spec(inv, host, spec)
    return {
        **extra,
        "containers": [_container(n, env)],
        "volumes": _volumes(n, config_map),
    }


def _volumes(n: NodeSpec, config_map: str) -> list[dict]:
    """The entrypoint (a ConfigMap), shared memory, the outputs on the job's PersistentVolumeClaim
    (snapshots outlive a pod: a restarted pod resumes from them), the inventory's host mounts."""
    shm: dict = {"medium": "Memory"}
    if n.shm_size:
        shm["sizeLimit"] = _quantity(n.shm_size)
    volumes = [{"name": "fabtrain", "configMap": {"name": config_map}},
               {"name": "shm", "emptyDir": shm},
               {"name": "output", "persistentVolumeClaim": {"claimName": output_claim(config_map)}}]
    return volumes + [
        {"name": f"mount{i}", "hostPath": {"path": m.source}} for i, m in enumerate(n.mounts_of(HOST))
    ]


def output_claim(config_map: str) -> str:
    return config_map.removesuffix("-entrypoint") + "-output"


OUTPUT_SIZE = "100Gi"  # what the claim asks for: snapshots and outputs of one job (edit to taste)


def _output_pvc(name: str, job_id: str) -> dict:
    """ReadWriteMany: every node's pod writes its own files into the job's one output directory."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": f"{name}-output", "labels": {"fabtrain.job": job_id}},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": OUTPUT_SIZE}}}}


# Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1): the cluster's torch runtime names its
# replicated job and its trainer container "node"; it sets PET_NNODES, PET_NODE_RANK,
# PET_MASTER_ADDR, PET_MASTER_PORT and PET_NPROC_PER_NODE, which the entrypoint reads.
TRAINER_RUNTIME = "torch-distributed"
TRAINER_NODE = "node"


def _config_map(name: str, job_id: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {"fabtrain.job": job_id}},
            "data": {"entrypoint.py": _entrypoint()}}


def k8s_manifests(
    inv: Inventory, spec: jobspec.JobSpec, restarts: int = 0
) -> tuple[dict[str, list[dict]], list[str]]:
    """({file name: documents}, warnings): a Kubeflow PyTorchJob, and plain Kubernetes (an Indexed
    Job with a headless Service for the pods' names). Both carry the entrypoint in a ConfigMap."""
    host, warnings = template_host(inv)
    nodes, name = len(inv.hosts), k8s_name(spec.job_id)
    port = spec.master_port or inv.job.master_port
    labels = {"fabtrain.job": spec.job_id}
    cm = f"{name}-entrypoint"
    if host.devices:
        warnings.append(f"{host.name}: devices {', '.join(host.devices)} are not mapped in Kubernetes; "
                        "expose them with the cluster's device plugin (e.g. an RDMA plugin for InfiniBand)")

    def replica(count: int) -> dict:
        pod = _pod_spec(inv, spec, host, cm, [])
        pod["containers"][0]["ports"] = [{"name": PYTORCHJOB_PORT, "containerPort": port}]
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": labels}, "spec": pod}}

    replicas = {"Master": replica(1)}
    if nodes > 1:
        replicas["Worker"] = replica(nodes - 1)
    pytorchjob = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                  "metadata": {"name": name, "labels": labels},
                  "spec": {"runPolicy": {"backoffLimit": restarts}, "pytorchReplicaSpecs": replicas}}

    rank_env: list[dict] = [
        {"name": "NNODES", "value": str(nodes)},
        {"name": "NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
        {"name": "MASTER_PORT", "value": str(port)},
    ]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"clusterIP": "None", "selector": {"job-name": name},
                        "publishNotReadyAddresses": True}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
           "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
                    # A torchrun job cannot take one node back alone: a failed pod fails the job.
                    "backoffLimit": restarts,
                    "template": {"metadata": {"labels": labels},
                                 "spec": _pod_spec(inv, spec, host, cm, rank_env, subdomain=name,
                                                   restartPolicy="Never")}}}
    pvc = _output_pvc(name, spec.job_id)
    docs = {"trainjob.yaml": [_config_map(cm, spec.job_id), pvc, _trainjob(inv, spec, host, name, cm)],
            "pytorchjob.yaml": [_config_map(cm, spec.job_id), pvc, pytorchjob],
            "indexed-job.yaml": [_config_map(cm, spec.job_id), pvc, service, job]}
    return docs, warnings


def _trainjob(inv: Inventory, spec: jobspec.JobSpec, host: Host, name: str, cm: str) -> dict:
    """A Kubeflow Trainer v2 TrainJob on the cluster's torch runtime: the trainer's image, command,
    environment and GPUs per node, and (a runtime patch, as Trainer v2 takes pod changes) the
    entrypoint, shared memory, output claim and mounts on its "node" container."""
    n = node_spec(inv, host, spec)
    c = _container(n, [])
    trainer = {"numNodes": len(inv.hosts), "image": c["image"], "command": c["command"], "args": c["args"],
               "env": c["env"]}
    if "resources" in c:
        trainer["resourcesPerNode"] = c["resources"]
    container = {"name": TRAINER_NODE, "volumeMounts": c["volumeMounts"]}
    if "securityContext" in c:
        container["securityContext"] = c["securityContext"]
    pod = {"volumes": _volumes(n, cm), "containers": [container]}
    patch = {"manager": "fabtrain", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": TRAINER_NODE, "template": {"spec": {"template": {"spec": pod}}}}]}}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": name, "labels": {"fabtrain.job": spec.job_id}},
            "spec": {"runtimeRef": {"name": TRAINER_RUNTIME, "apiGroup": "trainer.kubeflow.org",
                                    "kind": "ClusterTrainingRuntime"},
                     "trainer": trainer, "runtimePatches": [patch]}}


def k8s_header(inv: Inventory, spec: jobspec.JobSpec, kind: str) -> str:
    host = inv.hosts[0]
    lines = [
        f"# fabtrain job {spec.job_id} as {kind}, written by `fab export.k8s` from "
        f"{comment(str(inv.path))}:",
        *_summary(inv, spec, len(inv.hosts), host),
        "# Apply with: kubectl apply -f FILE. The image must hold the code at /workspace (or mount it",
        f"# there); /output is the PersistentVolumeClaim {k8s_name(spec.job_id)}-output (ReadWriteMany, "
        f"{OUTPUT_SIZE}), so",
        "# snapshots outlive a pod. Checked offline against the Kubernetes API schemas and the Kubeflow",
        "# models (TrainJob, PyTorchJob); not run on a live cluster by fabtrain's tests.",
    ]
    if inv.job.secret_files:
        files = " ".join(f"--from-file={name}={comment(path)}" for name, path in inv.job.secret_files)
        lines.append(
            f"# Secrets come from the Secret {SECRET_NAME}: kubectl create secret generic {SECRET_NAME} "
            f"{files}"
        )
    return "\n".join(lines) + "\n"


class _Dumper(yaml.SafeDumper):
    """Plain YAML a person can read: no anchors, multi-line strings (the entrypoint) as blocks."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def k8s_text(inv: Inventory, spec: jobspec.JobSpec, file: str, docs: list[dict]) -> str:
    kind = {"trainjob.yaml": "a Kubeflow Trainer v2 TrainJob (runtime torch-distributed)",
            "pytorchjob.yaml": "a Kubeflow PyTorchJob (Training Operator v1, deprecated)"}.get(
        file, "an Indexed Job and a headless Service")
    return k8s_header(inv, spec, kind) + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=100)
