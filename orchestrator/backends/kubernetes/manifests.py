"""The Kubernetes manifests: the job as a Kubeflow Trainer v2 TrainJob, a Kubeflow PyTorchJob and
a plain Indexed Job with a headless Service, each carrying the entrypoint in a ConfigMap. YAML is
written by a YAML library; secrets are referenced by name (a Secret), never written out."""

from __future__ import annotations

import re
from typing import Any

import yaml

from orchestrator.backends import export
from orchestrator.backends.export import comment
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.nodespec import HOST, NodeSpec
from orchestrator.hostcmds.node import node_spec

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
    skip = {
        "MASTER_ADDR",
        "MASTER_PORT",
        "NNODES",
        "NODE_RANK",
        "FABTRAIN_NODE",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",  # the platform's, or found by the entrypoint
        "FABTRAIN_CODE",
    }  # the code is in the image
    env = env + [{"name": k, "value": v} for k, v in n.env if k not in skip]
    env += [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": name}}}
        for name in n.secrets
    ]
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


def _pod_spec(
    inv: Inventory, spec: jobspec.JobSpec, host: Host, config_map: str, env: list[dict], **extra: Any
) -> dict:
    n = node_spec(inv, host, spec)
    return {**extra, "containers": [_container(n, env)], "volumes": _volumes(n, config_map)}


def _volumes(n: NodeSpec, config_map: str) -> list[dict]:
    """The entrypoint (a ConfigMap), shared memory, the outputs on the job's PersistentVolumeClaim
    (snapshots outlive a pod: a restarted pod resumes from them), the inventory's host mounts."""
    shm: dict = {"medium": "Memory"}
    if n.shm_size:
        shm["sizeLimit"] = _quantity(n.shm_size)
    volumes = [
        {"name": "fabtrain", "configMap": {"name": config_map}},
        {"name": "shm", "emptyDir": shm},
        {"name": "output", "persistentVolumeClaim": {"claimName": output_claim(config_map)}},
    ]
    return volumes + [
        {"name": f"mount{i}", "hostPath": {"path": m.source}} for i, m in enumerate(n.mounts_of(HOST))
    ]


def output_claim(config_map: str) -> str:
    return config_map.removesuffix("-entrypoint") + "-output"


OUTPUT_SIZE = "100Gi"  # what the claim asks for: snapshots and outputs of one job (edit to taste)


def _output_pvc(name: str, job_id: str) -> dict:
    """ReadWriteMany: every node's pod writes its own files into the job's one output directory."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{name}-output", "labels": {"fabtrain.job": job_id}},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": OUTPUT_SIZE}}},
    }


# Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1): the cluster's torch runtime names its
# replicated job and its trainer container "node"; it sets PET_NNODES, PET_NODE_RANK,
# PET_MASTER_ADDR, PET_MASTER_PORT and PET_NPROC_PER_NODE, which the entrypoint reads.
TRAINER_RUNTIME = "torch-distributed"
TRAINER_NODE = "node"


def _config_map(name: str, job_id: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {"fabtrain.job": job_id}},
        "data": export.runtime_files(),
    }


def k8s_manifests(
    inv: Inventory, spec: jobspec.JobSpec, restarts: int = 0
) -> tuple[dict[str, list[dict]], list[str]]:
    """({file name: documents}, warnings): a Kubeflow PyTorchJob, and plain Kubernetes (an Indexed
    Job with a headless Service for the pods' names). Both carry the entrypoint in a ConfigMap."""
    host, warnings = export.template_host(inv)
    name = k8s_name(spec.job_id)
    cm = f"{name}-entrypoint"
    if host.devices:
        warnings.append(
            f"{host.name}: devices {', '.join(host.devices)} are not mapped in Kubernetes; "
            "expose them with the cluster's device plugin (e.g. an RDMA plugin for InfiniBand)"
        )
    pytorchjob = _pytorchjob(inv, spec, host, name, cm, restarts)
    service, job = _indexed_job(inv, spec, host, name, cm, restarts)
    pvc = _output_pvc(name, spec.job_id)
    docs = {
        "trainjob.yaml": [_config_map(cm, spec.job_id), pvc, _trainjob(inv, spec, host, name, cm)],
        "pytorchjob.yaml": [_config_map(cm, spec.job_id), pvc, pytorchjob],
        "indexed-job.yaml": [_config_map(cm, spec.job_id), pvc, service, job],
    }
    return docs, warnings


def _pytorchjob(inv: Inventory, spec: jobspec.JobSpec, host: Host, name: str, cm: str, restarts: int) -> dict:
    """A Kubeflow PyTorchJob: a Master replica and (past one node) the Workers, the operator
    setting each pod's rank from the port named PYTORCHJOB_PORT."""
    nodes, labels = len(inv.hosts), {"fabtrain.job": spec.job_id}
    port = spec.master_port or inv.job.master_port

    def replica(count: int) -> dict:
        pod = _pod_spec(inv, spec, host, cm, [])
        pod["containers"][0]["ports"] = [{"name": PYTORCHJOB_PORT, "containerPort": port}]
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {"metadata": {"labels": labels}, "spec": pod},
        }

    replicas = {"Master": replica(1)}
    if nodes > 1:
        replicas["Worker"] = replica(nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": labels},
        "spec": {"runPolicy": {"backoffLimit": restarts}, "pytorchReplicaSpecs": replicas},
    }


def _indexed_job(
    inv: Inventory, spec: jobspec.JobSpec, host: Host, name: str, cm: str, restarts: int
) -> tuple[dict, dict]:
    """(the headless Service, the Indexed Job): plain Kubernetes, each pod's rank its completion
    index and rank 0 reached by its pod name NAME-0.NAME."""
    nodes, labels = len(inv.hosts), {"fabtrain.job": spec.job_id}
    port = spec.master_port or inv.job.master_port
    rank_env: list[dict] = [
        {"name": "NNODES", "value": str(nodes)},
        {
            "name": "NODE_RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
        {"name": "MASTER_PORT", "value": str(port)},
    ]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"clusterIP": "None", "selector": {"job-name": name}, "publishNotReadyAddresses": True},
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            # A torchrun job cannot take one node back alone: a failed pod fails the job.
            "backoffLimit": restarts,
            "template": {
                "metadata": {"labels": labels},
                "spec": _pod_spec(inv, spec, host, cm, rank_env, subdomain=name, restartPolicy="Never"),
            },
        },
    }
    return service, job


def _trainjob(inv: Inventory, spec: jobspec.JobSpec, host: Host, name: str, cm: str) -> dict:
    """A Kubeflow Trainer v2 TrainJob on the cluster's torch runtime: the trainer's image, command,
    environment and GPUs per node, and (a runtime patch, as Trainer v2 takes pod changes) the
    entrypoint, shared memory, output claim and mounts on its "node" container."""
    n = node_spec(inv, host, spec)
    c = _container(n, [])
    trainer = {
        "numNodes": len(inv.hosts),
        "image": c["image"],
        "command": c["command"],
        "args": c["args"],
        "env": c["env"],
    }
    if "resources" in c:
        trainer["resourcesPerNode"] = c["resources"]
    container = {"name": TRAINER_NODE, "volumeMounts": c["volumeMounts"]}
    if "securityContext" in c:
        container["securityContext"] = c["securityContext"]
    pod = {"volumes": _volumes(n, cm), "containers": [container]}
    patch = {
        "manager": "fabtrain",
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": TRAINER_NODE, "template": {"spec": {"template": {"spec": pod}}}}
                    ]
                }
            }
        },
    }
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "labels": {"fabtrain.job": spec.job_id}},
        "spec": {
            "runtimeRef": {
                "name": TRAINER_RUNTIME,
                "apiGroup": "trainer.kubeflow.org",
                "kind": "ClusterTrainingRuntime",
            },
            "trainer": trainer,
            "runtimePatches": [patch],
        },
    }


def k8s_header(inv: Inventory, spec: jobspec.JobSpec, kind: str) -> str:
    host = inv.hosts[0]
    lines = [
        f"# fabtrain job {spec.job_id} as {kind}, written by `fab export.k8s` from {comment(str(inv.path))}:",
        *export.summary(inv, spec, len(inv.hosts), host),
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
    kind = {
        "trainjob.yaml": "a Kubeflow Trainer v2 TrainJob (runtime torch-distributed)",
        "pytorchjob.yaml": "a Kubeflow PyTorchJob (Training Operator v1, deprecated)",
    }.get(file, "an Indexed Job and a headless Service")
    return k8s_header(inv, spec, kind) + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=100)
