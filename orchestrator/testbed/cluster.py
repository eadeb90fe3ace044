"""The local cluster: Docker-in-Docker test hosts standing in for bare-metal GPU servers.

Each host is a container on a private bridge network with a fixed address, its own sshd and host
key, and its own Docker engine (started without --privileged). `up` is idempotent: it reuses hosts
that run the current host image, replaces stale ones, and loads the trainer image only where the
image id differs. Host keys are read through `docker exec` (a trusted channel) and written to a
known_hosts file, so host-key checking stays on.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

# The library's modules by their full names: to mypy, a bare `docker` is this repository's docker/
# folder (a namespace package), which has none of the library's names.
import docker.errors
import docker.types
from docker.client import DockerClient

from orchestrator.config import inventory
from orchestrator.core.errors import UserError
from orchestrator.images.images import push
from orchestrator.testbed import slurmbed
from orchestrator.testbed.containers import Log, NodeInfo, exec_checked
from orchestrator.transport.remote import Session

if TYPE_CHECKING:
    from docker.models.containers import Container
    from docker.models.networks import Network

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# FABTRAIN_TESTBED=N (2, 3, ...): the Nth local cluster, beside the first with names, subnet, state
# and shared volume of its own (the test suite runs one per pytest-xdist worker). Unset or 1: the one
# `fab cluster.up` makes.
TESTBED = int(os.environ.get("FABTRAIN_TESTBED") or 1)
PREFIX = "fabtrain" if TESTBED == 1 else f"fabtrain{TESTBED}"
STATE_DIR = PROJECT_ROOT / (".cluster" if TESTBED == 1 else f".cluster{TESTBED}")
HOST_IMAGE = "fabtrain/host:latest"
TRAINER_IMAGE = "fabtrain/trainer:latest"
NETWORK = f"{PREFIX}-net"
SUBNET = f"172.28.{5 + 10 * (TESTBED - 1)}.0/24"
LABEL = "fabtrain.cluster"  # its value: TESTBED
# Training containers share their host's /dev/shm (--ipc host); Docker's 64 MB default is too small.
SHM_BYTES = 2 * 1024**3
# One directory every test host sees (a volume of this machine's engine), as a shared filesystem
# (NFS, Lustre) is seen by the nodes of a Slurm cluster.
SHARED_VOLUME = f"{PREFIX}-shared"
SHARED_DIR = "/shared"
# Docker-in-Docker without --privileged: every capability but the one this VM lacks, no seccomp,
# AppArmor or masked /proc paths (the CLI's systempaths=unconfined), the cgroup tree writable, and a
# volume for the inner engine.
DIND_OPTS = dict(
    cap_add=["ALL"], cap_drop=["SYS_RESOURCE"], security_opt=["seccomp=unconfined", "apparmor=unconfined"]
)


def node_infos(count: int, subnet: str = SUBNET) -> list[NodeInfo]:
    net = ipaddress.ip_network(subnet)
    return [
        NodeInfo(f"node{i}", container_name(f"node{i}"), str(net.network_address + 10 + i))
        for i in range(1, count + 1)
    ]


def container_name(node: str) -> str:
    """The container of test host `node` (node1, node2, ...) of this cluster."""
    return f"{PREFIX}-{node}"


def engine_client() -> DockerClient:
    try:
        client = DockerClient.from_env(timeout=300)
        client.ping()
        return client
    except docker.errors.DockerException as exc:
        raise UserError(
            f"local Docker engine not reachable ({exc}); start it (sudo dockerd &) or run "
            f"bash docker/bootstrap.sh"
        ) from None


def build_images() -> None:
    """The test hosts' and the trainer's images (build-images.sh), rebuilt only where their inputs
    changed. The detached jobs' controller image is built at the first `fab train --detach`
    (images.controller_image): a first run does not wait for it."""
    script = PROJECT_ROOT / "docker" / "build-images.sh"
    # One build at a time on this machine (two clusters brought up at once share the images and
    # the build's folders); the second finds them built. Its progress goes to stderr: stdout is for
    # what a command prints (cluster.up --json).
    (PROJECT_ROOT / ".cache").mkdir(exist_ok=True)
    with open(PROJECT_ROOT / ".cache" / "build-images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = subprocess.run(["bash", str(script)], stdout=sys.stderr).returncode == 0
    if not built:
        raise UserError(f"image build failed; see the output above and {PROJECT_ROOT}/.cache/build/*.log")


def build_from_text(tag: str, dockerfile: str) -> None:
    """An image built on this machine from a Dockerfile's text alone (no context), for the tests and
    benchmarks that derive one from the trainer image."""
    subprocess.run(
        ["docker", "build", "-q", "-t", tag, "-"],
        input=dockerfile,
        text=True,
        check=True,
        capture_output=True,
        env={**os.environ, "DOCKER_BUILDKIT": "0"},
        timeout=300,
    )


def ensure_key(state: Path = STATE_DIR) -> tuple[Path, str]:
    state.mkdir(mode=0o700, exist_ok=True)
    key = state / "id_ed25519"
    if not key.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "fabtrain-local-cluster", "-f", str(key)],
            check=True,
        )
    return key, (state / "id_ed25519.pub").read_text().strip()


def _ensure_network(client: DockerClient, subnet: str) -> Network:
    try:
        net = client.networks.get(NETWORK)
        have = net.attrs["IPAM"]["Config"][0]["Subnet"]
        if have != subnet:
            raise UserError(
                f"network {NETWORK} exists with subnet {have}, not {subnet}; run 'fab cluster.down' first"
            )
        return net
    except docker.errors.NotFound:
        ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=subnet)])
        return client.networks.create(NETWORK, driver="bridge", ipam=ipam, labels={LABEL: str(TESTBED)})


# A running host kept from before may lack a service that a test stopped and, killed itself, never
# gave back: its engine frozen (SIGSTOP) or its sshd gone. Both given back as host-init.sh runs them.
REVIVE = (
    "pkill -CONT -x containerd; pkill -CONT -x dockerd; pkill -CONT -x sshd; "
    '{ [ -s /run/sshd.pid ] && kill -0 "$(cat /run/sshd.pid)"; } 2>/dev/null || '
    "/usr/sbin/sshd -E /var/log/sshd.log"
)


def _ensure_node(client: DockerClient, node: NodeInfo, host_image_id: str) -> Container:
    try:
        c = client.containers.get(node.container)
        net = c.attrs["NetworkSettings"]["Networks"].get(NETWORK) or {}
        # The configured address: a stopped container reports no IPAddress, and must be restarted,
        # not replaced.
        addr = (net.get("IPAMConfig") or {}).get("IPv4Address") or net.get("IPAddress")
        shm = c.attrs["HostConfig"].get("ShmSize")
        shared = any(m.get("Destination") == SHARED_DIR for m in c.attrs.get("Mounts", []))
        if c.image.id == host_image_id and addr == node.address and shm == SHM_BYTES and shared:
            if c.status != "running":
                c.start()
            else:
                c.exec_run(["sh", "-c", REVIVE])
            return c
        c.remove(force=True)  # stale: an older host image or another address
    except docker.errors.NotFound:
        pass
    api = client.api
    host_config = api.create_host_config(
        shm_size=SHM_BYTES,
        binds={
            "/sys/fs/cgroup": {"bind": "/sys/fs/cgroup", "mode": "rw"},
            f"{node.container}-docker": {"bind": "/var/lib/docker", "mode": "rw"},
            SHARED_VOLUME: {"bind": SHARED_DIR, "mode": "rw"},
        },
        **DIND_OPTS,
    )
    host_config.update(MaskedPaths=[], ReadonlyPaths=[])
    net_config = api.create_networking_config(
        {NETWORK: api.create_endpoint_config(ipv4_address=node.address)}
    )
    created = api.create_container(
        HOST_IMAGE,
        name=node.container,
        hostname=node.name,
        host_config=host_config,
        networking_config=net_config,
        labels={LABEL: str(TESTBED)},
        detach=True,
    )
    api.start(created["Id"])
    return client.containers.get(created["Id"])


def _wait_ready(container: Container, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, _ = container.exec_run(
            [
                "sh",
                "-c",
                "timeout 5 docker info >/dev/null 2>&1 && test -s /etc/ssh/ssh_host_ed25519_key.pub "
                '&& kill -0 "$(cat /run/sshd.pid)"',
            ]
        )
        if code == 0:
            return
        time.sleep(0.5)
    raise UserError(
        f"{container.name}: its Docker engine or sshd did not start within {timeout:g}s; "
        f"see: docker exec {container.name} cat /var/log/dockerd.log /var/log/sshd.log (fab "
        "cluster.down, then cluster.up, makes the hosts new)"
    )


def up(
    count: int = 2,
    inventory_out: str | None = None,
    subnet: str = SUBNET,
    images: tuple[str, ...] = (TRAINER_IMAGE,),
    log: Log = print,
    spares: int = 0,
    slurm: bool = False,
) -> list[NodeInfo]:
    """`count` hosts and `spares` spare hosts (listed under spares: in the inventory); with `slurm`,
    the hosts (not the spares) are also a Slurm cluster."""
    if count < 1 or spares < 0:
        raise UserError("--hosts must be at least 1 and --spares at least 0")
    build_images()
    client = engine_client()
    key, pubkey = ensure_key()
    nodes = node_infos(count + spares, subnet)
    _ensure_network(client, subnet)
    host_image_id = client.images.get(HOST_IMAGE).id
    _remove_others(client, nodes, log)

    # Bounded: 64 containers created at once overload the local engine.
    with ThreadPoolExecutor(max_workers=min(len(nodes), 16)) as pool:
        known = list(pool.map(lambda n: _prepare(client, n, host_image_id, pubkey), nodes))
    known_hosts = STATE_DIR / "known_hosts"
    known_hosts.write_text("".join(known))
    known_hosts.chmod(0o600)

    # The trainer image reaches the hosts the way it reaches real ones: pushed over SSH, and only
    # where the id differs.
    state_inventory = STATE_DIR / "inventory.yaml"
    state_inventory.write_text(render_inventory(nodes[:count], key, known_hosts, nodes[count:], slurm=slurm))
    inv = inventory.load(state_inventory)
    _push_images(inv, images, len(nodes), log)
    if slurm:
        slurmbed.slurm_up(client, nodes[:count], STATE_DIR, log)
    if inventory_out:
        Path(inventory_out).write_text(state_inventory.read_text())
        log(f"wrote {inventory_out}")
    log("cluster up: " + ", ".join(f"{n.name}={n.address}" for n in nodes))
    return nodes


def _remove_others(client: DockerClient, nodes: list[NodeInfo], log: Log) -> None:
    """The cluster's hosts not among `nodes` (a larger cluster before), removed."""
    wanted = {n.container for n in nodes}
    for c in client.containers.list(all=True, filters={"label": f"{LABEL}={TESTBED}"}):
        if c.name not in wanted:
            log(f"removing {c.name} (not in a {len(nodes)}-host cluster)")
            c.remove(force=True, v=False)


def _prepare(client: DockerClient, node: NodeInfo, host_image_id: str, pubkey: str) -> str:
    """One host started (or kept) and ready, with this machine's key authorized; its known_hosts line."""
    c = _ensure_node(client, node, host_image_id)
    _wait_ready(c)
    exec_checked(
        c,
        [
            "sh",
            "-c",
            'umask 077; mkdir -p /root/.ssh; printf "%s\\n" "$1" > /root/.ssh/authorized_keys',
            "sh",
            pubkey,
        ],
    )
    # Under the load of dozens of new hosts the key file can still be empty for a moment.
    for _ in range(10):
        host_key = exec_checked(c, ["cat", "/etc/ssh/ssh_host_ed25519_key.pub"]).split()
        if len(host_key) >= 2:
            return f"{node.address} {host_key[0]} {host_key[1]}\n"
        time.sleep(0.5)
    raise UserError(f"{c.name}: its SSH host key could not be read; see docker exec {c.name} ls -l /etc/ssh")


def _push_images(inv: inventory.Inventory, images: tuple[str, ...], hosts: int, log: Log) -> None:
    """Each image pushed to every host of `inv` (of `hosts` in all), only where its id differs."""
    with Session(inv.all_hosts) as session:
        for image in images:
            results = push(session, image)
            bad = [r for r in results if r.action == "failed"]
            if bad:
                raise UserError(
                    "loading the trainer image failed: " + "; ".join(f"{r.host}: {r.detail}" for r in bad)
                )
            sent = [r for r in results if r.action == "sent"]
            log(
                f"{image}: sent to {len(sent)} host(s)"
                + (f" in {max(r.seconds for r in sent):.0f}s" if sent else "")
                + f", already present on {hosts - len(sent)}"
            )


def render_inventory(
    nodes: Sequence[NodeInfo],
    key: Path = STATE_DIR / "id_ed25519",
    known_hosts: Path = STATE_DIR / "known_hosts",
    spares: Sequence[NodeInfo] = (),
    slurm: bool = False,
) -> str:
    """The inventory of these test hosts; with `slurm`, a slurm: section whose login node is the
    first host (Slurm's controller, where sbatch runs: fab train --on slurm)."""
    lines = [
        "# Local Docker-in-Docker cluster, written by 'fab cluster.up'. Hosts are in rank order.",
        "ssh:",
        "  user: root",
        f"  key: {key}",
        f"  known_hosts: {known_hosts}",
        "  config: none",
        "job:",
        f"  image: {TRAINER_IMAGE}",
        "  nproc_per_node: 2",
    ]
    for title, group in (("hosts:", nodes), ("spares:", spares)):
        if group:
            lines.append(title)
        for n in group:
            lines += [
                f"  - name: {n.name}",
                f"    address: {n.address}",
                "    interface: eth0",
                "    gpus: {vendor: none, count: 0}",
            ]
    if slurm:
        lines += ["slurm:", f"  login: {nodes[0].address}"]
    return "\n".join(lines) + "\n"


def down(log: Log = print) -> None:
    client = engine_client()
    for c in client.containers.list(all=True, filters={"label": f"{LABEL}={TESTBED}"}):
        log(f"removing {c.name}")
        c.remove(force=True)
        try:
            client.volumes.get(f"{c.name}-docker").remove(force=True)
        except docker.errors.NotFound:
            pass
    for v in client.volumes.list(filters={"name": f"{PREFIX}-node"}):
        if v.name.startswith(f"{PREFIX}-node"):  # the filter matches the name anywhere
            v.remove(force=True)
    try:
        client.volumes.get(SHARED_VOLUME).remove(force=True)
    except docker.errors.NotFound:
        pass
    try:
        client.networks.get(NETWORK).remove()
    except docker.errors.NotFound:
        pass
    log("cluster down")
