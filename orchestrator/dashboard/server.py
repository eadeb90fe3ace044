"""The dashboard's web server: one page (static/) and the read-only JSON it polls.

One Refresher asks every host once per `every` seconds (top.ask: one command per host, over SSH
connections kept open) and keeps the overview it makes; every browser reads that copy, so the SSH
cost does not grow with the number of people looking. A job's page reads runs/JOB on this machine
(bounded tails), and is kept until one of the run's files changes.

GET and HEAD only: stopping a job stays a command. Every answer carries a Content-Security-Policy
that lets the page load only its own three files and talk only to this server, so a host's text
can never become a script there. A Gate stands before every page: a Host header that is not one of
this server's names is refused (a web page elsewhere cannot read the dashboard by pointing a name of
its own at its address, 0.0.0.0 included), and on any address but loopback a request without the
dashboard's token is refused (every job's logs are there).
"""
from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import re
import secrets
import shlex
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

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
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
HOST_NAME = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,255}")   # a name or address, with a port or without
TOKEN_BYTES = 32        # secrets.token_urlsafe(32): 256 random bits
TOKEN_MIN = 16          # characters of a --token-file token at least
TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~-]+")   # what a URL and a cookie carry as it is
URL_PATH = "/%:@!$&'()*+,;=-._~"                # what stays as it is in a redirect's path
ASK_TOKEN = (("WWW-Authenticate", 'Bearer realm="fabtrain dashboard"'),)
NEEDS_TOKEN = ("this dashboard asks for its token: open the URL that fab dashboard printed at its start "
               "(http://HOST:PORT/?token=...; with --token-file, the token is that file's first line) and "
               "the browser keeps it in a cookie; a script sends the header 'Authorization: Bearer TOKEN'")
WRONG_TOKEN = ("the token in this URL is not this dashboard's (it makes a new one at every start unless "
               "given --token-file): open the URL that fab dashboard printed at its latest start")


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


def own_names() -> set[str]:
    """This machine's names as a browser may write them in a Host header: its host name, its FQDN,
    the addresses they resolve to, and localhost's."""
    names = set(LOCAL_NAMES)
    for name in {socket.gethostname(), socket.getfqdn()}:
        names.add(name)
        try:
            found = socket.getaddrinfo(name, None)
        except (OSError, UnicodeError):
            continue  # a name that does not resolve is still answered by name
        names |= {str(info[4][0]) for info in found}
    return names


def _as_host(name: str) -> str:
    """A name as a Host header writes it: lower case, an IPv6 address in brackets (no zone)."""
    bare = name.partition("%")[0]
    try:
        if ipaddress.ip_address(bare).version == 6:
            return f"[{bare}]"
    except ValueError:
        pass
    return name.lower()


def answered_names(address: str, extra: Iterable[str] = ()) -> set[str]:
    """The names this server answers to: the address it listens on (on 0.0.0.0 or ::, every name of
    this machine: own_names), localhost's on a loopback address, and `extra` (--allow-host)."""
    ip = ipaddress.ip_address(address)
    names = own_names() if ip.is_unspecified else {address}
    if ip.is_loopback:
        names |= set(LOCAL_NAMES)
    return {_as_host(n) for n in names | set(extra)}


def allowed_hosts(address: str, port: int, extra: Iterable[str] = ()) -> set[str]:
    """The Host headers this server answers: answered_names, each with and without :port (a name
    given with a port of its own, as a proxy in front may send it, is kept as it is)."""
    out = set()
    for name in answered_names(address, extra):
        with_port = "]:" in name if name.startswith("[") else ":" in name
        out |= {name} if with_port else {name, f"{name}:{port}"}
    return out


def allow_list(values: Iterable[str]) -> tuple[str, ...]:
    """--allow-host's values (repeated, or separated by commas), each checked to be a host name or
    address, with a port or without."""
    names = [n for v in values for n in v.replace(",", " ").split()]
    for name in names:
        if not HOST_NAME.fullmatch(name):
            raise UserError(f"--allow-host {hostile.text(name)!r} is not a host name or address; give the "
                            "name the browser's URL has, such as dash.lab.example or 10.0.0.5 (with :PORT "
                            "if a proxy in front of the dashboard listens on another port)", exit_code=2)
    return tuple(names)


def read_token(path: Path) -> str:
    """The first line of --token-file's file; UserError naming the file when it is missing, not a
    regular file, empty, or not a token that a URL and a cookie carry as it is."""
    shown = hostile.text(str(path))
    where = f"--token-file {shown}"
    fix = (f"write a token of {TOKEN_MIN} or more letters, digits, '-', '_', '.' or '~' on its first line, "
           f"e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > {shlex.quote(shown)}")
    try:
        # O_NONBLOCK: a FIFO put there opens at once and is refused below instead of hanging the start
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UserError(f"{where}: no such file; {fix}", exit_code=2) from None
    except OSError as exc:
        raise UserError(f"{where}: cannot be opened ({exc.strerror}); give a file you can read", exit_code=2
                        ) from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        first = os.read(fd, 4096).split(b"\n", 1)[0].strip() if regular else b""
    except OSError as exc:
        raise UserError(f"{where}: cannot be read ({exc.strerror}); {fix}", exit_code=2) from None
    finally:
        os.close(fd)
    if not regular:
        raise UserError(f"{where} is not a regular file (a directory, a pipe or a device); give a file "
                        "whose first line is the token", exit_code=2)
    token = first.decode("ascii", "replace")
    if not token:
        raise UserError(f"{where} is empty (its first line holds no token); {fix}", exit_code=2)
    if len(token) < TOKEN_MIN or not TOKEN_CHARS.fullmatch(token):
        raise UserError(f"{where}: its first line is not a token of {TOKEN_MIN} or more letters, digits, "
                        f"'-', '_', '.' or '~' (it has {len(token)} characters); {fix}", exit_code=2)
    return token


def token_for(address: str, token_file: str | None) -> str | None:
    """The token the dashboard asks for: --token-file's; else none on a loopback address, a new random
    one on any other (0.0.0.0 and :: included: anyone on the network could read every job's logs)."""
    if token_file:
        return read_token(Path(token_file).expanduser())
    if ipaddress.ip_address(address).is_loopback:
        return None
    return secrets.token_urlsafe(TOKEN_BYTES)


@dataclass(frozen=True)
class Answer:
    """The gate's own answer to a request it does not pass on to the pages: a refusal, or the redirect
    that trades ?token= for a cookie."""
    status: HTTPStatus
    why: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Gate:
    """Which requests reach the pages: a Host header among `hosts` (a name of this server's: a web page
    elsewhere cannot read the dashboard by pointing a name of its own at its address), and, when
    `token` is set, the token: once as ?token= (answered with a cookie and a redirect to the same
    page without it, so it stays out of the history and of what the page sends on), then the cookie
    (the page's own fetches), or an Authorization: Bearer header (a script)."""
    hosts: frozenset[str]
    token: str | None = None
    cookie: str = "fabtrain_dashboard"   # a port's own name: a browser sends a host's cookies to every port

    def check(self, host: str, target: str, cookies: list[str], authorization: str = "") -> Answer | None:
        if host.lower() not in self.hosts:
            return Answer(HTTPStatus.MISDIRECTED_REQUEST,
                          f"Host {hostile.line(host, 100)!r} is not a name of this dashboard: open it by "
                          "a name it printed at its start, or start it with --allow-host NAME to answer "
                          "this one")
        if self.token is None:
            return None
        url = urlsplit(target)
        query = parse_qsl(url.query, keep_blank_values=True)
        given = [v for k, v in query if k == "token"]
        if given:
            if len(given) > 1 or not self.is_token(given[0]):
                return Answer(HTTPStatus.UNAUTHORIZED, WRONG_TOKEN, ASK_TOKEN)
            rest = urlencode([(k, v) for k, v in query if k != "token"])
            # one leading slash: '//name/' in a Location would send the browser to another server
            where = "/" + quote(url.path, safe=URL_PATH).lstrip("/") + (f"?{rest}" if rest else "")
            return Answer(HTTPStatus.SEE_OTHER, f"the token is kept in a cookie; on to {where}",
                          (("Location", where),
                           ("Set-Cookie", f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict")))
        scheme, _, bearer = authorization.strip().partition(" ")
        if self.in_cookies(cookies) or (scheme.lower() == "bearer" and self.is_token(bearer)):
            return None
        return Answer(HTTPStatus.UNAUTHORIZED, NEEDS_TOKEN, ASK_TOKEN)

    def is_token(self, value: str) -> bool:
        return self.token is not None and hmac.compare_digest(value.strip().encode(), self.token.encode())

    def in_cookies(self, headers: list[str]) -> bool:
        """Whether a request's Cookie headers hold this gate's cookie with the token (a stale one of an
        earlier start may be there too)."""
        pairs = (pair.strip().partition("=") for header in headers for pair in header.split(";"))
        return any(name == self.cookie and self.is_token(value) for name, _, value in pairs)


def make_handler(refresher: Refresher, pages: JobPages, gate: Gate) -> type[BaseHTTPRequestHandler]:
    """The request handler: `gate` first, then the page, its files and the JSON."""
    class Handler(BaseHTTPRequestHandler):
        server_version = "fabtrain-dashboard"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the terminal stays quiet: a browser polls every few seconds

        def send(self, status: HTTPStatus, body: bytes, kind: str, head: bool = False,
                 extra: tuple[tuple[str, str], ...] = ()) -> None:
            self.send_response(status)
            for k, v in (*HEADERS.items(), *extra):
                self.send_header(k, v)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def refuse(self, status: HTTPStatus, why: str, head: bool = False,
                   extra: tuple[tuple[str, str], ...] = ()) -> None:
            """JSON to the page's fetches (it shows `error`), plain text to a person at any other URL."""
            if urlsplit(self.path).path.startswith("/api/"):
                return self.send(status, views.to_json({"error": why}), "application/json", head, extra)
            return self.send(status, f"{why}\n".encode(), "text/plain; charset=utf-8", head, extra)

        def answer(self, head: bool) -> None:
            stop = gate.check(self.headers.get("Host", ""), self.path, self.headers.get_all("Cookie") or [],
                              self.headers.get("Authorization", ""))
            if stop is not None:
                return self.refuse(stop.status, stop.why, head, stop.headers)
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
    gate = Gate(frozenset())  # answers nobody until listen() knows the port it got

    def server_bind(self) -> None:
        # HTTPServer's own looks the address up in DNS (getfqdn) for a name nothing here reads: on
        # 0.0.0.0 with a slow resolver, seconds before the dashboard starts
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class Server6(Server):
    address_family = socket.AF_INET6


def listen(address: str, port: int, refresher: Refresher, pages: JobPages, token: str | None = None,
           allow: Iterable[str] = ()) -> Server:
    """A server listening on address:port (0: any free port), not yet serving, that answers only its
    own names and `allow`, and with `token` only requests carrying it; UserError naming --address or
    --port when it cannot listen there."""
    try:
        kind = Server6 if ":" in address else Server
        server = kind((address, port), make_handler(refresher, pages, Server.gate))
    except OSError as exc:
        why = ("it is in use (another dashboard?); pick another with --port"
               if exc.errno == errno.EADDRINUSE else f"{exc.strerror}; pick another --address or --port")
        raise UserError(f"the dashboard cannot listen on {address}:{port}: {why}", exit_code=2) from None
    bound = server.server_address[1]
    server.gate = Gate(frozenset(allowed_hosts(address, bound, allow)), token, f"fabtrain_dashboard_{bound}")
    server.RequestHandlerClass = make_handler(refresher, pages, server.gate)
    return server


def start(inv: Inventory, runs: Path, address: str, port: int, every: float = REFRESH,
          token_file: str | None = None, allow: Iterable[str] = ()) -> tuple[Server, Refresher]:
    """The server listening (not yet serving) and its refresher started; UserError naming --address,
    --port, --refresh, --token-file or --allow-host when one is wrong."""
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
        name, where = _as_host(address), ("this machine only" if ip.is_loopback else "this address only")
    url = f"http://{name}:{port}/"
    token = server.gate.token
    if token is None:
        first, asked = url, "no token asked (every account on this machine can read it; --token-file asks)"
    elif token_file:
        first = url
        asked = (f"a token is asked for: open {url}?token=TOKEN once, TOKEN being the first line of "
                 f"{hostile.text(token_file)}; the browser keeps it in a cookie")
    else:
        first = f"{url}?token={token}"
        asked = ("a token is asked for: open this URL once (a new token at every start); the browser "
                 "keeps it in a cookie")
    names = sorted({n.rpartition(":")[0] if n.endswith(f":{port}") else n for n in server.gate.hosts})
    return (f"dashboard: {first}\n"
            f"  listening on {_as_host(address)}:{port} ({where}); {asked}\n"
            f"  answers the names {', '.join(names)} (--allow-host NAME adds one)")


def serve(inv: Inventory, runs: Path, address: str, port: int, every: float, say: Any,
          token_file: str | None = None, allow: Iterable[str] = ()) -> None:
    """fab dashboard: serve until Ctrl+C."""
    server, refresher = start(inv, runs, address, port, every, token_file, allow)
    hosts = len(inv.all_hosts)
    say(f"{start_message(server, address, token_file)}\n"
        f"  {hosts} host{'' if hosts == 1 else 's'}, looked at every {every:g}s; read-only; Ctrl+C ends it")
    sys.stdout.flush()  # the address reaches a pipe (a script waiting for it) now, not at the end
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        refresher.stopping.set()
        server.server_close()
