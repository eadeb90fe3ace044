"""Readers of the inventory's fields that stand on their own: ssh: (as written, and resolved with
ssh_config), mounts, container options, a host's address, name, GPUs, devices and interface, and
job:'s paths, checkpoint, secret files and notify_url."""

from __future__ import annotations

import ipaddress
import re

from orchestrator.config.sshconf import ADDRESS_RE, SSH, Settings, parse_jump, read_config, resolve
from orchestrator.config.yamlloader import show
from orchestrator.config.yamlreader import ENV_KEY_RE, Reader
from orchestrator.core.nodespec import Mount

GPU_VENDORS = ("nvidia", "amd", "none")
# Used with fullmatch: a '$' match would let a trailing newline through.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# A Linux interface name (at most 15 bytes): it becomes NCCL_SOCKET_IFNAME=<name>, an exact match.
INTERFACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,14}")

SSH_FIELDS = ("user", "port", "key", "known_hosts", "connect_timeout", "keepalive", "jump", "config")


def read_ssh(reader: Reader, base: Settings, check_files: bool) -> Settings:
    """The inventory's ssh: section (global, or a host's override of it), as written."""
    reader.check_keys(SSH_FIELDS)
    jump_fix = "write [user@]host[:port] (an ssh_config alias works), several comma-separated"
    jump = reader.get("jump", (str, list), None)
    if isinstance(jump, list):
        hops = reader.items("jump", "[user@]host[:port]")
        for where, hop, line in hops:
            if not isinstance(hop, str):
                reader.fail(where, f"{show(hop)} is not a jump host", jump_fix, line)
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
        user=reader.get("user", str, None),
        port=reader.port("port", None),
        key=reader.path_field("key", None, must_exist=check_files),
        known_hosts=reader.path_field("known_hosts", None, must_exist=check_files),
        connect_timeout=reader.seconds("connect_timeout", base.connect_timeout, 1),
        keepalive=reader.seconds("keepalive", base.keepalive, 1),
        jump=jump,
        config=config_path,
    )
    return settings.over(base, {k for k in SSH_FIELDS if reader.given(k)})


def read_checkpoint(reader: Reader) -> str:
    from orchestrator.core.jobspec import checkpoint_pattern  # plan imports this module

    value = reader.get("checkpoint", str, "")
    try:
        return checkpoint_pattern(value) if value else ""
    except ValueError as exc:
        reader.fail(reader._field("checkpoint"), str(exc), "e.g. checkpoint: checkpoints/ckpt.pt")


def remote_path(reader: Reader, key: str, default: str) -> str:
    value = reader.get(key, str, default)
    if not value.startswith("/"):
        reader.fail(
            reader._field(key),
            f"{value!r} is not an absolute path",
            "write the full path on the hosts, starting with /",
        )
    return value.rstrip("/") or "/"


def read_mounts(reader: Reader, key: str) -> tuple[Mount, ...]:
    out = []
    for where, item, line in reader.items(key, "SOURCE:TARGET[:ro] (e.g. /data/corpus:/data:ro)"):
        if isinstance(item, str):
            parts = item.split(":")
            if (
                len(parts) not in (2, 3)
                or not all(parts[:2])
                or (len(parts) == 3 and parts[2] not in ("ro", "rw"))
            ):
                reader.fail(
                    where, f"{show(item)} is not SOURCE:TARGET[:ro]", "write e.g. /data/corpus:/data:ro", line
                )
            mount = Mount(parts[0], parts[1], len(parts) == 3 and parts[2] == "ro")
        else:
            m = Reader(
                reader.path,
                item,
                where,
                line,
                "write SOURCE:TARGET[:ro], or source:, target: and read_only: under the '-'",
            )
            m.check_keys(("source", "target", "read_only"))
            mount = Mount(
                m.get("source", str, required=True, fix="give the path on the host, e.g. /data/corpus"),
                m.get("target", str, required=True, fix="give the path in the container, e.g. /data"),
                m.get("read_only", bool, False),
            )
        if not (mount.source.startswith("/") and mount.target.startswith("/")):
            reader.fail(
                where,
                f"{show(mount.source)}:{show(mount.target)} must use absolute paths",
                "write both paths starting with /",
                line,
            )
        out.append(mount)
    return tuple(out)


# docker run --ulimit names (Docker's ulimit parser, from setrlimit(2)).
ULIMITS = (
    "core",
    "cpu",
    "data",
    "fsize",
    "locks",
    "memlock",
    "msgqueue",
    "nice",
    "nofile",
    "nproc",
    "rss",
    "rtprio",
    "rttime",
    "sigpending",
    "stack",
)
ULIMIT_VALUE_RE = re.compile(r"-?[0-9]+(:-?[0-9]+)?")
CAP_RE = re.compile(r"(CAP_)?[A-Z][A-Z_]*")
SECURITY_OPT_RE = re.compile(r"[a-z-]+([=:][A-Za-z0-9_./:=-]+)?")
CONTAINER_FIELDS = ("ulimits", "cap_add", "security_opt")


def read_container_options(reader: Reader) -> dict:
    """ulimits, cap_add and security_opt of job: or of one host."""
    limits = reader.sub("ulimits")
    limit_fix = "write a number, SOFT:HARD, or -1 / unlimited"
    ulimits = []
    for name in limits.data:
        where = limits._field(name)
        if name not in ULIMITS:
            limits.fail(
                where,
                "is not a ulimit Docker knows",
                f"use one of: {', '.join(ULIMITS)}",
                limits.line_of(name),
            )
        value = limits.get(name, (int, str), required=True, fix=limit_fix + ", or remove the line")
        text = "-1" if value in ("unlimited", -1) else str(value)
        if not ULIMIT_VALUE_RE.fullmatch(text):
            limits.fail(where, f"{show(value)} is not a limit", limit_fix, limits.line_of(name))
        ulimits.append((name, text))
    lists = {}
    for key, pattern, example in (
        ("cap_add", CAP_RE, "IPC_LOCK or SYS_PTRACE"),
        ("security_opt", SECURITY_OPT_RE, "seccomp=unconfined"),
    ):
        items = reader.items(key, f"an entry such as {example.split()[0]}")
        for where, item, line in items:
            if not isinstance(item, str) or not pattern.fullmatch(item):
                reader.fail(where, f"{show(item)} is not a valid {key} entry", f"write e.g. {example}", line)
        lists[key] = tuple(item for _, item, _ in items)
    return dict(ulimits=tuple(ulimits), **lists)


def read_address(reader: Reader) -> str:
    address = reader.get(
        "address", str, required=True, fix="give the host's name or IP address, e.g. 10.0.0.11"
    )
    if not ADDRESS_RE.fullmatch(address):
        reader.fail(
            reader._field("address"),
            f"{show(address)} is neither a host name, an IP address nor an ssh_config alias",
            "write e.g. 10.0.0.11, gpu1.example.com or an alias from "
            "~/.ssh/config (user and port go in ssh:)",
            reader.line_of("address"),
        )
    return address


def read_name(reader: Reader, address: str) -> str:
    """The host's name: name:, else its address (which must then be a valid name)."""
    name = reader.get("name", str, None)
    if name is None and not NAME_RE.fullmatch(address):
        # The name defaults to the address, and an IPv6 address has ':' in it.
        reader.fail(
            reader._field("name"),
            f"is empty, and the address {show(address)} cannot be the host's name",
            "add name: with letters, digits, '.', '_' and '-'",
            reader.line_of("name"),
        )
    name = address if name is None else name
    if not NAME_RE.fullmatch(name):
        reader.fail(
            reader._field("name"),
            f"{show(name)} has characters not allowed in a host name",
            "use letters, digits, '.', '_' and '-'",
            reader.line_of("name"),
        )
    return name


def read_gpus(gpus: Reader) -> tuple[str, int]:
    """A host's gpus: section: its vendor and GPU count."""
    gpus.check_keys(("vendor", "count"))
    vendor = gpus.get("vendor", str, "none")
    if vendor not in GPU_VENDORS:
        gpus.fail(
            gpus._field("vendor"),
            f"{vendor!r} is not a known GPU vendor",
            f"use one of: {', '.join(GPU_VENDORS)}",
        )
    count = gpus.get("count", int, 0)
    if count < 0 or (vendor == "none" and count) or (vendor != "none" and count == 0):
        gpus.fail(
            gpus._field("count"),
            f"count {count} does not fit vendor {vendor!r}",
            "give the number of GPUs (at least 1) for nvidia/amd hosts, 0 for vendor none",
        )
    return vendor, count


def read_devices(reader: Reader) -> tuple[str, ...]:
    devices = reader.items("devices", "a device path such as /dev/infiniband")
    for where, d, line in devices:
        if not isinstance(d, str) or not d.startswith("/dev/"):
            reader.fail(
                where, f"{show(d)} is not a device path", "list paths such as /dev/infiniband/uverbs0", line
            )
    return tuple(d for _, d, _ in devices)


def read_interface(reader: Reader) -> str:
    interface = reader.get(
        "interface",
        str,
        required=True,
        fix="give the network interface that reaches the other hosts, e.g. eth0",
    )
    if not INTERFACE_RE.fullmatch(interface):
        reader.fail(
            reader._field("interface"),
            f"{show(interface)} is not a network interface name",
            "write it as 'ip link' shows it, e.g. eth0 or ens1f0 (at most 15 letters, digits, '.', '_', '-')",
            reader.line_of("interface"),
        )
    return interface


def resolve_ssh(reader: Reader, address: str, settings: Settings, configs: dict) -> SSH:
    """The host's connection settings with its ssh_config applied (see sshconf); each ssh_config
    file is read once per inventory (`configs`)."""
    try:
        if settings.config not in configs:
            configs[settings.config] = read_config(settings.config)
        return resolve(address, settings, configs[settings.config])
    except ValueError as exc:
        reader.fail(reader._field("ssh"), str(exc), "fix the jump host or the ssh_config entry")
    raise AssertionError("unreachable")


def read_secret_files(secrets: Reader) -> tuple[tuple[str, str], ...]:
    """job:'s secret_files: environment variable name -> a local file's path."""
    secret_files: list[tuple[str, str]] = []
    for name in secrets.data:
        if not isinstance(name, str) or not ENV_KEY_RE.fullmatch(name):
            secrets.fail(
                secrets._field(name),
                "is not a valid environment variable name",
                "use letters, digits and underscores",
                secrets.line_of(name),
            )
        secret = secrets.path_field(
            name,
            None,
            required=True,
            fix=f"give the local file whose contents become {name}, or remove the line",
        )
        assert secret is not None  # required: a missing or empty one has failed above
        secret_files.append((name, secret))
    return tuple(secret_files)


def read_notify_url(reader: Reader) -> str | None:
    url = reader.get("notify_url", str, None)
    if url is not None and not re.fullmatch(r"https?://[^\s/?#]+[^\s]*", url):
        reader.fail(
            reader._field("notify_url"),
            f"{show(url)} is not an http:// or https:// URL",
            "give the URL notifications are POSTed to",
            reader.line_of("notify_url"),
        )
    return url


METRICS_ADDRESS = "127.0.0.1"  # loopback unless asked: a job's metrics name its hosts and owner


def listen_address(value: str) -> tuple[str, int]:
    """(address, port) of "PORT" (on loopback) or "ADDR:PORT" ("[::1]:PORT" for IPv6); ValueError
    says what is wrong."""
    text = str(value).strip()
    addr, sep, port = text.rpartition(":")
    if not sep:
        addr, port = METRICS_ADDRESS, text
    addr = addr.removeprefix("[").removesuffix("]") if addr.startswith("[") else addr
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: {port!r} is not a TCP port (1-65535)")
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        raise ValueError(f"{text!r}: {addr!r} is not an IP address to listen on") from None
    return addr, int(port)


def read_metrics_port(reader: Reader) -> str | None:
    """job.metrics_port: PORT or ADDR:PORT, checked as --metrics-port is."""
    value = reader.get("metrics_port", (int, str), None)
    if value is None:
        return None
    try:
        listen_address(str(value))
    except ValueError as exc:
        reader.fail(
            reader._field("metrics_port"),
            str(exc),
            "use a port (9400) or an address and port (0.0.0.0:9400)",
            reader.line_of("metrics_port"),
        )
    return str(value)
