"""The life of a job, in named stages (attempt.Stage, and `run`): one object owns it from the first
plan to the last clean-up, and reports what happens as events (events.py); it never prints.

Each attempt is a frozen plan (attempt.py) built from read-only facts about the hosts (facts.py);
the stages run that plan's steps, so `--dry-run` and runs/JOB/plan.txt show exactly what runs. Each
attempt's stages return its state as one frozen value (state.Attempted); what the job knows of its
hosts (used, lost, stuck, warm) is the sum of those. After an attempt, policy.decide says whether
another follows and on which hosts.
"""
from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.ssh import attempt as attempt_mod
from orchestrator.backends.ssh import claiming, facts, gate, snapshots
from orchestrator.backends.ssh import ending as ending_mod
from orchestrator.backends.ssh.attempt import AttemptPlan, Stage, Step, When
from orchestrator.backends.ssh.snapshotchecks import local_digest
from orchestrator.backends.ssh.state import Again, Attempted, Ending, Interrupted, JobResult, Queued, Refused
from orchestrator.backends.ssh.steps import run_steps
from orchestrator.backends.ssh.waiting import QUEUE_POLL, Place
from orchestrator.backends.ssh.watch import watch
from orchestrator.commands import hostfiles
from orchestrator.config import codetree
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.events import Reporter
from orchestrator.core.policy import Decision, Failure, HostFailure, Outcome, Policy, Roster, backoff, decide
from orchestrator.core.recovery import Attempt, JobRecord
from orchestrator.hosts.queue import new_ticket
from orchestrator.progress import bars, metrics, notify
from orchestrator.transport import deadlines
from orchestrator.transport.remote import PerHost, Session, describe

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.core.record import Notify
    from orchestrator.progress.bars import Transfer

STOP_POLL = 2.0  # seconds between looks for `fab stop` while waiting between attempts
REPLANS = 3      # plans made again in a row when other jobs claim the same units or port meanwhile


def _unfenced() -> None:
    pass


# A detached job's active controller sets this (failover.Mirror.check): asked before an attempt
# starts containers and before its teardown removes them; it ends the process when another
# controller took the job over (a controller that wakes from a freeze never acts on a job it lost).
FENCE: Callable[[], None] = _unfenced


def run(job: Job, running: AttemptPlan | None = None) -> JobResult:
    """The life of a job: PLAN -> CLAIM -> GATE -> SNAPSHOT -> START -> WATCH -> TEARDOWN -> DECIDE,
    again from PLAN while the policy allows, then FINISH. With `running` (an attempt whose containers
    run: fab attach), from its WATCH."""
    try:
        with job.open():
            ending = None
            try:
                ending = job.attempts(running)
            finally:
                job.leave_queue()
                result = ending_mod.finish(job, ending)
    except Refused:
        if not job.resuming:  # a new job refused its hosts leaves nothing, here either
            shutil.rmtree(job.run_dir, ignore_errors=True)
        raise
    return result


class Job:
    """One job across its attempts: what it was asked (inventory, spec, policy, options), its record,
    the attempts done (`history`) and the one under way (`current`), and one method per stage."""

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
    ) -> None:
        self.inv, self.policy = inv, policy
        self.run_dir = run_root / spec.job_id
        self.resuming = record is not None and bool(record.attempts)
        if record is None:
            spec = replace(spec, env=(*spec.env, ("FABTRAIN_TARGET_NODES", str(len(inv.hosts)))))
            record = JobRecord.new(spec, inv, policy.restarts, policy.min_nodes, policy.hang_timeout)
        self.spec, self.record = spec, record
        if notify_to is not None:
            record.notify = notify_to
        # Every event also goes to runs/JOB/events.jsonl and to the job's notification hooks.
        self.notifier = notify.Notifier(
            notify.Notices(spec.job_id, spec.owner, secrets=secret_values(inv)),
            record.notify.command, record.notify.url, warn=lambda t: self.note(t, "warning"))
        # From Job.open on: every event but the telemetry samples, and those in a file of their own.
        self.events = notify.EventLog(self.run_dir / notify.EVENTS_FILE, enabled=False, skip=notify.TELEMETRY)
        self.telemetry = notify.EventLog(self.run_dir / notify.TELEMETRY_FILE, enabled=False,
                                         only=notify.TELEMETRY)
        # fab train --metrics-port: /metrics for Prometheus, served while the job lives (Job.open).
        self.metrics = metrics.Metrics(spec.job_id, spec.owner) if inv.job.metrics_port else None
        self.reporter: Reporter = notify.Fanout(reporter, self.events, self.telemetry, self.notifier,
                                                *([self.metrics] if self.metrics else []))
        self.session = session
        self.checks, self.smoke = checks, smoke
        self.watch_options = watch_options or {}
        self.target_nodes = int(dict(spec.env).get("FABTRAIN_TARGET_NODES", len(inv.hosts)))
        self.roster = Roster(inv.hosts, inv.spares)   # the next attempt's hosts (policy.decide's)
        self.history: tuple[Attempted, ...] = ()      # the attempts done, each as its stages left it
        self.current: AttemptPlan | None = None       # the attempt under way, from its claim to DECIDE
        self.started = False  # a container of this job was started by this process
        self.snaps: snapshots.Snapshots | None = None
        self.leasing = threading.Event()
        # fab train --queue: the job's place in its hosts' queues (queue.new_ticket), while it waits.
        self.place_in_queue = (
            Place(inv, spec, new_ticket(spec.job_id), self.note, self.emit) if queue else None
        )

    # ------------------------------------------------------------ what the attempts add up to

    @property
    def last(self) -> AttemptPlan | None:
        """The attempt under way, or else the last one done (None before the first)."""
        return self.current or (self.history[-1].plan if self.history else None)

    @property
    def used(self) -> dict[str, Host]:
        """Every host an attempt of this job used (its outputs are fetched from them at the end)."""
        plans = [d.plan for d in self.history] + ([self.current] if self.current else [])
        return {h.name: h for a in plans for h in (*a.hot, *a.hosts)}

    @property
    def lost(self) -> frozenset[str]:
        """Hosts lost in an attempt: never asked again."""
        return frozenset().union(*(d.lost for d in self.history))

    @property
    def stuck(self) -> frozenset[str]:
        """Hosts whose Docker engine stopped answering: no teardown or sweep is tried there."""
        return frozenset().union(*(d.stuck for d in self.history))

    # ------------------------------------------------------------ around the stages

    def emit(self, event: str, **fields) -> None:
        self.reporter.emit(event, job=self.spec.job_id, **fields)

    def note(self, text: str, level: str = "info") -> None:
        self.emit("note", level=level, text=text)

    def stage(self, stage: Stage, number: int | None = None) -> None:
        self.emit("stage", attempt=number, stage=stage.value)

    @property
    def ssh(self) -> Session:
        """The session every stage runs in: the one given, or the one `open` made."""
        if self.session is None:
            raise RuntimeError(f"job {self.spec.job_id}: no session; the stages run inside Job.open")
        return self.session

    @property
    def store(self) -> snapshots.Snapshots:
        """The job's snapshots, made by `open` (or `open_snapshots`) before any stage needs them."""
        if self.snaps is None:
            raise RuntimeError(f"job {self.spec.job_id}: snapshots used before Job.open made them")
        return self.snaps

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """The session, the run directory, signal handlers, and the lease kept while the job lives."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events.enabled = self.telemetry.enabled = True
        self.open_snapshots()
        self.serve_metrics()
        own = None
        if self.session is None:
            own = self.session = Session(self.inv.all_hosts)
        install_signal_handlers()
        lease = threading.Thread(target=self.keep_lease, daemon=True, name="lease")
        lease.start()
        try:
            yield
        finally:
            self.leasing.set()
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
            raise UserError(f"--metrics-port {where}: cannot listen there: {exc.strerror or exc}; choose "
                            "another port (job.metrics_port in the inventory, or --metrics-port)") from None
        self.note(f"metrics for Prometheus at {url}")

    def open_snapshots(self) -> snapshots.Snapshots:
        """runs/JOB/snapshots (or checkpoints/), made when the job starts, or when a dry run of a
        resumed job looks for what it would resume from."""
        if self.snaps is None:
            self.snaps = snapshots.Snapshots(
                self.run_dir,
                self.inv,
                self.spec,
                keep=self.inv.job.keep_snapshots,
                report=lambda line: self.note(line, "warning"),
                transfers=bars.Transfers(emit=self.emit),
            )
        return self.snaps

    def keep_lease(self) -> None:
        """Touch the job's lease on its hosts every hostfiles.LEASE_EVERY s (hostops: left-over runtime
        directories are those whose lease went stale)."""
        while not self.leasing.wait(hostfiles.LEASE_EVERY):
            a, lost = self.last, self.lost
            if a is not None:
                self.run_steps(a, [s for s in a.steps if s.key == "lease" and s.where not in lost])

    def answering(self, hosts: Iterable[Host]) -> tuple[Host, ...]:
        lost = self.lost
        return tuple(h for h in hosts if h.name not in lost)

    def run_steps(self, a: AttemptPlan, steps: list[Step],
                  transfer: Callable[[Step], Transfer | None] | None = None) -> PerHost:
        return run_steps(self.ssh, (*a.hosts, *self.used.values()), steps, transfer)

    def stopped(self, hosts: Iterable[Host]) -> bool:
        """Whether `fab stop` left its marker on any of these hosts (never asking a lost one)."""
        command = attempt_mod.stopped_command(self.inv, self.spec.job_id)
        got = self.ssh.fan_out(
            lambda h: self.ssh.run(
                h, command, timeout=deadlines.STATUS_TIMEOUT, what="checking for fab stop"
            ),
            self.answering(hosts),
        )
        return any(r.ok for r in got.values_ok())

    def attempts(self, running: AttemptPlan | None) -> Ending | None:
        """Attempt after attempt, as the policy decides; how the job ended (None: an error ended it
        before its last attempt was judged). A claim that found its hosts taken meanwhile plans
        again (up to REPLANS times in a row), or waits in the queue (--queue)."""
        replans = 0
        while True:
            if running is not None:
                tried: Attempted | Again = self.take_over(running)
                running = None
            else:
                tried = self.run_attempt(self.plan(), may_replan=replans < REPLANS)
            if isinstance(tried, Again):
                if tried.queued is None:
                    replans += 1
                    continue
                replans = 0
                ended = self.wait_in_queue(tried.queued)
                if ended is not None:
                    return ended
                continue
            done, d = self.decide(tried)
            self.history, self.current = (*self.history, done), None
            if d.roster is None:
                return Ending.of(done.outcome, d.reason)
            self.roster = d.roster
            ended = self.between_attempts(self.pause_after(d, done.plan.number))
            if ended is not None:
                return ended

    # ------------------------------------------------------------ the stages

    def plan(self, dry: bool = False) -> AttemptPlan:
        """PLAN: the facts the attempt depends on, read-only (facts.py), then the frozen plan."""
        number = len(self.record.attempts) + 1
        self.stage(Stage.PLAN, number)
        self.key_code()
        inv = replace(self.inv, hosts=self.roster.hosts)
        hot = self.roster.spares if self.hot_spares else ()
        first = self.last is None
        queue = self.place_in_queue is not None
        newest = facts.Newest(None, (), ())
        # The looks read different things, each host at once: all of them at once too.
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="plan") as pool:
            accessing = pool.submit(facts.gpu_access, self.ssh, (*inv.hosts, *hot))
            # The spares too (what `fab status` shows of them), but never a host known lost.
            looked = (*inv.hosts, *hot, *self.answering(self.inv.spares))
            surveying = pool.submit(facts.what_runs, self.ssh, self.inv, looked)
            listing = pool.submit(facts.listening, self.ssh, inv)
            if number > 1 or self.resuming:
                asked = self.answering((*inv.hosts, *self.used.values()))
                newest = pool.submit(facts.newest_snapshot, self.ssh, self.open_snapshots(), inv, self.spec,
                                     asked, fetch=not dry).result()
            access, seen = accessing.result()
            found, listed = surveying.result(), listing.result()
        units = facts.choose_units(
            found, self.inv, self.spec, inv.hosts, refuse=first and not dry, queue=queue
        )
        if hot:  # a spare whose GPUs (slots) another job holds now stays cold
            spare = facts.choose_units(found, self.inv, self.spec, hot, refuse=False, queue=False)
            hot = tuple(h for h in hot if h.name not in spare.refused)
            units = replace(
                units,
                units={**units.units, **{h.name: spare.units[h.name] for h in hot}},
                facts=(*units.facts, *(f for f in spare.facts if f.where in {h.name for h in hot})),
            )
        taken = ({self.last.port} if self.last else set()) | units.claimed_ports
        port, port_fact = facts.free_port(listed, inv, taken)
        seen += [*units.facts, port_fact, *newest.facts]
        if first and (number > 1 or self.resuming):  # what a resumed job goes on from, said once
            self.say_resumed_from(newest.name)
        return attempt_mod.build(
            inv,
            self.spec,
            number,
            port,
            newest.name,
            newest.missing,
            access,
            tuple(seen),
            keep=self.inv.job.keep_snapshots,
            first=first,
            run_dir=str(self.run_dir),
            # A spare made hot only now (busy until now) has never had the code: sync then too.
            sync=not self.all_warm(inv.hosts) or any(h.name not in self.used for h in hot),
            units=units.units,
            ticket=None if self.started or not self.place_in_queue else self.place_in_queue.ticket,
            warm=self.warm,
            hot=hot,
        )

    def say_resumed_from(self, snapshot: str | None) -> None:
        self.note(
            f"resuming from {self.open_snapshots().layout.describe(snapshot)}"
            if snapshot
            else f"no {'checkpoint' if self.spec.checkpoint else 'snapshot'} of job "
            f"{self.spec.job_id} found here or on its hosts: it starts from the beginning",
            "info" if snapshot else "warning",
        )

    @property
    def hot_spares(self) -> bool:
        """Whether the job keeps its spares hot (job.hot_spares, --hot-spares): warm restarts only."""
        return self.warm and self.inv.job.hot_spares

    @property
    def warm(self) -> bool:
        """Whether the job's nodes stay warm between attempts: it may restart, and the inventory
        did not turn it off (job.warm_restarts)."""
        return self.policy.restarts > 0 and self.inv.job.warm_restarts

    def all_warm(self, hosts: tuple[Host, ...]) -> bool:
        """Every host of the next attempt holds its rank's container waiting warm, as the last
        watch found it a moment ago: their code (its key unchanged) and checks are as they were,
        so the attempt syncs nothing and runs no preflight."""
        if not (self.warm and hosts and self.history):
            return False
        last = self.history[-1]
        warm, hot = last.warm_ranks, {h.name for h in last.plan.hot}
        return last.plan.spec.code_key == self.spec.code_key and all(
            warm.get(h.name) == h.rank or h.name in hot for h in hosts
        )

    def key_code(self) -> None:
        """The job's code tree and its key (codetree.py), read again before every attempt: a tree
        edited since the last one runs under its new key, and the job says so."""
        if not Path(self.spec.code).is_dir():
            raise UserError(f"the job's code {self.spec.code} is not there any more; give the folder with "
                            "--code DIR")
        key = codetree.key(self.spec.code, self.spec.code_only)
        if key != self.spec.code_key:
            if self.spec.code_key:
                self.note(
                    f"the code in {self.spec.code} changed since the last attempt: this one runs tree "
                    f"{key} (was {self.spec.code_key})",
                    "warning",
                )
            self.spec = replace(self.spec, code_key=key)
            self.record.spec = replace(self.record.spec, code_key=key)

    def run_attempt(self, a: AttemptPlan, may_replan: bool = True) -> Attempted | Again:
        """CLAIM, GATE, SNAPSHOT, START, WATCH, TEARDOWN: the attempt as they left it, or Again when
        its claim found the hosts taken meanwhile (then it is as if the attempt never was)."""
        self.record.attempts.append(Attempt(a.number, [h.name for h in a.hosts], time.time(),
                                            resumed_from=a.snapshot))
        FENCE()
        self.record.state = "running"
        self.record.save(self.run_dir)
        self.current = a
        tried = self.guarded(a, lambda: self.prepare(a, may_replan) or self.start(a) or self.watch(a))
        if isinstance(tried, Again):
            self.record.attempts.pop()
            self.record.save(self.run_dir)
            self.current = None
        return tried

    def take_over(self, a: AttemptPlan) -> Attempted:
        """WATCH and TEARDOWN of an attempt whose containers another process started (fab attach)."""
        self.current = a
        self.started = True
        self.notifier.notices.started = True
        self.notifier.notices.hosts = [h.name for h in a.hosts]
        self.note(f"took over job {self.spec.job_id}: attempt {a.number} on "
                  f"{', '.join(f'{h.name} (rank {h.rank})' for h in a.hosts)}; following it "
                  "from the start of its output")
        done = self.guarded(a, lambda: self.watch(a))
        assert isinstance(done, Attempted), "a watch is never planned again"
        return done

    def guarded(self, a: AttemptPlan, body: Callable[[], Attempted | Again]) -> Attempted | Again:
        """The attempt's stages from `body`, then TEARDOWN whatever happened (not after an Again:
        nothing of that attempt started)."""
        done: Attempted | Again | None = None
        try:
            done = body()
        except KeyboardInterrupt as exc:  # Ctrl+C or SIGTERM outside the watch
            done = Attempted(a, Outcome(interrupted=getattr(exc, "signum", signal.SIGINT)))
            lost = self.lost
            self.run_steps(a, [s for s in a.steps if s.when is When.ON_INTERRUPT and s.where not in lost])
        finally:  # whatever happened, no container of the attempt is left (lost hosts aside)
            if not isinstance(done, Again):
                skip = self.lost | (done.lost | done.stuck if done else frozenset())
                if done is not None:  # a warm generation seen ended has nothing left to end
                    skip |= frozenset(done.warm_ranks)
                FENCE()
                self.stage(Stage.TEARDOWN, a.number)
                self.run_steps(a, [s for s in a.select("stop") if s.where not in skip])
        return done

    def prepare(self, a: AttemptPlan, may_replan: bool) -> Attempted | Again | None:
        """CLAIM, GATE and SNAPSHOT; the attempt's end when it cannot start (None: it goes on)."""
        self.stage(Stage.CLAIM, a.number)
        refused = claiming.claim(self, a, may_replan)
        if refused:
            return refused
        with (self.run_dir / "plan.txt").open(
            "a"
        ) as fh:  # after the claim: a queued job's tries are not plans
            fh.write(a.render() + "\n")
        self.emit("attempt", attempt=a.number, hosts={h.name: h.rank for h in a.hosts}, port=a.port,
                  snapshot=a.snapshot, run_dir=str(self.run_dir))
        self.stage(Stage.GATE, a.number)
        bad = gate.sync_and_check(self, a)
        if bad:
            return Attempted(
                a, Outcome(tuple(HostFailure(n, Failure.PREFLIGHT, why) for n, why in bad.items()))
            )
        if self.stopped(a.hosts):
            return Attempted(a, Outcome(stopped=True))
        if a.snapshot:
            placed = self.place(a)
            if placed.errors():
                return self.failed_to_start(a, placed)
        return None

    def wait_in_queue(self, q: Queued) -> Ending | None:
        """fab train --queue, while the hosts are held: the job's place kept in the queue of each of
        its hosts (queue.py), then a pause; the job's end when `fab stop` ended it meanwhile."""
        place = self.place_in_queue
        assert place is not None, "only a job with --queue waits in the queue"
        hosts = self.roster.hosts
        place.keep(self.ssh, hosts, q)
        deadline = time.monotonic() + QUEUE_POLL
        while time.monotonic() < deadline:
            if self.stopped(hosts):
                # Out of the queue, and fab stop's marker gone with it (no claim, no runtime files).
                claiming.release(self, list(hosts), queue=True)
                place.forget()
                return self.ended_by_stop("ended by 'fab stop' while it waited in the queue")
            time.sleep(min(STOP_POLL, max(0.0, deadline - time.monotonic())))
        return None

    def leave_queue(self) -> None:
        if self.place_in_queue is not None and self.session is not None:
            self.place_in_queue.leave(self.ssh)

    def place(self, a: AttemptPlan) -> PerHost:
        """SNAPSHOT: the plan's place steps, per host that lacks the snapshot: its copy pushed, checked
        by size and SHA-256 and renamed into place (Snapshots.push; up to 3 tries each)."""
        snapshot = a.snapshot
        if snapshot is None:
            raise ValueError(f"attempt {a.number} places no snapshot")
        self.stage(Stage.SNAPSHOT, a.number)
        snaps = self.store
        digest = local_digest(snaps.local_path(snapshot))
        targets = tuple(a.host(s.host) for s in a.select("place"))

        def push(h: Host) -> None:
            copy = next(s for s in a.select("place") if s.host == h.name)
            snaps.push(
                self.ssh,
                h,
                snapshot,
                digest,
                argv=copy.argv,
                check=a.step(h.name, "place-check").command,
                rename=a.step(h.name, "place-rename").command,
            )
        with snaps.lock:  # the copier of the last attempt must not prune it meanwhile
            return self.ssh.fan_out(push, targets)

    def start(self, a: AttemptPlan) -> Attempted | None:
        """START: the secrets file and docker run on every host at once, rank 0's issued first.
        Nothing waits for rank 0: torchrun's workers retry the rendezvous until it listens."""
        self.stage(Stage.START, a.number)
        self.leave_queue()
        self.started = True
        started = self.run_steps(
            a, [s for s in a.steps if s.key in ("secrets", "start", "spare") and s.when is When.ALWAYS]
        )
        hot = {h.name for h in a.hot}
        for name, exc in started.errors().items():
            if name in hot:  # the attempt goes on; that spare is started again (or cold) when needed
                self.note(f"{name}: the hot spare was not started ({exc}); it stays a cold spare", "warning")
        ranks = PerHost({n: r for n, r in started.items() if n not in hot})
        return self.failed_to_start(a, ranks) if ranks.errors() else None

    def failed_to_start(self, a: AttemptPlan, results: PerHost) -> Attempted:
        """The hosts that could not start (a host that did not answer is lost), the others' part of
        the attempt ended (ON_FAILURE)."""
        failures = []
        for name, exc in results.errors().items():
            h = a.host(name) if name in {x.name for x in a.hosts} else self.used[name]
            kind = Failure.START if isinstance(exc, UserError) else Failure.LOST
            failures.append(HostFailure(name, kind, describe(h, exc)))
            self.emit("host_failed", attempt=a.number, host=name, kind=kind.value, detail=failures[-1].detail)
        others = [s for s in a.steps if s.when is When.ON_FAILURE and s.where not in results.errors()]
        self.run_steps(a, others)
        return Attempted(a, Outcome(tuple(failures)))

    def watch(self, a: AttemptPlan) -> Attempted:
        """WATCH: follow every node (watch.py) while snapshots are copied off rank 0's host."""
        self.stage(Stage.WATCH, a.number)
        copying = threading.Event()
        self.store.follow(self.ssh, a.master, copying)
        try:
            w = watch(self.ssh, a, self.run_dir, self.reporter, hang_timeout=self.policy.hang_timeout,
                      **self.watch_options)
        finally:
            copying.set()
            self.watch_options.pop("known_lost", None)  # what a failover found holds for its first watch
        if w.interrupted is not None:
            return Attempted(a, Outcome(interrupted=w.interrupted), w)
        return Attempted(a, Outcome(tuple(e.failure_line() for e in w.failures)), w)

    def decide(self, done: Attempted) -> tuple[Attempted, Decision]:
        """DECIDE: the attempt recorded (a failure may have been `fab stop`), the policy asked."""
        a = done.plan
        self.stage(Stage.DECIDE, a.number)
        o = done.outcome
        if (
            o.failures
            and not o.stopped
            and self.stopped(h for h in self.used.values() if h.name not in done.lost)
        ):
            done = replace(done, outcome=replace(o, stopped=True))
        line = done.line()
        rec = self.record.attempts[-1]
        rec.ended, rec.outcome = time.time(), line
        self.record.save(self.run_dir)
        self.emit("attempt_end", attempt=a.number, ok=done.outcome.ok, outcome=line)
        d = decide(done.outcome, self.policy, self.roster, self.target_nodes, warm=frozenset(done.warm_ranks),
                   hot=frozenset(h.name for h in a.hot))
        if d.roster is None:
            self.emit("decision", attempt=a.number, next=False, reason=d.reason, notes=list(d.notes))
            return done, d
        for n in d.notes:
            self.note(n, "warning")
        self.emit("decision", attempt=a.number, next=True, notes=list(d.notes),
                  reason=(f"attempt {a.number} failed ({line}); restart {d.roster.restarts_used} of "
                          f"{self.policy.restarts} in {self.pause_after(d, a.number):g}s") if d.restart
                  else f"attempt {a.number}: {line}; trying again with other hosts")
        return done, d

    @staticmethod
    def pause_after(d: Decision, number: int) -> float:
        """Seconds before the attempt after `number`: a restart backs off, other hosts go at once."""
        return backoff(number + 1) if d.restart else 0

    def between_attempts(self, pause: float) -> Ending | None:
        """The pause before the next attempt; the job's end when `fab stop` came meanwhile."""
        deadline = time.monotonic() + pause
        while True:
            if self.stopped(tuple(self.used.values())):
                return self.ended_by_stop("ended by 'fab stop' between attempts")
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(STOP_POLL, max(0.0, deadline - time.monotonic())))

    def ended_by_stop(self, reason: str) -> Ending:
        self.emit("decision", next=False, reason=reason, notes=[])
        return Ending("stopped", reason)


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
