"""What a job tells people as it goes: notifications, and runs/JOB/events.jsonl.

Notifications: of a job's events, those people act on (NOTICES) become one JSON object, given to
a command on its stdin (`--notify CMD`, job.notify) and POSTed to a URL (`--notify-url URL`,
job.notify_url), from wherever the job's control runs (this machine, or its controller). One
thread delivers them in order; each delivery has a deadline (NOTIFY_TIMEOUT) and is tried TRIES
times; a hook that fails or hangs is reported once as a warning and never stops the job. A payload
holds only the fields below, its texts sanitized and the job's secret values masked.

events.jsonl: every event of the job, one JSON object a line, as `fab train --json` prints them,
each with the file's schema version besides: `"v": 1` (EVENTS_VERSION). In every object, not in a
first line: readers read a long job's file from its tail (latest.tail_records), where a header
would be out of sight, and a file copied or cut in part still says its version on every line. An
object without `v` was written before the field existed and has version 1's shape.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.core.events import Reporter, Throttle

NOTIFY_TIMEOUT = 10.0  # seconds one delivery (the command, or the POST) may take
TRIES = 3  # attempts per delivery, BACKOFF s apart (doubling)
BACKOFF = 1.0
DRAIN = 3 * (NOTIFY_TIMEOUT + 2 * BACKOFF)  # the job's end waits at most this for undelivered ones

# The notification kinds (docs/detached.md).
NOTICES = ("started", "attempt_failed", "restarted", "hung", "finished", "failed", "stopped")
EVENTS_FILE = "events.jsonl"
# `v` in every object of events.jsonl and telemetry.jsonl; raised when a field's meaning changes.
EVENTS_VERSION = 1
TELEMETRY_FILE = "telemetry.jsonl"  # the `telemetry` events alone (not in events.jsonl)
TELEMETRY = frozenset({"telemetry"})


def check_url(url: str, where: str) -> str:
    """An http(s) URL, or UserError naming where it was given."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{where}: {hostile.text(url)!r} is not an http:// or https:// URL", exit_code=2)
    return url


def shown_url(url: str) -> str:
    """A URL as warnings name it: scheme and host only (a webhook's path often is its secret)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


class Notices:
    """Which events become notifications, and their payloads (pure: no delivery)."""

    def __init__(self, job: str, owner: str, started: bool = False, secrets: tuple[str, ...] = ()) -> None:
        self.job, self.owner = job, owner
        self.started = started  # a job taken over was started by another process
        self.secrets = tuple(s for s in secrets if len(s) >= 4)
        self.hosts: list[str] = []

    def of(self, event: str, f: dict[str, Any]) -> dict[str, Any] | None:
        kind, detail = None, ""
        if event == "attempt":
            self.hosts = list(f.get("hosts") or {})
        elif event == "stage" and f.get("stage") == "watch":
            kind = "restarted" if self.started else "started"
            self.started = True
        elif event == "attempt_end" and not f.get("ok"):
            kind, detail = "attempt_failed", str(f.get("outcome", ""))
        elif event == "controller_lost":
            kind, detail = "controller_lost", f"{f.get('host')}: {f.get('why')}"
        elif event == "controller_started":
            kind, detail = "controller_started", f"on {f.get('host')}, after {f.get('from_host')}"
        elif event == "hang":
            kind, detail = "hung", "\n".join(str(x) for x in f.get("ranks", ()))
        elif event == "finished":
            state = str(f.get("state", ""))
            kind = {"finished": "finished", "failed": "failed"}.get(state, "stopped")
            detail = "" if state in ("finished", "failed", "stopped") else state
        if kind is None:
            return None
        return {
            "event": kind,
            "job": self.job,
            "time": round(time.time(), 3),
            "owner": self.owner,
            "attempt": f.get("attempt", f.get("attempts")),
            "hosts": list(self.hosts),
            "detail": self.mask(hostile.text(detail)),
        }

    def mask(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return text


def run_hook(command: str, payload: bytes, timeout: float = NOTIFY_TIMEOUT) -> str | None:
    """The command with the payload on stdin: None when it exited 0, else why not."""
    try:
        r = subprocess.run(
            ["/bin/sh", "-c", command],
            input=payload,
            capture_output=True,
            timeout=timeout,
            env={**os.environ, "FABTRAIN_NOTIFY": "1"},
        )
    except subprocess.TimeoutExpired:
        return f"did not end within {timeout:g}s"
    except OSError as exc:
        return str(exc)
    if r.returncode == 0:
        return None
    return f"exit {r.returncode}: {hostile.line(r.stderr.decode(errors='replace').strip(), 200)}"


def post(url: str, payload: bytes, timeout: float = NOTIFY_TIMEOUT) -> str | None:
    """POST the payload as JSON: None on a 2xx answer, else why not."""
    req = urllib.request.Request(
        url,
        data=payload,
        method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "fabtrain"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http(s) only (check_url)
            return None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return hostile.line(str(getattr(exc, "reason", exc)), 200)


class Notifier(Reporter):
    """Delivers Notices of the events it is given, in order, from one thread (see the module)."""

    def __init__(
        self,
        notices: Notices,
        command: str | None,
        url: str | None,
        warn: Callable[[str], None],
        backoff: float = BACKOFF,
    ) -> None:
        self.notices, self.command, self.url, self.warn = notices, command, url, warn
        self.backoff = backoff
        self.queue: queue.Queue[dict | None] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.warned: set[str] = set()

    def emit(self, event: str, **fields) -> None:
        n = self.notices.of(event, fields)
        if n is None or not (self.command or self.url):
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self.deliver_all, daemon=True, name="notify")
            self.thread.start()
        self.queue.put(n)

    def deliver_all(self) -> None:
        while (n := self.queue.get()) is not None:
            payload = json.dumps(n).encode()
            if self.command:
                self.deliver("--notify", n["event"], functools.partial(run_hook, self.command, payload))
            if self.url:
                self.deliver(
                    f"--notify-url {shown_url(self.url)}",
                    n["event"],
                    functools.partial(post, self.url, payload),
                )

    def deliver(self, target: str, event: str, send: Callable[[], str | None]) -> None:
        why = None
        for i in range(TRIES):
            why = send()
            if why is None:
                return
            if i + 1 < TRIES:
                time.sleep(self.backoff * 2**i)
        if target not in self.warned:  # once per hook: a dead hook does not flood the job's output
            self.warned.add(target)
            self.warn(
                f"notification {event} not delivered by {target} after {TRIES} tries: {why}; the job goes on"
            )

    def close(self, within: float = DRAIN) -> None:
        """Deliver what is queued, waiting at most `within` seconds."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(within)


class EventLog(Reporter):
    """Every event appended to runs/JOB/events.jsonl (the file made at the first one), each object
    with `"v": EVENTS_VERSION`; with `only`, just those kinds (runs/JOB/telemetry.jsonl: the
    telemetry samples), else all but `skip`."""

    def __init__(
        self,
        path: Path,
        enabled: bool = True,
        only: frozenset[str] | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        self.path, self.enabled = path, enabled  # off: a dry run writes nothing
        self.only, self.skip = only, skip
        self.lock = threading.Lock()
        self.throttle = Throttle()  # progress as --json prints it: at most one a second per host

    def emit(self, event: str, **fields) -> None:
        if not self.enabled or event in self.skip or (self.only is not None and event not in self.only):
            return
        with self.lock:
            lines = [
                json.dumps({"event": kind, "time": round(stamp, 3), **f, "v": EVENTS_VERSION}, default=str)
                for kind, stamp, f in self.throttle.take(event, fields)
            ]
            if not lines:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as fh:
                fh.write("".join(line + "\n" for line in lines))


class Fanout(Reporter):
    """Every event to each of these reporters, in order."""

    def __init__(self, *reporters: Reporter) -> None:
        self.reporters = reporters

    def emit(self, event: str, **fields) -> None:
        for r in self.reporters:
            r.emit(event, **fields)
