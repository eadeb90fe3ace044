"""The one place that talks SSH: a Session of open connections (connect.py), fan-out, commands
bounded by deadlines (kept by timers.py), streaming."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import paramiko
from fabric import Connection

from orchestrator.config.inventory import Host
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import sshargs
from orchestrator.transport.capture import drain, run_capped
from orchestrator.transport.connect import Gateways, connect_host, fds_needed, raise_fd_limit
from orchestrator.transport.timers import DEADLINES

T = TypeVar("T")


class CommandTimedOut(UserError):
    """A remote step that did not finish within its deadline (a stuck engine, disk or script)."""

    def __init__(self, host: Host, what: str, seconds: float) -> None:
        super().__init__(
            f"{host.name}: no answer within {seconds:g}s ({what}); the host answers SSH "
            f"but the command hangs: check its Docker engine and disks"
        )
        self.host, self.what, self.seconds = host, what, seconds


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
        return (
            f"{where}: the key {keys} is encrypted and no ssh-agent holds it; fabtrain never asks "
            f"for passphrases: run 'eval $(ssh-agent); ssh-add {keys}' first"
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return (
            f"{where}: host key CHANGED (now {exc.key.get_name()} {exc.key.fingerprint}). "
            f"This may be an attack or a reinstalled host; if you know it was reinstalled, "
            f"remove its line from {host.ssh.known_hosts_file} and accept the new key deliberately"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return (
            f"{where}: SSH key authentication failed; install the public key of "
            f"{host.ssh.key or 'your agent'} in ~{host.ssh.user}/.ssh/authorized_keys there"
        )
    if isinstance(exc, paramiko.ChannelException):
        return (
            f"{where}: the jump host could not open a connection to {host.ssh.hostname}:"
            f"{host.ssh.port} ({hostile.line(str(exc.text), 200)}); check the address as the jump "
            f"host sees it"
        )
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"{where}: no answer within {host.ssh.connect_timeout:g}s; is the host up and sshd running?"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        # paramiko's name for every address failing: refused, or unreachable (no route to host).
        others = [e for e in exc.errors.values() if not isinstance(e, ConnectionRefusedError)]
        exc = others[0] if others else ConnectionRefusedError()
    if isinstance(exc, ConnectionRefusedError):
        return f"{where}: connection refused; start sshd there or fix ssh.port in the inventory"
    if isinstance(exc, socket.gaierror):
        return (
            f"{where}: cannot resolve {host.ssh.hostname}; check the address, or the Host entry in "
            f"your ssh_config"
        )
    if isinstance(exc, OSError):
        return (
            f"{where}: cannot connect: {hostile.line(str(exc.strerror or exc))}; check the address and "
            f"the network"
        )
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


def timed_out(result: object) -> bool:
    """Whether a fan-out's answer is a deadline that passed: the command's, or the connection's
    (paramiko raises a host that accepts TCP but never sends its banner, a frozen one, as an
    SSHException whose context is the socket's timeout)."""
    seen: BaseException | None = result if isinstance(result, BaseException) else None
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, (CommandTimedOut, TimeoutError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _tail(stderr: str, limit: int = 200) -> str:
    """The end of a command's stderr (where its error is) as one safe line of at most `limit`."""
    end = stderr[-8 * limit :]
    return hostile.line(end, 3 * len(end))[-limit:]  # each newline becomes ' | ': never cut there


class Command:
    """One remote command on an open connection, bounded by a deadline.

    This is the one deadline mechanism for everything that talks to a host: when the deadline
    passes, the channel is closed, which wakes every call blocked on it (exec, send, recv, exit
    status) and the block raises CommandTimedOut naming the host. timeout=None is for log
    following only, whose liveness the keepalive watcher bounds instead.
    """

    def __init__(
        self, session: Session, host: Host, command: str, timeout: float | None, what: str = ""
    ) -> None:
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

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._cancel()
        if self.chan is not None:
            self.chan.close()
        if self.expired and self.timeout is not None:  # only a command with a timeout expires
            raise CommandTimedOut(self.host, self.what, self.timeout) from exc

    @property
    def channel(self) -> paramiko.Channel:
        """The command's open channel: there is one inside the `with` block (__enter__ opens it)."""
        if self.chan is None:
            raise RuntimeError(
                f"{self.host.name}: {self.what}: the command is not open (use it in a with block)"
            )
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
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.hosts)), thread_name_prefix="ssh")

    def connection(self, host: Host) -> Connection:
        with self._lock:
            conn = self._conns.get(host.name)
        if conn is not None and conn.is_connected:
            return conn
        conn = connect_host(host, self.gateways)
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

    def run(
        self, host: Host, command: str, timeout: float = 60, stdin: bytes | None = None, what: str = ""
    ) -> Result:
        """Run one command string (already quoted once, see sshargs.shell) and capture its output;
        CommandTimedOut if it has not finished within `timeout` seconds."""
        start = time.monotonic()
        with self.command(host, command, timeout, what) as cmd:
            if stdin is not None:
                cmd.send(stdin)
                cmd.close_stdin()
            out, err = drain(cmd.channel)
            code = cmd.exit_status()
        return Result(
            out.decode(errors="replace"), err.decode(errors="replace"), code, time.monotonic() - start
        )

    def stream(
        self,
        host: Host,
        command: str,
        on_data: Callable[[bytes], None],
        chunk: int = 1 << 16,
        timeout: float | None = None,
    ) -> int:
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

    def local(
        self, argv: list[str], timeout: float, on_output: Callable[[bytes], None] | None = None
    ) -> Result:
        """Run a command on this machine (rsync to or from a host): the one place a job starts a
        local process, so a recording stand-in sees those too. Its stdout and stderr are capped like
        a remote command's (drain): what rsync prints can be the host's (its shell's stderr).
        `on_output` sees its stdout as it comes (rsync's progress)."""
        start = time.monotonic()
        code, out, err = run_capped(argv, timeout, on_output)
        out_text, err_text = out.decode(errors="replace"), err.decode(errors="replace")
        if code is None:
            return Result(
                out_text,
                f"{err_text}\n{argv[0]} did not finish within {timeout:g}s",
                124,
                time.monotonic() - start,
            )
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
