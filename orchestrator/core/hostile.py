"""Everything a host or a container sends back is hostile input: the one place per kind of it.

Containers run code nobody here wrote, on servers several people share. What they send back is
handled here, and only here, before anything else looks at it:

- **names and paths** (checkpoint and snapshot paths, rank names, host and node names, job ids
  read back): `relpath` turns one into a safe relative path inside a directory, or refuses it
  (UnsafeName, with the reason); `component` does the same for a name that must be one path
  component;
- **text** (log lines, error text, a server's banner, docker's stderr, Slurm's fields): `text`
  removes everything a terminal obeys (ESC and so colours, clear-screen, OSC-8 links, OSC-52
  clipboard writes; the other C0 and the C1 controls; bidirectional overrides); the result is
  plain text, and the code that prints it never lets rich read it as markup (`rich_text`);
- **sizes**: a line with no newline is cut at LINE_MAX (`LineCutter`), a command's buffered
  output at OUTPUT_MAX (`Capped`), so a rank printing 1 GB costs bounded memory and linear CPU.

Time, the last kind, is bounded where commands run: remote.Command's deadline, and the attempt's
label swept after it (see attempt.py).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the core loads no terminal library: rich is imported where it is used
    from rich.text import Text

# ---------------------------------------------------------------- text

# C0 controls but tab and newline (ESC starts colours, clear-screen, titles, OSC-8 links and
# OSC-52 clipboard writes; CR and BS overwrite what is already shown), DEL, the C1 controls
# (U+0080-U+009F, which some terminals obey as CSI/OSC), and the bidirectional overrides and
# isolates, which make text read differently from what it is.
_CONTROL_TEXT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_C0_BYTES = bytes(c for c in range(32) if c not in (9, 10)) + b"\x7f"


def text(value: str) -> str:
    """Remote text made safe to print on a terminal (piped or not): control characters removed.
    Still text that rich could read as markup: print it with markup=False or as rich_text."""
    return _CONTROL_TEXT.sub("", value)


def line(value: str, limit: int = 300) -> str:
    """Remote text for one line of ours: `text`, newlines as ' | ', at most `limit` characters."""
    flat = " | ".join(part.strip() for part in text(value).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[:limit] + "...[cut]"


def text_bytes(data: bytes) -> bytes:
    """`text` for raw bytes on their way to a terminal (the per-host log files keep them). Bytes
    that are not UTF-8 become U+FFFD: a bare 0x9B is CSI to a terminal in 8-bit mode."""
    if data.isascii():  # the common case, at C speed
        return data.translate(None, _C0_BYTES)
    return text(data.decode("utf-8", "replace")).encode()


def rich_text(value: str, style: str = "") -> Text:
    """Remote text as a rich Text: shown as it is, never parsed as markup (`[/red]`, `[link=...]`)."""
    from rich.text import Text

    return Text(text(value), style=style)


# ---------------------------------------------------------------- names and paths


class UnsafeName(ValueError):
    """A remote-derived name that cannot be a path here; the message says why."""


NAME_MAX = 255  # bytes in one path component (Linux's NAME_MAX)
PATH_MAX = 4096  # bytes in a whole path
_CONTROL_NAME = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def relpath(name: str, root: Path | None = None) -> str:
    """A remote-derived name as a safe relative POSIX path ('a/b.pt'), or UnsafeName saying why:
    empty, absolute, with a '..' component, with control characters or newlines, or too long. With
    `root`, the path resolved under it (symbolic links followed) must stay inside it."""
    if not isinstance(name, str) or not name:
        raise UnsafeName("an empty name")
    if _CONTROL_NAME.search(name):
        raise UnsafeName(f"control characters or a newline in {name!r}")
    if name.startswith("/") or name.startswith("~"):
        raise UnsafeName(f"an absolute path {name!r}")
    if "\\" in name:
        raise UnsafeName(f"a backslash in {name!r}")
    if len(name.encode()) > PATH_MAX:
        raise UnsafeName(f"a path longer than {PATH_MAX} bytes")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts:
        raise UnsafeName(f"no file name in {name!r}")
    for p in parts:
        if p == "..":
            raise UnsafeName(f"'..' in {name!r}")
        if len(p.encode()) > NAME_MAX:
            raise UnsafeName(f"a component longer than {NAME_MAX} bytes in {name[:60]!r}...")
    clean = posixpath.join(*parts)
    if root is not None:
        base = Path(root).resolve()
        where = (base / clean).resolve()
        if where != base and base not in where.parents:
            raise UnsafeName(f"{name!r} leads out of {base} (through a symbolic link)")
    return clean


def component(name: str) -> str:
    """A remote-derived name that must be one path component (a host, node or rank name, a job
    id), or UnsafeName saying why."""
    clean = relpath(name)
    if "/" in clean or clean != name:
        raise UnsafeName(f"{name!r} is not a plain name (it holds '/' or '.' parts)")
    return clean


def refusal(host: str, what: str, name: str, why: UnsafeName) -> str:
    """The warning for a refused name, naming the host it came from (the name itself made safe)."""
    return f"{host}: ignored {what} {line(repr(name), 120)}: {why}; nothing was written for it"


# ---------------------------------------------------------------- sizes

LINE_MAX = 64 * 1024  # bytes of one line kept; the rest of it is dropped
CUT = b"...[cut]"
OUTPUT_MAX = 4 * 1024 * 1024  # bytes of one command's buffered stdout (and of its stderr) kept


class LineCutter:
    """Cuts every line of a byte stream at LINE_MAX bytes (then CUT, and the rest of that line
    dropped up to its newline), keeping only the current line's first LINE_MAX bytes in memory:
    a stream with no newline costs bounded memory and CPU linear in its size."""

    def __init__(self, limit: int = LINE_MAX) -> None:
        self.limit = limit
        self.length = 0  # bytes of the current line passed on so far
        self.cutting = False  # the current line went past the limit: drop up to its newline

    def feed(self, data: bytes) -> bytes:
        out = []
        start = 0
        while start < len(data):
            nl = data.find(b"\n", start)
            end = len(data) if nl < 0 else nl
            if not self.cutting:
                room = self.limit - self.length
                piece = data[start:end]
                if len(piece) > room:
                    out.append(piece[:room])
                    out.append(CUT)
                    self.cutting = True
                else:
                    out.append(piece)
                    self.length += len(piece)
            if nl < 0:
                break
            out.append(b"\n")
            self.length, self.cutting = 0, False
            start = nl + 1
        return b"".join(out)


class Capped:
    """A buffer that keeps the first `limit` bytes written to it and counts the rest."""

    def __init__(self, limit: int = OUTPUT_MAX) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.kept = 0
        self.dropped = 0

    def write(self, data: bytes) -> None:
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(data[:room])
            self.kept += min(room, len(data))
        self.dropped += max(0, len(data) - max(room, 0))

    def getvalue(self) -> bytes:
        out = b"".join(self.parts)
        return out + b"\n" + CUT + b" (%d more bytes)\n" % self.dropped if self.dropped else out
