"""The dashboard's web server: one page (static/) and the read-only JSON it polls (handler.py), for
every browser from one copy of what the hosts said (cache.py: one Refresher, however many look).

GET and HEAD only: stopping a job stays a command. A Gate (gate.py) stands before every page: a
Host header that is not one of this server's names is refused (a web page elsewhere cannot read the
dashboard by pointing a name of its own at its address, 0.0.0.0 included), and on any address but
loopback a request without the dashboard's token is refused (every job's logs are there).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from collections.abc import Iterable
from http.server import ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from typing import Any

from orchestrator.config.inventory import Inventory
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.dashboard.cache import REFRESH, JobPages, Refresher
from orchestrator.dashboard.gate import Gate, allow_list, allowed_hosts, as_host, token_for
from orchestrator.dashboard.handler import make_handler


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a browser that keeps a connection open never holds up the end
    allow_reuse_address = True
    gate = Gate(frozenset())  # answers nobody until listen() knows the port it got

    def server_bind(self) -> None:
        # HTTPServer's own looks the address up in DNS (getfqdn) for a name nothing here reads: on
        # 0.0.0.0 with a slow resolver, seconds before the dashboard starts
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class Server6(Server):
    address_family = socket.AF_INET6


def listen(
    address: str,
    port: int,
    refresher: Refresher,
    pages: JobPages,
    token: str | None = None,
    allow: Iterable[str] = (),
) -> Server:
    """A server listening on address:port (0: any free port), not yet serving, that answers only its
    own names and `allow`, and with `token` only requests carrying it; UserError naming --address or
    --port when it cannot listen there."""
    try:
        kind = Server6 if ":" in address else Server
        server = kind((address, port), make_handler(refresher, pages, Server.gate))
    except OSError as exc:
        why = (
            "it is in use (another dashboard?); pick another with --port"
            if exc.errno == errno.EADDRINUSE
            else f"{exc.strerror}; pick another --address or --port"
        )
        raise UserError(f"the dashboard cannot listen on {address}:{port}: {why}", exit_code=2) from None
    bound = server.server_address[1]
    server.gate = Gate(frozenset(allowed_hosts(address, bound, allow)), token, f"fabtrain_dashboard_{bound}")
    server.RequestHandlerClass = make_handler(refresher, pages, server.gate)
    return server


def start(
    inv: Inventory,
    runs: Path,
    address: str,
    port: int,
    every: float = REFRESH,
    token_file: str | None = None,
    allow: Iterable[str] = (),
) -> tuple[Server, Refresher]:
    """The server listening (not yet serving) and its refresher started; UserError naming --address,
    --port, --refresh, --token-file or --allow-host when one is wrong."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise UserError(
            f"--address {hostile.text(address)!r} is not an IP address; give one such as "
            "127.0.0.1 (this machine only, the default) or 0.0.0.0 (every address)",
            exit_code=2,
        ) from None
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port; give one from 1 to 65535", exit_code=2)
    if every <= 0:
        raise UserError(
            f"--refresh {every:g} must be a number of seconds above 0 (default {REFRESH:g})", exit_code=2
        )
    names = allow_list(allow)
    token = token_for(address, token_file)
    refresher = Refresher(inv, runs, every)
    server = listen(address, port, refresher, JobPages(runs), token, names)
    refresher.start()
    return server, refresher


def start_message(server: Server, address: str, token_file: str | None) -> str:
    """What fab dashboard prints at its start: the URL to open, where it listens, whether a token is
    asked for, and the names it answers."""
    port = server.server_address[1]
    ip = ipaddress.ip_address(address)
    if ip.is_unspecified:
        fqdn = socket.getfqdn()
        name, where = (fqdn if "." in fqdn else socket.gethostname()), "every address of this machine"
    else:
        name, where = as_host(address), ("this machine only" if ip.is_loopback else "this address only")
    url = f"http://{name}:{port}/"
    token = server.gate.token
    if token is None:
        first, asked = url, "no token asked (every account on this machine can read it; --token-file asks)"
    elif token_file:
        first = url
        asked = (
            f"a token is asked for: open {url}?token=TOKEN once, TOKEN being the first line of "
            f"{hostile.text(token_file)}; the browser keeps it in a cookie"
        )
    else:
        first = f"{url}?token={token}"
        asked = (
            "a token is asked for: open this URL once (a new token at every start); the browser "
            "keeps it in a cookie"
        )
    names = sorted({n.rpartition(":")[0] if n.endswith(f":{port}") else n for n in server.gate.hosts})
    return (
        f"dashboard: {first}\n"
        f"  listening on {as_host(address)}:{port} ({where}); {asked}\n"
        f"  answers the names {', '.join(names)} (--allow-host NAME adds one)"
    )


def serve(
    inv: Inventory,
    runs: Path,
    address: str,
    port: int,
    every: float,
    say: Any,
    token_file: str | None = None,
    allow: Iterable[str] = (),
) -> None:
    """fab dashboard: serve until Ctrl+C."""
    server, refresher = start(inv, runs, address, port, every, token_file, allow)
    hosts = len(inv.all_hosts)
    say(
        f"{start_message(server, address, token_file)}\n"
        f"  {hosts} host{'' if hosts == 1 else 's'}, looked at every {every:g}s; read-only; Ctrl+C ends it"
    )
    sys.stdout.flush()  # the address reaches a pipe (a script waiting for it) now, not at the end
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        refresher.stopping.set()
        server.server_close()
