"""Image push by chain on the local cluster (four test hosts): a host whose Docker engine stops
mid-transfer is named while the others get the image; a host frozen mid-chain is named and the
hosts after it get the image from a reformed chain; a changed small layer is all a second push
sends. Image ids are checked on the hosts directly. Each test leaves the hosts' engines running."""

import subprocess
from contextlib import contextmanager

import pytest

from orchestrator.config.inventory import load
from orchestrator.images import images
from orchestrator.testbed import faults
from orchestrator.transport.remote import Session

from .conftest import fab, on_host

REPO = "fabtrain/chaintest"
TAG = f"{REPO}:push"
BIG_MB = 48


BUILT: list[str] = []  # ids built by the tests: removed from the hosts after each, tagged or not


def build(tmp_path, small: str, tag: str) -> str:
    """FROM the base image: a 48 MB layer (the same one, from the build cache, in every version) and
    a small layer that differs between versions."""
    (tmp_path / f"Dockerfile.{small}").write_text(
        "FROM fabtrain/base:bookworm\n"
        f"RUN head -c {BIG_MB * 1000 * 1000} /dev/urandom > /big\n"
        f"RUN echo {small} > /small\n"
    )
    subprocess.run(
        ["docker", "build", "-q", "-t", tag, "-f", str(tmp_path / f"Dockerfile.{small}"), str(tmp_path)],
        check=True,
        capture_output=True,
        env={"DOCKER_BUILDKIT": "0", "PATH": "/usr/bin:/bin"},
    )
    BUILT.append(images.local_image(tag)[0])
    return BUILT[-1]


def host_id(node: str, tag: str = TAG) -> str:
    return on_host(node, f"docker image inspect --format '{{{{.Id}}}}' {tag}", check=False).stdout.strip()


def forget_test_images(nodes):
    """The test images off the hosts: by tag, and by id (a version replaced under the tag is left
    untagged, and would keep its layers there)."""
    ids = " ".join(BUILT)
    for node in nodes:
        on_host(
            node,
            f"docker image ls --quiet {REPO} | xargs -r docker rmi -f >/dev/null 2>&1; "
            f"for i in {ids}; do docker rmi -f $i >/dev/null 2>&1; done; true",
            check=False,
        )


@pytest.fixture
def four(four_hosts_inventory_path):
    inv = load(four_hosts_inventory_path)
    names = [h.name for h in inv.hosts]
    forget_test_images(names)
    yield inv
    forget_test_images(names)
    subprocess.run(["docker", "image", "rm", "-f", TAG, f"{REPO}:v1", f"{REPO}:v2"], capture_output=True)


class OnProgress:
    """A stand-in for rich's Progress that runs `act` once, when `at` bytes have been sent."""

    def __init__(self, at: int, act):
        self.at, self.act, self.done = at, act, False

    def add_task(self, *a, **k):
        return 1

    def update(self, task, completed):
        if completed >= self.at and not self.done:
            self.done = True
            self.act()

    def remove_task(self, task):
        pass


@contextmanager
def engine_stopped_later(node):
    """Yields a function that stops the host's dockerd (its command line kept); restarted after."""

    def stop():
        on_host(
            node,
            "tr '\\0' ' ' < /proc/$(pgrep -x dockerd)/cmdline > /run/dockerd.cmdline; "
            "pkill -x dockerd; while pgrep -x dockerd >/dev/null; do sleep 0.2; done",
        )

    try:
        yield stop
    finally:
        on_host(
            node,
            "pgrep -x dockerd >/dev/null && exit 0; "
            "$(cat /run/dockerd.cmdline) >/var/log/dockerd.log 2>&1 & "
            "for i in $(seq 60); do docker info >/dev/null 2>&1 && exit 0; sleep 0.5; done; exit 1",
        )


def test_engine_stopped_mid_chain_is_named_and_the_others_get_the_image(four, tmp_path):
    want = build(tmp_path, "one", TAG)
    progress = None
    with engine_stopped_later("node2") as stop, Session(four.hosts) as session:
        progress = OnProgress(8 << 20, stop)
        results = images.push(session, TAG, progress=progress)
    assert progress.done  # stopped with 8 of the 48+ MB sent
    by = {r.host: r for r in results}
    assert by["node2"].action == "failed"
    assert by["node2"].detail.startswith("node2: docker load exited 1:"), by["node2"].detail
    for node in ("node1", "node3", "node4"):
        assert by[node].action == "sent", by[node]
        assert by[node].detail.startswith("chain "), by[node].detail
        assert host_id(node) == want
    assert host_id("node2") != want


def test_host_frozen_mid_chain_is_named_and_the_chain_reformed_without_it(four, tmp_path):
    want = build(tmp_path, "one", TAG)
    progress = OnProgress(8 << 20, lambda: faults.freeze("node2"))
    try:
        with Session(four.hosts) as session:
            results = images.push(session, TAG, stall=5, progress=progress)
    finally:
        faults.thaw("node2")
    assert progress.done
    by = {r.host: r for r in results}
    assert by["node2"].action == "failed"
    assert by["node2"].detail.startswith("node2: "), by["node2"].detail
    assert [by[n].action for n in ("node1", "node3", "node4")] == ["sent"] * 3, results
    # node3 and node4 were behind node2: the second round is a chain of two.
    assert by["node1"].detail.startswith("chain 1/4")
    assert by["node3"].detail.startswith("chain 1/2") and by["node4"].detail.startswith("chain 2/2")
    for node in ("node1", "node3", "node4"):
        assert host_id(node) == want


def test_second_push_sends_only_the_changed_layer(four, four_hosts_inventory_path, tmp_path):
    v1 = build(tmp_path, "one", TAG)
    with Session(four.hosts) as session:
        first = images.push(session, TAG)
    assert {r.action for r in first} == {"sent"}
    size = images.local_image(TAG)[1]
    v2 = build(tmp_path, "two", TAG)
    assert v2 != v1
    with Session(four.hosts) as session:
        second = images.push(session, TAG)
    for r in second:
        assert r.action == "sent", r
        # The 48 MB layer and the base are on every host: only the small layer (and the tarball's
        # few kB of metadata) travels.
        assert r.bytes < 100_000 < BIG_MB * 1_000_000 < size, (r, size)
        assert "layers already there" in r.detail
        assert host_id(r.host) == v2
    # The command line, unchanged: nothing left to send.
    out = fab(four_hosts_inventory_path, "image.push", "--image", TAG, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [line for line in out.stdout.splitlines() if line.startswith("node")] == [
        f"node{i}: present" for i in range(1, 5)
    ]


def test_host_no_other_host_can_reach_is_sent_to_directly(four, tmp_path):
    want = build(tmp_path, "one", TAG)
    others = [h.address for h in four.hosts if h.name != "node3"]
    rules = [f"INPUT -p tcp --syn -s {a} -j DROP" for a in others]  # this machine's SSH still gets in
    on_host("node3", "; ".join(f"iptables -I {r}" for r in rules))
    try:
        with Session(four.hosts) as session:
            results = images.push(session, TAG)
    finally:
        on_host("node3", "; ".join(f"iptables -D {r}" for r in rules))
    by = {r.host: r for r in results}
    assert {r.action for r in results} == {"sent"}, results
    assert by["node3"].detail.startswith("direct (node2 could not connect to it)"), by["node3"].detail
    assert [by[n].detail[:9] for n in ("node1", "node2", "node4")] == ["chain 1/3", "chain 2/3", "chain 3/3"]
    for node in ("node1", "node2", "node3", "node4"):
        assert host_id(node) == want
