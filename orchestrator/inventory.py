"""Inventory: a YAML file -> frozen dataclasses, hosts in rank order.

Every validation error names the file, the line, the field, what was wrong and how to fix it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import UserError
from .sshconf import ADDRESS_RE, SSH, Settings, parse_jump, read_config, resolve

GPU_VENDORS = ("nvidia", "amd", "none")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False


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
    # Container options on top of job:'s (see plan.container_options).
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
class Job:
    image: str = "fabtrain/trainer:latest"
    master_port: int = 29500
    nproc_per_node: str = "auto"
    code_dir: str = "/opt/fabtrain/code"
    output_dir: str = "/opt/fabtrain/output"
    shm_size: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    # Files read on the orchestrator machine whose contents reach containers as env vars, never on
    # a command line: NAME -> local path.
    secret_files: tuple[tuple[str, str], ...] = ()
    stop_grace: float = 30.0
    # Container options for every host: name -> "soft[:hard]" (-1: unlimited), capabilities,
    # security options (docker run --ulimit / --cap-add / --security-opt).
    ulimits: tuple[tuple[str, str], ...] = ()
    cap_add: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = ()


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: tuple[Host, ...]
    job: Job = field(default_factory=Job)
    # Hosts that take a failed host's place (and node rank) when a job restarts (fab train
    # --restarts); their `rank` is only their place in this list, set when one is used.
    spares: tuple[Host, ...] = ()

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
            raise UserError(
                f"{self.path}: no host named {', '.join(missing)}; "
                f"hosts are {', '.join(known)}")
        return tuple(known[n] for n in names)


class _Loader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key, for error messages."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    mapping = _LineDict()
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.lines[key] = key_node.start_mark.line + 1
    mapping.line = node.start_mark.line + 1
    return mapping


class _LineDict(dict):
    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[Any, int] = {}
        self.line = 0


class _LineList(list):
    line = 0


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> list:
    seq = _LineList(loader.construct_object(child, deep=True) for child in node.value)
    seq.line = node.start_mark.line + 1
    return seq


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


class _Reader:
    """Reads typed fields out of one YAML mapping, raising errors that point at file:line field."""

    def __init__(self, path: Path, data: Any, where: str, line: int) -> None:
        self.path, self.where, self.line = path, where, line
        if data is None:
            data = _LineDict()
        if not isinstance(data, dict):
            self.fail(self.where, f"must be a mapping (key: value lines), not {type(data).__name__}",
                      "indent its fields under it", line)
        self.data = data
        self.lines = getattr(data, "lines", {})

    def fail(self, fieldname: str, problem: str, fix: str, line: int | None = None) -> None:
        line = line or self.lines.get(fieldname.rsplit(".", 1)[-1]) or self.line
        raise UserError(f"{self.path}:{line}: {fieldname}: {problem}; {fix}")

    def _field(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def check_keys(self, allowed: tuple[str, ...]) -> None:
        for key in self.data:
            if key not in allowed:
                self.fail(self._field(str(key)), "unknown field",
                          f"use one of: {', '.join(allowed)}", self.lines.get(key))

    def get(self, key: str, kind: type | tuple, default: Any = None, required: bool = False) -> Any:
        if key not in self.data or self.data[key] is None:
            if required:
                self.fail(self._field(key), "is missing", f"add '{key}:' to {self.where or 'the file'}",
                          self.line)
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            self.fail(self._field(key), f"must be {names}, got {value!r}",
                      f"write an {names} value" if names[0] in "aeiou" else f"write a {names} value", self.lines.get(key))
        if isinstance(value, str) and not value.strip():
            self.fail(self._field(key), "is empty", f"give a value, or remove '{key}:'", self.lines.get(key))
        return value

    def sub(self, key: str) -> "_Reader":
        value = self.data.get(key)
        return _Reader(self.path, value, self._field(key), self.lines.get(key, self.line))

    def port(self, key: str, default: int) -> int:
        value = self.get(key, int, default)
        if not 1 <= value <= 65535:
            self.fail(self._field(key), f"{value} is not a TCP port", "use a number from 1 to 65535")
        return value

    def env(self, key: str) -> tuple[tuple[str, str], ...]:
        env = self.sub(key)
        out = []
        for name, value in env.data.items():
            if not isinstance(name, str) or not ENV_KEY_RE.match(name):
                env.fail(env._field(str(name)), "is not a valid environment variable name",
                         "use letters, digits and underscores, not starting with a digit",
                         env.lines.get(name))
            if isinstance(value, (dict, list)) or value is None:
                env.fail(env._field(name), "must be a single value", "quote it as a string",
                         env.lines.get(name))
            out.append((name, value if isinstance(value, str) else str(value).lower()
                        if isinstance(value, bool) else str(value)))
        return tuple(out)

    def path_field(self, key: str, default: str | None, must_exist: bool = False,
                   fix: str = "fix the path (relative paths are relative to the inventory file)") -> str | None:
        value = self.get(key, str, default)
        if value is None:
            return None
        expanded = Path(value).expanduser()
        if not expanded.is_absolute():
            expanded = self.path.parent / expanded
        if must_exist and not expanded.is_file():
            self.fail(self._field(key), f"{expanded} does not exist",
                      "run 'fab cluster.up' to make the local cluster's" if ".cluster" in expanded.parts else fix)
        return str(expanded)


SSH_FIELDS = ("user", "port", "key", "known_hosts", "connect_timeout", "keepalive", "jump", "config")


def _ssh(reader: _Reader, base: Settings, check_files: bool) -> Settings:
    """The inventory's ssh: section (global, or a host's override of it), as written."""
    reader.check_keys(SSH_FIELDS)
    jump = reader.get("jump", (str, list), None)
    if isinstance(jump, list):
        jump = ",".join(str(j) for j in jump)
    if jump is not None and jump.lower() != "none":
        try:
            parse_jump(jump)
        except ValueError as exc:
            reader.fail(reader._field("jump"), str(exc),
                        "write [user@]host[:port] (an ssh_config alias works), several comma-separated")
    config = reader.get("config", str, None)
    # Always checked, not only with check_files: the file is read while the inventory is parsed.
    config_path = None if config is None or config.lower() == "none" else reader.path_field(
        "config", None, must_exist=True, fix="give the path of an ssh_config file, or none to read no ssh_config")
    settings = Settings(
        user=reader.get("user", str, None), port=reader.port("port", None) if "port" in reader.data else None,
        key=reader.path_field("key", None, must_exist=check_files),
        known_hosts=reader.path_field("known_hosts", None, must_exist=check_files),
        connect_timeout=reader.get("connect_timeout", float, base.connect_timeout),
        keepalive=reader.get("keepalive", float, base.keepalive), jump=jump, config=config_path)
    given = {k for k in SSH_FIELDS if reader.data.get(k) is not None}
    return settings.over(base, given)


def _remote_path(reader: _Reader, key: str, default: str) -> str:
    value = reader.get(key, str, default)
    if not value.startswith("/"):
        reader.fail(reader._field(key), f"{value!r} is not an absolute path",
                    "write the full path on the hosts, starting with /")
    return value.rstrip("/") or "/"


def _mounts(reader: _Reader, key: str) -> tuple[Mount, ...]:
    items = reader.get(key, list, [])
    out = []
    for i, item in enumerate(items):
        where = f"{reader._field(key)}[{i}]"
        line = getattr(items, "line", reader.line)
        if isinstance(item, str):
            parts = item.split(":")
            if len(parts) not in (2, 3) or not all(parts[:2]) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
                reader.fail(where, f"{item!r} is not SOURCE:TARGET[:ro]",
                            "write e.g. /data/corpus:/data:ro", line)
            out.append(Mount(parts[0], parts[1], len(parts) == 3 and parts[2] == "ro"))
        else:
            m = _Reader(reader.path, item, where, line)
            m.check_keys(("source", "target", "read_only"))
            out.append(Mount(m.get("source", str, required=True), m.get("target", str, required=True),
                             m.get("read_only", bool, False)))
    for m in out:
        if not (m.source.startswith("/") and m.target.startswith("/")):
            reader.fail(reader._field(key), f"{m.source}:{m.target} must use absolute paths",
                        "write both paths starting with /")
    return tuple(out)


# docker run --ulimit names (Docker's ulimit parser, from setrlimit(2)).
ULIMITS = ("core", "cpu", "data", "fsize", "locks", "memlock", "msgqueue", "nice", "nofile", "nproc",
           "rss", "rtprio", "rttime", "sigpending", "stack")
ULIMIT_VALUE_RE = re.compile(r"^-?\d+(:-?\d+)?$")
CAP_RE = re.compile(r"^(CAP_)?[A-Z][A-Z_]*$")
SECURITY_OPT_RE = re.compile(r"^[a-z-]+([=:][A-Za-z0-9_./:=-]+)?$")
CONTAINER_FIELDS = ("ulimits", "cap_add", "security_opt")


def _container_options(reader: _Reader) -> dict:
    """ulimits, cap_add and security_opt of job: or of one host."""
    limits = reader.sub("ulimits")
    ulimits = []
    for name, value in limits.data.items():
        where = limits._field(str(name))
        if name not in ULIMITS:
            limits.fail(where, "is not a ulimit Docker knows", f"use one of: {', '.join(ULIMITS)}",
                        limits.lines.get(name))
        text = "-1" if value in ("unlimited", -1) else str(value)
        if isinstance(value, (bool, dict, list)) or not ULIMIT_VALUE_RE.match(text):
            limits.fail(where, f"{value!r} is not a limit", "write a number, SOFT:HARD, or -1 / unlimited",
                        limits.lines.get(name))
        ulimits.append((name, text))
    lists = {}
    for key, pattern, example in (("cap_add", CAP_RE, "IPC_LOCK or SYS_PTRACE"),
                                  ("security_opt", SECURITY_OPT_RE, "seccomp=unconfined")):
        items = reader.get(key, list, [])
        for item in items:
            if not isinstance(item, str) or not pattern.match(item):
                reader.fail(reader._field(key), f"{item!r} is not a valid {key} entry", f"write e.g. {example}")
        lists[key] = tuple(items)
    return dict(ulimits=tuple(ulimits), **lists)


def _host(reader: _Reader, rank: int, base: Settings, check_files: bool, configs: dict) -> Host:
    reader.check_keys(("name", "address", "interface", "gpus", "ssh", "image", "env", "mounts",
                       "devices", *CONTAINER_FIELDS))
    address = reader.get("address", str, required=True)
    if not ADDRESS_RE.match(address):
        reader.fail(reader._field("address"), f"{address!r} is neither a host name, an IP address nor "
                    "an ssh_config alias", "write e.g. 10.0.0.11, gpu1.example.com or an alias from "
                    "~/.ssh/config (user and port go in ssh:)")
    name = reader.get("name", str, address)
    if not NAME_RE.match(name):
        reader.fail(reader._field("name"), f"{name!r} has characters not allowed in a host name",
                    "use letters, digits, '.', '_' and '-'")
    gpus = reader.sub("gpus")
    gpus.check_keys(("vendor", "count"))
    vendor = gpus.get("vendor", str, "none")
    if vendor not in GPU_VENDORS:
        gpus.fail(gpus._field("vendor"), f"{vendor!r} is not a known GPU vendor",
                  f"use one of: {', '.join(GPU_VENDORS)}")
    count = gpus.get("count", int, 0)
    if count < 0 or (vendor == "none" and count) or (vendor != "none" and count == 0):
        gpus.fail(gpus._field("count"), f"count {count} does not fit vendor {vendor!r}",
                  "give the number of GPUs (at least 1) for nvidia/amd hosts, 0 for vendor none")
    devices = reader.get("devices", list, [])
    for d in devices:
        if not isinstance(d, str) or not d.startswith("/dev/"):
            reader.fail(reader._field("devices"), f"{d!r} is not a device path",
                        "list paths such as /dev/infiniband/uverbs0")
    return Host(
        name=name,
        address=address,
        rank=rank,
        ssh=_resolve(reader, address, _ssh(reader.sub("ssh"), base, check_files), configs),
        interface=reader.get("interface", str, required=True),
        gpu_vendor=vendor,
        gpu_count=count,
        image=reader.get("image", str, None),
        env=reader.env("env"),
        mounts=_mounts(reader, "mounts"),
        devices=tuple(devices),
        **_container_options(reader),
    )


def _resolve(reader: _Reader, address: str, settings: Settings, configs: dict) -> SSH:
    """The host's connection settings with its ssh_config applied (see sshconf); each ssh_config
    file is read once per inventory (`configs`)."""
    try:
        if settings.config not in configs:
            configs[settings.config] = read_config(settings.config)
        return resolve(address, settings, configs[settings.config])
    except ValueError as exc:
        reader.fail(reader._field("ssh"), str(exc), "fix the jump host or the ssh_config entry")
    raise AssertionError("unreachable")


def _job(reader: _Reader) -> Job:
    reader.check_keys(("image", "master_port", "nproc_per_node", "code_dir", "output_dir", "shm_size",
                       "env", "secret_files", "stop_grace", *CONTAINER_FIELDS))
    nproc = str(reader.get("nproc_per_node", (int, str), "auto"))
    if nproc != "auto" and not (nproc.isdigit() and int(nproc) > 0):
        reader.fail(reader._field("nproc_per_node"), f"{nproc!r} is not a process count",
                    "use a positive number, or auto (GPU count, 1 on CPU)")
    secrets = reader.sub("secret_files")
    secret_files = []
    for name in secrets.data:
        if not ENV_KEY_RE.match(str(name)):
            secrets.fail(secrets._field(str(name)), "is not a valid environment variable name",
                         "use letters, digits and underscores")
        secret_files.append((name, secrets.path_field(name, None)))
    return Job(
        image=reader.get("image", str, Job.image),
        master_port=reader.port("master_port", Job.master_port),
        nproc_per_node=nproc,
        code_dir=_remote_path(reader, "code_dir", Job.code_dir),
        output_dir=_remote_path(reader, "output_dir", Job.output_dir),
        shm_size=reader.get("shm_size", str, None),
        env=reader.env("env"),
        secret_files=tuple(secret_files),
        stop_grace=reader.get("stop_grace", float, Job.stop_grace),
        **_container_options(reader),
    )


def parse(text: str, path: Path, check_files: bool = False) -> Inventory:
    """The inventory in `text`; with check_files, the key and known_hosts files must exist too."""
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        raise UserError(f"{path}:{line}: not valid YAML: {exc.problem}; check the indentation and "
                        f"quoting on that line") from None
    top = _Reader(path, data, "", 1)
    top.check_keys(("ssh", "job", "hosts", "spares"))
    ssh = _ssh(top.sub("ssh"), Settings(), check_files)
    hosts_data = top.get("hosts", list, required=True)
    if not hosts_data:
        top.fail("hosts", "is empty", "list at least one host; the first is rank 0")
    spares_data = top.get("spares", list, [])
    hosts, configs = [], {}
    for key, items in (("hosts", hosts_data), ("spares", spares_data)):
        for i, item in enumerate(items):
            line = getattr(item, "line", getattr(items, "line", 1))
            rank = i if key == "hosts" else len(hosts_data) + i
            hosts.append(_host(_Reader(path, item, f"{key}[{i}]", line), rank, ssh, check_files, configs))
    seen: dict[str, str] = {}
    for h in hosts:
        where = f"hosts[{h.rank}]" if h.rank < len(hosts_data) else f"spares[{h.rank - len(hosts_data)}]"
        for key in (h.name, f"{h.hostname}:{h.ssh.port}"):
            if key in seen:
                item = (hosts_data + spares_data)[h.rank]
                top.fail(where, f"{key!r} is also {seen[key]}",
                         "list each host once, in hosts: (rank order) or spares:", getattr(item, "line", None))
            seen[key] = where
    return Inventory(path=path, hosts=tuple(hosts[:len(hosts_data)]), job=_job(top.sub("job")),
                     spares=tuple(hosts[len(hosts_data):]))


def load(path: str | Path) -> Inventory:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: inventory not found; pass --inventory PATH, or run "
                        f"'fab cluster.up' to write the local cluster's inventory") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the inventory: {exc.strerror}") from None
    return parse(decode(raw, path), path, check_files=True)


def decode(raw: bytes, path: Path) -> str:
    """The file's text, or a clear error for a binary or non-UTF-8 file (never a traceback)."""
    if b"\0" in raw:
        raise UserError(f"{path}: is a binary file, not a YAML inventory; pass the right file with "
                        f"--inventory PATH")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x}); save the inventory "
                        f"as UTF-8") from None
