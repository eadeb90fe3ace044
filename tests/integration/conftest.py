"""Integration tests: a real local cluster (Docker-in-Docker hosts with sshd and their own Docker
engines), real SSH with host-key checking, real torch.distributed (gloo) inside the containers.

The cluster is started once per test run (reused if it is already up) and its inventory written
to a temporary file; each test leaves the hosts as it found them.
"""

import ipaddress
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.config.inventory import load
from orchestrator.testbed import cluster as cluster_mod
from tests import suite

ROOT = Path(__file__).resolve().parents[2]
FAB = str(Path(sys.executable).parent / "fab")
# The installed command (bootstrap installs this clone in place): runs from any directory.
FABTRAIN = str(Path(sys.executable).parent / "fabtrain")


def command(cwd) -> list[str]:
    """`fab` from this project (-r: its tasks from any directory), or `fabtrain` from a user's own."""
    return [FAB, "-r", str(ROOT)] if Path(cwd) == ROOT else [FABTRAIN]


def engine_available() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def inventory_path(tmp_path_factory, request):
    if not engine_available():
        if os.environ.get("CI"):
            pytest.fail("no Docker engine: CI must run bash docker/bootstrap.sh first")
        pytest.skip("no Docker engine running (bash docker/bootstrap.sh starts one)")
    started = request.config.stash.get(suite.PRESTART, None)  # the cluster, brought up meanwhile
    if started is not None:
        try:
            started.wait(timeout=900)
        except subprocess.TimeoutExpired:
            started.kill()
    folder = tmp_path_factory.mktemp("cluster")
    # Two hosts; a third that the recovery tests use as a spare (spares_inventory_path); a fourth
    # for two jobs of two hosts each (four_hosts_inventory_path).
    nodes = cluster_mod.up(2, spares=2)
    path = folder / "inventory.yaml"
    path.write_text(cluster_mod.render_inventory(nodes[:2]))
    (folder / "spares.yaml").write_text(cluster_mod.render_inventory(nodes[:2], spares=nodes[2:3]))
    (folder / "four.yaml").write_text(cluster_mod.render_inventory(nodes[:4]))
    (folder / "two-spares.yaml").write_text(cluster_mod.render_inventory(nodes[:2], spares=nodes[2:4]))
    subprocess.run(
        [FAB, "stop", "--all", "--yes", "--inventory", str(folder / "four.yaml"), "--grace", "0"],
        cwd=ROOT,
        capture_output=True,
    )
    return path


@pytest.fixture(scope="session")
def spares_inventory_path(inventory_path):
    """The same two hosts, with node3 under spares:."""
    return inventory_path.parent / "spares.yaml"


@pytest.fixture(scope="session")
def two_spares_inventory_path(inventory_path):
    """The same two hosts, with node3 and node4 under spares:."""
    return inventory_path.parent / "two-spares.yaml"


@pytest.fixture(scope="session")
def four_hosts_inventory_path(inventory_path):
    """node1..node4, all under hosts:."""
    return inventory_path.parent / "four.yaml"


@pytest.fixture(scope="session")
def inv(inventory_path):
    return load(inventory_path)


# For a test that freezes a host: found lost after 3 keepalives 2 s apart (6 s) instead of 5 s apart
# (15 s); each new connection to it waits 5 s for an answer instead of 10 s.
QUICK_LOSS = {"keepalive": 2, "connect_timeout": 5}


def with_ssh(inventory_path: Path, dest: Path, **settings) -> Path:
    """A copy of the inventory at `dest` with these ssh: settings added: shorter deadlines for a test
    that freezes a host (a frozen host is found lost after 3 keepalive intervals, and each new
    connection to it waits connect_timeout)."""
    added = "".join(f"  {k}: {v}\n" for k, v in settings.items())
    text = inventory_path.read_text()
    assert text.count("ssh:\n") == 1, text
    dest.write_text(text.replace("ssh:\n", "ssh:\n" + added))
    return dest


def fab(inventory_path, *args, timeout=600, cwd=ROOT, **kwargs):
    """Run the real command line, as a user would (from `cwd`: this project, or a user's own)."""
    return subprocess.run(
        [*command(cwd), *args, "--inventory", str(inventory_path)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


class Run:
    """`fab ARGS` in the background; its output lines (stdout and stderr) collected as they come."""

    def __init__(self, inventory_path, *args, env=None, cwd=ROOT):
        self.proc = subprocess.Popen(
            [*command(cwd), *args, "--inventory", str(inventory_path)],
            cwd=cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text:
                return
            if self.proc.poll() is not None:
                self.reader.join(5)
                if needle in self.text:
                    return
                raise AssertionError(
                    f"{needle!r} never came; fab exited {self.proc.returncode}:\n{self.text[-3000:]}"
                )
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} never came:\n{self.text[-3000:]}")

    def finish(self, timeout: float = 180) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"fab still ran after {timeout}s:\n{self.text[-3000:]}") from None
        finally:
            self.proc.kill()
            self.reader.join(5)
        return self.proc.returncode


# This run's cluster (cluster_mod.TESTBED: one per pytest-xdist worker): each test host's container
# and address, and this machine's address on the cluster's network.
CONTAINER = {n.name: n.container for n in cluster_mod.node_infos(4)}
ADDRESS = {n.name: n.address for n in cluster_mod.node_infos(4)}
GATEWAY = str(ipaddress.ip_network(cluster_mod.SUBNET).network_address + 1)


def on_host(node: str, script: str, check=True, detach=False) -> subprocess.CompletedProcess:
    """Act on a test host directly (to set up a fault), not through the code under test."""
    argv = ["docker", "exec", *(["-d"] if detach else []), CONTAINER[node], "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=120)


def project_containers(node: str) -> list[str]:
    out = on_host(node, "docker ps -aq --filter label=fabtrain.managed=1").stdout
    return out.split()


def free_port() -> int:
    """A TCP port free on loopback now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A real Prometheus server (Debian's package) on loopback, scraping `target` every second."""

    def __init__(self, tmp: Path, target: str) -> None:
        import shutil

        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: bash docker/bootstrap.sh --tests installs it"
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: fabtrain\n    honor_labels: true\n"  # the job's id stays in `job`
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not self.ready():
            alive = self.proc.poll() is None
            assert time.monotonic() < deadline and alive, (tmp / "prometheus.log").read_text()
            time.sleep(0.2)

    def ready(self) -> bool:
        import urllib.request

        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def range(self, query: str, start: float, end: float) -> list[dict]:
        """query_range's result: [{"metric": {labels}, "values": [[t, "v"], ...]}, ...]."""
        import json
        import urllib.parse
        import urllib.request

        url = f"http://127.0.0.1:{self.port}/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": query, "start": start, "end": end, "step": 1}
        )
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
