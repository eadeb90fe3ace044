"""A command's output, captured with bounded memory: a remote command's channel (drain) and a
local process's pipes (run_capped)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from io import BufferedReader

import paramiko

from orchestrator.core import hostile

# How long a finished command's output may still arrive before its EOF (see drain).
EOF_GRACE = 2.0


def run_capped(
    argv: list[str], timeout: float, on_output: Callable[[bytes], None] | None = None
) -> tuple[int | None, bytes, bytes]:
    """Run a local command, keeping at most OUTPUT_MAX bytes of each of its stdout and stderr:
    its exit status (None when it was killed at `timeout`), stdout, stderr. `on_output` sees every
    chunk of stdout as it comes (rsync's progress)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    bufs = (hostile.Capped(), hostile.Capped())

    def pump(pipe: BufferedReader, buf: hostile.Capped) -> None:
        with pipe:
            for chunk in iter(lambda: pipe.read1(1 << 16), b""):
                buf.write(chunk)
                if on_output is not None and buf is bufs[0]:
                    on_output(chunk)

    pumps = [
        threading.Thread(target=pump, args=(pipe, buf), daemon=True, name="local-output")
        for pipe, buf in zip((proc.stdout, proc.stderr), bufs, strict=True)
    ]
    for t in pumps:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        code: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    for t in pumps:  # a child (rsync's ssh) may hold the pipes a little longer
        t.join(max(5.0, deadline - time.monotonic()))
    return code, bufs[0].getvalue(), bufs[1].getvalue()


class _AlsoSets(threading.Event):
    """An event that sets another one with itself (the channel's exit status wakes drain)."""

    def __init__(self, other: threading.Event) -> None:
        super().__init__()
        self.other = other

    def set(self) -> None:
        super().set()
        self.other.set()


def drain(chan: paramiko.Channel) -> tuple[bytes, bytes]:
    """A command's stdout and stderr until it ends. The thread sleeps until data, EOF or a close
    (the deadline's) arrives: polling every few milliseconds, N waiting commands cost CPU in
    proportion to N times their duration, which itself grows with N on a loaded machine. Each of
    stdout and stderr keeps its first OUTPUT_MAX bytes (the rest is read and counted): a command
    printing 1 GB costs bounded memory."""
    out, err = hostile.Capped(), hostile.Capped()
    wake = threading.Event()  # set by paramiko when either buffer gets data or is closed
    chan.in_buffer.set_event(wake)
    chan.in_stderr_buffer.set_event(wake)
    old_status, chan.status_event = chan.status_event, _AlsoSets(wake)  # and when the exit status comes
    if old_status.is_set():  # it came before the swap
        chan.status_event.set()
    ended = 0.0  # when the exit status came
    while True:
        wake.clear()  # before looking, so that data arriving after the look wakes the wait below
        got = False
        if chan.recv_ready():
            out.write(chan.recv(1 << 16))
            got = True
        if chan.recv_stderr_ready():
            err.write(chan.recv_stderr(1 << 16))
            got = True
        if got:
            continue
        if chan.closed or chan.eof_received:
            break  # EOF comes after all the data
        wait = 1.0  # a safety net only: every change of the buffers sets `wake`
        if chan.exit_status_ready():
            # OpenSSH's sshd sends the exit status as the command ends, and then what is still in
            # its stdout pipe, then EOF: ending here lost a command's last lines under load. A
            # command whose background child keeps the pipe open sends no EOF: wait only so long.
            ended = ended or time.monotonic()
            wait = ended + EOF_GRACE - time.monotonic()
            if wait <= 0:
                break
        wake.wait(wait)
    while chan.recv_ready():
        out.write(chan.recv(1 << 16))
    while chan.recv_stderr_ready():
        err.write(chan.recv_stderr(1 << 16))
    return out.getvalue(), err.getvalue()
