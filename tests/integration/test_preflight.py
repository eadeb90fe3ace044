"""Preflight on the local cluster: each injected fault fails the right check on the right host,
with a message that says what was seen and how to fix it. Every test undoes its fault."""

import ipaddress
import json
import subprocess
from contextlib import contextmanager

import pytest

from orchestrator.testbed import cluster

from .conftest import ADDRESS, CONTAINER, fab, on_host

N1, N2 = ADDRESS["node1"], ADDRESS["node2"]
# A second network for node2, beside this cluster's (the next /24 up).
SIDE = ipaddress.ip_network(cluster.SUBNET).network_address + 256
SIDE_NET, SIDE_IP, SIDE_NAME = f"{SIDE}/24", str(SIDE + 12), f"{cluster.PREFIX}-test-side"

FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def preflight(inventory_path, *extra):
    r = fab(inventory_path, "preflight", "--no-smoke", "--json", *extra)
    data = json.loads(r.stdout)
    return r.returncode, {(c["host"], c["check"]): c for c in data["checks"]}


@contextmanager
def fault(node, inject, undo):
    """A fault injected on a test host for the duration of a block, always undone."""
    on_host(node, inject)
    try:
        yield
    finally:
        on_host(node, undo)


def node2_interface(inventory_path, tmp_path, iface):
    text = inventory_path.read_text()
    idx = text.index("name: node2")
    path = tmp_path / f"iface-{iface}.yaml"
    path.write_text(text[:idx] + text[idx:].replace("interface: eth0", f"interface: {iface}", 1))
    return path


def failures(checks):
    return sorted((h, name) for (h, name), c in checks.items() if c["status"] == "fail")


def edited(inventory_path, tmp_path, old, new, name="edited.yaml"):
    text = inventory_path.read_text()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return path


@pytest.fixture(autouse=True)
def synced(inventory_path):
    fab(inventory_path, "sync")


def test_clean_cluster_passes_everything_including_the_smoke_test(inventory_path):
    r = fab(inventory_path, "preflight", "--json", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    checks = json.loads(r.stdout)["checks"]
    assert {c["status"] for c in checks} <= {"ok", "n/a"}
    names = {c["check"] for c in checks}
    assert names >= {
        "ssh",
        "docker",
        "image",
        "gpus",
        "interface",
        "route",
        "port",
        "reach",
        "mtu",
        "time",
        "shm",
        "disk",
        "code",
        "smoke",
    }
    smoke = [c for c in checks if c["check"] == "smoke"]
    assert len(smoke) == 2 and all("all_reduce over 4 ranks (gloo), bus bw" in c["detail"] for c in smoke)
    for node in ("node1", "node2"):  # the smoke test's runtime files (entrypoint, secrets) are gone
        left = on_host(node, "ls /opt/fabtrain/output/.runtime", check=False).stdout.split()
        assert [d for d in left if d.startswith("preflight-")] == [], left


def test_firewall_dropping_the_master_port_on_rank0(inventory_path, inv):
    port = inv.job.master_port
    rule = f"INPUT -p tcp --dport {port} -s {inv.hosts[1].address} -j DROP"
    with fault("node1", f"iptables -I {rule}", f"iptables -D {rule}"):
        code, checks = preflight(inventory_path)
    assert code == 1
    assert failures(checks) == [("node2", "reach")]
    c = checks[("node2", "reach")]
    assert c["detail"] == (
        f"cannot reach node1 {N1}:{port} from {N2}: timed out (packets dropped: a firewall?)"
    )
    assert c["fix"].startswith(f"open TCP {port} on node1 for {N2}")
    assert checks[("node1", "port")]["status"] == "ok"  # free, just not reachable


def test_wrong_interface_name_suggests_the_right_one(inventory_path, inv, tmp_path):
    code, checks = preflight(node2_interface(inventory_path, tmp_path, "ens9f0"))
    assert code == 1
    assert ("node2", "interface") in failures(checks) and ("node1", "interface") not in failures(checks)
    c = checks[("node2", "interface")]
    assert c["detail"] == "no interface 'ens9f0'"
    assert c["fix"] == f"set interface: eth0 for node2 (its subnet holds {N1})"


def test_sshd_stopped_on_one_host(inventory_path):
    with fault("node2", "pkill -x sshd", "/usr/sbin/sshd -E /var/log/sshd.log"):
        code, checks = preflight(inventory_path)
    assert code == 1
    assert failures(checks) == [("node2", "ssh")]
    assert f"node2 (root@{N2}:22): connection refused; start sshd there" in checks[("node2", "ssh")]["detail"]


def test_docker_engine_stopped_on_one_host(inventory_path):
    # The engine comes back as the host started it (host-init's flags), kept before it is stopped.
    with fault(
        "node2",
        "tr '\\0' ' ' < /proc/$(pgrep -x dockerd)/cmdline > /run/dockerd.cmdline; "
        "pkill -x dockerd; while pgrep -x dockerd >/dev/null; do sleep 0.2; done",
        "$(cat /run/dockerd.cmdline) >/var/log/dockerd.log 2>&1 & "
        "for i in $(seq 60); do docker info >/dev/null 2>&1 && exit 0; sleep 0.5; done; exit 1",
    ):
        code, checks = preflight(inventory_path)
    assert code == 1
    assert ("node2", "docker") in failures(checks) and ("node1", "docker") not in failures(checks)
    c = checks[("node2", "docker")]
    assert c["detail"].startswith("engine not reachable: ") and "Is the docker daemon running?" in c["detail"]
    assert c["fix"] == "on node2: start the engine (sudo systemctl start docker)"


TEST_TAG = "fabtrain/trainer:preflight-test"


def test_image_missing_on_one_host(inventory_path, inv, tmp_path):
    on_host("node1", f"docker tag {inv.job.image} {TEST_TAG}")
    try:
        code, checks = preflight(
            edited(inventory_path, tmp_path, f"image: {inv.job.image}", f"image: {TEST_TAG}")
        )
    finally:
        on_host("node1", f"docker rmi {TEST_TAG}")
    assert code == 1
    assert failures(checks) == [("node2", "image")]
    assert checks[("node2", "image")]["detail"] == f"{TEST_TAG} not present"
    assert checks[("node2", "image")]["fix"].startswith(f"fab image.push --image {TEST_TAG}")


def test_different_image_under_the_same_tag(inventory_path, inv, tmp_path):
    on_host("node1", f"docker tag {inv.job.image} {TEST_TAG}")
    on_host(
        "node2",
        f"printf 'FROM {inv.job.image}\\nLABEL drift=1\\n' | DOCKER_BUILDKIT=0 docker build -q -t "
        f"{TEST_TAG} -",
    )
    try:
        code, checks = preflight(
            edited(inventory_path, tmp_path, f"image: {inv.job.image}", f"image: {TEST_TAG}")
        )
    finally:
        on_host("node1", f"docker rmi {TEST_TAG}")
        on_host("node2", f"docker rmi {TEST_TAG}")
    assert code == 1
    assert failures(checks) == [("node2", "image")]
    detail = checks[("node2", "image")]["detail"]
    assert "differs from node1's" in detail and "(same tag, other image)" in detail


def test_clock_two_seconds_off_on_one_host(inventory_path):
    skew = (
        "cp /etc/environment /etc/environment.orig; "
        f"printf 'LD_PRELOAD={FAKETIME}\\nFAKETIME=+2s\\n' >> /etc/environment"
    )
    with fault("node2", skew, "mv /etc/environment.orig /etc/environment"):
        code, checks = preflight(inventory_path)
    assert code == 1
    assert failures(checks) == [("node2", "time")]
    detail = checks[("node2", "time")]["detail"]
    offset = float(detail.split("offset ")[1].split(" ms")[0])
    assert 1900 < offset < 2100, detail
    assert abs(float(checks[("node1", "time")]["detail"].split("offset ")[1].split(" ms")[0])) < 100


def test_worker_interface_that_cannot_reach_the_master(inventory_path, tmp_path):
    subprocess.run(
        ["docker", "network", "create", "--subnet", SIDE_NET, SIDE_NAME], check=True, capture_output=True
    )
    try:
        subprocess.run(
            ["docker", "network", "connect", "--ip", SIDE_IP, SIDE_NAME, CONTAINER["node2"]],
            check=True,
            capture_output=True,
        )
        iface = on_host("node2", f"ip -o -4 addr show | awk '/{SIDE_IP}/ {{print $2}}'").stdout.strip()
        code, checks = preflight(node2_interface(inventory_path, tmp_path, iface))
    finally:
        subprocess.run(
            ["docker", "network", "disconnect", SIDE_NAME, CONTAINER["node2"]], capture_output=True
        )
        subprocess.run(["docker", "network", "rm", SIDE_NAME], capture_output=True)
    assert code == 1
    assert ("node2", "route") in failures(checks)
    c = checks[("node2", "route")]
    assert c["detail"] == f"{N1} is reached via eth0, not {iface}"
    assert c["fix"].startswith("set interface: eth0 for node2")


def test_unknown_host_key_fails_ssh_with_fingerprint(inventory_path, tmp_path):
    empty = tmp_path / "kh"
    empty.write_text("")
    text = inventory_path.read_text()
    line = next(x for x in text.splitlines() if "known_hosts:" in x)
    path = tmp_path / "unknown.yaml"
    path.write_text(text.replace(line, f"  known_hosts: {empty}"))
    code, checks = preflight(path)
    assert code == 1
    assert failures(checks) == [("node1", "ssh"), ("node2", "ssh")]
    assert "host key unknown (ssh-ed25519 SHA256:" in checks[("node2", "ssh")]["detail"]
