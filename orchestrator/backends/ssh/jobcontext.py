"""What a job's stages act through (`JobContext`): what the job was asked (inventory, spec, policy,
options), the SSH session, the reporter its events go to (the terminal or --json, runs/JOB/events.jsonl,
the notification hooks, /metrics), its snapshots, its place in the queue, and its record
(runs/JOB/job.json), which only the `record_*` methods here write. What changes from stage to stage
is the JobState (jobstate.py) each stage takes and returns; `state` holds the newest, which only
job.py's driver replaces (for the lease thread, and for the finish after an error).
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.ssh.jobstate import JobState
from orchestrator.backends.ssh.stagesteps import stopped_command
from orchestrator.backends.ssh.state import Interrupted
from orchestrator.backends.ssh.steps import run_steps
from orchestrator.backends.ssh.waiting import Place
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.events import Reporter
from orchestrator.core.policy import Roster
from orchestrator.core.recovery import Attempt, JobRecord
from orchestrator.hosts.queue import new_ticket
from orchestrator.progress import bars, metrics, notify
from orchestrator.snapshots.store import Snapshots
from orchestrator.transport import deadlines
from orchestrator.transport.remote import PerHost, Session

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping

    from orchestrator.backends.ssh.attempt import AttemptPlan, Stage
    from orchestrator.backends.ssh.planstep import Step
    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.core.policy import Policy
    from orchestrator.core.record import Notify
    from orchestrator.progress.bars import Transfer


class JobContext:
    """One job's fixed part across its attempts: what it was asked, its record, and the effects its
    stages go through (the session, the reporter, the snapshots, the queue)."""

    def __init__(
        self,
        inv: Inventory,
        spec: jobspec.JobSpec,
        policy: Policy,
        run_root: Path,
        reporter: Reporter,
        session: Session | None = None,
        record: JobRecord | None = None,
        checks: bool = True,
        smoke: bool = False,
        watch_options: dict | None = None,
        notify_to: Notify | None = None,
        queue: bool = False,
        selected: Iterable[str] | None = None,
        known_lost: Mapping[str, str] | None = None,
    ) -> None:
        self.inv, self.policy = inv, policy
        self.run_dir = run_root / spec.job_id
        self.resuming = record is not None and bool(record.attempts)
        if record is None:
            spec = replace(spec, env=(*spec.env, ("FABTRAIN_TARGET_NODES", str(len(inv.hosts)))))
            record = JobRecord.new(spec, inv, policy.restarts, policy.min_nodes, policy.hang_timeout)
            if selected is not None:
                record.selected = list(selected)
        self.spec, self.record = spec, record
        if notify_to is not None:
            record.notify = notify_to
        self.reporter = self.report_to(reporter)
        self.session = session
        self.checks, self.smoke = checks, smoke
        self.watch_options = dict(watch_options or {})
        self.target_nodes = int(dict(spec.env).get("FABTRAIN_TARGET_NODES", len(inv.hosts)))
        self.snaps: Snapshots | None = None
        # fab train --queue: the job's place in its hosts' queues (queue.new_ticket), while it waits.
        self.place_in_queue = (
            Place(inv, spec, new_ticket(spec.job_id), self.note, self.emit) if queue else None
        )
        # `known_lost`: hosts a failover's standby found silent, lost from the start of the first watch.
        self.state = JobState(
            spec,
            Roster(inv.hosts, inv.spares),
            recorded=len(record.attempts),
            known_lost=tuple((known_lost or {}).items()),
        )

    def report_to(self, reporter: Reporter) -> Reporter:
        """`reporter`, and every event also to runs/JOB/events.jsonl, the job's notification hooks and
        /metrics (fab train --metrics-port)."""
        self.notifier = notify.Notifier(
            notify.Notices(self.spec.job_id, self.spec.owner, secrets=secret_values(self.inv)),
            self.record.notify.command,
            self.record.notify.url,
            warn=lambda t: self.note(t, "warning"),
        )
        # From JobContext.open on: every event but the telemetry samples, and those in a file of their own.
        self.events = notify.EventLog(self.run_dir / notify.EVENTS_FILE, enabled=False, skip=notify.TELEMETRY)
        self.telemetry = notify.EventLog(
            self.run_dir / notify.TELEMETRY_FILE, enabled=False, only=notify.TELEMETRY
        )
        # fab train --metrics-port: /metrics for Prometheus, served while the job lives (JobContext.open).
        self.metrics = (
            metrics.Metrics(self.spec.job_id, self.spec.owner) if self.inv.job.metrics_port else None
        )
        return notify.Fanout(
            reporter, self.events, self.telemetry, self.notifier, *([self.metrics] if self.metrics else [])
        )

    # ------------------------------------------------------------ events

    def emit(self, event: str, **fields) -> None:
        self.reporter.emit(event, job=self.spec.job_id, **fields)

    def note(self, text: str, level: str = "info") -> None:
        self.emit("note", level=level, text=text)

    def stage(self, stage: Stage, number: int | None = None) -> None:
        self.emit("stage", attempt=number, stage=stage.value)

    def log_events(self) -> None:
        """runs/JOB/events.jsonl written from now on (by `open`, or before it by a failover that
        says what happened to the controllers first)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events.enabled = True

    def took_over(self, hosts: Iterable[Host]) -> None:
        """What the notifications say of a job taken over: started, on these hosts."""
        self.notifier.notices.started = True
        self.notifier.notices.hosts = [h.name for h in hosts]

    # ------------------------------------------------------------ the session and the job's life

    @property
    def ssh(self) -> Session:
        """The session every stage runs in: the one given, or the one `open` made."""
        if self.session is None:
            raise RuntimeError(f"job {self.spec.job_id}: no session; the stages run inside JobContext.open")
        return self.session

    @property
    def store(self) -> Snapshots:
        """The job's snapshots, made by `open` (or `open_snapshots`) before any stage needs them."""
        if self.snaps is None:
            raise RuntimeError(f"job {self.spec.job_id}: snapshots used before JobContext.open made them")
        return self.snaps

    @contextlib.contextmanager
    def connected(self) -> Iterator[Session]:
        """The session given, or one made for the while (closed after it)."""
        if self.session is not None:
            yield self.session
            return
        self.session = own = Session(self.inv.all_hosts)
        try:
            yield own
        finally:
            own.close()
            self.session = None

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """The session, the run directory, the event logs, /metrics and signal handlers while the
        job lives (job.py keeps its lease meanwhile)."""
        self.log_events()
        self.telemetry.enabled = True
        self.open_snapshots()
        self.serve_metrics()
        own = None
        if self.session is None:
            own = self.session = Session(self.inv.all_hosts)
        install_signal_handlers()
        try:
            yield
        finally:
            self.notifier.close()
            if self.metrics is not None:
                self.metrics.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if own is not None:
                own.close()

    def serve_metrics(self) -> None:
        where = self.inv.job.metrics_port
        if self.metrics is None or where is None:
            return
        try:
            url = self.metrics.serve(where)
        except OSError as exc:
            raise UserError(
                f"--metrics-port {where}: cannot listen there: {exc.strerror or exc}; choose "
                "another port (job.metrics_port in the inventory, or --metrics-port)"
            ) from None
        self.note(f"metrics for Prometheus at {url}")

    def open_snapshots(self) -> Snapshots:
        """runs/JOB/snapshots (or checkpoints/), made when the job starts, or when a dry run of a
        resumed job looks for what it would resume from."""
        if self.snaps is None:
            self.snaps = Snapshots(
                self.run_dir,
                self.inv,
                self.spec,
                keep=self.inv.job.keep_snapshots,
                report=lambda line: self.note(line, "warning"),
                transfers=bars.Transfers(emit=self.emit),
            )
        return self.snaps

    def leave_queue(self) -> None:
        if self.place_in_queue is not None and self.session is not None:
            self.place_in_queue.leave(self.ssh)

    # ------------------------------------------------------------ what the stages ask of the hosts

    @property
    def warm(self) -> bool:
        """Whether the job's nodes stay warm between attempts: it may restart, and the inventory
        did not turn it off (job.warm_restarts)."""
        return self.policy.restarts > 0 and self.inv.job.warm_restarts

    @property
    def hot_spares(self) -> bool:
        """Whether the job keeps its spares hot (job.hot_spares, --hot-spares): warm restarts only."""
        return self.warm and self.inv.job.hot_spares

    def run_steps(
        self,
        hosts: Iterable[Host],
        steps: list[Step],
        transfer: Callable[[Step], Transfer | None] | None = None,
    ) -> PerHost:
        """The steps on their hosts (found among `hosts`: JobState.reach), at once."""
        return run_steps(self.ssh, hosts, steps, transfer)

    def stopped(self, hosts: Iterable[Host]) -> bool:
        """Whether `fab stop` left its marker on any of these hosts (give only answering ones)."""
        command = stopped_command(self.inv, self.spec.job_id)
        got = self.ssh.fan_out(
            lambda h: self.ssh.run(
                h, command, timeout=deadlines.STATUS_TIMEOUT, what="checking for fab stop"
            ),
            tuple(hosts),
        )
        return any(r.ok for r in got.values_ok())

    # ------------------------------------------------------------ the record, runs/JOB/job.json

    def record_begun(self, a: AttemptPlan) -> None:
        """Attempt `a` recorded as running."""
        self.record.attempts.append(
            Attempt(a.number, [h.name for h in a.hosts], time.time(), resumed_from=a.snapshot)
        )
        self.record.state = "running"
        self.record.save(self.run_dir)

    def record_retracted(self) -> None:
        """The last attempt recorded gone again: its claim found the hosts taken meanwhile."""
        self.record.attempts.pop()
        self.record.save(self.run_dir)

    def record_judged(self, outcome: str) -> None:
        """The last attempt recorded as ended, with its outcome's line."""
        rec = self.record.attempts[-1]
        rec.ended, rec.outcome = time.time(), outcome
        self.record.save(self.run_dir)

    def record_ended(self, state: str) -> None:
        """The job recorded as ended (finished, failed, stopped, interrupted)."""
        self.record.state = state
        self.record.save(self.run_dir)

    def record_code_key(self, key: str) -> None:
        """The code tree's key the next attempt runs under (saved with the record's next change)."""
        self.record.spec = replace(self.record.spec, code_key=key)


def secret_values(inv: Inventory) -> tuple[str, ...]:
    """The job's secret values (job.secret_files), which notifications mask."""
    values = []
    for _, path in inv.job.secret_files:
        with contextlib.suppress(OSError):
            values.append(Path(path).expanduser().read_text().strip())
    return tuple(values)


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM both interrupt the job, which then stops its containers with their grace."""

    def handler(signum, frame):  # noqa: ANN001
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
