"""The dashboard's web server: one page (static/) and the read-only JSON it polls.

One Refresher asks every host once per `every` seconds (top.ask: one command per host, over SSH
connections kept open) and keeps the overview it makes; every browser reads that copy, so the SSH
cost does not grow with the number of people looking. A job's page reads runs/JOB on this machine
(bounded tails), and is kept until one of the run's files changes.

GET and HEAD only: stopping a job stays a command. Every answer carries a Content-Security-Policy
that lets the page load only its own three files and talk only to this server, so a host's text
can never become a script there, and a Host header that is not this server's is refused (a web
page elsewhere cannot read the dashboard by pointing a name of its own at 127.0.0.1).
"""
from __future__ import annotations

import errno
import ipaddress
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.dashboard import views
from orchestrator.progress import latest, report, top
from orchestrator.transport.remote import Result, Session

REFRESH = 5.0          # seconds between two looks at the hosts
RUNS_TTL = 30.0        # seconds the list of past runs is kept (it reads every run's record)
STATIC = Path(__file__).resolve().parent / "static"
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/style.css": ("style.css", "text/css; charset=utf-8")}
HEADERS = {
    "Content-Security-Policy": ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
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

    def run(self, host: Host, command: str, timeout: float = 60, stdin: bytes | None = None,
            what: str = "") -> Result:
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
        self.doc: dict[str, Any] = {"time": None, "hosts": [], "jobs": [], "queue": [], "errors": [],
                                    "loading": True}
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

    def refresh(self, session: CountingSession, before: dict[str, tuple[float, int]]
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
                        self.doc = {**self.doc, "errors": [f"the last look at the hosts failed: "
                                                           f"{hostile.line(str(exc), 300)}"]}
                self.stopping.wait(max(0.5, self.every - (time.monotonic() - started)))
        finally:
            session.close()

    def overview(self) -> dict[str, Any]:
        with self.lock:
            return {**self.doc, "cost": {"ssh_commands": self.commands, "refreshes": self.refreshes,
                                         "seconds": round(time.time() - self.started, 1)}}


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


def allowed_hosts(address: str, port: int) -> set[str] | None:
    """The Host headers this server answers (None: any, when it listens on every address)."""
    if address in ("0.0.0.0", "::", ""):
        return None
    names = {address, f"[{address}]"} if ":" in address else {address}
    if ipaddress.ip_address(address).is_loopback:
        names |= {"localhost", "127.0.0.1", "[::1]"}
    return {n for name in names for n in (name, f"{name}:{port}")}


def make_handler(refresher: Refresher, pages: JobPages, hosts: set[str] | None
                 ) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "fabtrain-dashboard"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the terminal stays quiet: a browser polls every few seconds

        def send(self, status: HTTPStatus, body: bytes, kind: str, head: bool = False) -> None:
            self.send_response(status)
            for k, v in HEADERS.items():
                self.send_header(k, v)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def refuse(self, status: HTTPStatus, why: str, head: bool = False) -> None:
            self.send(status, views.to_json({"error": why}), "application/json", head)

        def answer(self, head: bool) -> None:
            if hosts is not None and self.headers.get("Host", "") not in hosts:
                return self.refuse(HTTPStatus.MISDIRECTED_REQUEST, "not this server's name", head)
            path = unquote(urlsplit(self.path).path)
            try:
                if path in FILES:
                    name, kind = FILES[path]
                    return self.send(HTTPStatus.OK, (STATIC / name).read_bytes(), kind, head)
                if path == "/api/overview":
                    return self.send(HTTPStatus.OK, views.to_json(refresher.overview()), "application/json",
                                     head)
                if path == "/api/runs":
                    return self.send(HTTPStatus.OK, pages.runs_list(), "application/json", head)
                if path.startswith("/api/plan/"):
                    return self.send(HTTPStatus.OK, views.to_json(views.plan_page(pages.runs, path[10:])),
                                     "application/json", head)
                if path.startswith("/api/job/"):
                    return self.send(HTTPStatus.OK, pages.page(path[len("/api/job/"):]), "application/json",
                                     head)
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
    daemon_threads = True   # a browser that keeps a connection open never holds up the end
    allow_reuse_address = True


class Server6(Server):
    address_family = socket.AF_INET6


def start(inv: Inventory, runs: Path, address: str, port: int, every: float = REFRESH
          ) -> tuple[Server, Refresher]:
    """The server listening (not yet serving) and its refresher started; UserError naming --address
    or --port when it cannot listen there."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise UserError(f"--address {hostile.text(address)!r} is not an IP address; give one such as "
                        "127.0.0.1 (this machine only, the default) or 0.0.0.0 (every address)",
                        exit_code=2) from None
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port; give one from 1 to 65535", exit_code=2)
    if every <= 0:
        raise UserError(f"--refresh {every:g} must be a number of seconds above 0 (default {REFRESH:g})",
                        exit_code=2)
    refresher = Refresher(inv, runs, every)
    pages = JobPages(runs)
    try:
        kind = Server6 if ":" in address else Server
        server = kind((address, port), make_handler(refresher, pages, None))
    except OSError as exc:
        why = ("it is in use (another dashboard?); pick another with --port"
               if exc.errno == errno.EADDRINUSE else f"{exc.strerror}; pick another --address or --port")
        raise UserError(f"the dashboard cannot listen on {address}:{port}: {why}", exit_code=2) from None
    bound = server.server_address[1]
    server.RequestHandlerClass = make_handler(refresher, pages, allowed_hosts(address, bound))
    refresher.start()
    return server, refresher


def serve(inv: Inventory, runs: Path, address: str, port: int, every: float, say: Any) -> None:
    """fab dashboard: serve until Ctrl+C."""
    server, refresher = start(inv, runs, address, port, every)
    host = f"[{address}]" if ":" in address else address
    say(f"dashboard: http://{host}:{server.server_address[1]}/ ({len(inv.all_hosts)} hosts, looked at every "
        f"{every:g}s; read-only; Ctrl+C ends it)")
    sys.stdout.flush()  # the address reaches a pipe (a script waiting for it) now, not at the end
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        refresher.stopping.set()
        server.server_close()
