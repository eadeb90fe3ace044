"""The dashboard's HTTP answers: the page's three files and the read-only JSON it polls, each with
HEADERS (a Content-Security-Policy that lets the page load only its own files and talk only to this
server, so a host's text can never become a script there). GET and HEAD only; the Gate
(gate.py) stands before every answer.
"""

from __future__ import annotations

from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from orchestrator.dashboard import views
from orchestrator.dashboard.cache import JobPages, Refresher
from orchestrator.dashboard.gate import Gate

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
JSON = "application/json"


class Answering(BaseHTTPRequestHandler):
    """How every answer is sent: HEADERS on each, an error as JSON to the page's fetches and as text
    to a person, and anything but GET and HEAD refused."""

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

    def read_only(self) -> None:
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Allow", "GET, HEAD")
        for k, v in HEADERS.items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = read_only  # http.server's names


def route(path: str, refresher: Refresher, pages: JobPages) -> tuple[bytes, str] | None:
    """The body and content type of the page at `path` (unquoted); None when there is no such page,
    views.NotFound when it names a job or plan there is none of."""
    if path in FILES:
        name, kind = FILES[path]
        return (STATIC / name).read_bytes(), kind
    if path == "/api/overview":
        return views.to_json(refresher.overview()), JSON
    if path == "/api/runs":
        return pages.runs_list(), JSON
    if path.startswith("/api/plan/"):
        return views.to_json(views.plan_page(pages.runs, path[10:])), JSON
    if path.startswith("/api/job/"):
        return pages.page(path[len("/api/job/") :]), JSON
    return None


def make_handler(refresher: Refresher, pages: JobPages, gate: Gate) -> type[BaseHTTPRequestHandler]:
    """The request handler: `gate` first, then the page, its files and the JSON."""

    class Handler(Answering):
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
                found = route(path, refresher, pages)
            except views.NotFound as exc:
                return self.refuse(HTTPStatus.NOT_FOUND, str(exc), head)
            if found is None:
                return self.refuse(HTTPStatus.NOT_FOUND, "no such page", head)
            return self.send(HTTPStatus.OK, *found, head)

        def do_GET(self) -> None:
            self.answer(head=False)

        def do_HEAD(self) -> None:
            self.answer(head=True)

    return Handler
