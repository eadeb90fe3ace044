"""Connecting: Fabric connections with host keys checked, through shared jump hosts, kept alive.

Fabric's default is to auto-add unknown host keys and load no known_hosts; here every connection
loads the inventory's known_hosts (and the system-wide ones, as OpenSSH does) and refuses a host
whose key is missing, changed or revoked (hostkeys.py). First contact is accepted only deliberately
(`fab cluster.up` records keys it read through `docker exec`; for real hosts, `ssh-keyscan` after
comparing the fingerprint).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import paramiko
from fabric import Config, Connection

from orchestrator.config.inventory import Host
from orchestrator.config.sshconf import SSH
from orchestrator.transport.hostkeys import HostKeyError, RejectUnknown, host_trust

# How often an idle connection's paramiko thread wakes (paramiko's own default: 0.1 s).
IDLE_WAKE = 1.0

if tuple(int(x) for x in paramiko.__version__.split(".")[:2]) < (3, 4):
    raise ImportError(
        f"paramiko {paramiko.__version__} is too old: 3.4 or newer is required "
        "(Terrapin fix); run: pip install -r requirements.txt"
    )


def fds_needed(hosts: int) -> int:
    """File descriptors a command over `hosts` hosts may hold at once: a socket per host, a log
    file per host while following a job, and a margin for the interpreter and rsync pipes."""
    return 3 * hosts + 256


class ResourceLimits(Protocol):
    """What raise_fd_limit uses of the `resource` module (a stand-in in tests)."""

    RLIMIT_NOFILE: int
    RLIM_INFINITY: int

    def getrlimit(self, resource: int, /) -> tuple[int, int]: ...

    def setrlimit(self, resource: int, limits: tuple[int, int], /) -> None: ...


def raise_fd_limit(want: int, resource_module: ResourceLimits | None = None) -> int:
    """Raise this process's soft limit of open files to `want` (at most the hard limit): the
    usual soft limit of 1024 is met from about 300 hosts. The limit in force after."""
    import resource

    res = resource_module or resource
    soft, hard = res.getrlimit(res.RLIMIT_NOFILE)
    target = want if hard == res.RLIM_INFINITY else min(want, hard)
    if soft != res.RLIM_INFINITY and soft < target:
        res.setrlimit(res.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def connect_kwargs(ssh: SSH) -> dict:
    """What paramiko is given for one hop: the same keys as sshargs.ssh_argv gives OpenSSH."""
    kwargs: dict = {
        "banner_timeout": ssh.connect_timeout,
        "auth_timeout": ssh.connect_timeout,
        # The agent is always asked too, so a passphrase-protected key loaded there works.
        "allow_agent": True,
        "look_for_keys": not ssh.keys,
    }
    if ssh.keys:
        kwargs["key_filename"] = list(ssh.keys)
    return kwargs


def _open(ssh: SSH, label: str, sock: paramiko.Channel | None = None) -> Connection:
    """One connected hop, its host key checked against its known_hosts files (see host_trust):
    paramiko is given the host's keys, one per type (it asks the server for the first type), and
    the policy decides on anything else it is shown."""
    trust = host_trust(ssh)
    prefer: paramiko.PKey | None = None
    for attempt in range(2):
        conn = Connection(
            ssh.hostname,
            user=ssh.user,
            port=ssh.port,
            config=Config(overrides={"load_ssh_configs": False}),
            connect_timeout=ssh.connect_timeout,
            connect_kwargs={**connect_kwargs(ssh), **({"sock": sock} if sock else {})},
        )
        conn.client.set_missing_host_key_policy(RejectUnknown(label, ssh, trust))
        mine = conn.client.get_host_keys()
        given: dict[str, paramiko.PKey] = {}
        for e in trust.keys:  # only this host's entries; each file is parsed once (known_hosts)
            given.setdefault(e.key.get_name(), e.key)
        if prefer is not None:
            given[prefer.get_name()] = prefer
        for key_type, key in given.items():
            mine.add(trust.name, key_type, key)
        try:
            conn.open()
        except paramiko.BadHostKeyException as exc:
            problem = trust.refusal(label, ssh, exc.key)
            if problem is not None:
                raise HostKeyError(problem) from None
            if attempt == 0 and sock is None and trust.known(exc.key):
                # Another line of the same type lists the key the host showed: again, with that one.
                prefer = exc.key
                continue
            raise
        break
    # Paramiko's thread for the connection wakes every 0.1 s to look for a close (its socket
    # timeout): 64 idle connections cost 5% of a core. Data and closes wake it anyway; our own
    # heartbeat, not paramiko's wake-ups, tells a frozen host (see _heartbeat).
    conn.transport.sock.settimeout(IDLE_WAKE)
    return conn


# Opens one hop: (its settings, its label for messages, the channel to reach it through) -> connection.
OpenHop = Callable[[SSH, str, paramiko.Channel | None], Connection]


class Gateways:
    """The open connections to jump hosts, one per chain of hops, shared by every host behind it.

    Without sharing, N hosts behind one bastion open N SSH connections to it at once, and its sshd
    drops unauthenticated connections beyond MaxStartups (OpenSSH's default 10:30:100 starts
    refusing at 10): a connection storm that fails hosts at random from a few dozen on. Shared,
    the bastion sees one connection per chain, and each host is a direct-tcpip channel in it.
    """

    def __init__(self, open_hop: OpenHop | None = None) -> None:
        self._open = open_hop or _open
        self._conns: dict[tuple[SSH, ...], Connection] = {}
        self._locks: dict[tuple[SSH, ...], threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, hops: tuple[SSH, ...], host: Host) -> Connection:
        """The connection to the last of `hops` (through the ones before it), opened once."""
        with self._lock:
            lock = self._locks.setdefault(hops, threading.Lock())
        with lock:  # one opener per chain; the others wait for it instead of opening their own
            conn = self._conns.get(hops)
            if conn is not None and conn.is_connected:
                return conn
            hop = hops[-1]
            sock = self.channel(hops[:-1], hop, host) if len(hops) > 1 else None
            conn = self._open(hop, f"jump host {hop.hostname} (for {host.name})", sock)
            self._conns[hops] = conn
            return conn

    def channel(self, hops: tuple[SSH, ...], to: SSH, host: Host) -> paramiko.Channel | None:
        """A direct-tcpip channel to `to` through the chain `hops` (None when there is none)."""
        if not hops:
            return None
        return self.get(hops, host).transport.open_channel(
            "direct-tcpip", (to.hostname, to.port), ("", 0), timeout=hops[-1].connect_timeout
        )

    def close(self) -> None:
        for conn in reversed(list(self._conns.values())):  # the last hops first
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a dead link must not mask the real error
                pass
        self._conns.clear()


def connect_host(host: Host, gateways: Gateways) -> Connection:
    """Connect through the host's jump hosts (each checked like the host itself, and opened once
    for all the hosts behind it, see Gateways), then to it."""
    conn = _open(host.ssh, host.name, gateways.channel(tuple(host.ssh.jump), host.ssh, host))
    conn.transport.set_keepalive(int(host.ssh.keepalive))
    conn._fabtrain_alive = time.monotonic()
    threading.Thread(
        target=_heartbeat, args=(conn, host.ssh.keepalive), daemon=True, name=f"heartbeat-{host.name}"
    ).start()
    return conn


def _heartbeat(conn: Connection, interval: float) -> None:
    """Ask the server for a reply every `interval` s and record when one came.

    Paramiko's own keepalive wants no reply, so it cannot tell a frozen host from a quiet one; a
    watcher compares `_fabtrain_alive` with the clock instead.
    """
    transport = conn.transport
    while transport is not None and transport.is_active():
        try:
            transport.global_request("keepalive@openssh.com", wait=True)
        except Exception:  # noqa: BLE001 - a dead transport ends the loop below
            pass
        if transport.is_active():
            conn._fabtrain_alive = time.monotonic()
        time.sleep(interval)
