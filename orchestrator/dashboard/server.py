"""The dashboard's web server: one page (static/) and the read-only JSON it polls.

One Refresher asks every host once per `every` seconds (top.ask: one command per host, over SSH
connections kept open) and keeps the overview it makes; every browser reads that copy, so the SSH
cost does not grow with the number of people looking. A job's page reads runs/JOB on this machine
(bounded tails), and is kept until one of the run's files changes.

GET and HEAD only: stopping a job stays a command. Every answer carries a Content-Security-Policy
that lets the page load only its own three files and talk only to this server, so a host's text
can never become a script there. A Gate (gate.py) stands before every page: a Host header that is
not one of this server's names is refused (a web page elsewhere cannot read the dashboard by
pointing a name of its own at its address, 0.0.0.0 included), and on any address but loopback a
request without the dashboard's token is refused (every job's logs are there).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
import threading
import time
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.dashboard import views
from orchestrator.dashboard.gate import Gate, allow_list, allowed_hosts, as_host, token_for
from orchestrator.progress import latest, report, top
from orchestrator.transport.remote import Result, Session

REFRESH = 5.0  # seconds between two looks at the hosts
RUNS_TTL = 30.0  # seconds the list of past runs is kept (it reads every run's record)
STATIC = Path(__file__).resolve().parent / "static"
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Resource-Policy": "same-origin",
}


class CountingSession(Session):
    """A Session that counts the commands it runs (the dashboard shows its own SSH cost)."""

    def __init__(self, hosts: tuple[Host, ...]) -> None:
        super().__init__(hosts)
        self.commands = 0
        self._count = threading.Lock()

    def run(
        self, host: Host, command: str, timeout: float = 60, stdin: bytes | None = None, what: str = ""
    ) -> Result:
        with self._count:
            self.commands += 1
        return super().run(host, command, timeout, stdin, what)


class Refresher(threading.Thread):
    """Looks at the hosts every `every` seconds and keeps the newest overview (views.overview)."""

    def __init__(self, inv: Inventory, runs: Path, every: float = REFRESH) -> None:
        super().__init__(name="dashboard-refresher", daemon=True)
        self.inv, self.runs, self.every = inv, runs, every
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.doc: dict[str, Any] = {
            "time": None,
            "hosts": [],
            "jobs": [],
            "queue": [],
            "errors": [],
            "loading": True,
        }
        self.commands = 0
        self.refreshes = 0
        self.started = time.time()

    def local_figures(self, job_ids: list[str]) -> dict[str, dict[str, Any]]:
        """job -> its newest loss and tokens/s, for the jobs whose run is on this machine."""
        out = {}
        for job in job_ids:
            try:
                where = views.run_dir(self.runs, job)
            except views.NotFound:
                continue
            out[job] = views.figures(latest.latest(where, views.OVERVIEW_TAIL))
        return out

    def refresh(
        self, session: CountingSession, before: dict[str, tuple[float, int]]
    ) -> dict[str, tuple[float, int]]:
        started = time.monotonic()
        answers = top.ask(session, self.inv)
        found, _ = top.surveyed(answers)
        local = self.local_figures(sorted({j for hj in found.values_ok() for j in _jobs_of(hj)}))
        doc = views.overview(self.inv, answers, time.time(), before, local)
        doc["refresh"] = {"every": self.every, "took": round(time.monotonic() - started, 3)}
        with self.lock:
            self.refreshes += 1
            self.commands = session.commands
            self.doc = doc
        return top.readings(doc)

    def run(self) -> None:
        before: dict[str, tuple[float, int]] = {}
        session = CountingSession(self.inv.all_hosts)
        try:
            while not self.stopping.is_set():
                started = time.monotonic()
                try:
                    before = self.refresh(session, before)
                except Exception as exc:  # noqa: BLE001 - the page says what went wrong; the next look retries
                    with self.lock:
                        self.doc = {
                            **self.doc,
                            "errors": [f"the last look at the hosts failed: {hostile.line(str(exc), 300)}"],
                        }
                self.stopping.wait(max(0.5, self.every - (time.monotonic() - started)))
        finally:
            session.close()

    def overview(self) -> dict[str, Any]:
        with self.lock:
            return {
                **self.doc,
                "cost": {
                    "ssh_commands": self.commands,
                    "refreshes": self.refreshes,
                    "seconds": round(time.time() - self.started, 1),
                },
            }


def _jobs_of(hj: Any) -> set[str]:
    """Every job a host's survey names (claims, containers, runtime directories, its queue)."""
    return {*hj.containers, *hj.runtime, *(c.job for c in hj.claimed), *(w.job for w in hj.queued)}


class JobPages:
    """views.job_page, kept per job until a file of runs/JOB changes (several browsers, one read)."""

    def __init__(self, runs: Path) -> None:
        self.runs = runs
        self.lock = threading.Lock()
        self.kept: dict[str, tuple[tuple, bytes]] = {}
        self.past: tuple[float, bytes] | None = None

    def signature(self, job: str) -> tuple:
        where = views.run_dir(self.runs, job)
        out = []
        for p in sorted(where.iterdir())[:1000]:
            try:
                st = p.lstat()
            except OSError:
                continue
            out.append((p.name, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def page(self, job: str) -> bytes:
        sig = self.signature(job)
        with self.lock:
            kept = self.kept.get(job)
        if kept and kept[0] == sig:
            return kept[1]
        body = views.to_json(views.job_page(self.runs, job))
        with self.lock:
            if len(self.kept) > 256:
                self.kept.clear()
            self.kept[job] = (sig, body)
        return body

    def runs_list(self) -> bytes:
        with self.lock:
            if self.past and time.monotonic() - self.past[0] < RUNS_TTL:
                return self.past[1]
        body = views.to_json(views.clean({"runs": report.runs(self.runs)[:200]}))
        with self.lock:
            self.past = (time.monotonic(), body)
        return body


def make_handler(refresher: Refresher, pages: JobPages, gate: Gate) -> type[BaseHTTPRequestHandler]:
    """The request handler: `gate` first, then the page, its files and the JSON."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "fabtrain-dashboard"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the terminal stays quiet: a browser polls every few seconds

        def send(
            self,
            status: HTTPStatus,
            body: bytes,
            kind: str,
            head: bool = False,
            extra: tuple[tuple[str, str], ...] = (),
        ) -> None:
            self.send_response(status)
            for k, v in (*HEADERS.items(), *extra):
                self.send_header(k, v)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def refuse(
            self, status: HTTPStatus, why: str, head: bool = False, extra: tuple[tuple[str, str], ...] = ()
        ) -> None:
            """JSON to the page's fetches (it shows `error`), plain text to a person at any other URL."""
            if urlsplit(self.path).path.startswith("/api/"):
                return self.send(status, views.to_json({"error": why}), "application/json", head, extra)
            return self.send(status, f"{why}\n".encode(), "text/plain; charset=utf-8", head, extra)

        def answer(self, head: bool) -> None:
            stop = gate.check(
                self.headers.get("Host", ""),
                self.path,
                self.headers.get_all("Cookie") or [],
                self.headers.get("Authorization", ""),
            )
            if stop is not None:
                return self.refuse(stop.status, stop.why, head, stop.headers)
            path = unquote(urlsplit(self.path).path)
            try:
                if path in FILES:
                    name, kind = FILES[path]
                    return self.send(HTTPStatus.OK, (STATIC / name).read_bytes(), kind, head)
                if path == "/api/overview":
                    return self.send(
                        HTTPStatus.OK, views.to_json(refresher.overview()), "application/json", head
                    )
                if path == "/api/runs":
                    return self.send(HTTPStatus.OK, pages.runs_list(), "application/json", head)
                if path.startswith("/api/plan/"):
                    return self.send(
                        HTTPStatus.OK,
                        views.to_json(views.plan_page(pages.runs, path[10:])),
                        "application/json",
                        head,
                    )
                if path.startswith("/api/job/"):
                    return self.send(
                        HTTPStatus.OK, pages.page(path[len("/api/job/") :]), "application/json", head
                    )
            except views.NotFound as exc:
                return self.refuse(HTTPStatus.NOT_FOUND, str(exc), head)
            return self.refuse(HTTPStatus.NOT_FOUND, "no such page", head)

        def do_GET(self) -> None:
            self.answer(head=False)

        def do_HEAD(self) -> None:
            self.answer(head=True)

        def read_only(self) -> None:
            self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
            self.send_header("Allow", "GET, HEAD")
            for k, v in HEADERS.items():
                self.send_header(k, v)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = read_only  # http.server's names

    return Handler


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
