"""Inventory: a YAML file -> frozen dataclasses, hosts in rank order (the job: section's defaults
are jobdefaults.py's, each host's fields are read by fields.py).

Every validation error names the file, the line, the field, what was wrong and how to fix it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.config.fields import (
    CONTAINER_FIELDS,
    NAME_RE,
    read_address,
    read_container_options,
    read_devices,
    read_gpus,
    read_interface,
    read_mounts,
    read_name,
    read_ssh,
    remote_path,
    resolve_ssh,
)
from orchestrator.config.jobdefaults import JobDefaults, read_job
from orchestrator.config.sshconf import ADDRESS_RE, SSH, Settings
from orchestrator.config.yamlloader import load_yaml, show
from orchestrator.config.yamlreader import Reader
from orchestrator.core.errors import UserError
from orchestrator.core.nodespec import Mount

if TYPE_CHECKING:
    import paramiko


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    rank: int
    ssh: SSH
    interface: str
    gpu_vendor: str = "none"
    gpu_count: int = 0
    image: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[Mount, ...] = ()
    devices: tuple[str, ...] = ()
    # Container options on top of job:'s (see dockerargs.container_options_of).
    ulimits: tuple[tuple[str, str], ...] = ()
    cap_add: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = ()

    @property
    def infiniband(self) -> bool:
        """InfiniBand devices are mapped into its containers (NCCL should use them)."""
        return any(d.startswith("/dev/infiniband") for d in self.devices)

    @property
    def hostname(self) -> str:
        """The network address the host is reached at (ssh_config's HostName for an alias)."""
        return self.ssh.hostname


@dataclass(frozen=True)
class Slurm:
    """The inventory's slurm: section, for fab train --on slurm: where jobs are submitted and how.
    The hosts: entries describe the nodes (GPUs, interface, image); Slurm picks which ones."""

    login: Host  # reached with the same SSH settings as the hosts
    workdir: str  # on the login node: scripts and JOB-ID.out (the compute nodes see it)
    nodes: int
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    runtime: str = "docker"  # docker | pyxis


@dataclass(frozen=True)
class Controller:
    """The inventory's controller: section: where a detached job's control runs (fab train --detach)."""

    host: str | None = None  # a host's or spare's name (None: the first host under hosts:)
    image: str = "fabtrain/controller:latest"


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: tuple[Host, ...]
    job: JobDefaults = field(default_factory=JobDefaults)
    # Hosts that take a failed host's place (and node rank) when a job restarts (fab train
    # --restarts); their `rank` is only their place in this list, set when one is used.
    spares: tuple[Host, ...] = ()
    slurm: Slurm | None = None
    controller: Controller = field(default_factory=lambda: Controller())

    @property
    def master(self) -> Host:
        return self.hosts[0]

    @property
    def all_hosts(self) -> tuple[Host, ...]:
        """The hosts and the spares: where a job of this inventory may have containers."""
        return (*self.hosts, *self.spares)

    def image_for(self, host: Host) -> str:
        return host.image or self.job.image

    def select(self, names: list[str] | None) -> tuple[Host, ...]:
        if not names:
            return self.hosts
        known = {h.name: h for h in self.hosts}
        missing = [n for n in names if n not in known]
        if missing:
            raise UserError(f"{self.path}: no host named {', '.join(missing)}; hosts are {', '.join(known)}")
        return tuple(known[n] for n in names)


def _host(reader: Reader, rank: int, base: Settings, check_files: bool, configs: dict) -> Host:
    reader.check_keys(
        (
            "name",
            "address",
            "interface",
            "gpus",
            "ssh",
            "image",
            "env",
            "mounts",
            "devices",
            *CONTAINER_FIELDS,
        )
    )
    address = read_address(reader)
    name = read_name(reader, address)
    vendor, count = read_gpus(reader.sub("gpus"))
    devices = read_devices(reader)
    interface = read_interface(reader)
    return Host(
        name=name,
        address=address,
        rank=rank,
        ssh=resolve_ssh(reader, address, read_ssh(reader.sub("ssh"), base, check_files), configs),
        interface=interface,
        gpu_vendor=vendor,
        gpu_count=count,
        image=reader.get("image", str, None),
        env=reader.env("env"),
        mounts=read_mounts(reader, "mounts"),
        devices=devices,
        **read_container_options(reader),
    )


def parse(text: str, path: Path, check_files: bool = False) -> Inventory:
    """The inventory in `text`; with check_files, the key and known_hosts files must exist too."""
    data = load_yaml(text, path)
    top = Reader(
        path, data, "", 1, "write the inventory as ssh:, job: and hosts: sections (see inventory.yaml)"
    )
    top.check_keys(("ssh", "job", "hosts", "spares", "slurm", "controller"))
    ssh = read_ssh(top.sub("ssh"), Settings(), check_files)
    host_entry = "the host's address: and interface: (indented under it)"
    hosts_items = top.items(
        "hosts", host_entry, required=True, fix="list at least one host; the first is rank 0"
    )
    items = hosts_items + top.items("spares", host_entry)
    hosts: list[Host] = []
    configs: dict[str | None, paramiko.SSHConfig | None] = {}
    for rank, (where, item, line) in enumerate(items):
        reader = Reader(
            path,
            item,
            where,
            getattr(item, "line", line),
            "write the host's address:, interface: and other fields indented under its '-'",
        )
        hosts.append(_host(reader, rank, ssh, check_files, configs))
    seen: dict[str, str] = {}
    for h, (where, item, line) in zip(hosts, items, strict=True):
        for key in (h.name, f"{h.hostname}:{h.ssh.port}"):
            if key in seen:
                top.fail(
                    where,
                    f"{show(key)} is also {seen[key]}",
                    "list each host once, in hosts: (rank order) or spares:",
                    getattr(item, "line", line),
                )
            seen[key] = where
    job = read_job(top.sub("job"))
    slurm = (
        _slurm(top.sub("slurm"), ssh, check_files, configs, job, len(hosts_items))
        if top.given("slurm")
        else None
    )
    return Inventory(
        path=path,
        hosts=tuple(hosts[: len(hosts_items)]),
        job=job,
        spares=tuple(hosts[len(hosts_items) :]),
        slurm=slurm,
        controller=_controller(top.sub("controller"), [h.name for h in hosts]),
    )


def _controller(reader: Reader, names: list[str]) -> Controller:
    reader.check_keys(("host", "image"))
    host = reader.get("host", str, None)
    if host is not None and host not in names:
        reader.fail(
            reader._field("host"),
            f"{show(host)} is not a host of this inventory",
            f"name one of {', '.join(names)}",
            reader.line_of("host"),
        )
    return Controller(host=host, image=reader.get("image", str, Controller.image))


SLURM_RUNTIMES = ("docker", "pyxis")
# What sbatch takes as a partition, account or time limit (no spaces, quotes or shell characters).
SLURM_VALUE_RE = re.compile(r"[A-Za-z0-9_.,:=+-]+")


def _slurm(
    reader: Reader, base: Settings, check_files: bool, configs: dict, job: JobDefaults, hosts: int
) -> Slurm:
    reader.check_keys(("login", "ssh", "workdir", "nodes", "partition", "account", "time", "runtime"))
    login = reader.get(
        "login",
        str,
        required=True,
        fix="give the login node's name or address, where sbatch runs, e.g. login1.example.com",
    )
    if not ADDRESS_RE.fullmatch(login):
        reader.fail(
            reader._field("login"),
            f"{show(login)} is neither a host name, an IP address nor an ssh_config alias",
            "write e.g. login1.example.com (user and port go in ssh:)",
        )
    values = {}
    for key, example in (("partition", "gpu"), ("account", "myproject"), ("time", "04:00:00")):
        value = reader.get(key, (str, int), None)
        if value is not None and not SLURM_VALUE_RE.fullmatch(str(value)):
            reader.fail(
                reader._field(key),
                f"{show(value)} is not a Slurm {key}",
                f"use letters, digits and _.,:=+- only, e.g. {key}: {example}",
            )
        values[key] = None if value is None else str(value)
    runtime = reader.get("runtime", str, "docker")
    if runtime not in SLURM_RUNTIMES:
        reader.fail(
            reader._field("runtime"),
            f"{show(runtime)} is not a container runtime fabtrain runs under Slurm",
            "use docker (docker run on each node) or pyxis (srun --container-image, enroot)",
        )
    host = Host(
        name=login.replace(":", "-") if not NAME_RE.fullmatch(login) else login,
        address=login,
        rank=0,
        ssh=resolve_ssh(reader, login, read_ssh(reader.sub("ssh"), base, check_files), configs),
        interface="lo",
    )
    return Slurm(
        login=host,
        workdir=remote_path(reader, "workdir", f"{job.output_dir}/slurm"),
        nodes=reader.integer("nodes", hosts, 1, 100_000, "a number of nodes"),
        runtime=runtime,
        **values,
    )


INVENTORY_ENV = "FABTRAIN_INVENTORY"
DEFAULT_FILE = "inventory.yaml"


def locate(given: str | Path | None = None) -> Path:
    """The inventory to use: --inventory, else $FABTRAIN_INVENTORY, else inventory.yaml in the
    current directory."""
    if given:
        return Path(given).expanduser()
    if os.environ.get(INVENTORY_ENV):
        return Path(os.environ[INVENTORY_ENV]).expanduser()
    if Path(DEFAULT_FILE).is_file():
        return Path.cwd() / DEFAULT_FILE  # absolute: job.json records it for --resume from elsewhere
    raise UserError(
        f"no inventory: no {DEFAULT_FILE} in {Path.cwd()}, no --inventory PATH and no "
        f"${INVENTORY_ENV}; pass one of them (docs/real-hosts.md shows one)"
    )


def load(path: str | Path | None = None) -> Inventory:
    path = locate(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(
            f"{path}: inventory not found; pass --inventory PATH, or run "
            f"'fab cluster.up' to write the local cluster's inventory"
        ) from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the inventory: {exc.strerror}") from None
    return parse(decode(raw, path), path, check_files=True)


def decode(raw: bytes, path: Path) -> str:
    """The file's text, or a clear error for a binary or non-UTF-8 file (never a traceback)."""
    if b"\0" in raw:
        raise UserError(
            f"{path}: is a binary file, not a YAML inventory; pass the right file with --inventory PATH"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x}); save the inventory as UTF-8"
        ) from None
