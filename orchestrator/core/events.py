"""What happens to a job, as events, and who hears them: the terminal or a JSON-lines stream.

The lifecycle (job.py) and the watcher (watch.py) never print; they call `Reporter.emit(event,
**fields)`. `Terminal` turns events into the lines a person reads; `JsonLines` writes one JSON
object a line (`fab train --json`) for scripts: every object has `event` and `time` (Unix
seconds), and the fields listed in KINDS.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TYPE_CHECKING, TextIO

from orchestrator.core import hostile

if TYPE_CHECKING:  # the core loads no terminal library
    from collections.abc import Callable

    from rich.console import Console

# Every event kind and its fields (docs/how-train-works.md: Events for scripts).
KINDS = {
    "stage": "job, attempt, stage (plan, claim, sync+preflight, snapshot, start, watch, teardown, decide, "
    "finish)",
    "attempt": "job, attempt, hosts ({host: node rank}), port, snapshot, run_dir",
    "note": "job, level (info, warning, error), text",
    "host_failed": "job, attempt, host, kind (exited, failed to start, hung, lost, engine stuck, failed "
    "preflight), detail",
    "progress": "job, attempt, host, step (the newest step a node reported; at most one a second per host), "
    "ranks (each of its ranks' newest step line: rank, step, loss, tokens_per_s, step_ms, "
    "compute_ms)",
    "telemetry": "job, attempt, host, sample (its GPUs, the job's containers, load and memory: docs: "
    "Metrics and telemetry)",
    "hang": "job, attempt, ranks (one line per rank: where it is)",
    "attempt_end": "job, attempt, ok, outcome (one line)",
    "decision": "job, attempt, next (true: another attempt follows), reason, notes",
    "queued": "job, position (1: next in line), waits (per host, what it waits for)",
    "finished": "job, state (finished, failed, stopped, interrupted), attempts, run_dir",
    "controller_lost": "job, host (where the detached job's controller ran), why, seconds (since its last "
    "heartbeat)",
    "controller_started": "job, host (where its standby took the job over), from_host, seconds (from the "
    "loss seen to the new controller following the job)",
    "transfer": "job, host, what (code sync, snapshot push, snapshot fetch), bytes_done, bytes_total "
    "(at most one a second per host and what; the last has bytes_done == bytes_total when it "
    "completed)",
}
# Kinds that come often: at most one a second per host (and `what`), the newest never lost (Throttle).
THROTTLED = ("progress", "transfer")


class Reporter:
    """Events go nowhere (a job run quietly, such as the preflight's smoke test)."""

    def emit(self, event: str, **fields) -> None:
        pass


class Terminal(Reporter):
    """Events as lines for a person, through a rich console."""

    STYLE = {"warning": "yellow", "error": "red"}

    def __init__(self, console: Console) -> None:
        self.console = console

    def emit(self, event: str, **f) -> None:
        kind = event
        text = self.line(kind, f)
        if text is None:
            return
        style = self.STYLE.get(f.get("level", ""), "yellow" if kind in ("host_failed", "decision") else "")
        if kind == "hang":
            style = "red"
        # The whole line as plain text: host-derived fields can never be read as markup.
        self.console.print(hostile.rich_text(text, style), highlight=False)

    @staticmethod
    def line(kind: str, f: dict) -> str | None:
        if kind == "attempt":
            hosts = f["hosts"]
            rank0 = next(h for h, r in hosts.items() if r == 0)
            return (
                f"job {f['job']} attempt {f['attempt']}: starting {len(hosts)} node(s), rank 0 on {rank0} "
                f"(port {f['port']})"
                + (f", from snapshot {f['snapshot']}" if f.get("snapshot") else "")
                + f"; logs in {f['run_dir']}"
            )
        if kind == "note":
            return hostile.text(f["text"])
        if kind == "host_failed":
            return f"{f['host']} {f['kind']}: {hostile.text(f['detail'])}" if f.get("detail") else None
        if kind == "hang":
            return "hang watchdog: no progress; where each rank is:\n  " + "\n  ".join(
                hostile.text(s) for s in f["ranks"]
            )
        if kind == "controller_lost":
            return f"job {f['job']}: its controller on {f['host']} is lost ({hostile.text(f['why'])})"
        if kind == "controller_started":
            return (
                f"job {f['job']}: its controller now runs on {f['host']} (took over from "
                f"{f['from_host']} in {f['seconds']}s)"
            )
        if kind == "decision" and f["next"]:
            return f"job {f['job']}: {hostile.text(f['reason'])}"
        return None  # stages, progress and the end are shown by the log lines and the final message


class Throttle:
    """At most one `progress` (or `transfer`: THROTTLED) event a second per host (and `what`), the
    newest never lost: one that comes too soon is held (a newer one of its host replaces it) and let
    out before the next event of another kind, or with the host's next one a second later. `take`
    gives the events to write now, in order, each as (event, time, fields)."""

    EVERY = 1.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last: dict[str, float] = {}
        self.held: dict[str, tuple[str, float, dict]] = {}

    def take(self, event: str, fields: dict) -> list[tuple[str, float, dict]]:
        now, stamp = self.clock(), time.time()
        if event not in THROTTLED:
            out = list(self.held.values())
            self.held.clear()
            return [*out, (event, stamp, fields)]
        host = str(fields.get("host", ""))
        if event != "progress":
            host = f"{event}\0{host}\0{fields.get('what', '')}"
        done = event == "transfer" and fields.get("bytes_done") == fields.get("bytes_total")
        if now - self.last.get(host, -self.EVERY) < self.EVERY and not done:  # a finished copy: at once
            self.held[host] = (event, stamp, fields)
            return []
        self.last[host] = now
        self.held.pop(host, None)
        return [(event, stamp, fields)]


class JsonLines(Reporter):
    """One JSON object a line on `out` (stdout by default), flushed at once; progress throttled
    (Throttle)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.lock = threading.Lock()
        self.throttle = Throttle()

    def emit(self, event: str, **fields) -> None:
        with self.lock:
            for kind, stamp, f in self.throttle.take(event, fields):
                self.out.write(json.dumps({"event": kind, "time": round(stamp, 3), **f}, default=str) + "\n")
            self.out.flush()
