"""The one place that talks SSH: Fabric connections with host keys checked, fan-out, streaming.

Fabric's default is to auto-add unknown host keys and load no known_hosts; here every connection
loads the inventory's known_hosts and refuses a host whose key is missing or changed. First contact
is accepted only deliberately (`fab cluster.up` records keys it read through `docker exec`; for real
hosts, `ssh-keyscan` after comparing the fingerprint).
"""
from __future__ import annotations

import heapq
import io
import itertools
import os
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

import paramiko
from fabric import Config, Connection

from .errors import UserError
from . import plan
from .inventory import Host
from . import hostile
from .sshconf import SSH

T = TypeVar("T")
# How long a finished command's output may still arrive before its EOF (see _drain).
EOF_GRACE = 2.0
# How often an idle connection's paramiko thread wakes (paramiko's own default: 0.1 s).
IDLE_WAKE = 1.0

if tuple(int(x) for x in paramiko.__version__.split(".")[:2]) < (3, 4):
    raise ImportError(f"paramiko {paramiko.__version__} is too old: 3.4 or newer is required "
                      "(Terrapin fix); run: pip install -r requirements.txt")


class HostKeyError(UserError):
    pass


class CommandTimedOut(UserError):
    """A remote step that did not finish within its deadline (a stuck engine, disk or script)."""

    def __init__(self, host: Host, what: str, seconds: float) -> None:
        super().__init__(f"{host.name}: no answer within {seconds:g}s ({what}); the host answers SSH "
                         f"but the command hangs: check its Docker engine and disks")
        self.host, self.what, self.seconds = host, what, seconds


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    """Refuse a host missing from known_hosts, keeping its fingerprint for the error message."""

    def __init__(self, label: str, ssh: SSH) -> None:
        self.label, self.ssh = label, ssh

    def missing_host_key(self, client, hostname, key) -> None:  # noqa: ANN001 - paramiko's signature
        fp = key.fingerprint  # e.g. SHA256:abc...
        raise HostKeyError(
            f"{self.label} ({hostname}): host key unknown ({key.get_name()} {fp}), not in "
            f"{', '.join(self.ssh.known_hosts)}. Check that fingerprint on the host "
            f"(ssh-keygen -lf /etc/ssh/ssh_host_{key.get_name().split('-')[-1]}_key.pub), then accept "
            f"it deliberately: ssh-keyscan -p {self.ssh.port} {self.ssh.hostname} "
            f">> {self.ssh.known_hosts_file}")


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
    where = f"{host.name} ({host.ssh.where()}{' via ' + ','.join(j.hostname for j in host.ssh.jump) if host.ssh.jump else ''})"
    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, paramiko.PasswordRequiredException):
        keys = " ".join(host.ssh.keys) or "your key"
        return (f"{where}: the key {keys} is encrypted and no ssh-agent holds it; fabtrain never asks "
                f"for passphrases: run 'eval $(ssh-agent); ssh-add {keys}' first")
    if isinstance(exc, paramiko.BadHostKeyException):
        return (f"{where}: host key CHANGED (now {exc.key.get_name()} {exc.key.fingerprint}). "
                f"This may be an attack or a reinstalled host; if you know it was reinstalled, "
                f"remove its line from {host.ssh.known_hosts_file} and accept the new key deliberately")
    if isinstance(exc, paramiko.AuthenticationException):
        return (f"{where}: SSH key authentication failed; install the public key of "
                f"{host.ssh.key or 'your agent'} in ~{host.ssh.user}/.ssh/authorized_keys there")
    if isinstance(exc, paramiko.ChannelException):
        return (f"{where}: the jump host could not open a connection to {host.ssh.hostname}:"
                f"{host.ssh.port} ({exc.text}); check the address as the jump host sees it")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"{where}: no answer within {host.ssh.connect_timeout:g}s; is the host up and sshd running?"
    if isinstance(exc, (ConnectionRefusedError, paramiko.ssh_exception.NoValidConnectionsError)):
        return f"{where}: connection refused; start sshd there or fix ssh.port in the inventory"
    if isinstance(exc, socket.gaierror):
        return (f"{where}: cannot resolve {host.ssh.hostname}; check the address, or the Host entry in "
                f"your ssh_config")
    if isinstance(exc, OSError):
        return f"{where}: cannot connect: {exc.strerror or exc}; check the address and the network"
    return f"{where}: {type(exc).__name__}: {exc}"


class PerHost(dict):
    """What a fan-out returns: host name -> the function's value, or the exception it raised there."""

    def error(self, name: str) -> BaseException | None:
        value = self.get(name)
        return value if isinstance(value, BaseException) else None

    def value(self, name: str, default=None):
        """The host's value; `default` where it raised (or was not asked)."""
        value = self.get(name, default)
        return default if isinstance(value, BaseException) else value

    def errors(self) -> dict[str, BaseException]:
        return {n: v for n, v in self.items() if isinstance(v, BaseException)}

    def values_ok(self) -> list:
        return [v for v in self.values() if not isinstance(v, BaseException)]


def failure(host: Host, result: "Result | BaseException", what: str) -> str | None:
    """Why a command fanned out to a host did not succeed there (None if it did), for the user."""
    if isinstance(result, BaseException):
        return describe(host, result)
    if not result.ok:
        return f"{host.name}: {what} failed (exit {result.exited}): {hostile.text(result.stderr.strip())[-200:]}"
    return None


class Deadlines:
    """Every pending command deadline, kept by one thread instead of a timer thread per command
    (a fan-out to 64 hosts started 64 more threads). A deadline that passes runs its action on a
    thread of its own, so one slow close (a frozen host's channel) cannot hold up the others;
    the common case, a command done in time, costs no thread at all."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, spawn: Callable | None = None) -> None:
        self.clock = clock
        self._spawn = spawn or (lambda action: threading.Thread(target=action, daemon=True, name="deadline").start())
        self._heap: list[list] = []  # [when, sequence, action or None once cancelled]
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, seconds: float, action: Callable[[], None]) -> list:
        """Run `action` once `seconds` have passed, unless cancelled; the handle for cancel()."""
        entry = [self.clock() + seconds, next(self._seq), action]
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="deadlines")
                self._thread.start()
            self._cond.notify()
        return entry

    def cancel(self, entry: list) -> None:
        with self._cond:
            entry[2] = None  # dropped when it reaches the top of the heap

    def due(self) -> list[Callable[[], None]]:
        """The actions whose time has come, in deadline order, taken off the heap."""
        out = []
        with self._cond:
            now = self.clock()
            while self._heap and (self._heap[0][2] is None or self._heap[0][0] <= now):
                action = heapq.heappop(self._heap)[2]
                if action is not None:
                    out.append(action)
        return out

    def _run(self) -> None:
        while True:
            for action in self.due():
                self._spawn(action)
            with self._cond:
                wait = self._heap[0][0] - self.clock() if self._heap else None
                if wait is None or wait > 0:
                    self._cond.wait(wait)


DEADLINES = Deadlines()


class Command:
    """One remote command on an open connection, bounded by a deadline.

    This is the one deadline mechanism for everything that talks to a host: when the deadline
    passes, the channel is closed, which wakes every call blocked on it (exec, send, recv, exit
    status) and the block raises CommandTimedOut naming the host. timeout=None is for log
    following only, whose liveness the keepalive watcher bounds instead.
    """

    def __init__(self, session: "Session", host: Host, command: str, timeout: float | None,
                 what: str = "") -> None:
        self.session, self.host, self.command, self.timeout = session, host, command, timeout
        self.what = what or command[:60]
        self.expired = False
        self.chan: paramiko.Channel | None = None
        self._timer: list | None = None

    def __enter__(self) -> "Command":
        start = time.monotonic()
        conn = self.session.connection(self.host)
        if self.timeout is not None:
            left = self.timeout - (time.monotonic() - start)
            if left <= 0:
                raise CommandTimedOut(self.host, self.what, self.timeout)
            self._timer = DEADLINES.add(left, self._expire)
        try:
            self.chan = conn.transport.open_session(timeout=self.host.ssh.connect_timeout)
            if self.expired:
                self.chan.close()
            self.chan.exec_command(self.command)
        except BaseException as exc:
            self._cancel()
            if self.expired:
                raise CommandTimedOut(self.host, self.what, self.timeout) from exc
            raise
        return self

    def _expire(self) -> None:
        self.expired = True
        if self.chan is not None:
            self.chan.close()

    def _cancel(self) -> None:
        if self._timer is not None:
            DEADLINES.cancel(self._timer)

    def __exit__(self, kind, exc, tb) -> None:  # noqa: ANN001
        self._cancel()
        if self.chan is not None:
            self.chan.close()
        if self.expired:
            raise CommandTimedOut(self.host, self.what, self.timeout) from exc

    def recv(self, n: int = 1 << 16) -> bytes:
        return self.chan.recv(n)

    def send(self, data: bytes) -> None:
        self.chan.sendall(data)

    def close_stdin(self) -> None:
        self.chan.shutdown_write()

    def exit_status(self) -> int:
        return self.chan.recv_exit_status()


class Session:
    """Open SSH connections to a set of hosts, reused by every step of a command."""

    def __init__(self, hosts: tuple[Host, ...] | list[Host]) -> None:
        self.hosts = tuple(hosts)
        self._conns: dict[str, Connection] = {}
        self._lock = threading.Lock()
        self.gateways = Gateways()
        raise_fd_limit(fds_needed(len(self.hosts)))
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.hosts)),
                                        thread_name_prefix="ssh")

    def connection(self, host: Host) -> Connection:
        with self._lock:
            conn = self._conns.get(host.name)
        if conn is not None and conn.is_connected:
            return conn
        conn = _connect(host, self.gateways)
        with self._lock:
            self._conns[host.name] = conn
        return conn

    def fan_out(self, fn: Callable[[Host], T], hosts: tuple[Host, ...] | None = None) -> PerHost:
        """Call fn(host) on every host at once; each host's value, or the exception it raised."""
        hosts = self.hosts if hosts is None else hosts
        futures = {h.name: self._pool.submit(fn, h) for h in hosts}
        out = PerHost()
        for name, fut in futures.items():
            try:
                out[name] = fut.result()
            except BaseException as exc:  # noqa: BLE001 - collected per host, reported together
                out[name] = exc
        return out

    def command(self, host: Host, command: str, timeout: float | None, what: str = "") -> Command:
        """A remote command with a deadline, for callers that talk to it (see Command)."""
        return Command(self, host, command, timeout, what)

    def run(self, host: Host, command: str, timeout: float = 60, stdin: bytes | None = None,
            what: str = "") -> Result:
        """Run one command string (already quoted once, see plan.shell) and capture its output;
        CommandTimedOut if it has not finished within `timeout` seconds."""
        start = time.monotonic()
        with self.command(host, command, timeout, what) as cmd:
            if stdin is not None:
                cmd.send(stdin)
                cmd.close_stdin()
            out, err = _drain(cmd.chan)
            code = cmd.exit_status()
        return Result(out.decode(errors="replace"), err.decode(errors="replace"), code,
                      time.monotonic() - start)

    def stream(self, host: Host, command: str, on_data: Callable[[bytes], None],
               chunk: int = 1 << 16, timeout: float | None = None) -> int:
        """Run a command, passing its combined stdout/stderr to on_data as it arrives; exit code."""
        with self.command(host, command, timeout) as cmd:
            cmd.chan.set_combine_stderr(True)
            while True:
                data = cmd.recv(chunk)
                if not data:
                    break
                on_data(data)
            return cmd.exit_status()

    def put(self, host: Host, data: bytes, path: str, mode: int = 0o600, timeout: float = 30) -> None:
        """Write bytes to a remote file (put_command), under the same deadline as every command."""
        r = self.run(host, put_command(path, mode), timeout=timeout, stdin=data, what=f"writing {path}")
        if not r.ok:
            raise UserError(f"{host.name}: cannot write {path}: {r.stderr.strip()[-200:]}")

    def local(self, argv: list[str], timeout: float) -> Result:
        """Run a command on this machine (rsync to or from a host): the one place a job starts a
        local process, so a recording stand-in sees those too."""
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            return Result("", f"{err}\n{argv[0]} did not finish within {timeout:g}s", 124, time.monotonic() - start)
        return Result(proc.stdout, proc.stderr, proc.returncode, time.monotonic() - start)

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
        self.gateways.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fds_needed(hosts: int) -> int:
    """File descriptors a command over `hosts` hosts may hold at once: a socket per host, a log
    file per host while following a job, and a margin for the interpreter and rsync pipes."""
    return 3 * hosts + 256


def raise_fd_limit(want: int, resource_module=None) -> int:  # noqa: ANN001 - `resource`, or a stand-in
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


def put_command(path: str, mode: int = 0o600) -> str:
    """Write the command's stdin to `path` (its directory made if missing), created private and then
    given `mode`: the bytes (a secret, our entrypoint) travel on stdin, never on a command line."""
    script = 'mkdir -p "$(dirname "$1")" && umask 077 && cat > "$1" && chmod "$2" "$1"'
    return plan.shell(["sh", "-c", script, "sh", path, f"{mode:o}"])


class _AlsoSets(threading.Event):
    """An event that sets another one with itself (the channel's exit status wakes _drain)."""

    def __init__(self, other: threading.Event) -> None:
        super().__init__()
        self.other = other

    def set(self) -> None:
        super().set()
        self.other.set()


def _drain(chan: paramiko.Channel) -> tuple[bytes, bytes]:
    """A command's stdout and stderr until it ends. The thread sleeps until data, EOF or a close
    (the deadline's) arrives: polling every few milliseconds, N waiting commands cost CPU in
    proportion to N times their duration, which itself grows with N on a loaded machine."""
    out, err = io.BytesIO(), io.BytesIO()
    wake = threading.Event()  # set by paramiko when either buffer gets data or is closed
    chan.in_buffer.set_event(wake)
    chan.in_stderr_buffer.set_event(wake)
    old_status, chan.status_event = chan.status_event, _AlsoSets(wake)  # and when the exit status comes
    if old_status.is_set():  # it came before the swap
        chan.status_event.set()
    ended = 0.0  # when the exit status came
    while True:
        wake.clear()  # before looking, so that data arriving after the look wakes the wait below
        got = False
        if chan.recv_ready():
            out.write(chan.recv(1 << 16))
            got = True
        if chan.recv_stderr_ready():
            err.write(chan.recv_stderr(1 << 16))
            got = True
        if got:
            continue
        if chan.closed or chan.eof_received:
            break  # EOF comes after all the data
        wait = 1.0  # a safety net only: every change of the buffers sets `wake`
        if chan.exit_status_ready():
            # OpenSSH's sshd sends the exit status as the command ends, and then what is still in
            # its stdout pipe, then EOF: ending here lost a command's last lines under load. A
            # command whose background child keeps the pipe open sends no EOF: wait only so long.
            ended = ended or time.monotonic()
            wait = ended + EOF_GRACE - time.monotonic()
            if wait <= 0:
                break
        wake.wait(wait)
    while chan.recv_ready():
        out.write(chan.recv(1 << 16))
    while chan.recv_stderr_ready():
        err.write(chan.recv_stderr(1 << 16))
    return out.getvalue(), err.getvalue()


def connect_kwargs(ssh: SSH) -> dict:
    """What paramiko is given for one hop: the same keys as plan.ssh_argv gives OpenSSH."""
    kwargs: dict = {"banner_timeout": ssh.connect_timeout, "auth_timeout": ssh.connect_timeout,
                    # The agent is always asked too, so a passphrase-protected key loaded there works.
                    "allow_agent": True, "look_for_keys": not ssh.keys}
    if ssh.keys:
        kwargs["key_filename"] = list(ssh.keys)
    return kwargs


_KNOWN_HOSTS: dict[str, tuple[tuple[int, int, int], paramiko.HostKeys]] = {}
_KNOWN_HOSTS_LOCK = threading.Lock()


def known_hosts(path: str) -> paramiko.HostKeys:
    """A known_hosts file as paramiko parses it, read again only when it changed (inode, mtime or size);
    empty when there is no such file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return paramiko.HostKeys()
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    with _KNOWN_HOSTS_LOCK:
        cached = _KNOWN_HOSTS.get(path)
        if cached is None or cached[0] != stamp:
            cached = _KNOWN_HOSTS[path] = (stamp, paramiko.HostKeys(path))
        return cached[1]


def _open(ssh: SSH, label: str, sock=None) -> Connection:  # noqa: ANN001 - a paramiko Channel
    """One connected hop, its host key checked against its known_hosts files."""
    conn = Connection(ssh.hostname, user=ssh.user, port=ssh.port,
                      config=Config(overrides={"load_ssh_configs": False}),
                      connect_timeout=ssh.connect_timeout,
                      connect_kwargs={**connect_kwargs(ssh), **({"sock": sock} if sock else {})})
    conn.client.set_missing_host_key_policy(_RejectUnknown(label, ssh))
    # Only this host's entries (paramiko looks the host up under this name): each file is parsed
    # once, not once per connection (N hosts reading a known_hosts of N or more entries each).
    name = ssh.hostname if ssh.port == 22 else f"[{ssh.hostname}]:{ssh.port}"
    mine = conn.client.get_host_keys()
    for path in ssh.known_hosts:
        for key_type, key in (known_hosts(path).lookup(name) or {}).items():
            mine.add(name, key_type, key)  # a missing file: every key is unknown, and the error names it
    conn.open()
    # Paramiko's thread for the connection wakes every 0.1 s to look for a close (its socket
    # timeout): 64 idle connections cost 5% of a core. Data and closes wake it anyway; our own
    # heartbeat, not paramiko's wake-ups, tells a frozen host (see _heartbeat).
    conn.transport.sock.settimeout(IDLE_WAKE)
    return conn


class Gateways:
    """The open connections to jump hosts, one per chain of hops, shared by every host behind it.

    Without sharing, N hosts behind one bastion open N SSH connections to it at once, and its sshd
    drops unauthenticated connections beyond MaxStartups (OpenSSH's default 10:30:100 starts
    refusing at 10): a connection storm that fails hosts at random from a few dozen on. Shared,
    the bastion sees one connection per chain, and each host is a direct-tcpip channel in it.
    """

    def __init__(self, open_hop=None) -> None:  # noqa: ANN001 - _open, or a stand-in in tests
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

    def channel(self, hops: tuple[SSH, ...], to: SSH, host: Host):
        """A direct-tcpip channel to `to` through the chain `hops` (None when there is none)."""
        if not hops:
            return None
        return self.get(hops, host).transport.open_channel("direct-tcpip", (to.hostname, to.port), ("", 0),
                                                          timeout=hops[-1].connect_timeout)

    def close(self) -> None:
        for conn in reversed(list(self._conns.values())):  # the last hops first
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a dead link must not mask the real error
                pass
        self._conns.clear()


def _connect(host: Host, gateways: Gateways) -> Connection:
    """Connect through the host's jump hosts (each checked like the host itself, and opened once
    for all the hosts behind it, see Gateways), then to it."""
    conn = _open(host.ssh, host.name, gateways.channel(tuple(host.ssh.jump), host.ssh, host))
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
