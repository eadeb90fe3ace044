"""A local port forwarded to a port on a host (`fab forward`), over the Session's connection to it:
the same host key checks, keys and jump hosts (connect.Gateways) as every other remote step.

Like `ssh -L 127.0.0.1:LOCAL:127.0.0.1:PORT`, but the local socket is bound here, before anything
else happens: a LOCAL port that is taken is a clear error, not a line in ssh's output; a connection
the host refuses (nothing listens there yet) is named and the forward goes on for the next one.
Fabric's own forward_local ends at the first refused connection and polls its socket every 10 ms.
"""

from __future__ import annotations

import errno
import select
import socket
import threading
import time
from collections.abc import Callable

import paramiko

from orchestrator.config.inventory import Host
from orchestrator.core.errors import UserError
from orchestrator.transport.remote import Session, describe

LOOPBACK = "127.0.0.1"  # only this machine reaches the forward: a job's Jupyter has no password
CHUNK = 1 << 16
# How often the accept loop looks at the stop flag and at the host's heartbeat.
TICK = 0.5


def listen(port: int, option: str = "LOCAL") -> socket.socket:
    """A socket listening on 127.0.0.1:`port`, or UserError naming the port and the fix."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A port in TIME_WAIT from an earlier forward is free to take; one in use by a listener is not.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(
                f"{option} port {port} on {LOOPBACK} is already in use on this machine; give "
                "another local port (fab forward JOB PORT --local LOCAL)",
                exit_code=2,
            ) from None
        if exc.errno == errno.EACCES:
            raise UserError(
                f"{option} port {port}: only root may listen on ports below 1024 here; give a "
                "local port of 1024 or more",
                exit_code=2,
            ) from None
        raise UserError(f"cannot listen on {LOOPBACK}:{port}: {exc.strerror}", exit_code=2) from None
    return sock


def serve(
    session: Session,
    host: Host,
    remote_port: int,
    listener: socket.socket,
    stop: threading.Event,
    warn: Callable[[str], None],
) -> None:
    """Forward every connection to `listener` to 127.0.0.1:`remote_port` on the host until `stop` is
    set; UserError when the host stops answering (no keepalive reply for 4 intervals)."""
    listener.settimeout(TICK)
    lost_after = 4 * host.ssh.keepalive
    while not stop.is_set():
        try:
            client, peer = listener.accept()
        except TimeoutError:
            alive = session.alive_since(host)
            if alive is not None and time.monotonic() - alive > lost_after:
                raise UserError(
                    f"{host.name}: no answer over SSH for {lost_after:g}s; the forward "
                    "ended. Run fab forward again once the host answers"
                ) from None
            continue
        threading.Thread(
            target=_pipe,
            args=(session, host, remote_port, client, peer, warn),
            daemon=True,
            name=f"forward-{peer[1]}",
        ).start()


def _pipe(
    session: Session,
    host: Host,
    remote_port: int,
    client: socket.socket,
    peer: tuple[str, int],
    warn: Callable[[str], None],
) -> None:
    """One forwarded connection, both ways, until either side closes."""
    with client:
        try:
            transport = session.connection(host).transport
            channel = transport.open_channel(
                "direct-tcpip", (LOOPBACK, remote_port), peer, timeout=host.ssh.connect_timeout
            )
        except paramiko.ChannelException as exc:
            # The host's sshd says why (connect failed: nothing listens there yet, or forwarding is
            # off); its text is the host's, so only its code is shown.
            why = "nothing listens there" if exc.code == 2 else f"refused by sshd (code {exc.code})"
            warn(f"{host.name}: port {remote_port}: {why}; connection from {peer[1]} closed")
            return
        except Exception as exc:  # noqa: BLE001 - one connection's failure; the forward goes on
            warn(describe(host, exc))
            return
        with channel:
            ends = [client, channel]
            try:
                while True:
                    ready, _, _ = select.select(ends, [], [])
                    for end in ready:
                        data = end.recv(CHUNK)
                        if not data:
                            return
                        (channel if end is client else client).sendall(data)
            except (OSError, EOFError):  # either end reset or the link dropped: this connection ends
                return
