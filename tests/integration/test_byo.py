"""Bring your own code and image, on the local cluster."""

import json
import subprocess

from .conftest import ADDRESS, FAB, ROOT, fab, on_host

USER_SCRIPT = """\
import argparse, json, os, sys
import torch
import torch.distributed as dist

p = argparse.ArgumentParser(description="a user's own training script")
p.add_argument("--name", required=True)
p.add_argument("--quote", required=True)
p.add_argument("--steps", type=int, default=1)
a = p.parse_args()
dist.init_process_group("gloo")
t = torch.tensor([1.0])
dist.all_reduce(t)
data = open("/data/hello.txt").read().strip() if os.path.exists("/data/hello.txt") else None
sys.stdout.write("USER " + json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                 "sum": t.item(),
                 "name": a.name, "quote": a.quote, "steps": a.steps, "colour": os.environ.get("COLOUR"),
                 "data": data, "cwd_files": sorted(os.listdir("."))}) + "\\n")
"""


def with_host_extras(text: str) -> str:
    """node1 gets env COLOUR=red; node2 gets COLOUR=blue and a read-only data mount."""
    text = text.replace("  - name: node1\n", "  - name: node1\n    env: {COLOUR: red}\n")
    return text.replace(
        "  - name: node2\n",
        "  - name: node2\n    env: {COLOUR: blue}\n    mounts: ['/srv/fabtrain-test-data:/data:ro']\n",
    )


def test_user_script_outside_the_project(inventory_path, tmp_path):
    proj = tmp_path / "my-project"
    proj.mkdir()
    (proj / "train_user.py").write_text(USER_SCRIPT)
    inv = tmp_path / "byo.yaml"
    inv.write_text(with_host_extras(inventory_path.read_text()))
    on_host(
        "node2",
        "mkdir -p /srv/fabtrain-test-data && echo from-node2-disk > /srv/fabtrain-test-data/hello.txt",
    )
    try:
        r = fab(
            inv,
            "train",
            "--code",
            str(proj),
            "--script",
            "train_user.py",
            "--nproc",
            "2",
            "--args",
            '--name \'a b  c\' --quote "it\'s \\"quoted\\"" --steps=3',
        )
    finally:
        on_host("node2", "rm -rf /srv/fabtrain-test-data")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    reports = [json.loads(line.split("USER ", 1)[1]) for line in r.stdout.splitlines() if "| USER " in line]
    assert sorted(rep["rank"] for rep in reports) == [0, 1, 2, 3]
    for rep in reports:
        assert (rep["world"], rep["sum"]) == (4, 4.0)
        assert rep["name"] == "a b  c" and rep["quote"] == 'it\'s "quoted"' and rep["steps"] == 3
        node2 = rep["rank"] >= 2
        assert rep["colour"] == ("blue" if node2 else "red")
        assert rep["data"] == ("from-node2-disk" if node2 else None)
        assert rep["cwd_files"] == ["train_user.py"]  # the user's tree, not this project


def test_dry_run_prints_every_command_per_host(inventory_path):
    r = fab(inventory_path, "train", "--dry-run", "--model", "tiny", "--epochs", "1")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    runs = [line for line in lines if " docker run " in line]
    assert runs[0].startswith("[node1 rank 0] mkdir -p /opt/fabtrain/output/gpt-")
    # The runtime files (the entrypoint and its memory module) unpacked from one tar on stdin.
    assert " && (umask 022 && tar -x -o -f - -C /opt/fabtrain/output/.runtime/gpt-" in runs[0]
    assert ") && timeout -k 5 110 docker run --detach --name fabtrain-gpt-" in runs[0]
    assert runs[0].endswith(
        " >/dev/null || { rc=$?; case $rc in 124|137) echo 'not done within 110s: ended on "
        "the host (timeout); check its Docker engine and disks' >&2;; esac; exit $rc; }  "
        "# stdin: docker/entrypoint.py, docker/fabtrain_memory.py and the modules they import (a tar archive)"
    )
    assert runs[1].startswith("[node2 rank 1] mkdir -p ")
    assert "--env NODE_RANK=1" in runs[1] and "trainers/gpt.py --model tiny --epochs 1" in runs[1]
    assert sum(line.startswith("[local] rsync --archive") for line in lines) == 2
    assert on_host("node1", "docker ps -aq --filter label=fabtrain.managed=1").stdout == ""


def local(*argv, **kw):
    return subprocess.run(list(argv), check=True, capture_output=True, text=True, **kw)


def test_image_push_is_idempotent_and_corrects_drift(inventory_path):
    tag = "fabtrain/push-test:1"
    local(
        "docker",
        "build",
        "-q",
        "-t",
        tag,
        "-",
        input="FROM fabtrain/base:bookworm\nLABEL push-test=1\n",
        env={"DOCKER_BUILDKIT": "0", "PATH": "/usr/local/bin:/usr/bin:/bin"},
    )
    want = local("docker", "image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
    try:
        first = fab(inventory_path, "image.push", "--image", tag)
        assert first.returncode == 0, first.stderr
        assert "node1: sent" in first.stdout and "node2: sent" in first.stdout
        again = fab(inventory_path, "image.push", "--image", tag)
        assert again.returncode == 0
        assert [x for x in again.stdout.splitlines() if x] == [
            "node1: present",
            "node2: present",
        ]  # nothing sent
        # node2 gets a different image under the same tag; the next push corrects only node2.
        on_host(
            "node2", f"printf 'FROM {tag}\\nLABEL drift=1\\n' | DOCKER_BUILDKIT=0 docker build -q -t {tag} -"
        )
        assert on_host("node2", f"docker image inspect --format '{{{{.Id}}}}' {tag}").stdout.strip() != want
        fixed = fab(inventory_path, "image.push", "--image", tag)
        assert fixed.returncode == 0
        assert "node1: present" in fixed.stdout and "node2: sent" in fixed.stdout
        for node in ("node1", "node2"):
            assert on_host(node, f"docker image inspect --format '{{{{.Id}}}}' {tag}").stdout.strip() == want
    finally:
        for node in ("node1", "node2"):
            on_host(node, f"docker rmi -f {tag}; docker image prune -f", check=False)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


def test_entrypoint_by_hand_with_platform_variables_forms_the_same_job(inventory_path, inv):
    r = fab(inventory_path, "sync", "--code", str(ROOT), "--json")  # the whole project: its test scripts too
    doc = json.loads(r.stdout)  # --json: only the JSON on stdout (the file list and bars on stderr)
    code = doc["destination"]
    assert set(doc["seconds"]) == {h.name for h in inv.hosts}, doc
    names = []
    try:
        for h in inv.hosts:
            name = f"by-hand-{h.rank}"
            names.append(name)
            # Only what a platform sets: number of nodes, this node's rank, the master.
            on_host(
                h.name,
                f"docker run -d --name {name} --network host -e WORLD_SIZE=2 -e RANK={h.rank} "
                f"-e MASTER_ADDR={inv.master.address} -e MASTER_PORT=29517 "
                f"-v {code}:/workspace -w /workspace {inv.job.image} "
                f"tests/integration/scripts/report.py",
            )
        logs = {}
        for h, name in zip(inv.hosts, names, strict=True):
            code = on_host(h.name, f"docker wait {name}").stdout.strip()
            logs[h.name] = on_host(h.name, f"docker logs {name} 2>&1").stdout
            assert code == "0", logs[h.name]
    finally:
        for h, name in zip(inv.hosts, names, strict=True):
            on_host(h.name, f"docker rm -f {name}", check=False)
    for node, rank in (("node1", 0), ("node2", 1)):
        banner = next(line for line in logs[node].splitlines() if line.startswith("[fabtrain]"))
        assert f"nodes=2 node_rank={rank} master={ADDRESS['node1']}:29517" in banner
        assert "procs_per_node=1 world_size=2 ifname=eth0" in banner  # CPU node: auto = 1
        rep = json.loads(next(line for line in logs[node].splitlines() if line.startswith("REPORT "))[7:])
        assert (rep["world"], rep["sum"], rep["rank"]) == (2, 3.0, rank)


def fab_no_inventory(*args):
    return subprocess.run([FAB, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_derived_image_from_base_plus_requirements(tmp_path):
    wheels = tmp_path / "wheels"
    local("python3", "-m", "pip", "download", "--quiet", "--no-deps", "six==1.16.0", "-d", str(wheels))
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("six==1.16.0\n")
    tag = "fabtrain/derived-test:1"
    try:
        r = fab_no_inventory(
            "image.build",
            "--base",
            "fabtrain/trainer:latest",
            "--requirements",
            str(reqs),
            "--tag",
            tag,
            "--wheels",
            str(wheels),
        )
        assert r.returncode == 0, r.stderr
        assert f"push it with: fab image.push --image {tag}" in r.stdout
        out = local(
            "docker",
            "run",
            "--rm",
            "--entrypoint",
            "python3",
            tag,
            "-c",
            "import six, torch; print(six.__version__)",
        ).stdout.strip()
        assert out == "1.16.0"
        usage = subprocess.run(["docker", "run", "--rm", tag], capture_output=True, text=True)
        assert "usage: fabtrain-entrypoint SCRIPT" in usage.stderr  # the same entrypoint
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
    bad = fab_no_inventory(
        "image.build",
        "--base",
        "fabtrain/trainer:latest",
        "--requirements",
        str(tmp_path / "missing.txt"),
        "--tag",
        tag,
    )
    assert bad.returncode == 1 and "missing.txt: requirements file not found" in bad.stderr
