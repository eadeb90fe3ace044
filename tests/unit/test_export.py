"""The Slurm and Kubernetes exports: exact text for an NVIDIA, an AMD and a CPU inventory (golden
files; UPDATE_GOLDEN=1 rewrites them), hostile values kept as data, manifests valid against the
published schemas."""

import dataclasses
import json
import os
import subprocess
import types
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubeflow.training.api_client import ApiClient

from orchestrator.backends import export
from orchestrator.backends.kubernetes import manifests
from orchestrator.backends.slurm import script as sbatch
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import dockerargs

GOLDEN = Path(__file__).parent / "golden" / "export"
K8S_VERSION = "1.30.0"
SPEC = jobspec.JobSpec(
    job_id="gpt-demo",
    script="trainers/gpt.py",
    args=("--model", "tiny", "--epochs", "5"),
    code_key="c0de0000c0de0000",
)

INVENTORIES = {
    # The DGX example of inventory.yaml, with a secret.
    "nvidia": """\
ssh: {user: trainer, key: /k/id, known_hosts: /k/kh}
job:
  image: nvcr.io/nvidia/pytorch:24.01-py3
  nproc_per_node: auto
  code_dir: /home/trainer/fabtrain
  output_dir: /home/trainer/fabtrain-out
  shm_size: 64g
  secret_files: {WANDB_API_KEY: ~/.config/wandb.key}
hosts:
  - name: dgx1
    address: 10.0.0.11
    interface: ens1f0
    gpus: {vendor: nvidia, count: 8}
    devices: [/dev/infiniband]
    mounts: ["/data/corpus:/data:ro"]
  - name: dgx2
    address: 10.0.0.12
    interface: ens1f0
    gpus: {vendor: nvidia, count: 8}
    devices: [/dev/infiniband]
    mounts: ["/data/corpus:/data:ro"]
""",
    "amd": """\
ssh: {user: me, key: /k/id, known_hosts: /k/kh}
job:
  image: rocm/pytorch:latest
  nproc_per_node: auto
  code_dir: /home/me/fabtrain
  output_dir: /home/me/fabtrain-out
hosts:
  - {name: mi1, address: 192.168.10.21, interface: enp65s0, gpus: {vendor: amd, count: 4}, env: {HSA_FORCE_FINE_GRAIN_PCIE: "1"}}
  - {name: mi2, address: 192.168.10.22, interface: enp65s0, gpus: {vendor: amd, count: 4}, env: {HSA_FORCE_FINE_GRAIN_PCIE: "1"}}
""",
    "cpu": """\
ssh: {user: root, key: /k/id, known_hosts: /k/kh}
job:
  nproc_per_node: 2
  env: {OMP_NUM_THREADS: "1"}
hosts:
  - {name: node1, address: 172.28.5.11, interface: eth0}
  - {name: node2, address: 172.28.5.12, interface: eth0}
""",
}


def inv(kind: str, path: str = "inventory.yaml"):
    return parse(INVENTORIES[kind], Path(path))


def without_runtime(text: str) -> str:
    """The script with each shipped file's text (checked on its own: the entrypoint and the memory
    module beside it) cut out of its heredoc."""
    for name, source in dockerargs.RUNTIME_SOURCES.items():
        head, sep, rest = text.partition(f"/{name} <<'{export.HEREDOC}' || return 1\n")
        body, sep2, tail = rest.partition(f"\n{export.HEREDOC}\n")
        assert sep and sep2 and body + "\n" == source.read_text(), name
        text = head + sep + f"<docker/{name}>" + sep2 + tail
    return text


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; UPDATE_GOLDEN=1 rewrites it after review"


@pytest.mark.parametrize("kind,pyxis", [("nvidia", False), ("nvidia", True), ("amd", False), ("cpu", False)])
def test_sbatch_script_exact_text(kind, pyxis):
    text, warnings = sbatch.slurm_script(
        inv(kind),
        SPEC,
        pyxis=pyxis,
        partition="gpu" if kind != "cpu" else None,
        time_limit="12:00:00" if kind == "nvidia" else None,
    )
    assert warnings == []
    check_golden(f"{kind}{'-pyxis' if pyxis else ''}.sbatch", without_runtime(text))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def k8s_texts(kind: str) -> dict[str, str]:
    i = inv(kind)
    docs, _ = manifests.k8s_manifests(i, SPEC)
    return {file: manifests.k8s_text(i, SPEC, file, d) for file, d in docs.items()}


@pytest.mark.parametrize("kind", ["nvidia", "amd", "cpu"])
def test_k8s_manifests_exact_text_and_valid(kind):
    for file, text in k8s_texts(kind).items():
        docs = list(yaml.safe_load_all(text))
        # The ConfigMap, mounted as one directory, holds every file a node's start ships.
        assert docs[0]["kind"] == "ConfigMap" and list(docs[0]["data"]) == list(dockerargs.RUNTIME_SOURCES)
        for name, source in dockerargs.RUNTIME_SOURCES.items():
            assert docs[0]["data"][name] == source.read_text(), name
            docs[0]["data"][name] = f"<docker/{name}>"
        check_golden(
            f"{kind}-{file}",
            text.split("\napiVersion:", 1)[0]
            + "\n"
            + yaml.dump_all(docs, Dumper=manifests._Dumper, sort_keys=False, width=100),
        )
        for doc in docs:
            validate(doc)


def validate(doc: dict) -> None:
    """A document against the published schemas: Kubernetes' own kinds with kubernetes-validate
    (strict: unknown fields fail), a PyTorchJob with the Kubeflow training SDK's model (a field it
    does not know would be dropped on the way through) and its pod templates as Kubernetes'."""
    if doc["kind"] == "TrainJob":
        validate_trainjob(doc)
        return
    if doc["kind"] != "PyTorchJob":
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    for replica in doc["spec"]["pytorchReplicaSpecs"].values():
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": replica["template"],
            },
            K8S_VERSION,
            strict=True,
        )
    client = ApiClient()
    model = client.deserialize(types.SimpleNamespace(data=json.dumps(doc)), "KubeflowOrgV1PyTorchJob")
    assert client.sanitize_for_serialization(model) == doc


def validate_trainjob(doc: dict) -> None:
    """A TrainJob against the Kubeflow Trainer API's pydantic models (strict types; a field they do
    not know would be dropped, so the document must come back whole), and its runtime patch's pod
    (volumes, mounts) as a Kubernetes PodTemplate with the trainer's image."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    model = TrainerV1alpha1TrainJob.from_dict(doc)
    assert model.to_dict() == doc
    pod = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"
    ]["spec"]["template"]["spec"]
    container = {**pod["containers"][0], "image": doc["spec"]["trainer"]["image"]}
    kubernetes_validate.validate(
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": {"spec": {**pod, "containers": [container]}},
        },
        K8S_VERSION,
        strict=True,
    )


def test_a_broken_trainjob_is_rejected():
    import pydantic

    docs, _ = manifests.k8s_manifests(inv("nvidia"), SPEC)
    trainjob = docs["trainjob.yaml"][2]
    assert trainjob["spec"]["runtimeRef"] == {
        "name": "torch-distributed",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    assert trainjob["spec"]["trainer"]["numNodes"] == 2
    assert trainjob["spec"]["trainer"]["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "8"}}
    validate(trainjob)
    for broken in (
        {**trainjob["spec"]["trainer"], "numNodes": "two"},
        {**trainjob["spec"]["trainer"], "nodes": 2},
    ):
        doc = {**trainjob, "spec": {**trainjob["spec"], "trainer": broken}}
        with pytest.raises((pydantic.ValidationError, AssertionError)):
            validate(doc)
    without_runtime = {**trainjob, "spec": {k: v for k, v in trainjob["spec"].items() if k != "runtimeRef"}}
    with pytest.raises(pydantic.ValidationError):
        validate(without_runtime)


def test_validation_catches_a_wrong_field():
    docs, _ = manifests.k8s_manifests(inv("nvidia"), SPEC)
    job = docs["pytorchjob.yaml"][2]
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(Exception, match="gpus"):
        validate(job)
    job = docs["pytorchjob.yaml"][2]
    del job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["gpus"]
    job["spec"]["replicas"] = 2  # not a PyTorchJob field
    with pytest.raises(AssertionError):
        validate(job)


def test_nvidia_manifests_carry_gpus_shm_capabilities_and_secret_references():
    docs, warnings = manifests.k8s_manifests(inv("nvidia"), SPEC)
    pod = docs["indexed-job.yaml"][3]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert {
        "name": "WANDB_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "fabtrain-secrets", "key": "WANDB_API_KEY"}},
    } in c["env"]
    assert "infiniband" in warnings[0]
    amd = manifests.k8s_manifests(inv("amd"), SPEC)[0]["pytorchjob.yaml"][2]
    amd_c = amd["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert amd_c["resources"] == {"limits": {"amd.com/gpu": "4"}}
    assert amd_c["securityContext"] == {"seccompProfile": {"type": "Unconfined"}}


HOSTILE = "a'b\"c $(touch PWNED) `touch PWNED` ; ${HOME}\nsecond line"


def hostile_inventory(tmp_path: Path):
    text = f"""\
ssh: {{user: root, key: /k/id, known_hosts: /k/kh}}
job:
  code_dir: {tmp_path}/code dir
  output_dir: {tmp_path}/out
  env: {{WEIRD: {json.dumps(HOSTILE)}}}
hosts:
  - {{name: node1, address: 10.1.1.1, interface: eth0}}
  - {{name: node2, address: 10.1.1.2, interface: eth0}}
"""
    return parse(text, tmp_path / "inv.yaml")


STUBS = {
    "scontrol": """#!/bin/bash
case "$2" in hostnames) echo node1; echo node2;; node) echo "NodeName=node1 Arch=x86_64 NodeAddr=10.1.1.1 NodeHostName=node1";; esac
""",
    # srun: the step's command once, as node rank 1 of 2.
    "srun": """#!/bin/bash
while [ "${1#-}" != "$1" ]; do shift; done
SLURM_NODEID=1 SLURMD_NODENAME=node2 exec "$@"
""",
    "docker": """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["STUB_OUT"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "run":  # docker run --cidfile FILE writes the container's id there
    with open(sys.argv[sys.argv.index("--cidfile") + 1], "x") as f:
        f.write("c0ffee")
""",
}


def test_sbatch_hostile_values_stay_data(tmp_path):
    """The docker flavour run by bash with scontrol, srun and docker stubbed: the container gets
    every value exactly, and nothing in a value runs."""
    i = hostile_inventory(tmp_path)
    spec = jobspec.JobSpec(
        job_id="j1", script="trainers/gpt.py", args=(HOSTILE, "--x", "$(touch PWNED)"), code_key="k1"
    )
    text, _ = sbatch.slurm_script(i, spec)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(text)
    (tmp_path / "code dir" / "k1").mkdir(parents=True)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_OUT": str(tmp_path / "calls"),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "7",
        "SLURM_RESTART_COUNT": "1",
    }
    r = subprocess.run(
        ["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "master 10.1.1.1" in r.stdout
    calls = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    assert calls[0] == ["info"]  # the node's engine answers before anything starts
    assert calls[1] == ["rm", "--force", "fabtrain-j1-r1"]
    run = calls[2]
    # A requeued attempt has a runtime directory of its own (the old attempt's cleanup cannot remove
    # it), one per node (a shared output_dir holds every node's cidfile and secrets).
    assert run[:8] == [
        "run",
        "--rm",
        "--cidfile",
        f"{tmp_path}/out/.runtime/j1/7.1.1/cid",
        "--name",
        "fabtrain-j1-r1",
        "--label",
        "fabtrain.managed=1",
    ]
    assert f"{tmp_path}/out/.runtime/j1/7.1.1:/run/fabtrain:ro" in run
    assert "fabtrain.rank=1" in run and "fabtrain.host=node2" in run
    assert f"WEIRD={HOSTILE}" in run
    assert [
        "--env",
        "MASTER_ADDR",
        "--env",
        "MASTER_PORT=29500",
        "--env",
        "NNODES",
        "--env",
        "NODE_RANK",
    ] == run[run.index("MASTER_ADDR") - 1 : run.index("NODE_RANK") + 1]
    assert f"{tmp_path}/code dir/k1:/run/fabtrain-code:ro" in run
    assert f"{tmp_path}/out/j1/work:/workspace" in run and (tmp_path / "out/j1/work").is_dir()
    assert run[-4:] == ["trainers/gpt.py", HOSTILE, "--x", "$(touch PWNED)"]
    assert calls[3] == ["stop", "--time", "30", "c0ffee"]  # the EXIT trap: this attempt's container
    assert not list(tmp_path.rglob("PWNED"))
    assert not (tmp_path / "out" / ".runtime" / "j1").exists()  # removed at the end
    assert len(calls) == 4
    # A node whose engine does not answer fails its task at once, named; nothing is started there.
    (bin_dir / "docker").write_text('#!/bin/sh\necho "$@" >> "$STUB_OUT.fail"; [ "$1" != info ]\n')
    r = subprocess.run(
        ["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode != 0 and "[fabtrain] node2: no Docker engine answers (docker info, 30 s)" in r.stderr
    assert (tmp_path / "calls.fail").read_text() == "info\n"
    # A node without the code (no shared filesystem, no fab sync there) is named with the path.
    (bin_dir / "docker").write_text('#!/bin/sh\necho "$@" >> "$STUB_OUT.nocode"\n')
    (tmp_path / "code dir" / "k1").rmdir()
    r = subprocess.run(
        ["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert (
        r.returncode != 0 and f"[fabtrain] node2: the code is not at {tmp_path}/code dir/k1: put" in r.stderr
    )
    assert (tmp_path / "calls.nocode").read_text() == "info\n"


def test_a_fractional_stop_grace_is_a_whole_number_of_seconds_for_docker(tmp_path):
    i = hostile_inventory(tmp_path)
    i = dataclasses.replace(i, job=dataclasses.replace(i.job, stop_grace=2.5))
    text, _ = sbatch.slurm_script(i, jobspec.JobSpec(job_id="j1", script="trainers/gpt.py", code_key="k1"))
    assert "docker stop --time 3 " in text and "--time 2.5" not in text


def test_k8s_hostile_values_stay_data(tmp_path):
    i = hostile_inventory(tmp_path)
    spec = jobspec.JobSpec(job_id="J_1.x", script="trainers/gpt.py", args=(HOSTILE,))
    docs, _ = manifests.k8s_manifests(i, spec)
    text = manifests.k8s_text(i, spec, "indexed-job.yaml", docs["indexed-job.yaml"])
    job = list(yaml.safe_load_all(text))[3]
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["args"] == ["trainers/gpt.py", HOSTILE]
    assert {"name": "WEIRD", "value": HOSTILE} in c["env"]
    assert job["metadata"]["name"] == "j-1-x"  # a DNS-1123 name
    for doc in yaml.safe_load_all(text):
        validate(doc)


def test_bad_input_is_refused_clearly():
    with pytest.raises(UserError, match="--partition"):
        sbatch.slurm_script(inv("cpu"), SPEC, partition="gpu\n#SBATCH --uid=0")
    odd = parse(
        INVENTORIES["cpu"].replace("interface: eth0}\n", "interface: eth0, mounts: ['/a,b:/data']}\n", 1),
        Path("inv.yaml"),
    )
    with pytest.raises(UserError, match="container-mounts"):
        sbatch.slurm_script(odd, SPEC, pyxis=True)
    text, warnings = sbatch.slurm_script(odd, SPEC)
    assert warnings == ["node2: mounts differs from node1's; the export gives every node node1's"]


def test_enroot_image_names():
    assert sbatch.enroot_image("nvcr.io/nvidia/pytorch:24.01-py3") == "nvcr.io#nvidia/pytorch:24.01-py3"
    assert sbatch.enroot_image("localhost:5000/x") == "localhost:5000#x"
    assert sbatch.enroot_image("rocm/pytorch:latest") == "rocm/pytorch:latest"


def test_one_node_spec_is_what_docker_slurm_and_kubernetes_all_render():
    """Each renderer reads the NodeSpec's fields (none parses another's output): a capability and a
    security option added to the node alone reach the docker argv, the sbatch script's docker run
    and the Kubernetes container."""
    from orchestrator.hostcmds import node as nodes

    inv = parse(INVENTORIES["amd"], Path("/i/amd.yaml"))
    host = inv.hosts[0]
    n = nodes.node_spec(inv, host, SPEC)
    argv = dockerargs.docker_run(n, "--detach")
    started = nodes.docker_run_argv(inv, host, SPEC)  # what fab train runs: the same, plus its console
    at = started.index("FABTRAIN_CONSOLE=/output/.console/node-0.log") - 1
    assert started[:at] + started[at + 2 :] == argv
    assert argv[argv.index("--entrypoint") + 1 : argv.index(n.image)] == ["python3"]
    assert argv[argv.index(n.image) :] == [n.image, jobspec.ENTRYPOINT_PATH, *n.command]
    container = manifests._container(n, [])
    assert container["command"] == ["python3", jobspec.ENTRYPOINT_PATH] and container["args"] == list(
        n.command
    )
    assert n.seccomp_unconfined and container["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    more = dataclasses.replace(n, cap_add=(*n.cap_add, "SYS_PTRACE"), security_opt=("apparmor=unconfined",))
    docker = dockerargs.docker_options(more)
    assert docker[docker.index("SYS_PTRACE") - 1] == "--cap-add" and "seccomp=unconfined" not in docker
    k8s = manifests._container(more, [])
    assert k8s["securityContext"]["capabilities"]["add"][-1] == "SYS_PTRACE"
    assert "seccompProfile" not in k8s["securityContext"]
    # The sbatch script's docker run is the same options, the Slurm task filling in name and rank.
    script, _ = sbatch.slurm_script(inv, SPEC)
    for flag, value in zip(docker[::2], docker[1::2], strict=True):
        if (
            flag in ("--ulimit", "--cap-add", "--security-opt", "--shm-size", "--device", "--group-add")
            and value != "SYS_PTRACE"
            and value != "apparmor=unconfined"
        ):
            assert f"{flag} {value}" in script or f"{flag} '{value}'" in script, (flag, value)


def test_fab_export_writes_through_the_registry_what_the_golden_files_hold(tmp_path, monkeypatch, capsys):
    """fab export.slurm and export.k8s reach their renderers by name (backends/registry.py): the
    renderers give the golden texts for the golden job, and the tasks write those files."""
    from fabric.main import make_program as make_fab
    from rich.console import Console

    from orchestrator.backends import registry
    from orchestrator.backends.base import Launch
    from orchestrator.core.policy import Policy

    def launch(kind: str) -> Launch:
        return Launch(inv(kind), SPEC, Policy(), None, tmp_path / "runs", Console(file=None))

    rendered = registry.render(
        registry.renderer("slurm"), launch("nvidia"), pyxis=True, partition="gpu", time="12:00:00"
    )
    assert list(rendered.files) == ["gpt-demo.sbatch"] and rendered.warnings == ()
    check_golden("nvidia-pyxis.sbatch", without_runtime(rendered.files["gpt-demo.sbatch"]))
    rendered = registry.render(registry.renderer("kubernetes"), launch("cpu"))
    assert rendered.files == k8s_texts("cpu") and rendered.warnings == ()

    for name in ("id", "kh"):
        (tmp_path / name).write_text("")
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORIES["cpu"].replace("/k/", f"{tmp_path}/"))
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    make_fab().run(
        [
            "fab",
            "export.slurm",
            "--inventory",
            str(path),
            "--out",
            str(tmp_path / "job.sbatch"),
            "--partition",
            "cpu",
        ],
        exit=False,
    )
    make_fab().run(
        ["fab", "export.k8s", "--inventory", str(path), "--out", str(tmp_path / "k8s"), "--restarts", "2"],
        exit=False,
    )
    printed = capsys.readouterr()
    out = printed.out.splitlines()
    assert printed.err == "", printed.err
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --partition=cpu" in script and (tmp_path / "job.sbatch").stat().st_mode & 0o777 == 0o755
    assert out[0].startswith(f"wrote {tmp_path}/job.sbatch (job gpt-") and out[0].endswith(
        f"; put the code on every node (fab sync) and submit: sbatch {tmp_path}/job.sbatch"
    )
    files = sorted(p.name for p in (tmp_path / "k8s").iterdir())
    assert files == ["indexed-job.yaml", "pytorchjob.yaml", "trainjob.yaml"]
    assert "backoffLimit: 2" in (tmp_path / "k8s" / "indexed-job.yaml").read_text()
    assert out[1].startswith(f"wrote {tmp_path}/k8s/trainjob.yaml, ") and out[1].endswith(
        "apply one with kubectl apply -f (trainjob.yaml on Kubeflow Trainer v2)"
    )
