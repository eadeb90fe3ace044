"""What every browser of the dashboard reads, made once and kept: the hosts' overview and each
job's page (server.py serves them; handler.py answers with them).

One Refresher asks every host once per `every` seconds (top.ask: one command per host, over SSH
connections kept open) and keeps the overview it makes; every browser reads that copy, so the SSH
cost does not grow with the number of people looking. A job's page reads runs/JOB on this machine
(bounded tails), and is kept until one of the run's files changes (JobPages).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile
from orchestrator.dashboard import views
from orchestrator.progress import latest, report, top
from orchestrator.transport.remote import Result, Session

REFRESH = 5.0  # seconds between two looks at the hosts
RUNS_TTL = 30.0  # seconds the list of past runs is kept (it reads every run's record)


class CountingSession(Session):
    """A Session that counts the commands it runs (the dashboard shows its own SSH cost)."""

    def __init__(self, hosts: tuple[Host, ...]) -> None:
        super().__init__(hosts)
        self.commands = 0
        self._count = threading.Lock()

    def run(
        self, host: Host, command: str, timeout: float = 60, stdin: bytes | None = None, what: str = ""
    ) -> Result:
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
        self.doc: dict[str, Any] = {
            "time": None,
            "hosts": [],
            "jobs": [],
            "queue": [],
            "errors": [],
            "loading": True,
        }
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

    def refresh(
        self, session: CountingSession, before: dict[str, tuple[float, int]]
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
                        self.doc = {
                            **self.doc,
                            "errors": [f"the last look at the hosts failed: {hostile.line(str(exc), 300)}"],
                        }
                self.stopping.wait(max(0.5, self.every - (time.monotonic() - started)))
        finally:
            session.close()

    def overview(self) -> dict[str, Any]:
        with self.lock:
            return {
                **self.doc,
                "cost": {
                    "ssh_commands": self.commands,
                    "refreshes": self.refreshes,
                    "seconds": round(time.time() - self.started, 1),
                },
            }


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
