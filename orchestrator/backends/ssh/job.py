"""The life of a job, in named stages (see `Stage` and `run`): one object owns it from the first
plan to the last clean-up, and reports what happens as events (events.py); it never prints.

Each attempt is a frozen plan (attempt.py) built from read-only facts about the hosts; the stages
run that plan's steps, so `--dry-run` and runs/JOB/plan.txt show exactly what runs. After an
attempt, policy.decide says whether another follows and on which hosts.
"""
from __future__ import annotations

import contextlib
import enum
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import preflight
from orchestrator.backends.ssh import attempt as attempt_mod
from orchestrator.backends.ssh import snapshots
from orchestrator.backends.ssh.attempt import ALWAYS, ON_FAILURE, ON_INTERRUPT, AttemptPlan, Fact, Step
from orchestrator.backends.ssh.watch import NodeEnd, Watched, watch
from orchestrator.commands import dockerargs, hostfiles, ports, sshargs
from orchestrator.config import codetree
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.events import Reporter
from orchestrator.core.policy import Decision, Failure, HostFailure, Outcome, Policy, Roster, backoff, decide
from orchestrator.core.recovery import Attempt, JobRecord
from orchestrator.hosts import claims, hostops
from orchestrator.progress import notify
from orchestrator.transport import deadlines
from orchestrator.transport.remote import PerHost, Result, Session, describe

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from orchestrator.preflight.checks import Check

STOP_POLL = 2.0  # seconds between looks for `fab stop` while waiting between attempts
QUEUE_POLL = 5.0  # seconds between a queued job's tries (each renews its place: hostfiles.LEASE_STALE)


class Stage(enum.StrEnum):
    """A job's stages, in order; an attempt walks PLAN to DECIDE, the job ends with FINISH."""

    PLAN = "plan"                 # read the facts (GPU access, free port, newest snapshot); freeze the plan
    CLAIM = "claim"               # the job's runtime directory on its hosts: `fab stop` finds it from here on
    GATE = "sync+preflight"       # code synced and every check run, at once; nothing starts if one fails
    SNAPSHOT = "snapshot"         # the newest snapshot placed on every host that lacks it
    START = "start"               # the secrets file, then docker run, on every host at once
    WATCH = "watch"               # output followed until every node ends; first failure stops the rest
    TEARDOWN = "teardown"         # the attempt's containers removed
    DECIDE = "decide"             # policy.decide: another attempt (which hosts), or the end
    FINISH = "finish"             # outputs fetched, runtime files removed, the record closed


@dataclass
class JobResult:
    job_id: str
    run_dir: Path
    state: str = "running"        # finished, failed, stopped, interrupted
    attempts: int = 0
    reason: str = ""              # why the job ended (policy.decide), when it did not finish
    watched: Watched | None = None  # the last attempt's
    failures: list[str] = field(default_factory=list)  # every failed attempt, one line each
    interrupted: int | None = None
    lost: list[str] = field(default_factory=list)
    stuck_engines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.state == "finished"


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run(job: Job, running: AttemptPlan | None = None) -> JobResult:
    """The life of a job: PLAN -> CLAIM -> GATE -> SNAPSHOT -> START -> WATCH -> TEARDOWN -> DECIDE,
    again from PLAN while the policy allows, then FINISH. With `running` (an attempt whose containers
    run: fab attach), from its WATCH."""
    try:
        with job.open():
            try:
                while True:
                    if running is not None:
                        attempt, outcome, running = running, job.take_over(running), None
                    else:
                        attempt = job.plan()
                        try:
                            outcome = job.run_attempt(attempt)
                        except Contended:
                            continue  # planned again with another port (Job.claim)
                        except Queued as q:
                            if job.wait_in_queue(q):
                                continue  # planned again once its place came
                            break
                    decision = job.decide(attempt, outcome)
                    if decision.roster is None or not job.next_attempt(decision):
                        break
            finally:
                job.leave_queue()
                result = job.finish()
    except Refused:
        if not job.resuming:  # a new job refused its hosts leaves nothing, here either
            shutil.rmtree(job.run_dir, ignore_errors=True)
        raise
    return result


class Job:
    """One job's state across its attempts, and one method per stage."""

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
        notify_to: dict[str, str] | None = None,
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
            record.notify = dict(notify_to)
        # Every event also goes to runs/JOB/events.jsonl and to the job's notification hooks.
        self.notifier = notify.Notifier(
            notify.Notices(spec.job_id, spec.owner, secrets=secret_values(inv)),
            record.notify.get("command"), record.notify.get("url"), warn=lambda t: self.note(t, "warning"))
        self.events = notify.EventLog(self.run_dir / notify.EVENTS_FILE, enabled=False)  # from Job.open on
        self.reporter: Reporter = notify.Fanout(reporter, self.events, self.notifier)
        self.session = session
        self.checks, self.smoke = checks, smoke
        self.watch_options = watch_options or {}
        self.roster = Roster(inv.hosts, inv.spares)
        self.target_nodes = int(dict(spec.env).get("FABTRAIN_TARGET_NODES", len(inv.hosts)))
        self.used: dict[str, Host] = {}
        self.lost: dict[str, Host] = {}
        self.warm_ranks: dict[str, int] = {}  # host -> rank of its container waiting warm, after a watch
        self.stuck: dict[str, Host] = {}
        self.result = JobResult(spec.job_id, self.run_dir)
        self.last: AttemptPlan | None = None
        self.snaps: snapshots.Snapshots | None = None
        self.leasing = threading.Event()
        self.pause = 0.0
        self.before: AttemptPlan | None = None  # the plan before the last one (Job.claim: planned again)
        self.claimed_ports: set[int] = set()     # other jobs' master ports on this attempt's rank-0 host
        self.replans = 0
        # fab train --queue: the job's place in its hosts' queues (claims.new_ticket), while it waits.
        self.ticket = claims.new_ticket(spec.job_id) if queue else None
        self.queued: tuple[Host, ...] = ()
        self.queued_since = 0.0
        self.position: int | None = None
        self.started = False  # a container of this job was started by this process

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
        self.events.enabled = True
        self.open_snapshots()
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
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if own is not None:
                own.close()

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
            )
        return self.snaps

    def keep_lease(self) -> None:
        """Touch the job's lease on its hosts every hostfiles.LEASE_EVERY s (hostops: left-over runtime
        directories are those whose lease went stale)."""
        while not self.leasing.wait(hostfiles.LEASE_EVERY):
            a = self.last
            if a is not None:
                self.run_steps(a, [s for s in a.steps if s.key == "lease" and s.where not in self.lost])

    def answering(self, hosts: Iterable[Host]) -> tuple[Host, ...]:
        return tuple(h for h in hosts if h.name not in self.lost)

    def run_steps(self, a: AttemptPlan, steps: list[Step]) -> PerHost:
        """Run steps on their hosts at once (several on one host in order): host -> last Result or error."""
        by_host: dict[str, list[Step]] = {}
        for s in steps:
            by_host.setdefault(s.host or s.where, []).append(s)
        hosts = {h.name: h for h in (*a.hosts, *self.used.values())}

        def one(h: Host) -> Result | None:
            r = None
            for s in by_host[h.name]:
                r = (self.ssh.local(list(s.argv), s.deadline) if s.where == jobspec.LOCAL else
                     self.ssh.run(h, s.command, timeout=s.deadline, stdin=s.stdin, what=s.what))
                if not r.ok:
                    raise UserError(
                        f"{h.name}: {s.what} failed (exit {r.exited}): "
                        f"{hostile.text(r.stderr.strip()[-300:])}"
                    )
            return r
        return self.ssh.fan_out(one, tuple(hosts[n] for n in by_host))

    def stopped(self, hosts: tuple[Host, ...]) -> bool:
        """Whether `fab stop` left its marker on any of these hosts (never asking a lost one)."""
        command = attempt_mod.stopped_command(self.inv, self.spec.job_id)
        got = self.ssh.fan_out(
            lambda h: self.ssh.run(
                h, command, timeout=deadlines.STATUS_TIMEOUT, what="checking for fab stop"
            ),
            self.answering(hosts),
        )
        return any(r.ok for r in got.values_ok())

    # ------------------------------------------------------------ the stages

    def plan(self, dry: bool = False) -> AttemptPlan:
        """PLAN: the facts the attempt depends on, read-only, then the frozen plan."""
        number = len(self.record.attempts) + 1
        self.stage(Stage.PLAN, number)
        self.before = self.last
        self.key_code()
        inv = replace(self.inv, hosts=self.roster.hosts)
        facts: list[Fact] = []
        access = {}
        for h in inv.hosts:
            probe = dockerargs.gpu_probe_argv(h)
            if probe:
                try:
                    access[h.name] = preflight.gpu_access(self.ssh, h)
                    facts.append(Fact(h.name, sshargs.shell(probe), str(access[h.name])))
                except Exception as exc:  # noqa: BLE001 - the start then assumes NVIDIA's hook
                    facts.append(
                        Fact(
                            h.name,
                            sshargs.shell(probe),
                            f"no answer ({describe(h, exc)}); assumed NVIDIA's runtime hook",
                        )
                    )
        units = self.choose_units(inv.hosts, facts, dry)
        port = self.free_port(inv, facts)
        snapshot: str | None = None
        missing: tuple[str, ...] = ()
        if number > 1 or self.resuming:
            snapshot, missing = self.find_snapshot(inv, facts, fetch=not dry)
            if self.last is None:  # what a resumed job goes on from, said once
                self.note(
                    f"resuming from {self.open_snapshots().layout.describe(snapshot)}"
                    if snapshot
                    else f"no {'checkpoint' if self.spec.checkpoint else 'snapshot'} of job "
                    f"{self.spec.job_id} found here or on its hosts: it starts from the beginning",
                    "info" if snapshot else "warning",
                )
        warm_all = self.all_warm(inv.hosts)
        a = attempt_mod.build(
            inv,
            self.spec,
            number,
            port,
            snapshot,
            missing,
            access,
            tuple(facts),
            keep=self.inv.job.keep_snapshots,
            first=self.last is None,
            run_dir=str(self.run_dir),
            sync=not warm_all,
            units=units,
            ticket=None if self.started else self.ticket,
            warm=self.warm,
        )
        self.last = a
        return a

    @property
    def warm(self) -> bool:
        """Whether the job's nodes stay warm between attempts: it may restart, and the inventory
        did not turn it off (job.warm_restarts)."""
        return self.policy.restarts > 0 and self.inv.job.warm_restarts

    def all_warm(self, hosts: tuple[Host, ...]) -> bool:
        """Every host of the next attempt holds its rank's container waiting warm, as the last
        watch found it a moment ago: their code (its key unchanged) and checks are as they were,
        so the attempt syncs nothing and runs no preflight."""
        return (
            self.warm
            and bool(hosts)
            and self.last is not None
            and self.last.spec.code_key == self.spec.code_key
            and all(self.warm_ranks.get(h.name) == h.rank for h in hosts)
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
            self.record.spec["code_key"] = key

    def choose_units(
        self, hosts: tuple[Host, ...], facts: list[Fact], dry: bool
    ) -> dict[str, tuple[int, ...]]:
        """The GPUs (CPU slots) the attempt claims on each host: those asked for, or the first free
        ones, from what other jobs hold there now (read-only; the claim stage makes it atomic). On
        the first attempt a host that cannot give them refuses the job, naming the holder; at a
        restart the claim of such a host fails and the policy takes another."""
        found = hostops.survey(self.ssh, self.inv, (*hosts, *self.inv.spares))
        want = claims.want_of(self.spec, self.inv.job.nproc_per_node)
        units, refusals, impossible = {}, [], []
        master = found.value(hosts[0].name)
        self.claimed_ports = (
            {c.port for c in master.holders(but=self.spec.job_id) if c.port} if master else set()
        )
        for h in hosts:
            hj = found.value(h.name)
            cap = claims.capacity(h, hj.cpus if hj else 1)
            holders = hj.holders(but=self.spec.job_id) if hj else []
            asked = want.of(h, cap)
            try:
                units[h.name] = claims.choose(h, cap, holders, asked)
                answer = f"takes {claims.kind(h)}s {claims.units_text(units[h.name])} of {cap}"
            except UserError as exc:
                refusals.append(str(exc))
                units[h.name] = asked if isinstance(asked, tuple) else tuple(range(min(asked, cap)))
                answer = f"refused: {exc}"
                if self.ticket and hj:
                    try:  # what no wait can give (GPU 7 of 4) is refused in the queue too
                        claims.choose(h, cap, [], asked)
                    except UserError as never:
                        impossible.append(str(never).split("; free there")[0])
            held = "; ".join(c.describe(h) for c in holders) or "nothing"
            if hj:
                seen = f"held by other jobs: {held}; "
            else:
                error = found.error(h.name)
                assert error is not None, "survey: a host without HostJobs raised"  # HostJobs is truthy
                seen = f"no answer ({describe(h, error)}); "
            facts.append(
                Fact(h.name, "docker ps + ls .runtime + cat .claims (hostops.survey)", seen + answer)
            )
        if refusals and self.last is None and not dry and self.ticket is None:
            raise Refused("\n".join(refusals))
        if impossible and self.last is None and not dry:
            raise Refused(
                "\n".join(impossible) + "; no wait in the queue gives that: ask for what the hosts have"
            )
        return units

    def free_port(self, inv: Inventory, facts: list[Fact]) -> int:
        base = inv.job.master_port
        taken = ({self.last.port} if self.last else set()) | self.claimed_ports
        try:
            r = self.ssh.run(inv.master, ports.port_command(), timeout=deadlines.STATUS_TIMEOUT,
                                 what="listing ports")
            port = ports.free_port(r.stdout, base, taken) if r.ok else None
            answer = f"{port} free" if port else f"no free port in {base}..{base + ports.PORT_RANGE - 1}"
        except Exception as exc:  # noqa: BLE001 - preflight names the host; the plan says it was not checked
            port, answer = None, f"no answer ({describe(inv.master, exc)}); not checked"
        facts.append(Fact(inv.master.name, ports.port_command(), answer))
        if port is None:
            port = next(p for p in range(base, base + ports.PORT_RANGE) if p not in taken)
        return port

    def find_snapshot(
        self, inv: Inventory, facts: list[Fact], fetch: bool
    ) -> tuple[str | None, tuple[str, ...]]:
        """The newest complete snapshot on this machine or any host answering (the attempt's and
        every earlier one's), copied here; and the attempt's hosts that lack it."""
        asked = {h.name: h for h in self.answering((*inv.hosts, *self.used.values()))}
        snaps = self.open_snapshots()
        warn = snaps.warn  # a name refused: told once, naming the host
        found = self.ssh.fan_out(
            lambda h: snapshots.remote_newest(self.ssh, h, inv, self.spec, warn=warn),
            tuple(asked.values()),
        )
        for name in asked:
            facts.append(Fact(name, snapshots.list_command(inv, self.spec), str(found.value(name) or "none")))
        remote = max(((snap, name) for name, snap in found.items() if found.value(name)), default=None)
        if remote and fetch:
            snaps.fetch(self.ssh, asked[remote[1]], remote[0])
        local = snaps.local_newest()
        best = local if fetch else max(filter(None, [local, remote[0] if remote else None]), default=None)
        if best is None:
            return None, ()
        holders = tuple(h for h in inv.hosts if found.value(h.name) == best)
        if fetch and holders:  # the same name is not the same bytes: each holder's copy is checked
            digest = snapshots.local_digest(snaps.local_path(best))
            dest = snaps.remote_path(best)
            same = self.ssh.fan_out(lambda h: snaps.holds(self.ssh, h, dest, digest), holders)
            holders = tuple(h for h in holders if same.value(h.name))
            facts += [Fact(h.name, snapshots.checksum_command(dest), "same bytes" if same.value(h.name) else
                           "different bytes: placed again") for h in inv.hosts if h.name in same]
        return best, tuple(h.name for h in inv.hosts if h not in holders)

    def run_attempt(self, a: AttemptPlan) -> Outcome:
        """CLAIM, GATE, SNAPSHOT, START, WATCH, TEARDOWN: how the attempt ended."""
        self.record.attempts.append(Attempt(a.number, [h.name for h in a.hosts], time.time(),
                                            resumed_from=a.snapshot))
        self.record.state = "running"
        self.record.save(self.run_dir)
        self.used.update({h.name: h for h in a.hosts})
        return self.guarded(a, lambda: self.prepare(a) or self.start(a) or self.watch(a))

    def take_over(self, a: AttemptPlan) -> Outcome:
        """WATCH and TEARDOWN of an attempt whose containers another process started (fab attach)."""
        self.last = a
        self.used.update({h.name: h for h in a.hosts})
        self.notifier.notices.started = True
        self.notifier.notices.hosts = [h.name for h in a.hosts]
        self.note(f"took over job {self.spec.job_id}: attempt {a.number} on "
                  f"{', '.join(f'{h.name} (rank {h.rank})' for h in a.hosts)}; following it "
                  "from the start of its output")
        return self.guarded(a, lambda: self.watch(a))

    def guarded(self, a: AttemptPlan, body: Callable[[], Outcome]) -> Outcome:
        """The attempt's stages from `body`, then TEARDOWN whatever happened."""
        try:
            outcome = body()
        except KeyboardInterrupt as exc:  # Ctrl+C or SIGTERM outside the watch
            outcome = Outcome(interrupted=getattr(exc, "signum", signal.SIGINT))
            self.run_steps(
                a, [s for s in a.steps if s.when == ON_INTERRUPT and s.where not in self.lost]
            )
        finally:  # whatever happened, no container of the attempt is left (lost hosts aside)
            self.stage(Stage.TEARDOWN, a.number)
            self.run_steps(a, [s for s in a.select("stop") if s.where not in self.lost | self.stuck.keys()])
        return outcome

    def prepare(self, a: AttemptPlan) -> Outcome | None:
        """CLAIM, GATE and SNAPSHOT; an outcome when the attempt cannot start."""
        self.stage(Stage.CLAIM, a.number)
        refused = self.claim(a)
        if refused:
            return refused
        with (self.run_dir / "plan.txt").open(
            "a"
        ) as fh:  # after the claim: a queued job's tries are not plans
            fh.write(a.render() + "\n")
        self.emit("attempt", attempt=a.number, hosts={h.name: h.rank for h in a.hosts}, port=a.port,
                  snapshot=a.snapshot, run_dir=str(self.run_dir))
        self.stage(Stage.GATE, a.number)
        bad = self.gate(a)
        if bad:
            return Outcome(tuple(HostFailure(n, Failure.PREFLIGHT, why) for n, why in bad.items()))
        if self.stopped(a.hosts):
            return Outcome(stopped=True)
        if a.snapshot:
            placed = self.place(a)
            if placed.errors():
                return self.failed_to_start(a, placed)
        return None

    def claim(self, a: AttemptPlan) -> Outcome | None:
        """CLAIM: the attempt's hosts one at a time, in claims.order (the plan's order of the claim
        steps). A host whose units another job took meanwhile refuses: what this attempt claimed is
        released, and the first attempt ends with the holder named; a later one fails that host."""
        done: list[Host] = []
        for s in a.select("claim"):
            h = a.host(s.where)
            try:
                r = self.ssh.run(h, s.command, timeout=s.deadline, what=s.what)
            except Exception as exc:  # noqa: BLE001 - lost or stuck: that host fails to start
                self.release(done)
                return self.failed_to_start(a, PerHost({h.name: exc}))
            held, cleared = claims.parse_claim_output(r.stdout)
            for c in cleared:
                self.note(f"{h.name}: cleared the stale claim of {c.describe(h)}: no container of that job "
                          "runs there and its lease is old", "warning")
            if r.ok:
                done.append(h)
                continue
            self.release(done)
            if r.exited in (claims.REFUSED, claims.QUEUED) and self.ticket and not self.started:
                self.record.attempts.pop()  # as if this attempt never was: the job waits in line
                self.record.save(self.run_dir)
                self.used.clear()
                self.last = self.before
                raise Queued(h, held, claims.parse_queue_output(r.stdout)[0])
            if r.exited in (claims.REFUSED, claims.PORT_TAKEN) and self.replans < 3:
                # Another job planned at the same moment took these units or this master port: plan
                # the attempt again from the claims as they are now (other free units and port, or a
                # refusal naming the holder), as if this one never was.
                self.replans += 1
                taken = "master port " + str(a.port) if r.exited == claims.PORT_TAKEN else "its units"
                self.note(
                    f"{h.name}: {taken} claimed meanwhile by another job; planning again",
                    "warning",
                )
                self.record.attempts.pop()
                self.record.save(self.run_dir)
                if self.before is None:
                    self.used.clear()
                self.last = self.before
                raise Contended()
            ahead, _ = claims.parse_queue_output(r.stdout)
            why = (
                f"{h.name}: {claims.kind(h)}s {claims.units_text(a.units.get(h.name, ())) or '(all)'} were "
                f"claimed meanwhile by {'; '.join(c.describe(h) for c in held) or 'another job'}"
                if r.exited == claims.REFUSED
                else f"{h.name}: jobs queued before this one wait for it: "
                f"{'; '.join(w.describe() for w in ahead)}; add --queue to wait in line behind them"
                if r.exited == claims.QUEUED
                else f"{h.name}: {s.what} failed (exit {r.exited}): {hostile.text(r.stderr.strip()[-300:])}"
            )
            if a.number == 1 and not self.resuming:
                for name in [x.name for x in a.hosts]:
                    self.used.pop(name, None)  # nothing of this job is left on them to fetch or clean
                raise Refused(
                    f"{why}; nothing was started. Wait for that job (--queue waits in line and starts "
                    "by itself), or choose other hosts or GPUs (--include/--exclude/--num-nodes/--gpus)"
                )
            return self.failed_to_start(a, PerHost({h.name: UserError(why)}))
        return None

    def wait_in_queue(self, q: Queued) -> bool:
        """fab train --queue, while the hosts are held: the job's place taken (or renewed) in the queue
        of each of its hosts, its position said when it changes, then a pause; False when `fab stop`
        ended it meanwhile. claims.queue_scan_script states the queue's rule."""
        hosts = self.roster.hosts
        ticket = self.ticket or ""
        self.replans = 0
        want = claims.want_of(self.spec, self.inv.job.nproc_per_node)

        def enqueue(h: Host) -> Result:
            asked = want.of(h, 0)
            script = claims.enqueue_script(self.inv, self.spec.job_id, ticket, self.spec.owner,
                                           asked if isinstance(asked, tuple) else ())
            return self.ssh.run(
                h, script, timeout=deadlines.STATUS_TIMEOUT, what="keeping its place in the queue"
            )

        got = self.ssh.fan_out(enqueue, hosts)
        ahead: dict[str, list[claims.Waiting]] = {}
        for name in got:
            r = got.value(name)
            if r is None:
                continue
            ahead[name], dropped = claims.parse_queue_output(r.stdout)
            for w in dropped:
                self.note(f"{name}: dropped {w.describe()} from the queue: its fab train (or controller) "
                          f"has not kept its place for {hostfiles.LEASE_STALE:g}s", "warning")
        if not self.queued:
            self.queued, self.queued_since = hosts, time.time()
        position = 1 + max((len(v) for v in ahead.values()), default=0)
        if position != self.position:
            self.position = position
            waits = "; ".join(
                f"{n}: behind {', '.join(w.job for w in v)}" for n, v in ahead.items() if v
            ) or (f"{q.host.name}: held by {', '.join(c.job for c in q.held) or 'another job'}")
            self.note(f"queued: position {position} ({waits}); it starts by itself when its hosts are free. "
                      f"'fab status' shows the queue; 'fab stop --job {self.spec.job_id}' leaves it")
            self.emit("queued", position=position, waits=waits)
        deadline = time.monotonic() + QUEUE_POLL
        while time.monotonic() < deadline:
            if self.stopped(hosts):
                # Out of the queue, and fab stop's marker gone with it (no claim, no runtime files).
                self.release(list(hosts), queue=True)
                self.queued = ()
                self.result.state = self.record.state = "stopped"
                self.result.reason = "ended by 'fab stop' while it waited in the queue"
                self.emit("decision", next=False, reason=self.result.reason, notes=[])
                return False
            time.sleep(min(STOP_POLL, max(0.0, deadline - time.monotonic())))
        return True

    def leave_queue(self) -> None:
        """The job's places in its hosts' queues removed (it starts, or ended while it waited)."""
        if self.queued:
            hosts, self.queued = self.queued, ()
            command = claims.dequeue_command(self.inv, self.spec.job_id)
            self.ssh.fan_out(lambda h: self.ssh.run(h, command, timeout=deadlines.STATUS_TIMEOUT,
                                                    what="leaving the queue"), hosts)
            self.note(f"left the queue after {time.time() - self.queued_since:.0f}s")

    def release(self, hosts: list[Host], queue: bool = False) -> None:
        """Remove this job's claims and runtime directories (with `queue`, its places in their
        queues and stop markers too) from these hosts."""
        command = claims.release_command(self.inv, [self.spec.job_id], queue=queue)
        self.ssh.fan_out(lambda h: self.ssh.run(h, command, timeout=deadlines.STATUS_TIMEOUT,
                                                what="releasing the claim"), tuple(hosts))

    def place(self, a: AttemptPlan) -> PerHost:
        """SNAPSHOT: the plan's snapshot pushed to each host that lacks it, checked by size and
        SHA-256 and renamed into place (the plan's place steps; up to 3 tries each)."""
        snapshot = a.snapshot
        if snapshot is None:
            raise ValueError(f"attempt {a.number} places no snapshot")
        self.stage(Stage.SNAPSHOT, a.number)
        snaps = self.store
        digest = snapshots.local_digest(snaps.local_path(snapshot))
        targets = tuple(a.host(s.host) for s in a.select("place"))
        with snaps.lock:  # the copier of the last attempt must not prune it meanwhile
            return self.ssh.fan_out(lambda h: snaps.push(self.ssh, h, snapshot, digest), targets)

    def gate(self, a: AttemptPlan) -> dict[str, str]:
        """Sync and preflight at once: the hosts that failed, with why. On the first attempt a
        failure ends the job with the preflight's table (nothing was started)."""
        syncs = a.select("sync")
        if not syncs and a.warm and a.number > 1:  # every node warm (all_warm): nothing to sync or check
            return {}
        if not (self.checks or a.number > 1 or self.resuming):
            synced = self.run_steps(a, syncs)
            return {n: str(e) for n, e in synced.errors().items()}
        with ThreadPoolExecutor(max_workers=1) as pool:
            syncing = pool.submit(self.run_steps, a, syncs)
            checks = preflight.run(self.ssh, a.inv, image=a.spec.image, code=False)
            synced = syncing.result()
        here = [c for c in preflight.failed(checks) if c.host == jobspec.LOCAL]
        if here and a.number == 1:  # this machine's own check (rsync): no host to leave out, resumed or not
            raise PreflightFailed(
                checks,
                [],
                f"preflight failed on this machine ({here[0].check}); nothing was "
                "started. Fix the checks above, then run the command again",
            )
        bad = {c.host: f"{c.check}: {c.detail}" for c in preflight.failed(checks) if c.host != jobspec.LOCAL}
        bad.update({n: str(e) for n, e in synced.errors().items() if n not in bad})
        if bad and a.number == 1 and not self.resuming:
            raise PreflightFailed(checks, sorted(bad, key=[h.name for h in a.hosts].index))
        if not bad and self.smoke and a.number == 1:
            smoke = preflight.smoke_test(self.ssh, a.inv, a.spec.image, checks, run_quiet,
                                         within=a.spec.job_id)
            if preflight.failed(smoke):
                raise PreflightFailed(smoke, [], "the collective smoke test failed; nothing was started")
        if not bad:
            seconds = max((r.seconds for r in synced.values_ok()), default=0)
            self.note(f"synced code to {len(syncs)} host(s) in {seconds:.1f}s; preflight ok")
        return bad

    def start(self, a: AttemptPlan) -> Outcome | None:
        """START: the secrets file and docker run on every host at once, rank 0's issued first.
        Nothing waits for rank 0: torchrun's workers retry the rendezvous until it listens."""
        self.stage(Stage.START, a.number)
        self.leave_queue()
        self.started = True
        started = self.run_steps(
            a, [s for s in a.steps if s.key in ("secrets", "start") and s.when == ALWAYS]
        )
        return self.failed_to_start(a, started) if started.errors() else None

    def failed_to_start(self, a: AttemptPlan, results: PerHost) -> Outcome:
        failures = []
        for name, exc in results.errors().items():
            h = a.host(name) if name in {x.name for x in a.hosts} else self.used[name]
            lost = not isinstance(exc, UserError)
            if lost:
                self.lost[name] = h
            failures.append(HostFailure(name, Failure.LOST if lost else Failure.START, describe(h, exc)))
            self.emit("host_failed", attempt=a.number, host=name, kind=failures[-1].kind.value,
                      detail=failures[-1].detail)
        others = [s for s in a.steps if s.when == ON_FAILURE and s.where not in results.errors()]
        self.run_steps(a, others)
        return Outcome(tuple(failures))

    def watch(self, a: AttemptPlan) -> Outcome:
        """WATCH: follow every node (watch.py) while snapshots are copied off rank 0's host."""
        self.stage(Stage.WATCH, a.number)
        copying = threading.Event()
        self.store.follow(self.ssh, a.master, copying)
        try:
            w = watch(self.ssh, a, self.run_dir, self.reporter, hang_timeout=self.policy.hang_timeout,
                      **self.watch_options)
        finally:
            copying.set()
        self.result.watched = w
        self.warm_ranks = {n: e.host.rank for n, e in w.ends.items() if e.warm}
        for e in w.failures:
            if e.failure is Failure.LOST:
                self.lost[e.host.name] = e.host
        for name in w.stuck_engines:
            self.stuck[name] = a.host(name)
        if w.interrupted is not None:
            return Outcome(interrupted=w.interrupted)
        return Outcome(tuple(e.failure_line() for e in w.failures))

    def decide(self, a: AttemptPlan, outcome: Outcome) -> Decision:
        """DECIDE: record the attempt, ask the policy (a failure may have been `fab stop`)."""
        self.stage(Stage.DECIDE, a.number)
        if outcome.failures and not outcome.stopped and self.stopped(tuple(self.used.values())):
            outcome = replace(outcome, stopped=True)
        line = "ok" if outcome.ok else (
            f"interrupted ({signal.Signals(outcome.interrupted).name})" if outcome.interrupted is not None
            else "; ".join(f.line() for f in outcome.failures) or "ended by 'fab stop'")
        rec = self.record.attempts[-1]
        rec.ended, rec.outcome = time.time(), line
        self.record.save(self.run_dir)
        self.emit("attempt_end", attempt=a.number, ok=outcome.ok, outcome=line)
        if not outcome.ok and outcome.interrupted is None:
            self.result.failures.append(f"attempt {a.number} on {', '.join(h.name for h in a.hosts)}: {line}")
        d = decide(outcome, self.policy, self.roster, self.target_nodes)
        self.result.interrupted = outcome.interrupted
        self.result.reason = d.reason
        self.result.state = ("finished" if outcome.ok else "interrupted" if outcome.interrupted is not None
                             else "stopped" if outcome.stopped else "failed")
        if d.roster is not None:
            for n in d.notes:
                self.note(n, "warning")
            pause = backoff(a.number + 1) if d.restart else 0
            self.emit("decision", attempt=a.number, next=True, notes=list(d.notes),
                      reason=(f"attempt {a.number} failed ({line}); restart {d.roster.restarts_used} of "
                              f"{self.policy.restarts} in {pause:g}s") if d.restart
                      else f"attempt {a.number}: {line}; trying again with other hosts")
            self.pause = pause
        else:
            self.emit("decision", attempt=a.number, next=False, reason=d.reason, notes=list(d.notes))
        return d

    def next_attempt(self, d: Decision) -> bool:
        """Between attempts: the new roster, after a pause; False when `fab stop` came meanwhile."""
        if d.roster is None:
            raise ValueError("the decision ends the job: there is no next attempt")
        self.roster = d.roster
        deadline = time.monotonic() + self.pause
        while True:
            if self.stopped(tuple(self.used.values())):
                self.result.state, self.result.reason = "stopped", "ended by 'fab stop' between attempts"
                self.emit("decision", next=False, reason=self.result.reason, notes=[])
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(min(STOP_POLL, max(0.0, deadline - time.monotonic())))

    def finish(self) -> JobResult:
        """FINISH: outputs fetched from every host used and still answering, runtime files removed."""
        self.stage(Stage.FINISH)
        a = self.last
        if self.result.state == "running":  # an error ended the job before its attempt was judged
            self.result.state = "failed"
        self.record.state = self.result.state
        self.record.save(self.run_dir)
        reachable = tuple(h for h in self.used.values() if h.name not in self.lost)
        ends = attempt_mod.end_steps(a.inv, self.spec, reachable, str(self.run_dir)) if a is not None else []
        self.sweep([s for s in ends if s.key == "sweep" and s.where not in self.stuck])
        if a is not None and reachable and self.snaps is not None:
            # The newest snapshot, checked, is the one the outputs keep (the hosts keep K each). No
            # attempt follows, so no host's copy needs checking for placement (hosts=()): every
            # host used is still asked where the newest is.
            self.find_snapshot(replace(a.inv, hosts=()), [], fetch=True)
        if a is not None and reachable:
            for h in reachable:
                (self.run_dir / "outputs" / h.name).mkdir(parents=True, exist_ok=True)
            fetched = self.run_steps(a, [s for s in ends if s.key == "fetch"])
            for name, exc in fetched.errors().items():
                self.note(f"could not fetch outputs from {name}: {exc}", "warning")
            self.run_steps(a, [s for s in ends if s.key == "cleanup"])
        if self.lost:
            self.note(
                f"lost during the job: {', '.join(self.lost)}; its container and runtime files may still "
                "exist: 'fab stop' removes them once it answers again",
                "warning",
            )
        if self.stuck:
            self.note(f"Docker engine stuck on {', '.join(self.stuck)}: its container may still exist; run "
                      "'fab stop' once the engine answers", "warning")
        self.result.attempts = len(self.record.attempts)
        self.result.lost, self.result.stuck_engines = list(self.lost), list(self.stuck)
        self.emit(
            "finished", state=self.result.state, attempts=self.result.attempts, run_dir=str(self.run_dir)
        )
        return self.result

    def sweep(self, steps: list[Step]) -> None:
        """Every container of the job removed again, by its label, from the hosts it used: what a
        `docker run` that came back late (after its deadline, or after the teardown looked) left
        behind is named and gone before the job's claim on those GPUs is released."""
        a = self.last
        if not steps or a is None:  # no plan, no steps: the job ended before its first attempt
            return
        swept = self.run_steps(a, steps)
        for name, r in swept.items():
            if name in swept.errors():
                self.note(f"{name}: could not look for containers of the job left after its teardown: "
                          f"{describe(self.used[name], r)}; 'fab stop' removes them", "warning")
            elif r.stdout.split() and not a.warm:  # a warm job's containers wait there by design
                self.note(
                    f"{name}: removed {len(r.stdout.split())} container(s) of the job still there after its "
                    "teardown (a docker run that came back after its deadline?)",
                    "warning",
                )


class Contended(Exception):
    """The attempt's units or master port were claimed by another job between its plan and its claim."""


class Queued(Exception):
    """fab train --queue: a host's GPUs (slots) are held, or jobs queued before this one wait for it."""

    def __init__(self, host: Host, held: list[claims.Holder], ahead: list[claims.Waiting]) -> None:
        super().__init__(host.name)
        self.host, self.held, self.ahead = host, held, ahead


class Refused(UserError):
    """The job's hosts (or GPUs) are held by another job: nothing was started."""


class PreflightFailed(UserError):
    """The first attempt's gate failed: nothing was started."""

    def __init__(self, checks: list[Check], hosts: list[str], text: str = "") -> None:
        super().__init__(
            text
            or f"preflight failed on {', '.join(hosts)}; nothing was started. Fix the checks "
            "above, then run the command again"
        )
        self.checks = checks


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


def start_quiet(session: Session, inv: Inventory, spec: jobspec.JobSpec) -> AttemptPlan:
    """Start a short job's containers on every host (no sync, no events, no copies): the
    preflight's smoke test and the benchmarks. UserError naming the hosts that failed to start."""
    spec = replace(spec, code_key=codetree.key(spec.code, spec.code_only))
    a = attempt_mod.build(inv, spec, 1, inv.job.master_port)
    job = Job(inv, spec, Policy(hang_timeout=0), Path("runs"), Reporter(), session=session)
    errors = job.run_steps(a, a.select("claim") + a.select("sync") + [
        s for s in a.steps if s.key in ("secrets", "start") and s.when == ALWAYS]).errors()
    if errors:
        end_quiet(session, a)
        raise UserError("starting the job failed:\n" + "\n".join(str(e) for e in errors.values()))
    return a


def end_quiet(session: Session, a: AttemptPlan) -> None:
    """Remove a short job's containers and runtime files from every host."""
    Job(a.inv, a.spec, Policy(), Path("runs"), Reporter(), session=session).run_steps(
        a, a.select("stop") + a.select("cleanup")
    )


def run_quiet(session: Session, inv: Inventory, spec: jobspec.JobSpec, run_dir: Path) -> Watched:
    """A short job, start to clean up, quietly (the preflight's smoke test)."""
    try:
        a = start_quiet(session, inv, spec)
    except UserError as exc:
        return Watched(failures=[NodeEnd(h, failure=Failure.START, detail=str(exc)) for h in inv.hosts])
    try:
        return watch(session, a, run_dir, echo=False)
    finally:
        end_quiet(session, a)
