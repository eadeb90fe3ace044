"""SSH connection settings, resolved once: the inventory's over the user's ssh_config over OpenSSH's
defaults. Paramiko (remote.py) and the OpenSSH client that rsync runs (sshargs.ssh_argv) are both
built from the same resolved `SSH` value, so they reach the same host with the same trust.

What is honoured from ssh_config: Host/Match blocks, HostName, User, Port, IdentityFile,
IdentitiesOnly, UserKnownHostsFile, GlobalKnownHostsFile, ProxyJump (several hops, and a first
hop's own ProxyJump), Include (its files are read in place; OpenSSH applies an Include inside a
Host block only to that block, so keep Include lines at the top, as is usual). A ProxyCommand is
refused with a clear error: it cannot be checked or bounded here.
"""

from __future__ import annotations

import getpass
import glob
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import paramiko

from orchestrator.core.errors import UserError

DEFAULT_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
# OpenSSH reads these as well as the user's files (its GlobalKnownHostsFile default); paramiko
# (remote.py) is given the same ones, and the ssh that rsync runs is told them explicitly.
DEFAULT_GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
# What an address may be: a DNS name or ssh_config alias, an IPv4 or an IPv6 address. Anything
# else ('/', spaces, a leading '-', '@') would make rsync copy to a local path or ssh read an option.
ADDRESS_RE = re.compile(r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$")
JUMP_RE = re.compile(
    r"^(?:(?P<user>[^@\s:/]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^@\s:/\[\]]+)(?::(?P<port>\d+))?$"
)
MAX_HOPS = 8


@dataclass(frozen=True)
class SSH:
    """How to reach one host (or one jump hop), fully resolved."""

    hostname: str
    user: str
    port: int = 22
    # Identity files; () = ssh-agent, then ~/.ssh/id_* (as OpenSSH does).
    keys: tuple[str, ...] = ()
    # True when the inventory or ssh_config said IdentitiesOnly: only these keys, no agent.
    keys_only: bool = False
    known_hosts: tuple[str, ...] = ()
    # The system-wide files, read too (OpenSSH's GlobalKnownHostsFile); () for none.
    global_known_hosts: tuple[str, ...] = DEFAULT_GLOBAL_KNOWN_HOSTS
    connect_timeout: float = 10.0
    # Seconds between keepalives; a host missing 3 in a row counts as lost.
    keepalive: float = 5.0
    # Jump hosts, the first one dialled first; each is reached through the ones before it.
    jump: tuple[SSH, ...] = ()

    @property
    def key(self) -> str | None:
        return self.keys[0] if self.keys else None

    @property
    def known_hosts_file(self) -> str:
        """The file a new key is added to (the first one searched)."""
        return self.known_hosts[0] if self.known_hosts else os.path.expanduser(DEFAULT_KNOWN_HOSTS)

    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


@dataclass(frozen=True)
class Settings:
    """The inventory's SSH settings as written (None: not set), merged global -> per host."""

    user: str | None = None
    port: int | None = None
    key: str | None = None
    known_hosts: str | None = None
    connect_timeout: float = 10.0
    keepalive: float = 5.0
    jump: str | None = None  # "[user@]host[:port][,...]", an ssh_config alias, or "none"
    config: str | None = DEFAULT_CONFIG  # ssh_config file, or None for none

    def over(self, base: Settings, given: set[str]) -> Settings:
        """These settings where given, base's elsewhere."""
        return replace(base, **{k: getattr(self, k) for k in given})


def read_config(path: str | None) -> paramiko.SSHConfig | None:
    """Parse an ssh_config file with its Include lines inlined; None when there is none to read."""
    if path is None:
        return None
    full = Path(path).expanduser()
    if path == DEFAULT_CONFIG and not full.exists():
        return None  # the inventory checked any other path
    try:
        return paramiko.SSHConfig.from_text(_inline_includes(full, 0))
    except paramiko.ssh_exception.ConfigParseError as exc:
        raise UserError(f"{full}: {exc}; fix that line of the ssh_config file") from None


def _inline_includes(path: Path, depth: int) -> str:
    if depth > 16:
        raise UserError(f"{path}: Include nested more than 16 deep (a loop?)")
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:  # an Include matching a directory or an unreadable file: ssh refuses it too
        raise UserError(
            f"{path}: cannot read this ssh_config file ({exc.strerror}); fix the Include "
            "that names it, or its permissions"
        ) from None
    for line in text.splitlines():
        m = re.match(r"^\s*include\s*=?\s*(.+?)\s*$", line, re.I)
        if not m:
            out.append(line)
            continue
        for pattern in m.group(1).split():
            pattern = os.path.expanduser(pattern.strip('"'))
            if not os.path.isabs(pattern):  # relative to ~/.ssh, as OpenSSH reads user configs
                pattern = os.path.join(os.path.expanduser("~/.ssh"), pattern)
            for included in sorted(glob.glob(pattern)):
                out.append(_inline_includes(Path(included), depth + 1))
    return "\n".join(out) + "\n"


def global_known_hosts(value: str | None) -> tuple[str, ...]:
    """ssh_config's GlobalKnownHostsFile (None: not set) as the files it names: OpenSSH's default
    when not set, none for 'none'."""
    if value is None:
        return DEFAULT_GLOBAL_KNOWN_HOSTS
    files = tuple(os.path.expanduser(f) for f in value.split())
    return () if files == ("none",) else files


def parse_jump(spec: str) -> list[tuple[str | None, str, int | None]]:
    """'[user@]host[:port][,...]' (ssh -J / ProxyJump syntax) -> [(user, host, port), ...]."""
    hops = []
    for part in spec.split(","):
        m = JUMP_RE.match(part.strip())
        if not m:
            raise ValueError(f"{part.strip()!r} is not [user@]host[:port]")
        port = int(m.group("port")) if m.group("port") else None
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"{part.strip()!r}: {port} is not a TCP port")
        hops.append((m.group("user"), m.group("host").strip("[]"), port))
    return hops


def resolve(
    address: str,
    settings: Settings,
    config: paramiko.SSHConfig | None,
    inherit: Settings | None = None,
    _depth: int = 0,
) -> SSH:
    """The connection to `address`: the inventory's settings, then ssh_config, then (for a jump
    hop) the inventory's user, key and known_hosts, then OpenSSH's defaults."""
    cfg = config.lookup(address) if config is not None else {"hostname": address}
    if cfg.get("proxycommand"):
        raise ValueError(
            f"ssh_config gives {address} a ProxyCommand, which fabtrain cannot check or "
            f"bound; use ProxyJump (or ssh.jump in the inventory) instead"
        )
    inherit = inherit or Settings()
    port = settings.port or int(cfg.get("port", 22))
    user = settings.user or cfg.get("user") or inherit.user or getpass.getuser()
    keys, keys_only = _identities(settings, cfg, inherit)
    known = (
        (settings.known_hosts,)
        if settings.known_hosts
        else tuple(os.path.expanduser(k) for k in cfg.get("userknownhostsfile", "").split())
        or ((inherit.known_hosts,) if inherit.known_hosts else ())
        or (os.path.expanduser(DEFAULT_KNOWN_HOSTS),)
    )
    global_known = global_known_hosts(cfg.get("globalknownhostsfile"))
    jump_spec = settings.jump if settings.jump is not None else cfg.get("proxyjump")
    chain: list[SSH] = []
    if jump_spec and jump_spec.lower() != "none":
        chain = _jump_chain(jump_spec, settings, config, inherit if _depth else settings, _depth)
    return SSH(
        hostname=cfg.get("hostname", address),
        user=user,
        port=port,
        keys=keys,
        keys_only=keys_only,
        known_hosts=known,
        global_known_hosts=global_known,
        connect_timeout=settings.connect_timeout,
        keepalive=settings.keepalive,
        jump=tuple(chain),
    )


def _identities(settings: Settings, cfg: dict, inherit: Settings) -> tuple[tuple[str, ...], bool]:
    """(the identity files, whether only they are offered): the inventory's key, else ssh_config's
    IdentityFile (with its IdentitiesOnly), else a jump hop's inherited key, else none (the agent,
    then ~/.ssh/id_*)."""
    if settings.key:
        return (settings.key,), True
    if cfg.get("identityfile"):
        keys = tuple(os.path.expanduser(k) for k in cfg["identityfile"])
        return keys, str(cfg.get("identitiesonly", "no")).lower() == "yes"
    if inherit.key:
        return (inherit.key,), True
    return (), False


def _jump_chain(
    jump_spec: str, settings: Settings, config: paramiko.SSHConfig | None, inherit: Settings, depth: int
) -> list[SSH]:
    """The hops of a ProxyJump spec, resolved, the first one dialled first (a hop's own jumps
    before it); `inherit` gives each hop the user, key and known_hosts the inventory gave."""
    if depth >= MAX_HOPS:
        raise ValueError(f"more than {MAX_HOPS} jump hosts (a ProxyJump loop?)")
    chain: list[SSH] = []
    for i, (juser, jhost, jport) in enumerate(parse_jump(jump_spec)):
        # Only the first hop may bring a jump of its own (from ssh_config); later hops are
        # reached through the ones before them.
        hop_settings = Settings(
            user=juser,
            port=jport,
            jump=None if i == 0 else "none",
            connect_timeout=settings.connect_timeout,
            keepalive=settings.keepalive,
        )
        hop = resolve(jhost, hop_settings, config, inherit, depth + 1)
        chain += [*hop.jump, replace(hop, jump=())]
    return chain
