"""Progress of copies and builds: one look for every bar (the image push's), and the same progress
as `transfer` events for `--json`.

A copy's progress comes from rsync's `--info=progress2` lines on its stdout (`parse_progress2`,
`RsyncProgress`), an image build's from docker's `Step N/M` lines (`parse_build_step`). Both are
read as hostile text: numbers bounded, a line with no end kept to its last LINE_KEEP bytes, never
an exception. A bar shows only on a terminal (`bar`: rich's `disable` when the console is not one),
so a piped or logged run prints nothing extra.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)

from orchestrator.core import hostile

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import ProgressColumn, TaskID

MAX_BYTES = 1 << 60  # no copy is bigger: a larger number read back is cut to this
LINE_KEEP = 256  # bytes of an unfinished progress line kept between chunks
_PROGRESS2 = re.compile(rb"^\s*(\d[\d,.' ]{0,40}?)\s+(\d{1,3})%")
_STEP = re.compile(rb"^Step (\d{1,6})/(\d{1,6}) : ?(.{0,200})")


def columns() -> tuple[str | ProgressColumn, ...]:
    """A byte copy's bar: what and where, the bar, bytes done of the total, speed (fab image.push's)."""
    return ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())


def step_columns() -> tuple[str | ProgressColumn, ...]:
    """A build's bar: what, the bar, steps done of all, the current step."""
    return ("{task.description}", BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[step]}"))


def bar(console: Console, *cols: str | ProgressColumn) -> Progress:
    """A transient Progress with these columns (default: `columns`) that shows nothing unless
    `console` is a terminal."""
    return Progress(*(cols or columns()), console=console, transient=True, disable=not console.is_terminal)


def parse_progress2(line: bytes) -> int | None:
    """Bytes done from one `rsync --info=progress2` line ('  1,234,567  45%  1.2MB/s  0:00:01 ...';
    the separator is the locale's), at most MAX_BYTES; None for any other line."""
    m = _PROGRESS2.match(line[:LINE_KEEP])
    if not m:
        return None
    digits = re.sub(rb"\D", b"", m.group(1))[:19]
    return min(int(digits), MAX_BYTES) if digits else None


def parse_build_step(line: bytes) -> tuple[int, int, str] | None:
    """(step, of, instruction) from docker build's 'Step 3/7 : RUN pip install ...' (the classic
    builder's), steps bounded by their total; None for any other line."""
    m = _STEP.match(line[:LINE_KEEP].strip())
    if not m:
        return None
    total = int(m.group(2))
    if total == 0:
        return None
    return min(int(m.group(1)), total), total, hostile.line(m.group(3).decode("utf-8", "replace"), 80)


class Lines:
    """Cuts a byte stream into lines at CR or LF (rsync redraws its progress with CR) and hands
    `on_line` each complete one; what is left of an unfinished line is kept to LINE_KEEP bytes."""

    def __init__(self, on_line: Callable[[bytes], None]) -> None:
        self.on_line = on_line
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        *done, rest = re.split(rb"[\r\n]", self.tail + chunk)
        self.tail = rest[-LINE_KEEP:]
        for line in done:
            self.on_line(line)


def transfer_fields(host: str, what: str, done: int, total: int) -> dict:
    """A `transfer` event's fields (core/events KINDS): bytes_done within 0..bytes_total."""
    total = max(0, min(int(total), MAX_BYTES))
    return {"host": host, "what": what, "bytes_done": max(0, min(int(done), total)), "bytes_total": total}


class Transfer:
    """One copy's progress, to a bar (when there is one) and as `transfer` events (when `emit`)."""

    def __init__(
        self, host: str, what: str, total: int, progress: Progress | None, emit: Callable[..., None] | None
    ) -> None:
        self.host, self.what, self.total = host, what, max(0, min(total, MAX_BYTES))
        self.progress, self.emit = progress, emit
        self.done = -1
        self.task: TaskID | None = (
            progress.add_task(f"{what} {host}", total=self.total or None) if progress is not None else None
        )
        self.lines = Lines(self._line)

    def _line(self, line: bytes) -> None:
        got = parse_progress2(line)
        if got is not None:
            self.update(got)

    def output(self, chunk: bytes) -> None:
        """rsync's stdout as it comes (Session.local's on_output)."""
        self.lines.feed(chunk)

    def update(self, done: int) -> None:
        done = max(0, min(done, self.total))
        if done == self.done:
            return
        self.done = done
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=done)
        if self.emit is not None:
            self.emit("transfer", **transfer_fields(self.host, self.what, done, self.total))

    def finish(self, ok: bool) -> None:
        """The copy ended: complete when `ok` (rsync sent nothing for files already there), and
        its bar removed."""
        if ok:
            self.update(self.total)
        if self.progress is not None and self.task is not None:
            self.progress.remove_task(self.task)
            self.task = None


class Transfers:
    """Makes a Transfer per copy, all on one bar display and one event stream (either may be None).
    Safe from several threads (one copy per host runs at once)."""

    def __init__(self, progress: Progress | None = None, emit: Callable[..., None] | None = None) -> None:
        self.progress, self.emit = progress, emit
        self.lock = threading.Lock()

    def start(self, host: str, what: str, total: int) -> Transfer:
        with self.lock:
            return Transfer(host, what, total, self.progress, self._emit if self.emit else None)

    def _emit(self, event: str, **fields: object) -> None:
        assert self.emit is not None
        with self.lock:
            self.emit(event, **fields)


def run_watched(
    argv: list[str], on_output: Callable[[bytes], None], env: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """Run a local command whose stdout is progress (rsync --info=progress2, docker build), handing
    each chunk to `on_output` as it comes: its exit status and its stderr (capped, hostile.Capped).
    No deadline of its own: rsync's --timeout ends a copy whose data stops moving."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    err = hostile.Capped()

    def read_stderr() -> None:
        for chunk in iter(lambda: os.read(err_fd, 1 << 16), b""):
            err.write(chunk)

    reader = threading.Thread(target=read_stderr, daemon=True, name="watched-stderr")
    reader.start()
    try:
        for chunk in iter(lambda: os.read(out_fd, 1 << 16), b""):
            on_output(chunk)
    finally:
        code = proc.wait()
        reader.join(10)
        proc.stdout.close()
        proc.stderr.close()
    return code, err.getvalue()
