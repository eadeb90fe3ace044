"""Inventory: a YAML file -> frozen dataclasses, hosts in rank order.

Every validation error names the file, the line, the field, what was wrong and how to fix it.
"""
from __future__ import annotations

import datetime
import os
import re
import reprlib
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, overload

import yaml

from orchestrator.config.sshconf import ADDRESS_RE, SSH, Settings, parse_jump, read_config, resolve
from orchestrator.core.errors import UserError
from orchestrator.core.nodespec import Mount

if TYPE_CHECKING:
    import paramiko

GPU_VENDORS = ("nvidia", "amd", "none")
# Used with fullmatch: a '$' match would let a trailing newline through.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A Linux interface name (at most 15 bytes): it becomes NCCL_SOCKET_IFNAME=<name>, an exact match.
INTERFACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,14}")
# Upper bounds that keep every number well inside what docker, ssh and the OS accept (a value past
# them is a typo, not a setting).
MAX_SECONDS = 86400
MAX_SNAPSHOTS = 1_000_000
MAX_DEPTH = 64


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
    # How many of the newest snapshots of a job are kept on every host and on this machine.
    keep_snapshots: int = 2
    # Where a program writes its own checkpoints (fab train --checkpoint), as jobspec.checkpoint_pattern
    # gives it; "" for none.
    checkpoint: str = ""
    # Container options for every host: name -> "soft[:hard]" (-1: unlimited), capabilities,
    # security options (docker run --ulimit / --cap-add / --security-opt).
    ulimits: tuple[tuple[str, str], ...] = ()
    cap_add: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = ()
    # Notifications (progress/notify.py): a command given each event as JSON on stdin, a URL POSTed it.
    notify: str | None = None
    notify_url: str | None = None
    # A job with restarts keeps the containers of the nodes that did not fail and restarts only
    # their workers (the entrypoint's generations, README: recovery); false: every restart is cold.
    warm_restarts: bool = True


@dataclass(frozen=True)
class Slurm:
    """The inventory's slurm: section, for fab train --on slurm: where jobs are submitted and how.
    The hosts: entries describe the nodes (GPUs, interface, image); Slurm picks which ones."""

    login: Host                      # reached with the same SSH settings as the hosts
    workdir: str                     # on the login node: scripts and JOB-ID.out (the compute nodes see it)
    nodes: int
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    runtime: str = "docker"          # docker | pyxis


@dataclass(frozen=True)
class Controller:
    """The inventory's controller: section: where a detached job's control runs (fab train --detach)."""

    host: str | None = None          # a host's or spare's name (None: the first host under hosts:)
    image: str = "fabtrain/controller:latest"


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: tuple[Host, ...]
    job: Job = field(default_factory=Job)
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
            raise UserError(
                f"{self.path}: no host named {', '.join(missing)}; "
                f"hosts are {', '.join(known)}")
        return tuple(known[n] for n in names)


class _Loader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key and list entry, for error messages."""

    depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        # PyYAML composes and constructs recursively: deep enough nesting would end in a
        # RecursionError, with no line to report. An inventory is a few levels deep.
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"lists or mappings nested more than {MAX_DEPTH} deep",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # A scalar that looks like a date, number or bool but is not one (2024-13-45, !!int x,
        # 5000 digits) fails inside PyYAML's constructors with a bare ValueError; it is reported at
        # its line like any other YAML mistake.
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, KeyError, OverflowError):
            what = _show(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            raise yaml.constructor.ConstructorError(
                None, None, f"{what} is not a valid {node.tag.rsplit(':', 1)[-1]}", node.start_mark) from None


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    mapping = _LineDict()
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, "a list or mapping used as a key",
                                                    key_node.start_mark) from None
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
    lines: list[int] = []


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> list:
    seq = _LineList(loader.construct_object(child, deep=True) for child in node.value)
    seq.line = node.start_mark.line + 1
    # An entry that is only '-' is a null whose mark is still on the '-' line.
    seq.lines = [child.start_mark.line + 1 for child in node.value]
    return seq


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    value = yaml.SafeLoader.construct_yaml_int(loader, node)
    # Hex and binary literals have no digit limit in Python; no field takes anything this long, and
    # printing it in a message would fail (int max_str_digits).
    if value.bit_length() > 128:
        raise yaml.constructor.ConstructorError(None, None, f"{_show(node.value)} is too large a number",
                                                node.start_mark)
    return value


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


class _Repr(reprlib.Repr):
    """reprlib's bounded repr, which also knows the loader's dict and list types: a value in a
    message stays short however big (or alias-multiplied) the YAML value is."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = 60
        self.maxlevel, self.maxlist, self.maxdict = 2, 4, 4

    def repr__LineDict(self, x: dict, level: int) -> str:
        return self.repr_dict(x, level)

    def repr__LineList(self, x: list, level: int) -> str:
        return self.repr_list(x, level)


_show = _Repr().repr


def _kind_name(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    names = {str: "text", list: "a list", dict: "a mapping"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


def _unset(value: Any, kinds: tuple) -> bool:
    """Nothing written for a field: the key alone or `~` (YAML null), or an empty list or mapping
    where a list or mapping goes. An optional field then takes its default, as if the line were
    not there; a required field is an error. A blank string is not this: it is a value, and the
    wrong one (_is_blank)."""
    return value is None or (isinstance(value, (list, dict)) and not value and isinstance(value, kinds))


def _key_name(key: Any) -> str:
    """A key as it goes into a field path: as written, unless quoting shows it better (a blank,
    multi-line or very long key)."""
    text = str(key)
    return text if text.isprintable() and text.strip() == text and 0 < len(text) <= 60 else _show(key)


def _is_blank(value: Any) -> bool:
    return isinstance(value, str) and not value.strip()


def _control_char(text: str) -> str | None:
    """The first control character (or lone surrogate) in a one-line field, as U+XXXX."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cs"):
            return f"U+{ord(ch):04X}"
    return None


class _Reader:
    """Reads typed fields out of one YAML mapping, raising errors that point at file:line field."""

    def __init__(self, path: Path, data: Any, where: str, line: int,
                 fix: str = "indent its fields under it") -> None:
        self.path, self.where, self.line = path, where, line
        self.lines: dict[Any, int] = {}
        if _is_blank(data) and where:
            self.fail(
                self.where, "is empty", f"give its fields, or remove '{self.where.rsplit('.', 1)[-1]}:'", line
            )
        if _unset(data, (dict,)):
            data = _LineDict()
        if not isinstance(data, dict):
            self.fail(self.where, f"must be a mapping (key: value lines), not {_kind_name(data)}", fix, line)
        self.data = data
        self.lines = getattr(data, "lines", {})

    def fail(self, fieldname: str, problem: str, fix: str, line: int | None = None) -> NoReturn:
        line = line or self.lines.get(fieldname.rsplit(".", 1)[-1]) or self.line
        subject = f"{fieldname}: " if fieldname else ""
        raise UserError(f"{self.path}:{line}: {subject}{problem}; {fix}")

    def line_of(self, key: Any) -> int:
        return self.lines.get(key) or self.line

    def _field(self, key: Any) -> str:
        return f"{self.where}.{_key_name(key)}" if self.where else _key_name(key)

    def check_keys(self, allowed: tuple[str, ...]) -> None:
        for key in self.data:
            if key not in allowed:
                self.fail(self._field(key), "unknown field",
                          f"use one of: {', '.join(allowed)}", self.lines.get(key))

    def get(self, key: Any, kind: type | tuple, default: Any = None, required: bool = False,
            fix: str = "give a value") -> Any:
        """The value of `key`, of one of the types in `kind`. Every field is read here, so an empty
        value means the same everywhere (see _unset); `fix` is the advice for a required field
        left empty."""
        kinds = kind if isinstance(kind, tuple) else (kind,)
        field_, line = self._field(key), self.line_of(key)
        if key not in self.data:
            if required:
                self.fail(field_, "is missing", f"add '{key}:' to {self.where or 'the file'}", self.line)
            return default
        value = self.data[key]
        if _unset(value, kinds):
            if required:
                self.fail(field_, "is empty", fix, line)
            return default
        if _is_blank(value):
            self.fail(field_, "is empty", f"give a value, or remove '{key}:'", line)
        # An int is a valid float field; the caller converts it once its range is checked.
        number = float in kinds and isinstance(value, int)
        if not (isinstance(value, kinds) or number) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            self.fail(field_, f"must be {names}, got {_show(value)}",
                      f"write an {names} value" if names[0] in "aeiou" else f"write a {names} value", line)
        if isinstance(value, str) and _control_char(value):
            self.fail(field_, f"contains the control character {_control_char(value)}",
                      "remove it (the value is one line of text)", line)
        return value

    def given(self, key: str) -> bool:
        """`key` has a value (a field left empty is as good as absent)."""
        return key in self.data and not _unset(self.data[key], (list, dict))

    def items(
        self, key: str, entry: str, required: bool = False, fix: str = ""
    ) -> list[tuple[str, Any, int]]:
        """The entries of list field `key` as (field path, value, line); `entry` says what one
        entry should be, for the error about an entry left empty."""
        values = self.get(key, list, [], required=required, fix=fix)
        lines = getattr(values, "lines", [])
        out = []
        for i, value in enumerate(values):
            where, line = f"{self._field(key)}[{i}]", lines[i] if i < len(lines) else self.line_of(key)
            if _unset(value, (list, dict)) or _is_blank(value):
                self.fail(where, "is empty", f"write {entry} after the '-', or remove that line", line)
            if isinstance(value, str) and _control_char(value):
                self.fail(where, f"contains the control character {_control_char(value)}",
                          "remove it (an entry is one line of text)", line)
            out.append((where, value, line))
        return out

    def sub(self, key: str) -> _Reader:
        value = self.data.get(key)
        return _Reader(self.path, value, self._field(key), self.line_of(key))

    @overload
    def integer(self, key: str, default: int, low: int, high: int, what: str) -> int: ...
    @overload
    def integer(self, key: str, default: int | None, low: int, high: int, what: str) -> int | None: ...

    def integer(self, key: str, default: int | None, low: int, high: int, what: str) -> int | None:
        value = self.get(key, int, default)
        if value is not None and not low <= value <= high:
            self.fail(self._field(key), f"{value} is not {what}", f"use a number from {low} to {high}",
                      self.line_of(key))
        return value

    @overload
    def port(self, key: str, default: int) -> int: ...
    @overload
    def port(self, key: str, default: int | None) -> int | None: ...

    def port(self, key: str, default: int | None) -> int | None:
        return self.integer(key, default, 1, 65535, "a TCP port")

    def seconds(self, key: str, default: float, low: float) -> float:
        value = self.get(key, float, default)
        # nan fails both comparisons; inf and 1e400 fail the upper bound.
        if not (low <= value <= MAX_SECONDS):
            self.fail(self._field(key), f"{_show(value)} is not a number of seconds",
                      f"use a number from {low:g} to {MAX_SECONDS}", self.line_of(key))
        return float(value)

    def env(self, key: str) -> tuple[tuple[str, str], ...]:
        env = self.sub(key)
        out = []
        for name, value in env.data.items():
            if not isinstance(name, str) or not ENV_KEY_RE.fullmatch(name):
                env.fail(env._field(name), "is not a valid environment variable name",
                         "use letters, digits and underscores, not starting with a digit",
                         env.line_of(name))
            # No default here: a variable with no value may be a value forgotten, and "" is a
            # legitimate value, so the user says which one is meant.
            if value is None:
                env.fail(
                    env._field(name),
                    "is empty",
                    f'write {name}: "" for an empty variable, or remove the line',
                    env.line_of(name),
                )
            # datetime.date: an unquoted 2024-01-01, which reads back as written.
            if not isinstance(value, (str, int, float, datetime.date)):
                env.fail(env._field(name), f"must be a single value, not {_kind_name(value)}",
                         "quote it as a string", env.line_of(name))
            out.append((name, value if isinstance(value, str) else str(value).lower()
                        if isinstance(value, bool) else str(value)))
        return tuple(out)

    def path_field(self, key: Any, default: str | None, must_exist: bool = False,
                   fix: str = "fix the path (relative paths are relative to the inventory file)",
                   required: bool = False) -> str | None:
        value = self.get(key, str, default, required=required, fix=fix)
        if value is None:
            return None
        try:
            expanded = Path(value).expanduser()
        except RuntimeError:  # ~name of a user this machine does not know
            self.fail(self._field(key), f"{_show(value)}: no home directory for {value.split('/')[0]}",
                      "write the full path", self.line_of(key))
        if not expanded.is_absolute():
            expanded = self.path.parent / expanded
        try:
            exists = not must_exist or expanded.is_file()
        except OSError as exc:  # a name too long, a directory that may not be searched
            self.fail(self._field(key), f"{expanded}: {exc.strerror}", fix, self.line_of(key))
        if not exists:
            self.fail(
                self._field(key),
                f"{expanded} is a directory" if expanded.is_dir() else f"{expanded} does not exist",
                "run 'fab cluster.up' to make the local cluster's" if ".cluster" in expanded.parts else fix,
                self.line_of(key),
            )
        return str(expanded)


SSH_FIELDS = ("user", "port", "key", "known_hosts", "connect_timeout", "keepalive", "jump", "config")


def _ssh(reader: _Reader, base: Settings, check_files: bool) -> Settings:
    """The inventory's ssh: section (global, or a host's override of it), as written."""
    reader.check_keys(SSH_FIELDS)
    jump_fix = "write [user@]host[:port] (an ssh_config alias works), several comma-separated"
    jump = reader.get("jump", (str, list), None)
    if isinstance(jump, list):
        hops = reader.items("jump", "[user@]host[:port]")
        for where, hop, line in hops:
            if not isinstance(hop, str):
                reader.fail(where, f"{_show(hop)} is not a jump host", jump_fix, line)
        jump = ",".join(hop for _, hop, _ in hops)
    if jump is not None and jump.lower() != "none":
        try:
            for _, host, _ in parse_jump(jump):
                # The same rule as a host's address: a hop such as -oProxyCommand=... would be read
                # by ssh as an option.
                if not ADDRESS_RE.fullmatch(host):
                    raise ValueError(
                        f"{host!r} is neither a host name, an IP address nor an ssh_config alias"
                    )
        except ValueError as exc:
            reader.fail(reader._field("jump"), str(exc), jump_fix, reader.line_of("jump"))
    config = reader.get("config", str, None)
    # Always checked, not only with check_files: the file is read while the inventory is parsed.
    config_path = (
        None
        if config is None or config.lower() == "none"
        else reader.path_field(
            "config",
            None,
            must_exist=True,
            fix="give the path of an ssh_config file, or none to read no ssh_config",
        )
    )
    # At least 1 s: ssh's ConnectTimeout and ServerAliveInterval take whole seconds, and 0 turns
    # them off (sshargs.ssh_options).
    settings = Settings(
        user=reader.get("user", str, None), port=reader.port("port", None),
        key=reader.path_field("key", None, must_exist=check_files),
        known_hosts=reader.path_field("known_hosts", None, must_exist=check_files),
        connect_timeout=reader.seconds("connect_timeout", base.connect_timeout, 1),
        keepalive=reader.seconds("keepalive", base.keepalive, 1), jump=jump, config=config_path)
    return settings.over(base, {k for k in SSH_FIELDS if reader.given(k)})


def _checkpoint(reader: _Reader) -> str:
    from orchestrator.core.jobspec import checkpoint_pattern  # plan imports this module
    value = reader.get("checkpoint", str, "")
    try:
        return checkpoint_pattern(value) if value else ""
    except ValueError as exc:
        reader.fail(reader._field("checkpoint"), str(exc), "e.g. checkpoint: checkpoints/ckpt.pt")


def _remote_path(reader: _Reader, key: str, default: str) -> str:
    value = reader.get(key, str, default)
    if not value.startswith("/"):
        reader.fail(reader._field(key), f"{value!r} is not an absolute path",
                    "write the full path on the hosts, starting with /")
    return value.rstrip("/") or "/"


def _mounts(reader: _Reader, key: str) -> tuple[Mount, ...]:
    out = []
    for where, item, line in reader.items(key, "SOURCE:TARGET[:ro] (e.g. /data/corpus:/data:ro)"):
        if isinstance(item, str):
            parts = item.split(":")
            if (
                len(parts) not in (2, 3)
                or not all(parts[:2])
                or (len(parts) == 3 and parts[2] not in ("ro", "rw"))
            ):
                reader.fail(where, f"{_show(item)} is not SOURCE:TARGET[:ro]",
                            "write e.g. /data/corpus:/data:ro", line)
            mount = Mount(parts[0], parts[1], len(parts) == 3 and parts[2] == "ro")
        else:
            m = _Reader(reader.path, item, where, line,
                        "write SOURCE:TARGET[:ro], or source:, target: and read_only: under the '-'")
            m.check_keys(("source", "target", "read_only"))
            mount = Mount(
                m.get("source", str, required=True, fix="give the path on the host, e.g. /data/corpus"),
                m.get("target", str, required=True, fix="give the path in the container, e.g. /data"),
                m.get("read_only", bool, False),
            )
        if not (mount.source.startswith("/") and mount.target.startswith("/")):
            reader.fail(where, f"{_show(mount.source)}:{_show(mount.target)} must use absolute paths",
                        "write both paths starting with /", line)
        out.append(mount)
    return tuple(out)


# docker run --ulimit names (Docker's ulimit parser, from setrlimit(2)).
ULIMITS = ("core", "cpu", "data", "fsize", "locks", "memlock", "msgqueue", "nice", "nofile", "nproc",
           "rss", "rtprio", "rttime", "sigpending", "stack")
ULIMIT_VALUE_RE = re.compile(r"-?[0-9]+(:-?[0-9]+)?")
CAP_RE = re.compile(r"(CAP_)?[A-Z][A-Z_]*")
SECURITY_OPT_RE = re.compile(r"[a-z-]+([=:][A-Za-z0-9_./:=-]+)?")
CONTAINER_FIELDS = ("ulimits", "cap_add", "security_opt")


def _container_options(reader: _Reader) -> dict:
    """ulimits, cap_add and security_opt of job: or of one host."""
    limits = reader.sub("ulimits")
    limit_fix = "write a number, SOFT:HARD, or -1 / unlimited"
    ulimits = []
    for name in limits.data:
        where = limits._field(name)
        if name not in ULIMITS:
            limits.fail(where, "is not a ulimit Docker knows", f"use one of: {', '.join(ULIMITS)}",
                        limits.line_of(name))
        value = limits.get(name, (int, str), required=True, fix=limit_fix + ", or remove the line")
        text = "-1" if value in ("unlimited", -1) else str(value)
        if not ULIMIT_VALUE_RE.fullmatch(text):
            limits.fail(where, f"{_show(value)} is not a limit", limit_fix, limits.line_of(name))
        ulimits.append((name, text))
    lists = {}
    for key, pattern, example in (("cap_add", CAP_RE, "IPC_LOCK or SYS_PTRACE"),
                                  ("security_opt", SECURITY_OPT_RE, "seccomp=unconfined")):
        items = reader.items(key, f"an entry such as {example.split()[0]}")
        for where, item, line in items:
            if not isinstance(item, str) or not pattern.fullmatch(item):
                reader.fail(where, f"{_show(item)} is not a valid {key} entry",
                            f"write e.g. {example}", line)
        lists[key] = tuple(item for _, item, _ in items)
    return dict(ulimits=tuple(ulimits), **lists)


def _host(reader: _Reader, rank: int, base: Settings, check_files: bool, configs: dict) -> Host:
    reader.check_keys(("name", "address", "interface", "gpus", "ssh", "image", "env", "mounts",
                       "devices", *CONTAINER_FIELDS))
    address = reader.get(
        "address", str, required=True, fix="give the host's name or IP address, e.g. 10.0.0.11"
    )
    if not ADDRESS_RE.fullmatch(address):
        reader.fail(reader._field("address"), f"{_show(address)} is neither a host name, an IP address nor "
                    "an ssh_config alias", "write e.g. 10.0.0.11, gpu1.example.com or an alias from "
                    "~/.ssh/config (user and port go in ssh:)", reader.line_of("address"))
    name = reader.get("name", str, None)
    if name is None and not NAME_RE.fullmatch(address):
        # The name defaults to the address, and an IPv6 address has ':' in it.
        reader.fail(
            reader._field("name"),
            f"is empty, and the address {_show(address)} cannot be the host's name",
            "add name: with letters, digits, '.', '_' and '-'",
            reader.line_of("name"),
        )
    name = address if name is None else name
    if not NAME_RE.fullmatch(name):
        reader.fail(reader._field("name"), f"{_show(name)} has characters not allowed in a host name",
                    "use letters, digits, '.', '_' and '-'", reader.line_of("name"))
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
    devices = reader.items("devices", "a device path such as /dev/infiniband")
    for where, d, line in devices:
        if not isinstance(d, str) or not d.startswith("/dev/"):
            reader.fail(where, f"{_show(d)} is not a device path",
                        "list paths such as /dev/infiniband/uverbs0", line)
    interface = reader.get("interface", str, required=True,
                           fix="give the network interface that reaches the other hosts, e.g. eth0")
    if not INTERFACE_RE.fullmatch(interface):
        reader.fail(
            reader._field("interface"),
            f"{_show(interface)} is not a network interface name",
            "write it as 'ip link' shows it, e.g. eth0 or ens1f0 (at most 15 letters, digits, '.', '_', '-')",
            reader.line_of("interface"),
        )
    return Host(
        name=name,
        address=address,
        rank=rank,
        ssh=_resolve(reader, address, _ssh(reader.sub("ssh"), base, check_files), configs),
        interface=interface,
        gpu_vendor=vendor,
        gpu_count=count,
        image=reader.get("image", str, None),
        env=reader.env("env"),
        mounts=_mounts(reader, "mounts"),
        devices=tuple(d for _, d, _ in devices),
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
    reader.check_keys(
        (
            "image",
            "master_port",
            "nproc_per_node",
            "code_dir",
            "output_dir",
            "shm_size",
            "env",
            "secret_files",
            "stop_grace",
            "keep_snapshots",
            "checkpoint",
            "notify",
            "notify_url",
            "warm_restarts",
            *CONTAINER_FIELDS,
        )
    )
    nproc = str(reader.get("nproc_per_node", (int, str), "auto"))
    # [0-9], not isdigit(): '²' is a digit to isdigit() but not to int().
    if nproc != "auto" and not (re.fullmatch(r"[0-9]+", nproc) and int(nproc) > 0):
        reader.fail(reader._field("nproc_per_node"), f"{_show(nproc)} is not a process count",
                    "use a positive number, or auto (GPU count, 1 on CPU)", reader.line_of("nproc_per_node"))
    secrets = reader.sub("secret_files")
    secret_files: list[tuple[str, str]] = []
    for name in secrets.data:
        if not isinstance(name, str) or not ENV_KEY_RE.fullmatch(name):
            secrets.fail(secrets._field(name), "is not a valid environment variable name",
                         "use letters, digits and underscores", secrets.line_of(name))
        secret = secrets.path_field(
            name,
            None,
            required=True,
            fix=f"give the local file whose contents become {name}, or remove the line",
        )
        assert secret is not None  # required: a missing or empty one has failed above
        secret_files.append((name, secret))
    return Job(
        image=reader.get("image", str, Job.image),
        master_port=reader.port("master_port", Job.master_port),
        nproc_per_node=nproc,
        code_dir=_remote_path(reader, "code_dir", Job.code_dir),
        output_dir=_remote_path(reader, "output_dir", Job.output_dir),
        shm_size=reader.get("shm_size", str, None),
        env=reader.env("env"),
        secret_files=tuple(secret_files),
        stop_grace=reader.seconds("stop_grace", Job.stop_grace, 0),
        keep_snapshots=reader.integer("keep_snapshots", Job.keep_snapshots, 1, MAX_SNAPSHOTS,
                                      "a number of snapshots to keep"),
        checkpoint=_checkpoint(reader),
        notify=reader.get("notify", str, None),
        notify_url=_notify_url(reader),
        warm_restarts=reader.get("warm_restarts", bool, Job.warm_restarts),
        **_container_options(reader),
    )


def _notify_url(reader: _Reader) -> str | None:
    url = reader.get("notify_url", str, None)
    if url is not None and not re.fullmatch(r"https?://[^\s/?#]+[^\s]*", url):
        reader.fail(reader._field("notify_url"), f"{_show(url)} is not an http:// or https:// URL",
                    "give the URL notifications are POSTed to", reader.line_of("notify_url"))
    return url


def parse(text: str, path: Path, check_files: bool = False) -> Inventory:
    """The inventory in `text`; with check_files, the key and known_hosts files must exist too."""
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        raise UserError(f"{path}:{line}: not valid YAML: {exc.problem}; check the indentation and "
                        f"quoting on that line") from None
    except yaml.reader.ReaderError as exc:  # raised before any mark exists
        line = text[:exc.position].count("\n") + 1
        raise UserError(f"{path}:{line}: not valid YAML: the control character U+{exc.character:04X} is not "
                        f"allowed; remove it") from None
    top = _Reader(
        path, data, "", 1, "write the inventory as ssh:, job: and hosts: sections (see inventory.yaml)"
    )
    top.check_keys(("ssh", "job", "hosts", "spares", "slurm", "controller"))
    ssh = _ssh(top.sub("ssh"), Settings(), check_files)
    host_entry = "the host's address: and interface: (indented under it)"
    hosts_items = top.items(
        "hosts", host_entry, required=True, fix="list at least one host; the first is rank 0"
    )
    items = hosts_items + top.items("spares", host_entry)
    hosts: list[Host] = []
    configs: dict[str | None, paramiko.SSHConfig | None] = {}
    for rank, (where, item, line) in enumerate(items):
        reader = _Reader(path, item, where, getattr(item, "line", line),
                         "write the host's address:, interface: and other fields indented under its '-'")
        hosts.append(_host(reader, rank, ssh, check_files, configs))
    seen: dict[str, str] = {}
    for h, (where, item, line) in zip(hosts, items, strict=True):
        for key in (h.name, f"{h.hostname}:{h.ssh.port}"):
            if key in seen:
                top.fail(
                    where,
                    f"{_show(key)} is also {seen[key]}",
                    "list each host once, in hosts: (rank order) or spares:",
                    getattr(item, "line", line),
                )
            seen[key] = where
    job = _job(top.sub("job"))
    slurm = (
        _slurm(top.sub("slurm"), ssh, check_files, configs, job, len(hosts_items))
        if top.given("slurm")
        else None
    )
    return Inventory(path=path, hosts=tuple(hosts[:len(hosts_items)]), job=job,
                     spares=tuple(hosts[len(hosts_items):]), slurm=slurm,
                     controller=_controller(top.sub("controller"), [h.name for h in hosts]))


def _controller(reader: _Reader, names: list[str]) -> Controller:
    reader.check_keys(("host", "image"))
    host = reader.get("host", str, None)
    if host is not None and host not in names:
        reader.fail(reader._field("host"), f"{_show(host)} is not a host of this inventory",
                    f"name one of {', '.join(names)}", reader.line_of("host"))
    return Controller(host=host, image=reader.get("image", str, Controller.image))


SLURM_RUNTIMES = ("docker", "pyxis")
# What sbatch takes as a partition, account or time limit (no spaces, quotes or shell characters).
SLURM_VALUE_RE = re.compile(r"[A-Za-z0-9_.,:=+-]+")


def _slurm(reader: _Reader, base: Settings, check_files: bool, configs: dict, job: Job, hosts: int) -> Slurm:
    reader.check_keys(("login", "ssh", "workdir", "nodes", "partition", "account", "time", "runtime"))
    login = reader.get(
        "login",
        str,
        required=True,
        fix="give the login node's name or address, where sbatch runs, e.g. login1.example.com",
    )
    if not ADDRESS_RE.fullmatch(login):
        reader.fail(reader._field("login"), f"{_show(login)} is neither a host name, an IP address nor an "
                    "ssh_config alias", "write e.g. login1.example.com (user and port go in ssh:)")
    values = {}
    for key, example in (("partition", "gpu"), ("account", "myproject"), ("time", "04:00:00")):
        value = reader.get(key, (str, int), None)
        if value is not None and not SLURM_VALUE_RE.fullmatch(str(value)):
            reader.fail(reader._field(key), f"{_show(value)} is not a Slurm {key}",
                        f"use letters, digits and _.,:=+- only, e.g. {key}: {example}")
        values[key] = None if value is None else str(value)
    runtime = reader.get("runtime", str, "docker")
    if runtime not in SLURM_RUNTIMES:
        reader.fail(
            reader._field("runtime"),
            f"{_show(runtime)} is not a container runtime fabtrain runs under Slurm",
            "use docker (docker run on each node) or pyxis (srun --container-image, enroot)",
        )
    host = Host(
        name=login.replace(":", "-") if not NAME_RE.fullmatch(login) else login,
        address=login,
        rank=0,
        ssh=_resolve(reader, login, _ssh(reader.sub("ssh"), base, check_files), configs),
        interface="lo",
    )
    return Slurm(
        login=host,
        workdir=_remote_path(reader, "workdir", f"{job.output_dir}/slurm"),
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
    raise UserError(f"no inventory: no {DEFAULT_FILE} in {Path.cwd()}, no --inventory PATH and no "
                    f"${INVENTORY_ENV}; pass one of them (the README's inventory section shows one)")


def load(path: str | Path | None = None) -> Inventory:
    path = locate(path)
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
