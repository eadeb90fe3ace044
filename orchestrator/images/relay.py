"""The relay that runs on each host of an image chain (imagechain): the script, its command and
control line, what it reports, and its one SSH command seen from this machine."""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass

from orchestrator.config.inventory import Host
from orchestrator.hostcmds import sshargs
from orchestrator.transport.remote import Session, describe


@dataclass(frozen=True)
class Report:
    """A relay's last line (None fields where the relay never said it)."""

    received: int
    load_exit: int | None
    load_error: str = ""
    next_error: str = ""
    source_error: str = ""


# Run as `python3 -c RELAY first|relay BIND_ADDRESS` on a host. Says `port N` (its listener; 0 for
# the first host, which reads the stream from stdin), then reads one JSON line on stdin: token,
# next [address, port] or null, size, stall, deadline, connect. It connects to the next host and
# says `linked` or `nolink WHY`, takes the stream (from stdin, or from the one upstream connection
# that sends the token), forwards each chunk and writes it to `docker load`, says `got N` about
# once a second, and ends with `result {json}`. A relay that is not first leaves as soon as its
# stdin closes: the orchestrator gave up on the round.
RELAY = r"""
import hmac, json, os, socket, subprocess, sys, threading, time
CHUNK = 1 << 20
def say(*words):
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()
first = sys.argv[1] == "first"
listener = None
if not first:
    listener = socket.socket()
    try:
        listener.bind((sys.argv[2], 0))
    except OSError:
        listener.bind(("", 0))
    listener.listen(4)
say("port", listener.getsockname()[1] if listener else 0)
ctl = json.loads(sys.stdin.buffer.readline())
token = ctl["token"].encode()
stall = ctl["stall"]
end = time.monotonic() + ctl["deadline"]
if not first:
    def leave_when_stdin_closes():
        sys.stdin.buffer.read()
        os._exit(3)
    threading.Thread(target=leave_when_stdin_closes, daemon=True).start()
nxt = None
if ctl["next"]:
    try:
        nxt = socket.create_connection((ctl["next"][0], ctl["next"][1]), timeout=ctl["connect"])
        nxt.settimeout(stall)
        nxt.sendall(token)
        say("linked")
    except OSError as exc:
        nxt = None
        say("nolink", exc)
report = {"received": 0, "load_exit": None, "load_error": "", "next_error": "", "source_error": ""}
def finish():
    say("result", json.dumps(report))
    sys.exit(0)
if first:
    read = lambda: sys.stdin.buffer.read1(CHUNK)
else:
    conn = None
    while conn is None:
        left = end - time.monotonic()
        if left <= 0:
            report["source_error"] = "no upstream connection with the token"
            finish()
        listener.settimeout(min(left, stall))
        try:
            conn, peer = listener.accept()
        except OSError as exc:
            report["source_error"] = "no upstream connection: %s" % exc
            finish()
        conn.settimeout(stall)
        got = b""
        try:
            while len(got) < len(token):
                part = conn.recv(len(token) - len(got))
                if not part:
                    break
                got += part
        except OSError:
            pass
        if not hmac.compare_digest(got, token):
            conn.close()
            conn = None
    listener.close()
    read = lambda: conn.recv(CHUNK)
load = None
last = time.monotonic()
while True:
    if time.monotonic() > end:
        report["source_error"] = "deadline passed"
        break
    try:
        data = read()
    except OSError as exc:
        report["source_error"] = "upstream: %s" % (exc or "stalled")
        break
    if not data:
        break
    report["received"] += len(data)
    if nxt is not None:
        try:
            nxt.sendall(data)
        except OSError as exc:
            report["next_error"] = str(exc) or "stalled"
            nxt.close()
            nxt = None
    if load is None and report["load_exit"] is None:
        load = subprocess.Popen(["docker", "load", "--quiet"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if load is not None:
        try:
            load.stdin.write(data)
        except OSError:
            report["load_exit"] = load.wait()
            report["load_error"] = load.stderr.read().decode(errors="replace")[-500:]
            load = None
    if time.monotonic() - last >= 1:
        last = time.monotonic()
        say("got", report["received"])
if nxt is not None:
    try:
        nxt.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    nxt.close()
if load is not None:
    if report["received"] == ctl["size"]:
        try:
            load.stdin.close()
            while load.poll() is None:
                if time.monotonic() > end:
                    raise subprocess.TimeoutExpired("docker load", ctl["deadline"])
                try:
                    load.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    say("loading")
            report["load_exit"] = load.returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            load.kill()
            report["load_exit"] = load.wait()
            report["load_error"] = "docker load: %s" % exc
        report["load_error"] = report["load_error"] or load.stderr.read().decode(errors="replace")[-500:]
    else:
        load.kill()
        load.wait()
finish()
"""


def relay_command(first: bool, bind: str) -> str:
    return sshargs.shell(["python3", "-c", RELAY, "first" if first else "relay", bind])


def control_line(
    token: str, next_hop: tuple[str, int] | None, size: int, stall: float, deadline: float, connect: float
) -> bytes:
    return (
        json.dumps(
            {
                "token": token,
                "next": list(next_hop) if next_hop else None,
                "size": size,
                "stall": stall,
                "deadline": deadline,
                "connect": connect,
            }
        )
        + "\n"
    ).encode()


class Relay:
    """One host's relay command and what it has said so far (read on a thread of its own)."""

    def __init__(self, session: Session, host: Host, first: bool, deadline: float) -> None:
        self.host = host
        self.cmd = session.command(host, relay_command(first, host.address), deadline, "image relay")
        self.events: queue.Queue = queue.Queue()
        self.port: int | None = None
        self.link: str | None = None  # "" linked, else why not
        self.report: Report | None = None
        self.error: str | None = None
        self.got = 0
        self.heard = time.monotonic()
        self.done = threading.Event()

    def start(self) -> None:
        try:
            self.cmd.__enter__()
        except BaseException as exc:  # noqa: BLE001 - this host fails, the round goes on without it
            self.error = describe(self.host, exc)
            self.done.set()
            return
        threading.Thread(target=self._read, daemon=True, name=f"relay-{self.host.name}").start()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                data = self.cmd.recv()
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._line(line.decode(errors="replace"))
        except Exception as exc:  # noqa: BLE001 - a closed or expired channel
            self.error = self.error or describe(self.host, exc)
        if self.report is None and self.error is None:
            err = b""
            try:
                while self.cmd.channel.recv_stderr_ready():
                    err += self.cmd.channel.recv_stderr(65536)
            except Exception:  # noqa: BLE001 - only for the message
                pass
            self.error = f"{self.host.name}: the image relay ended without a report" + (
                f": {err.decode(errors='replace').strip()[-300:]}" if err.strip() else ""
            )
        self.done.set()
        self.events.put("end")

    def _line(self, line: str) -> None:
        self.heard = time.monotonic()
        word, _, rest = line.partition(" ")
        if word == "port":
            self.port = int(rest)
        elif word == "linked":
            self.link = ""
        elif word == "nolink":
            self.link = rest or "connection failed"
        elif word == "got":
            self.got = int(rest)
        elif word == "result":
            self.report = Report(**json.loads(rest))
        self.events.put(word)

    def wait_for(self, attr: str, until: float) -> bool:
        while getattr(self, attr) is None and not self.done.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return False
            try:
                self.events.get(timeout=left)
            except queue.Empty:
                return False
        return getattr(self, attr) is not None

    def close(self) -> None:
        try:
            self.cmd.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - an expired deadline: already judged from what it said
            pass
