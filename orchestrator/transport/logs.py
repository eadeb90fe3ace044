"""One output stream per host, multiplexed into the terminal with a stable prefix, and a full
log file per host on the local disk.

Bytes are written to the host's file as they arrive (nothing is lost if the terminal is slow or
gone); only complete lines go to the terminal, each whole, so lines of different hosts never mix.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from orchestrator.core import hostile

if TYPE_CHECKING:
    from rich.console import Console

COLOURS = (36, 33, 35, 32, 34, 31, 96, 93)  # cyan, yellow, magenta, green, blue, red, bright...


class LineObserver(Protocol):
    """What sees every host's complete lines (live.Board, or several observers at once)."""

    def observe(self, host: str, block: bytes) -> None: ...


class Multiplexer:
    """With a rich `console` (the live status view), lines go out through it, so that its live
    display stays below them; otherwise straight to `out` as bytes. A `board` (live.Board) sees
    every host's complete lines."""

    def __init__(
        self,
        run_dir: Path,
        out: BinaryIO | None = None,
        colour: bool | None = None,
        echo: bool = True,
        console: Console | None = None,
        board: LineObserver | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.console, self.board = console, board
        self.out = out if out is not None else sys.stdout.buffer
        if colour is None:
            colour = (
                console.is_terminal
                if console is not None
                else hasattr(self.out, "isatty") and self.out.isatty()
            ) and "NO_COLOR" not in os.environ
        self.colour = colour
        self.echo = echo
        self._lock = threading.Lock()
        run_dir.mkdir(parents=True, exist_ok=True)

    def sink(self, name: str, rank: int, width: int = 0) -> HostSink:
        name = hostile.component(name)  # it names a file in run_dir: never a path out of it
        label = f"{name} r{rank}".ljust(width)
        prefix = (
            f"\x1b[{COLOURS[rank % len(COLOURS)]}m{label} |\x1b[0m " if self.colour else f"{label} | "
        ).encode()
        return HostSink(self, self.run_dir / f"{name}.log", prefix, name)

    def write(self, data: bytes) -> None:
        with self._lock:
            try:
                if self.console is not None:
                    self.console.out(data.decode(errors="replace"), end="", highlight=False)
                else:
                    self.out.write(data)
                    self.out.flush()
            except (BrokenPipeError, ValueError):
                self.echo = False  # the terminal is gone; the log files still get everything

    def note(self, line: str) -> None:
        """A line of our own between the hosts' lines (not in any host's log)."""
        if self.echo:
            text = f"[fabtrain] {hostile.text(line)}"
            self.write((f"\x1b[1;31m{text}\x1b[0m\n" if self.colour else text + "\n").encode())


class HostSink:
    def __init__(
        self, mux: Multiplexer, path: Path, prefix: bytes, name: str = "", tail_lines: int = 20
    ) -> None:
        self.mux, self.path, self.prefix, self.name = mux, path, prefix, name
        self._file = path.open("ab")
        self._partial = b""
        self._cut = hostile.LineCutter()  # a line with no end costs bounded memory, here and in the file
        self.tail_lines = tail_lines
        self.tail: deque[bytes] = deque(maxlen=tail_lines)
        self._lock = threading.Lock()  # the follower and the hang watchdog both write here

    def feed(self, data: bytes) -> None:
        with self._lock:
            if not self._file.closed:
                self._feed(data)

    def _feed(self, data: bytes) -> None:
        data = self._cut.feed(data)
        if not data:
            return
        self._file.write(data)
        self._file.flush()
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        if not cut:
            return
        block = hostile.text_bytes(data[: cut - 1])  # complete lines, without the last newline
        self.tail.extend(block.rsplit(b"\n", self.tail_lines)[-self.tail_lines :])
        if self.mux.board is not None:
            self.mux.board.observe(self.name, block)
        if self.mux.echo:
            # One C-level replace per chunk instead of a Python loop per line: the prefix is what
            # costs most when a host prints fast.
            p = self.prefix
            self.mux.write(p + block.replace(b"\n", b"\n" + p) + b"\n")

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._partial:
            partial = hostile.text_bytes(self._partial)
            self.tail.append(partial)
            if self.mux.echo:
                self.mux.write(self.prefix + partial + b"\n")
            self._partial = b""
        self._file.close()

    def last_lines(self) -> str:
        return "\n".join(line.decode(errors="replace") for line in self.tail)


def missing_output(received_total: int, received_tail: bytes, tail: bytes, tail_bytes: int) -> bytes | None:
    """What a stream missed, given the last bytes it received and the log's last `tail_bytes`
    bytes; None when that cannot be told from the tail (then read the log again from an offset).

    If the tail holds fewer bytes than asked, it is the whole log. Otherwise the received bytes'
    end must be found exactly once in the tail; several matches (repeated output) are ambiguous.
    """
    if len(tail) < tail_bytes:
        return tail[received_total:] if received_total <= len(tail) else b""
    if not received_tail:
        return None
    first = tail.find(received_tail)
    if first < 0 or tail.find(received_tail, first + 1) >= 0:
        return None
    return tail[first + len(received_tail) :]
