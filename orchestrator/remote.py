"""The one place that talks SSH: Fabric connections with host keys checked, fan-out, streaming.

Fabric's default is to auto-add unknown host keys and load no known_hosts; here every connection
loads the inventory's known_hosts and refuses a host whose key is missing or changed. First contact
is accepted only deliberately (`fab cluster.up` records keys it read through `docker exec`; for real
hosts, `ssh-keyscan` after comparing the fingerprint).
"""
from __future__ import annotations

import io
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

import paramiko
from fabric import Config, Connection

from .errors import UserError
from .inventory import Host

T = TypeVar("T")

if tuple(int(x) for x in paramiko.__version__.split(".")[:2]) < (3, 4):
    raise ImportError(f"paramiko {paramiko.__version__} is too old: 3.4 or newer is required "
                      "(Terrapin fix); run: pip install -r requirements.txt")


class HostKeyError(UserError):
    pass


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    """Refuse a host missing from known_hosts, keeping its fingerprint for the error message."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def missing_host_key(self, client, hostname, key) -> None:  # noqa: ANN001 - paramiko's signature
        fp = key.fingerprint  # e.g. SHA256:abc...
        raise HostKeyError(
            f"{self.host.name} ({hostname}): host key unknown ({key.get_name()} {fp}), not in "
            f"{self.host.ssh.known_hosts}. Check that fingerprint on the host "
            f"(ssh-keygen -lf /etc/ssh/ssh_host_{key.get_name().split('-')[-1]}_key.pub), then accept "
            f"it deliberately: ssh-keyscan -p {self.host.ssh.port} {self.host.address} "
            f">> {self.host.ssh.known_hosts}")


@dataclass
class Result:
    stdout: str
    stderr: str
    exited: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exited == 0


def describe(host: Host, exc: BaseException) -> str:
    """One line saying why a host could not be reached or a command failed, with the fix."""
    where = f"{host.name} ({host.ssh.user}@{host.address}:{host.ssh.port})"
    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, paramiko.BadHostKeyException):
        return (f"{where}: host key CHANGED (now {exc.key.get_name()} {exc.key.fingerprint}). "
                f"This may be an attack or a reinstalled host; if you know it was reinstalled, "
                f"remove its line from {host.ssh.known_hosts} and accept the new key deliberately")
    if isinstance(exc, paramiko.AuthenticationException):
        return (f"{where}: SSH key authentication failed; install the public key of "
                f"{host.ssh.key or 'your agent'} in ~{host.ssh.user}/.ssh/authorized_keys there")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"{where}: no answer within {host.ssh.connect_timeout:g}s; is the host up and sshd running?"
    if isinstance(exc, (ConnectionRefusedError, paramiko.ssh_exception.NoValidConnectionsError)):
        return f"{where}: connection refused; start sshd there or fix ssh.port in the inventory"
    if isinstance(exc, OSError):
        return f"{where}: cannot connect: {exc.strerror or exc}; check the address and the network"
    return f"{where}: {type(exc).__name__}: {exc}"


class Session:
    """Open SSH connections to a set of hosts, reused by every step of a command."""

    def __init__(self, hosts: tuple[Host, ...] | list[Host]) -> None:
        self.hosts = tuple(hosts)
        self._conns: dict[str, Connection] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.hosts)),
                                        thread_name_prefix="ssh")

    def connection(self, host: Host) -> Connection:
        with self._lock:
            conn = self._conns.get(host.name)
        if conn is not None and conn.is_connected:
            return conn
        conn = _connect(host)
        with self._lock:
            self._conns[host.name] = conn
        return conn

    def fan_out(self, fn: Callable[[Host], T], hosts: tuple[Host, ...] | None = None
                ) -> dict[str, T | BaseException]:
        """Call fn(host) on every host at once; each host's value, or the exception it raised."""
        hosts = self.hosts if hosts is None else hosts
        futures = {h.name: self._pool.submit(fn, h) for h in hosts}
        out: dict[str, T | BaseException] = {}
        for name, fut in futures.items():
            try:
                out[name] = fut.result()
            except BaseException as exc:  # noqa: BLE001 - collected per host, reported together
                out[name] = exc
        return out

    def run(self, host: Host, command: str, timeout: float | None = 60, stdin: bytes | None = None
            ) -> Result:
        """Run one command string (already quoted once, see plan.shell) and capture its output."""
        conn = self.connection(host)
        start = time.monotonic()
        chan = conn.transport.open_session(timeout=host.ssh.connect_timeout)
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            if stdin is not None:
                chan.sendall(stdin)
                chan.shutdown_write()
            out, err = _drain(chan)
            code = chan.recv_exit_status()
        finally:
            chan.close()
        return Result(out.decode(errors="replace"), err.decode(errors="replace"), code,
                      time.monotonic() - start)

    def stream(self, host: Host, command: str, on_data: Callable[[bytes], None],
               chunk: int = 1 << 16) -> int:
        """Run a command, passing its combined stdout/stderr to on_data as it arrives; exit code."""
        conn = self.connection(host)
        chan = conn.transport.open_session(timeout=host.ssh.connect_timeout)
        try:
            chan.set_combine_stderr(True)
            chan.exec_command(command)
            while True:
                data = chan.recv(chunk)
                if not data:
                    break
                on_data(data)
            return chan.recv_exit_status()
        finally:
            chan.close()

    def put(self, host: Host, data: bytes, path: str, mode: int = 0o600) -> None:
        """Write bytes to a remote file over SFTP, created with `mode` (no command line involved)."""
        sftp = self.connection(host).client.open_sftp()
        try:
            with sftp.open(path, "wb") as fh:
                fh.chmod(mode)
                fh.write(data)
        finally:
            sftp.close()

    def alive_since(self, host: Host) -> float | None:
        """Monotonic time of the last keepalive answer from the host (see heartbeat)."""
        conn = self._conns.get(host.name)
        return getattr(conn, "_fabtrain_alive", None) if conn else None

    def close(self) -> None:
        for conn in list(self._conns.values()):
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a dead link must not mask the real error
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drain(chan: paramiko.Channel) -> tuple[bytes, bytes]:
    out, err = io.BytesIO(), io.BytesIO()
    while not (chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready()):
        got = False
        if chan.recv_ready():
            out.write(chan.recv(1 << 16))
            got = True
        if chan.recv_stderr_ready():
            err.write(chan.recv_stderr(1 << 16))
            got = True
        if not got:
            if chan.closed or chan.eof_received and chan.exit_status_ready():
                break
            chan.status_event.wait(0.005)
    while chan.recv_ready():
        out.write(chan.recv(1 << 16))
    while chan.recv_stderr_ready():
        err.write(chan.recv_stderr(1 << 16))
    return out.getvalue(), err.getvalue()


def _connect(host: Host) -> Connection:
    config = Config(overrides={"load_ssh_configs": False})
    kwargs: dict = {"banner_timeout": host.ssh.connect_timeout, "auth_timeout": host.ssh.connect_timeout}
    if host.ssh.key:
        kwargs.update(key_filename=host.ssh.key, look_for_keys=False, allow_agent=False)
    conn = Connection(host.address, user=host.ssh.user, port=host.ssh.port, config=config,
                      connect_timeout=host.ssh.connect_timeout, connect_kwargs=kwargs)
    conn.client.set_missing_host_key_policy(_RejectUnknown(host))
    try:
        conn.client.load_host_keys(host.ssh.known_hosts)
    except FileNotFoundError:
        pass  # every key is then unknown, and the policy's error names the file
    conn.open()
    conn.transport.set_keepalive(int(host.ssh.keepalive))
    conn._fabtrain_alive = time.monotonic()
    threading.Thread(target=_heartbeat, args=(conn, host.ssh.keepalive), daemon=True,
                     name=f"heartbeat-{host.name}").start()
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
