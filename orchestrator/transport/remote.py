"""The one place that talks SSH: Fabric connections with host keys checked, fan-out, streaming.

Fabric's default is to auto-add unknown host keys and load no known_hosts; here every connection
loads the inventory's known_hosts (and the system-wide ones, as OpenSSH does) and refuses a host
whose key is missing, changed or revoked. First contact is accepted only deliberately (`fab
cluster.up` records keys it read through `docker exec`; for real hosts, `ssh-keyscan` after
comparing the fingerprint).

known_hosts files are read here line by line as OpenSSH reads them (KnownHosts), not by
paramiko.HostKeys, which fails the whole file on one `@cert-authority` line and knows neither
`@revoked` nor wildcards. Host certificates are not checked (paramiko cannot): a host known only
through a `@cert-authority` line is refused with the way to add its plain key.
"""
from __future__ import annotations

import binascii
import functools
import heapq
import hmac
import itertools
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from hashlib import sha1
from io import BufferedReader
from types import TracebackType
from typing import Any, Protocol, TypeVar

import paramiko
from fabric import Config, Connection

from orchestrator.commands import sshargs
from orchestrator.config.inventory import Host
from orchestrator.config.sshconf import SSH
from orchestrator.core import hostile
from orchestrator.core.errors import UserError

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
    """Decide on a host none of whose usable keys paramiko was given (see _open): accept a key the
    known_hosts files list for it; refuse a revoked one, one known only through a CA, and an
    unknown one, each with its fix."""

    def __init__(self, label: str, ssh: SSH, trust: HostTrust | None = None) -> None:
        self.label, self.ssh = label, ssh
        self.trust = trust or host_trust(ssh)

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        problem = self.trust.refusal(self.label, self.ssh, key)
        if problem is not None:
            raise HostKeyError(problem)
        if not self.trust.known(key):
            raise HostKeyError(unknown_key(self.label, self.ssh, hostname, key))


def _keyscan(ssh: SSH, key: paramiko.PKey) -> str:
    """How to check a host's key on the host and then accept it deliberately."""
    return (f"Check that fingerprint on the host (ssh-keygen -lf /etc/ssh/ssh_host_"
            f"{key.get_name().split('-')[-1]}_key.pub), then accept it deliberately: ssh-keyscan -p "
            f"{ssh.port} {ssh.hostname} >> {ssh.known_hosts_file}")


def unknown_key(label: str, ssh: SSH, hostname: str, key: paramiko.PKey) -> str:
    return (f"{label} ({hostname}): host key unknown ({key.get_name()} {key.fingerprint}), not in "
            f"{', '.join(ssh.known_hosts + ssh.global_known_hosts)}. {_keyscan(ssh, key)}")


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
    via = " via " + ",".join(j.hostname for j in host.ssh.jump) if host.ssh.jump else ""
    where = f"{host.name} ({host.ssh.where()}{via})"
    if isinstance(exc, UserError):  # ours, but it may quote a host's text
        return hostile.line(str(exc), 2000)
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
                f"{host.ssh.port} ({hostile.line(str(exc.text), 200)}); check the address as the jump "
                f"host sees it")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"{where}: no answer within {host.ssh.connect_timeout:g}s; is the host up and sshd running?"
    if isinstance(exc, (ConnectionRefusedError, paramiko.ssh_exception.NoValidConnectionsError)):
        return f"{where}: connection refused; start sshd there or fix ssh.port in the inventory"
    if isinstance(exc, socket.gaierror):
        return (f"{where}: cannot resolve {host.ssh.hostname}; check the address, or the Host entry in "
                f"your ssh_config")
    if isinstance(exc, OSError):
        return (f"{where}: cannot connect: {hostile.line(str(exc.strerror or exc))}; check the address and "
                f"the network")
    # paramiko's SSHException text quotes what the server sent (a banner it could not read).
    return f"{where}: {type(exc).__name__}: {hostile.line(str(exc))}"


class PerHost(dict):
    """What a fan-out returns: host name -> the function's value, or the exception it raised there."""

    def error(self, name: str) -> BaseException | None:
        value = self.get(name)
        return value if isinstance(value, BaseException) else None

    def value(self, name: str, default: Any = None) -> Any:
        """The host's value; `default` where it raised (or was not asked)."""
        value = self.get(name, default)
        return default if isinstance(value, BaseException) else value

    def errors(self) -> dict[str, BaseException]:
        return {n: v for n, v in self.items() if isinstance(v, BaseException)}

    def values_ok(self) -> list:
        return [v for v in self.values() if not isinstance(v, BaseException)]


def failure(host: Host, result: Result | BaseException, what: str) -> str | None:
    """Why a command fanned out to a host did not succeed there (None if it did), for the user."""
    if isinstance(result, BaseException):
        return describe(host, result)
    if not result.ok:
        return f"{host.name}: {what} failed (exit {result.exited}): {_tail(result.stderr)}"
    return None


def _tail(stderr: str, limit: int = 200) -> str:
    """The end of a command's stderr (where its error is) as one safe line of at most `limit`."""
    end = stderr[-8 * limit:]
    return hostile.line(end, 3 * len(end))[-limit:]  # each newline becomes ' | ': never cut there


class Deadlines:
    """Every pending command deadline, kept by one thread instead of a timer thread per command
    (a fan-out to 64 hosts started 64 more threads). A deadline that passes runs its action on a
    thread of its own, so one slow close (a frozen host's channel) cannot hold up the others;
    the common case, a command done in time, costs no thread at all."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, spawn: Callable | None = None) -> None:
        self.clock = clock
        self._spawn = spawn or (
            lambda action: threading.Thread(target=action, daemon=True, name="deadline").start()
        )
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

    def __init__(self, session: Session, host: Host, command: str, timeout: float | None,
                 what: str = "") -> None:
        self.session, self.host, self.command, self.timeout = session, host, command, timeout
        self.what = what or command[:60]
        self.expired = False
        self.chan: paramiko.Channel | None = None
        self._timer: list | None = None

    def __enter__(self) -> Command:
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
            if self.expired and self.timeout is not None:  # only a command with a timeout expires
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

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._cancel()
        if self.chan is not None:
            self.chan.close()
        if self.expired and self.timeout is not None:  # only a command with a timeout expires
            raise CommandTimedOut(self.host, self.what, self.timeout) from exc

    @property
    def channel(self) -> paramiko.Channel:
        """The command's open channel: there is one inside the `with` block (__enter__ opens it)."""
        if self.chan is None:
            raise RuntimeError(f"{self.host.name}: {self.what}: the command is not open (use it in a "
                               f"with block)")
        return self.chan

    def recv(self, n: int = 1 << 16) -> bytes:
        return self.channel.recv(n)

    def send(self, data: bytes) -> None:
        self.channel.sendall(data)

    def close_stdin(self) -> None:
        self.channel.shutdown_write()

    def exit_status(self) -> int:
        return self.channel.recv_exit_status()


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

    def fan_out(self, fn: Callable[[Host], T], hosts: Sequence[Host] | None = None) -> PerHost:
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
        """Run one command string (already quoted once, see sshargs.shell) and capture its output;
        CommandTimedOut if it has not finished within `timeout` seconds."""
        start = time.monotonic()
        with self.command(host, command, timeout, what) as cmd:
            if stdin is not None:
                cmd.send(stdin)
                cmd.close_stdin()
            out, err = _drain(cmd.channel)
            code = cmd.exit_status()
        return Result(out.decode(errors="replace"), err.decode(errors="replace"), code,
                      time.monotonic() - start)

    def stream(self, host: Host, command: str, on_data: Callable[[bytes], None],
               chunk: int = 1 << 16, timeout: float | None = None) -> int:
        """Run a command, passing its combined stdout/stderr to on_data as it arrives; exit code."""
        with self.command(host, command, timeout) as cmd:
            cmd.channel.set_combine_stderr(True)
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
            raise UserError(f"{host.name}: cannot write {path}: {_tail(r.stderr)}")

    def local(self, argv: list[str], timeout: float) -> Result:
        """Run a command on this machine (rsync to or from a host): the one place a job starts a
        local process, so a recording stand-in sees those too. Its stdout and stderr are capped like
        a remote command's (_drain): what rsync prints can be the host's (its shell's stderr)."""
        start = time.monotonic()
        code, out, err = run_capped(argv, timeout)
        out_text, err_text = out.decode(errors="replace"), err.decode(errors="replace")
        if code is None:
            return Result(out_text, f"{err_text}\n{argv[0]} did not finish within {timeout:g}s", 124,
                          time.monotonic() - start)
        return Result(out_text, err_text, code, time.monotonic() - start)

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

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_capped(argv: list[str], timeout: float) -> tuple[int | None, bytes, bytes]:
    """Run a local command, keeping at most OUTPUT_MAX bytes of each of its stdout and stderr:
    its exit status (None when it was killed at `timeout`), stdout, stderr."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    bufs = (hostile.Capped(), hostile.Capped())

    def pump(pipe: BufferedReader, buf: hostile.Capped) -> None:
        with pipe:
            for chunk in iter(lambda: pipe.read1(1 << 16), b""):
                buf.write(chunk)

    pumps = [threading.Thread(target=pump, args=(pipe, buf), daemon=True, name="local-output")
             for pipe, buf in zip((proc.stdout, proc.stderr), bufs, strict=True)]
    for t in pumps:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        code: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    for t in pumps:  # a child (rsync's ssh) may hold the pipes a little longer
        t.join(max(5.0, deadline - time.monotonic()))
    return code, bufs[0].getvalue(), bufs[1].getvalue()


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


def put_command(path: str, mode: int = 0o600) -> str:
    """Write the command's stdin to `path` (its directory made if missing), created private and then
    given `mode`: the bytes (a secret, a batch script) travel on stdin, never on a command line.

    The directory must be this account's own and no link: whoever owns the directory above it (as
    the first account to use a shared output_dir owns `.runtime`) can rename this account's job
    directory away and put its own there, with a 0666 file waiting at the secrets' name. The command
    enters the directory and checks that its path, no link, still names it (nothing renamed in its
    place meanwhile is written into), removes whatever is at the file's name, and makes the file new
    (noclobber: never written through a file or link put there meanwhile); `mode` is given through
    the open descriptor."""
    script = (
        'd=$(dirname "$1"); case "$d" in /*) ;; *) d="$PWD/$d";; esac; '
        'mkdir -p "$d" && cd -P "$d" && [ ! -L "$d" ] && [ "$d" -ef . ] && [ -O . ] || '
        '{ printf "%s is not a directory of %s (a link, or one of another account): %s is not written\\n" '
        '"$d" "$(id -un)" "$1" >&2; exit 1; }; '
        'f="./${1##*/}"; umask 077 && rm -f "$f" && '
        '( set -C; exec 3> "$f" && cat >&3 && chmod "$2" /dev/fd/3 )'
    )
    return sshargs.shell(["sh", "-c", script, "sh", path, f"{mode:o}"])


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
    proportion to N times their duration, which itself grows with N on a loaded machine. Each of
    stdout and stderr keeps its first OUTPUT_MAX bytes (the rest is read and counted): a command
    printing 1 GB costs bounded memory."""
    out, err = hostile.Capped(), hostile.Capped()
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
    """What paramiko is given for one hop: the same keys as sshargs.ssh_argv gives OpenSSH."""
    kwargs: dict = {"banner_timeout": ssh.connect_timeout, "auth_timeout": ssh.connect_timeout,
                    # The agent is always asked too, so a passphrase-protected key loaded there works.
                    "allow_agent": True, "look_for_keys": not ssh.keys}
    if ssh.keys:
        kwargs["key_filename"] = list(ssh.keys)
    return kwargs


# ---------------------------------------------------------------- known_hosts, as OpenSSH reads it

MARKERS = ("@cert-authority", "@revoked")


def pattern_matches(name: str, pattern: str) -> bool:
    """One known_hosts host pattern ('*' any run, '?' one character, nothing else special; no
    case) against a host name as ssh looks it up ('host', or '[host]:port' off port 22)."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(regex, name.lower(), re.S) is not None


@functools.lru_cache(maxsize=65536)
def _salted(field: str) -> tuple[bytes, bytes] | None:
    """A hashed host field's salt and hash, decoded once (None: not a valid one)."""
    parts = field.split("|")
    if len(parts) != 4:
        return None
    try:
        return binascii.a2b_base64(parts[2]), binascii.a2b_base64(parts[3])
    except (binascii.Error, ValueError):
        return None


def hosts_match(name: str, field: str) -> bool:
    """Whether a known_hosts line's host field names `name`, as OpenSSH decides: a hashed field
    (|1|salt|hash) by its HMAC; otherwise comma-separated patterns, any one matching, and a
    matching negated one (!pattern) vetoing the whole line."""
    if field.startswith("|1|"):
        salted = _salted(field)
        # ssh looks a host up by its name in lower case; a file written by another tool may not.
        return salted is not None and any(
            hmac.compare_digest(hmac.new(salted[0], n.encode(), sha1).digest(), salted[1])
            for n in {name, name.lower()})
    found = False
    for pattern in field.split(","):
        if pattern.startswith("!"):
            if pattern_matches(name, pattern[1:]):
                return False
        elif pattern and pattern_matches(name, pattern):
            found = True
    return found


@dataclass(frozen=True)
class KnownKey:
    """One usable line of a known_hosts file."""

    marker: str            # "", "@revoked" or "@cert-authority"
    hosts: str             # the host field as written (patterns, or one hashed name)
    key: paramiko.PKey
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


_PLAIN_NAME = re.compile(r"^[^*?!|,]+$")


class KnownHosts(paramiko.HostKeys):
    """A known_hosts file read as OpenSSH reads it, line by line: `@revoked` and `@cert-authority`
    lines kept for what they are, hashed names, wildcards, negations and [host]:port forms matched
    as ssh matches them, and a line that cannot be read (garbage, a key type paramiko does not
    know) skipped on its own. paramiko.HostKeys reads the same file as a whole and fails it, every
    host included, on one `@cert-authority` line (InvalidHostKey: '@cert-authority' is taken as
    the host field, the pattern as the key type and the key type as base64)."""

    def __init__(self, path: str | None = None, text: str = "") -> None:
        super().__init__()
        self.path = path or "known_hosts"
        self.lines: list[KnownKey] = []
        self.skipped: list[int] = []  # line numbers of lines that could not be read
        # Lines naming plain hosts only, by name; the others (patterns, hashes) are matched in turn.
        self._by_name: dict[str, list[KnownKey]] = {}
        self._scan: list[KnownKey] = []
        for number, raw in enumerate(text.splitlines(), 1):
            entry = self._parse(raw, number)
            if entry is None:
                continue
            self.lines.append(entry)
            names = entry.hosts.split(",")
            if all(_PLAIN_NAME.match(n) for n in names):
                for n in names:
                    self._by_name.setdefault(n.lower(), []).append(entry)
            else:
                self._scan.append(entry)

    @classmethod
    def read(cls, path: str) -> KnownHosts:
        with open(path, "rb") as f:
            return cls(path, f.read().decode(errors="replace"))

    def _parse(self, raw: str, number: int) -> KnownKey | None:
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            return None
        marker = ""
        if fields[0].startswith("@"):
            marker, fields = fields[0], fields[1:]
            if marker not in MARKERS:
                self.skipped.append(number)
                return None
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields[:3]), number)
        except Exception:  # noqa: BLE001 - bad base64 or key data: this line only, as ssh does
            entry = None
        if entry is None or entry.key is None:
            self.skipped.append(number)
            return None
        return KnownKey(marker, fields[0], entry.key, self.path, number)

    def matching(self, name: str) -> list[KnownKey]:
        """The lines naming `name` ('host', or '[host]:port'), in file order."""
        found = [e for e in self._by_name.get(name.lower(), ()) if hosts_match(name, e.hosts)]
        found += [e for e in self._scan if hosts_match(name, e.hosts)]
        return sorted(found, key=lambda e: e.line) if len(found) > 1 else found

    # paramiko documents lookup as answering a dict of key type to key; its stubs name the private
    # mapping class paramiko itself returns (_SubDict), which no other class can return.
    def lookup(self, hostname: str) -> dict[str, paramiko.PKey] | None:  # type: ignore[override]
        """The plain (unmarked) keys for a host, by type, as paramiko.HostKeys.lookup answers;
        revoked keys left out."""
        found = self.matching(hostname)
        revoked = [e.key for e in found if e.marker == "@revoked"]
        keys: dict[str, paramiko.PKey] = {}
        for e in found:
            if not e.marker and e.key not in revoked:
                keys.setdefault(e.key.get_name(), e.key)
        return keys or None


_KNOWN_HOSTS: dict[str, tuple[tuple[int, int, int], KnownHosts]] = {}
_KNOWN_HOSTS_LOCK = threading.Lock()


def known_hosts(path: str) -> KnownHosts:
    """A known_hosts file (KnownHosts), read again only when it changed (inode, mtime or size);
    empty when there is no such file or it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return KnownHosts(path)
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    with _KNOWN_HOSTS_LOCK:
        cached = _KNOWN_HOSTS.get(path)
    if cached is None or cached[0] != stamp:
        try:
            parsed = KnownHosts.read(path)
        except OSError:  # unreadable (a directory, no permission): no keys, as ssh treats it
            parsed = KnownHosts(path)
        cached = (stamp, parsed)
        with _KNOWN_HOSTS_LOCK:
            _KNOWN_HOSTS[path] = cached
    return cached[1]


@dataclass(frozen=True)
class HostTrust:
    """What a host's known_hosts lines (user and system-wide files) say about it, under the name
    ssh looks it up by."""

    name: str
    keys: tuple[KnownKey, ...]          # plain lines, revoked keys left out
    revoked: tuple[KnownKey, ...]
    authorities: tuple[KnownKey, ...]   # @cert-authority lines (certificates are not checked)

    def known(self, key: paramiko.PKey) -> bool:
        return any(e.key == key for e in self.keys)

    def refusal(self, label: str, ssh: SSH, key: paramiko.PKey) -> str | None:
        """Why `key`, presented by the host, is refused beyond being unknown (None if not)."""
        for e in self.revoked:
            if e.key == key:
                return (f"{label} ({self.name}): host key {key.get_name()} {key.fingerprint} is REVOKED "
                        f"(@revoked line {e.where}); refused, as ssh refuses it. The host needs a new "
                        f"host key: make one there (ssh-keygen -A after removing the old "
                        f"/etc/ssh/ssh_host_{key.get_name().split('-')[-1]}_key*), then check its "
                        f"fingerprint and add it: ssh-keyscan -p {ssh.port} {ssh.hostname} >> "
                        f"{ssh.known_hosts_file}; if the revocation is a mistake, remove line {e.line} "
                        f"of {e.path}")
        if self.authorities and not self.keys:
            first = self.authorities[0]
            return (f"{label} ({self.name}): known only through the @cert-authority line {first.where}; "
                    f"fabtrain checks host keys with paramiko, which does not verify host certificates, "
                    f"so it does not accept CA-signed host keys. Add the host's plain key: "
                    f"{_keyscan(ssh, key)}")
        return None


def lookup_name(ssh: SSH) -> str:
    """The name ssh and paramiko look a host's key up by."""
    return ssh.hostname if ssh.port == 22 else f"[{ssh.hostname}]:{ssh.port}"


def host_trust(ssh: SSH) -> HostTrust:
    """What the user's and the system-wide known_hosts files (the same ones sshargs.ssh_options gives
    OpenSSH) say about the host `ssh` reaches."""
    name = lookup_name(ssh)
    found = [e for path in ssh.known_hosts + ssh.global_known_hosts for e in known_hosts(path).matching(name)]
    revoked = tuple(e for e in found if e.marker == "@revoked")
    keys = tuple(e for e in found if not e.marker and not any(r.key == e.key for r in revoked))
    return HostTrust(name, keys, revoked, tuple(e for e in found if e.marker == "@cert-authority"))


def _open(ssh: SSH, label: str, sock: paramiko.Channel | None = None) -> Connection:
    """One connected hop, its host key checked against its known_hosts files (see host_trust):
    paramiko is given the host's keys, one per type (it asks the server for the first type), and
    the policy decides on anything else it is shown."""
    trust = host_trust(ssh)
    prefer: paramiko.PKey | None = None
    for attempt in range(2):
        conn = Connection(ssh.hostname, user=ssh.user, port=ssh.port,
                          config=Config(overrides={"load_ssh_configs": False}),
                          connect_timeout=ssh.connect_timeout,
                          connect_kwargs={**connect_kwargs(ssh), **({"sock": sock} if sock else {})})
        conn.client.set_missing_host_key_policy(_RejectUnknown(label, ssh, trust))
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
