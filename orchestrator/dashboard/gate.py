"""Who may read the dashboard: the Host names it answers (a web page elsewhere cannot read it by
pointing a name of its own at its address: DNS rebinding) and, off loopback, its token, traded once
for a cookie. Pure but for own_names (this machine's names) and read_token (--token-file)."""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import secrets
import shlex
import socket
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from orchestrator.core import hostile
from orchestrator.core.errors import UserError

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
HOST_NAME = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,255}")  # a name or address, with a port or without
TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 256 random bits
TOKEN_MIN = 16  # characters of a --token-file token at least
TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~-]+")  # what a URL and a cookie carry as it is
URL_PATH = "/%:@!$&'()*+,;=-._~"  # what stays as it is in a redirect's path
ASK_TOKEN = (("WWW-Authenticate", 'Bearer realm="fabtrain dashboard"'),)
NEEDS_TOKEN = (
    "this dashboard asks for its token: open the URL that fab dashboard printed at its start "
    "(http://HOST:PORT/?token=...; with --token-file, the token is that file's first line) and "
    "the browser keeps it in a cookie; a script sends the header 'Authorization: Bearer TOKEN'"
)
WRONG_TOKEN = (
    "the token in this URL is not this dashboard's (it makes a new one at every start unless "
    "given --token-file): open the URL that fab dashboard printed at its latest start"
)


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


def as_host(name: str) -> str:
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
    return {as_host(n) for n in names | set(extra)}


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
            raise UserError(
                f"--allow-host {hostile.text(name)!r} is not a host name or address; give the "
                "name the browser's URL has, such as dash.lab.example or 10.0.0.5 (with :PORT "
                "if a proxy in front of the dashboard listens on another port)",
                exit_code=2,
            )
    return tuple(names)


def read_token(path: Path) -> str:
    """The first line of --token-file's file; UserError naming the file when it is missing, not a
    regular file, empty, or not a token that a URL and a cookie carry as it is."""
    shown = hostile.text(str(path))
    where = f"--token-file {shown}"
    fix = (
        f"write a token of {TOKEN_MIN} or more letters, digits, '-', '_', '.' or '~' on its first line, "
        f"e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > {shlex.quote(shown)}"
    )
    try:
        # O_NONBLOCK: a FIFO put there opens at once and is refused below instead of hanging the start
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UserError(f"{where}: no such file; {fix}", exit_code=2) from None
    except OSError as exc:
        raise UserError(
            f"{where}: cannot be opened ({exc.strerror}); give a file you can read", exit_code=2
        ) from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        first = os.read(fd, 4096).split(b"\n", 1)[0].strip() if regular else b""
    except OSError as exc:
        raise UserError(f"{where}: cannot be read ({exc.strerror}); {fix}", exit_code=2) from None
    finally:
        os.close(fd)
    if not regular:
        raise UserError(
            f"{where} is not a regular file (a directory, a pipe or a device); give a file "
            "whose first line is the token",
            exit_code=2,
        )
    token = first.decode("ascii", "replace")
    if not token:
        raise UserError(f"{where} is empty (its first line holds no token); {fix}", exit_code=2)
    if len(token) < TOKEN_MIN or not TOKEN_CHARS.fullmatch(token):
        raise UserError(
            f"{where}: its first line is not a token of {TOKEN_MIN} or more letters, digits, "
            f"'-', '_', '.' or '~' (it has {len(token)} characters); {fix}",
            exit_code=2,
        )
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
    cookie: str = "fabtrain_dashboard"  # a port's own name: a browser sends a host's cookies to every port

    def check(self, host: str, target: str, cookies: list[str], authorization: str = "") -> Answer | None:
        if host.lower() not in self.hosts:
            return Answer(
                HTTPStatus.MISDIRECTED_REQUEST,
                f"Host {hostile.line(host, 100)!r} is not a name of this dashboard: open it by "
                "a name it printed at its start, or start it with --allow-host NAME to answer "
                "this one",
            )
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
            return Answer(
                HTTPStatus.SEE_OTHER,
                f"the token is kept in a cookie; on to {where}",
                (
                    ("Location", where),
                    ("Set-Cookie", f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict"),
                ),
            )
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
