"""The deep check on the local cluster, with faults made for real inside the test hosts: a host's
NIC shaped with tc (named as the host, not its peers), one link shaped with a tc filter on one
destination (named as the link), a test host starved of CPU (named as slow), an output_dir on a tiny
tmpfs (named with its free space), and fab train --health putting a spare in a shaped host's place."""

import json
import os
import subprocess

import pytest

from orchestrator.preflight import deep

from .conftest import ADDRESS, CONTAINER, ROOT, Run, on_host

SHAPE = "tc qdisc add dev eth0 root tbf rate 50mbit burst 32kbit latency 400ms"
TINY = "/opt/fabtrain-tiny"
HEALTH = ROOT / deep.results_path()  # the cwd-relative default, or $XDG_STATE_HOME's


def shape_link(to_address: str) -> str:
    """Only traffic to one address goes through a 50 Mbit/s class (htb with a u32 filter; this
    kernel has no prio qdisc)."""
    return (
        "tc qdisc add dev eth0 root handle 1: htb default 10 && "
        "tc class add dev eth0 parent 1: classid 1:10 htb rate 100gbit && "
        "tc class add dev eth0 parent 1: classid 1:30 htb rate 50mbit ceil 50mbit && "
        f"tc filter add dev eth0 protocol ip parent 1: prio 1 u32 match ip dst {to_address}/32 flowid 1:30"
    )


def cpus(nodes, n):
    for node in nodes:
        subprocess.run(
            ["docker", "update", "--cpus", str(n), CONTAINER[node]], check=True, capture_output=True
        )


def unshape(*nodes):
    for n in nodes:
        on_host(n, "tc qdisc del dev eth0 root 2>/dev/null; true", check=False)


def deep(inventory, *extra, timeout=300):
    r = subprocess.run(
        [
            str(ROOT / ".venv/bin/fab"),
            "-r",
            str(ROOT),
            "preflight",
            "--deep",
            "--no-smoke",
            "--json",
            "--inventory",
            str(inventory),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    data = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    return r, data, {(c["host"], c["check"]): c for c in data.get("checks", [])}


@pytest.fixture
def tiny_output(four_hosts_inventory_path, tmp_path):
    """The four hosts with job.output_dir on TINY: a 4 MB tmpfs on node3, a plain directory elsewhere."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        four_hosts_inventory_path.read_text().replace(
            "  nproc_per_node: 2", f"  nproc_per_node: 2\n  output_dir: {TINY}"
        )
    )
    for n in ("node1", "node2", "node3", "node4"):
        on_host(n, f"mkdir -p {TINY}")
    on_host("node3", f"mount -t tmpfs -o size=4m tmpfs {TINY}")
    try:
        yield inv
    finally:
        on_host("node3", f"umount {TINY}", check=False)
        for n in ("node1", "node2", "node3", "node4"):
            on_host(n, f"rm -rf {TINY}", check=False)


def test_deep_check_names_a_slow_host_a_slow_link_and_a_full_disk(tiny_output):
    try:
        on_host("node2", SHAPE)
        on_host("node1", shape_link(ADDRESS["node3"]))
        r, data, checks = deep(tiny_output)
    finally:
        unshape("node1", "node2")
    assert r.returncode == 1, r.stderr[-2000:]
    net = data["deep"]["network"]
    assert list(net["slow_hosts"]) == ["node2"] and net["slow_hosts"]["node2"].startswith(
        "sends slowly to every peer"
    )
    assert [link[:2] for link in net["slow_links"]] == [["node1", "node3"]], net
    assert checks[("node2", "net")]["status"] == "fail" and checks[("node1", "link")]["status"] == "fail"
    for n in ("node1", "node3", "node4"):
        assert checks[(n, "net")]["status"] == "ok", checks[(n, "net")]
    # Every pair was measured, in 3 rounds of 2 pairs: 12 directed links, a 4 x 4 matrix.
    assert len(net["mbit_s"]) == 12 and len(net["rtt_ms"]) == 12
    assert net["matrix"].splitlines()[0].split() == ["from", "\\", "to", "node1", "node2", "node3", "node4"]
    disk = checks[("node3", "disk-speed")]
    assert (
        disk["status"] == "fail" and disk["detail"].startswith(f"{TINY}: ") and " MB free" in disk["detail"]
    )
    assert all(checks[(n, "disk-speed")]["status"] == "ok" for n in ("node1", "node2", "node4"))
    kept = json.loads(HEALTH.read_text())
    assert kept["node2"]["ok"] is False and kept["node4"]["ok"] is True


def test_a_host_starved_of_cpu_is_named_as_slow(inventory_path):
    """Two hosts (with four, three healthy test hosts would share this machine's two CPUs unevenly
    and the comparison would measure that): node2 limited to 0.2 CPU is named, node1 is not."""
    subprocess.run(["docker", "update", "--cpus", "0.2", CONTAINER["node2"]], check=True, capture_output=True)
    try:
        r, data, checks = deep(inventory_path)
    finally:
        # --cpus 0 leaves the quota in place; all of this machine's CPUs is no limit.
        cpus(["node2"], os.cpu_count())
    assert r.returncode == 1
    assert checks[("node2", "compute")]["status"] == "fail", checks[("node2", "compute")]
    assert checks[("node2", "compute")]["detail"].startswith("slow: node2 ")
    assert checks[("node1", "compute")]["status"] == "ok", data["deep"]["compute"]


def test_train_with_health_puts_a_spare_in_place_of_a_shaped_host(spares_inventory_path):
    """Three hosts' compute is measured at once on this machine's CPUs: each is held to the same
    share (0.6 CPU), or the one that started last could get less and be named slow."""
    HEALTH.unlink(missing_ok=True)  # measured now, not taken from the tests above
    three = ("node1", "node2", "node3")
    try:
        cpus(three, 0.6)
        on_host("node2", SHAPE)
        run = Run(
            spares_inventory_path,
            "train",
            "--health",
            "--script",
            "tests/integration/scripts/report.py",
            "--nproc",
            "1",
            "--skip-preflight",
            "--plain",
        )
        code = run.finish(timeout=400)
    finally:
        unshape("node2")
        cpus(three, os.cpu_count())
        HEALTH.unlink(missing_ok=True)
    assert code == 0, run.text[-3000:]
    assert "health: node2 left out (net: sends slowly to every peer" in run.text
    assert "spare node3 takes its place" in run.text
    assert "node1 r0 | REPORT" in run.text and "node3 r1 | REPORT" in run.text and "node2 r" not in run.text
