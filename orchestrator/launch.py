"""Launch, watch and stop jobs: the steps behind `fab sync`, `train`, `stop`, `status`, `logs`.

Containers run detached, so a job survives a lost terminal or SSH link; `fab status` lists it,
`fab logs` re-attaches and `fab stop` ends it. While `fab train` watches, any container exiting
non-zero or any host going silent (no keepalive answer) stops every other container of the job.
"""
from __future__ import annotations

import contextlib
import queue
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.live import Live

from . import plan, preflight, recovery, report, snapshots
from .errors import UserError
from .inventory import Host, Inventory
from .live import Board
from .logs import Multiplexer, missing_output, sanitize
from .remote import PerHost, Session, describe

PROJECT_ROOT = plan.PROJECT_ROOT
# Deadlines of the remote steps, seconds (the preflight's are in preflight.py). A host that passes
# one is named as stuck; the other hosts are still served.
STATUS_TIMEOUT = 10
START_TIMEOUT = 120  # docker run: may create the output directory and start a large image
STOP_MARGIN = 15     # beyond the stop grace period


# ---------------------------------------------------------------- sync

def sync(inv: Inventory, source: Path = PROJECT_ROOT, hosts: tuple[Host, ...] | None = None) -> dict[str, float]:
    """rsync the local tree to job.code_dir on every host at once; seconds per host."""
    hosts = hosts or inv.hosts

    def one(host: Host) -> float:
        start = time.monotonic()
        proc = subprocess.run(plan.rsync_argv(host, str(source), inv.job.code_dir),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"sync to {host.name} ({host.ssh.where()}) failed (rsync exit {proc.returncode}): "
                            f"{sanitize(proc.stderr.strip()[-400:])}; check SSH access with: "
                            f"{plan.shell([*plan.ssh_argv(host), host.hostname, 'true'])}")
        return time.monotonic() - start

    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        futures = {h.name: pool.submit(one, h) for h in hosts}
    errors, times = [], {}
    for name, fut in futures.items():
        try:
            times[name] = fut.result()
        except UserError as exc:
            errors.append(str(exc))
    if errors:
        raise UserError("\n".join(errors))
    return times


# ---------------------------------------------------------------- train

@dataclass
class Outcome:
    """How one node of a job ended."""

    host: Host
    exit_code: int | None = None  # None: never finished (lost, or stopped by us)
    error: str | None = None
    tail: str = ""
    lost: bool = False  # the host stopped answering (it is replaced at a restart)


@dataclass
class JobResult:
    job_id: str
    run_dir: Path
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    first_failure: Outcome | None = None
    interrupted: int | None = None  # the signal number that stopped the job
    teardown_seconds: float | None = None
    hung: list[str] = field(default_factory=list)  # the watchdog's per-rank summary of a hang
    attempts: int = 1
    failures: list[str] = field(default_factory=list)  # every failed attempt, one line each
    stopped: bool = False  # ended by `fab stop`

    @property
    def ok(self) -> bool:
        return (self.first_failure is None and self.interrupted is None
                and all(o.exit_code == 0 for o in self.outcomes.values()))


def dry_run(inv: Inventory, spec: plan.JobSpec) -> str:
    """Every command, per host, in order, exactly as `train` would run it."""
    lines = ["# on this machine, for every host at once:"]
    lines += [plan.shell(plan.rsync_argv(h, spec.code, inv.job.code_dir)) for h in inv.hosts]
    lines.append("# preflight probes (read-only) on every host, then, in rank order:")
    if inv.job.secret_files:
        lines.append(f"# every host: the secrets file {plan.secrets_file(inv, spec)} (mode 600), written "
                     "through the command's stdin")
    for h in inv.hosts:
        probe = plan.gpu_probe_argv(h)
        if probe:
            lines.append(f"[{h.name} rank {h.rank}] {plan.shell(probe)}  # decides the GPU flags below "
                         "(shown for NVIDIA's runtime hook / no AMD groups)")
        lines.append(f"[{h.name} rank {h.rank}] {plan.start_script(inv, h, spec)}  # stdin: "
                     f"{plan.ENTRYPOINT_SOURCE.relative_to(PROJECT_ROOT)}")
    for h in inv.hosts:
        lines.append(f"[{h.name} rank {h.rank}] {plan.follow_logs_script(inv, spec, h.rank)}")
    lines.append("# when a container exits: its exit code and the tail of its log (to send any output "
                 "the follow missed), e.g.:")
    lines.append(f"[{inv.master.name} rank 0] {plan.finish_logs_script(inv, spec, 0)}")
    lines.append("# on failure, Ctrl+C or lost host, on every host:")
    lines.append(plan.stop_script(spec.job_id, inv.job.stop_grace))
    lines.append("# at the end, outputs are fetched, then on every host:")
    lines.append(plan.stop_script(spec.job_id, 0))
    lines.append(plan.shell(plan.cleanup_argv(inv, spec)))
    return "\n".join(lines)


def list_containers(session: Session) -> dict:
    """This project's containers on every host (`plan.status_argv` lines): host -> Result or error,
    each host within STATUS_TIMEOUT."""
    command = plan.shell(plan.status_argv())
    return session.fan_out(lambda h: session.run(h, command, timeout=STATUS_TIMEOUT, what="docker ps"))


def running_jobs(session: Session) -> dict[str, dict[str, int]]:
    """job id -> {host: node rank} where a container of it is running."""
    results = list_containers(session)
    jobs: dict[str, dict[str, int]] = {}
    for host in session.hosts:
        r = results.value(host.name)
        if r is None or not r.ok:
            continue
        for line in r.stdout.splitlines():
            fields = line.split("\t")
            if len(fields) >= 4 and fields[3] in ("running", "created", "restarting") and fields[1].isdigit():
                jobs.setdefault(fields[0], {})[host.name] = int(fields[1])
    return jobs


def mark_stopped(session: Session, inv: Inventory, jobs: dict[str, dict[str, int]]) -> None:
    """Tell a watching `fab train --restarts` that these jobs (running_jobs: job -> its hosts) were
    ended on purpose: a marker in the job's runtime directory, on the hosts it runs on."""
    def mark(h: Host) -> None:
        for job_id, where in jobs.items():
            if h.name in where and plan.valid_job_id(job_id):
                session.put(h, b"", plan.stopped_marker(inv, job_id), 0o644)
    # A host that cannot take its marker is still stopped below (and named there).
    session.fan_out(mark, tuple(h for h in inv.all_hosts if any(h.name in w for w in jobs.values())))


def _write_secrets(session: Session, inv: Inventory, spec: plan.JobSpec) -> None:
    """Secrets go to a 0600 file in the job's runtime directory on each host (mounted read-only),
    through the command's stdin; never a command line."""
    body = []
    for name, path in inv.job.secret_files:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise UserError(f"{inv.path}: job.secret_files.{name}: cannot read {path}: {exc.strerror}") from None
        if "\n" in value:
            raise UserError(f"{inv.path}: job.secret_files.{name}: {path} holds several lines; "
                            "a secret must be one line")
        body.append(f"{name}={value}\n")
    data = "".join(body).encode()
    target = plan.secrets_file(inv, spec)
    results = session.fan_out(lambda h: session.put(h, data, target, 0o600), inv.hosts)
    _raise_any(inv.hosts, results, "writing the secrets file")


def _raise_any(hosts: tuple[Host, ...], results: PerHost, what: str) -> None:
    errors = [describe(h, e) for h in hosts if (e := results.error(h.name))]
    if errors:
        raise UserError(f"{what} failed:\n" + "\n".join(errors))


def start(session: Session, inv: Inventory, spec: plan.JobSpec) -> None:
    """Start the job's containers on every host at once, rank 0's command issued first.

    Nothing waits for rank 0 to be up: torchrun's workers retry the rendezvous store until it
    listens, and waiting for rank 0's `docker run` before the others doubled the launch time
    (see BENCHMARKS.md). If any host fails to start, the caller tears the whole job down.
    """
    if inv.job.secret_files:
        _write_secrets(session, inv, spec)
    entrypoint = plan.ENTRYPOINT_SOURCE.read_bytes()

    def one(host: Host) -> None:
        access = preflight.gpu_access(session, host)
        r = session.run(host, plan.start_script(inv, host, spec, access), timeout=START_TIMEOUT,
                        stdin=entrypoint, what="docker run")
        if not r.ok:
            raise UserError(f"{host.name} (rank {host.rank}): docker run failed (exit {r.exited}): "
                            f"{r.stderr.strip()[-500:]}")

    _raise_any(inv.hosts, session.fan_out(one, inv.hosts), "starting the job")


def cleanup(session: Session, inv: Inventory, spec: plan.JobSpec, hosts: tuple[Host, ...] | None = None) -> None:
    """Remove the job's runtime directory (entrypoint, secrets file) from every host."""
    command = plan.shell(plan.cleanup_argv(inv, spec))
    session.fan_out(lambda h: session.run(h, command, timeout=STATUS_TIMEOUT, what="removing the job's runtime files"),
                    hosts or inv.hosts)


def stop(session: Session, job_id: str | None, grace: float, hosts: tuple[Host, ...] | None = None) -> dict:
    """Stop and remove the job's (or every project) container on each host: host -> Result or error."""
    script = plan.stop_script(job_id, grace)
    return session.fan_out(lambda h: session.run(h, script, timeout=grace + STOP_MARGIN, what="stopping containers"),
                           hosts)


def teardown(session: Session, job_id: str | None, grace: float, hosts: tuple[Host, ...] | None = None) -> float:
    """stop(), timed: seconds until every host answered."""
    start_t = time.monotonic()
    stop(session, job_id, grace, hosts)
    return time.monotonic() - start_t


def watch(session: Session, inv: Inventory, spec: plan.JobSpec, run_dir: Path, echo: bool = True,
          out=None, lost_after: float | None = None, detach: bool = False, hang_timeout: float = 0,
          console=None, live: bool = False) -> JobResult:
    """Stream every node's output until all exit; on the first failure or lost host, stop the rest.
    With `hang_timeout`, no output from any node for that long dumps every rank's stacks and fails
    the job. Ctrl+C stops the job, or with `detach` (a re-attached `fab logs`) only stops watching it.
    With `live` (and a console on a terminal), one status line per host stays below the scrolling lines; a
    straggler is named as soon as its recent steps show it, live or not."""
    board = Board([(h.name, h.rank) for h in inv.hosts])
    live = live and echo and console is not None and console.is_terminal
    mux = Multiplexer(run_dir, out=out, echo=echo, console=console if live else None, board=board)
    width = max(len(f"{h.name} r{h.rank}") for h in inv.hosts)
    result = JobResult(spec.job_id, run_dir)
    events: queue.Queue[Outcome] = queue.Queue()
    sinks = {h.name: mux.sink(h.name, h.rank, width) for h in inv.hosts}
    last_output = [time.monotonic()]

    def follow(host: Host) -> None:
        sink = sinks[host.name]
        outcome = Outcome(host)
        received, window = 0, bytearray()

        def feed(data: bytes) -> None:
            nonlocal received
            received += len(data)
            last_output[0] = time.monotonic()
            window.extend(data)
            del window[:-4096]  # enough to find where the stream stopped in the log's tail
            sink.feed(data)
        try:
            session.stream(host, plan.follow_logs_script(inv, spec, host.rank), feed)
            end = bytearray()
            session.stream(host, plan.finish_logs_script(inv, spec, host.rank), end.extend)
            code, _, tail = bytes(end).partition(b"\n")
            outcome.exit_code = int(code or 255)
            missed = missing_output(received, bytes(window), tail, plan.TAIL_LINES)
            if missed is None:
                session.stream(host, plan.remainder_logs_script(inv, spec, host.rank, received), sink.feed)
            elif missed:
                sink.feed(missed)
        except BaseException as exc:  # noqa: BLE001 - a lost link is an outcome, not a crash
            outcome.error = describe(host, exc)
            outcome.lost = not isinstance(exc, UserError)
        finally:
            sink.close()
            outcome.tail = sink.last_lines()
            events.put(outcome)

    threads = [threading.Thread(target=follow, args=(h,), daemon=True, name=f"follow-{h.name}")
               for h in inv.hosts]
    for t in threads:
        t.start()
    lost_after = lost_after or 3 * max(h.ssh.keepalive for h in inv.hosts)
    pending = {h.name for h in inv.hosts}

    def until_done() -> None:
        """Until every host has ended, or the first failure (then the others are torn down)."""
        while pending:
            for line in board.new_stragglers():
                mux.note(line)
            try:
                o = events.get(timeout=0.2)
            except queue.Empty:
                o = _lost_host(session, inv, pending, lost_after)
                silent = time.monotonic() - last_output[0]
                if o is None and hang_timeout and silent > hang_timeout:
                    result.hung = dump_stacks(session, inv, spec, sinks, console)
                    o = Outcome(inv.master, error=f"no output from any node for {silent:.0f}s (--hang-timeout "
                                f"{hang_timeout:g}); stuck: {'; '.join(result.hung) or 'no stacks could be read'}")
                if o is None:
                    continue
            pending.discard(o.host.name)
            result.outcomes[o.host.name] = o
            if (o.exit_code != 0 or o.error) and result.first_failure is None:
                result.first_failure = o
                others = tuple(h for h in inv.hosts if h.name in pending)
                result.teardown_seconds = teardown(session, spec.job_id, 0, others)
                _drain_events(events, pending, result, timeout=5)
                return

    view = (Live(get_renderable=board.render, console=console, refresh_per_second=2, transient=True,
                 redirect_stdout=False, redirect_stderr=False) if live else contextlib.nullcontext())
    try:
        with view:
            until_done()
    except KeyboardInterrupt as exc:
        if detach:
            raise
        result.interrupted = getattr(exc, "signum", signal.SIGINT)
        result.teardown_seconds = teardown(session, spec.job_id, inv.job.stop_grace)
        _drain_events(events, pending, result, timeout=5)
    return result


STACKS_TIMEOUT = 15


def dump_stacks(session: Session, inv: Inventory, spec: plan.JobSpec, sinks: dict, console=None) -> list[str]:
    """Every rank's Python stacks (the watchdog hook, docker/entrypoint.py), into each host's log
    and the terminal; one line per rank saying where it is."""
    results = session.fan_out(lambda h: session.run(h, plan.shell(plan.stacks_argv(spec, h.rank)),
                                                    timeout=STACKS_TIMEOUT, what="reading stacks"), inv.hosts)
    summary = []
    for h in inv.hosts:
        r, err = results.value(h.name), results.error(h.name)
        text = r.stdout if r else ""
        if not text.strip():
            why = describe(h, err) if err else (r.stderr.strip()[-200:] or "no stacks")
            summary.append(f"{h.name}: stacks unreadable ({sanitize(why)})")
            continue
        sinks[h.name].feed(f"[fabtrain] hang watchdog: stacks of every rank on {h.name}\n{text}".encode())
        for line in recovery.stack_summary(text):
            rank, _, where = line.partition(": ")
            src = recovery.source_line(spec.code, where.rsplit(" from ", 1)[-1].split(" in ")[0])
            summary.append(f"{rank} on {h.name}: {where}" + (f" `{src}`" if src else ""))
    if console is not None:
        console.print("[red]hang watchdog:[/] no output from any node; where each rank is:\n  "
                      + "\n  ".join(sanitize(s) for s in summary), highlight=False)
    return summary


def _drain_events(events: queue.Queue, pending: set[str], result: JobResult, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        try:
            o = events.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue.Empty:
            break
        pending.discard(o.host.name)
        result.outcomes.setdefault(o.host.name, o)


def _lost_host(session: Session, inv: Inventory, pending: set[str], lost_after: float) -> Outcome | None:
    now = time.monotonic()
    for h in inv.hosts:
        seen = session.alive_since(h)
        if h.name in pending and seen is not None and now - seen > lost_after:
            return Outcome(h, error=f"{h.name}: no SSH keepalive answer for {now - seen:.0f}s; host lost",
                           lost=True)
    return None


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM both interrupt the watcher, which then stops the job with its grace."""
    def handler(signum, frame):  # noqa: ANN001
        raise Interrupted(signum)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def fetch_outputs(session: Session, inv: Inventory, spec: plan.JobSpec, run_dir: Path,
                  hosts: tuple[Host, ...] | None = None) -> dict[str, str]:
    """Copy each host's output directory of the job into run_dir/outputs/<host> (rsync)."""
    def one(host: Host) -> str:
        dest = run_dir / "outputs" / host.name
        dest.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(plan.fetch_argv(host, f"{inv.job.output_dir}/{spec.job_id}", str(dest)),
                              capture_output=True, text=True)
        return "ok" if proc.returncode == 0 else sanitize(proc.stderr.strip()[-200:])
    results = session.fan_out(one, hosts)
    return {h: results.value(h) or str(results.error(h)) for h in results}


# ---------------------------------------------------------------- the whole job

def refuse_if_running(session: Session, job_id: str | None = None) -> None:
    jobs = running_jobs(session)
    jobs.pop(job_id, None)
    if jobs:
        listing = "; ".join(f"{j} on {', '.join(hs)}" for j, hs in jobs.items())
        raise UserError(f"a job is already running ({listing}): one job at a time shares the master "
                        f"port and the GPUs. Watch it with 'fab logs', or end it with 'fab stop'")


def gate(session: Session, inv: Inventory, spec: plan.JobSpec, console, smoke: bool = False,
         hosts_at_fault: bool = False) -> list[str]:
    """Sync the code and run preflight at once; start nothing if either fails. The code check is
    left out (the sync running beside it is what makes the trees equal), the smoke test runs
    after the sync when asked. Returns the hosts that failed (with `hosts_at_fault`, at a restart,
    so spares can replace them); otherwise a failure raises."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        synced = pool.submit(sync, inv, Path(spec.code))
        checks = preflight.run(session, inv, image=spec.image, code=False)
        bad = preflight.failed(checks)
        if bad:
            preflight.render(checks, console)
            try:
                synced.result()
            except UserError:
                pass  # the preflight's verdict names the host too
            hosts = sorted({c.host for c in bad}, key=[h.name for h in inv.hosts].index)
            if hosts_at_fault:
                return hosts
            raise UserError(f"preflight failed on {', '.join(hosts)}; nothing was started. Fix the checks "
                            "above, then run the command again")
        times = synced.result()
    if smoke:
        smoke_checks = preflight.smoke_test(session, inv, spec.image, checks, run_once)
        if preflight.failed(smoke_checks):
            preflight.render(smoke_checks, console)
            raise UserError("the collective smoke test failed; nothing was started")
    console.print(f"synced code to {len(times)} host(s) in {max(times.values()):.1f}s; preflight ok",
                  highlight=False)
    return []


def run_once(session: Session, inv: Inventory, spec: plan.JobSpec, run_dir: Path) -> JobResult:
    """A short job, start to clean up, quietly (the preflight's smoke test)."""
    try:
        start(session, inv, spec)
        return watch(session, inv, spec, run_dir, echo=False)
    finally:
        teardown(session, spec.job_id, 0)
        cleanup(session, inv, spec)


@dataclass
class Policy:
    """How a job meets failures: `restarts` more attempts at most (for the whole job, not per
    node), down to `min_nodes` nodes when no spare is left, and a hang watchdog."""

    restarts: int = 0
    min_nodes: int | None = None  # None: every node of the inventory's hosts:
    hang_timeout: float = recovery.HANG_TIMEOUT


def train(inv: Inventory, spec: plan.JobSpec, console, run_root: Path, checks: bool = True,
          smoke: bool = False, out=None, policy: Policy = Policy(),
          record: recovery.JobRecord | None = None, live: bool = False) -> JobResult:
    """The whole job: gate -> start -> watch -> (recover -> start -> watch)... -> fetch -> clean up.

    Every attempt keeps the job's id and output directory; before each one after the first (and
    when resuming), the newest snapshot is placed on every host, so the trainers resume from it.
    A lost host, a host failing preflight at a restart, or a host failing twice gives its node rank
    to a spare; without one the job goes on with fewer nodes down to policy.min_nodes."""
    run_dir = run_root / spec.job_id
    run_dir.mkdir(parents=True, exist_ok=True)
    if record is None:
        spec = replace(spec, env=(*spec.env, ("FABTRAIN_TARGET_NODES", str(len(inv.hosts)))))
        record = recovery.JobRecord.new(spec, inv, policy.restarts, policy.min_nodes, policy.hang_timeout)
    resuming = bool(record.attempts)
    min_nodes = policy.min_nodes or len(inv.hosts)
    spares = list(inv.spares)
    snaps = snapshots.Snapshots(run_dir, inv, spec, keep=inv.job.keep_snapshots,
                                report=lambda line: console.print(line, markup=False, highlight=False))
    used: dict[str, Host] = {}       # every host of any attempt: outputs are fetched from each
    lost: dict[str, Host] = {}
    failed_on: Counter[str] = Counter()
    result = JobResult(spec.job_id, run_dir)
    cur, error = inv, None
    with Session(inv.all_hosts) as session:
        refuse_if_running(session)
        install_signal_handlers()
        try:
            restarts_used = 0
            while True:
                number = len(record.attempts) + 1
                first = number == 1
                if checks or not first:
                    bad = gate(session, cur, spec, console, smoke and first, hosts_at_fault=not first)
                    if bad:  # at a restart: spares take the failing hosts' places
                        cur = _replace(console, cur, bad, spares, min_nodes, {h: "failed preflight" for h in bad})
                        continue
                else:
                    sync(cur, Path(spec.code))
                answering = tuple(h for h in used.values() if h.name not in lost)
                resumed = snaps.place(session, cur, also_ask=answering) if not first or resuming else None
                attempt_spec = replace(spec, env=(*spec.env, ("FABTRAIN_ATTEMPT", str(number))))
                attempt = recovery.Attempt(number, [h.name for h in cur.hosts], time.time(), resumed_from=resumed)
                record.attempts.append(attempt)
                record.state = "running"
                record.save(run_dir)
                _write_plan(run_dir, cur, attempt_spec, number)
                used.update({h.name: h for h in cur.hosts})
                console.print(f"job {spec.job_id} attempt {number}: starting {len(cur.hosts)} node(s), rank 0 on "
                              f"{cur.master.name}" + (f", from snapshot {resumed}" if resumed else "")
                              + f"; logs in {run_dir}", highlight=False)
                copying = threading.Event()
                snaps.follow(session, cur.master, copying)
                try:
                    start(session, cur, attempt_spec)
                    result = watch(session, cur, attempt_spec, run_dir, out=out, hang_timeout=policy.hang_timeout,
                                   console=console, live=live)
                finally:
                    copying.set()
                result.attempts = number
                attempt.ended = time.time()
                attempt.outcome = ("ok" if result.ok else f"interrupted ({signal.Signals(result.interrupted).name})"
                                   if result.interrupted is not None else _failure_line(result))
                record.save(run_dir)
                if result.ok or result.interrupted is not None:
                    break
                result.failures = [f"attempt {a.number} on {', '.join(a.hosts)}: {a.outcome}"
                                   for a in record.attempts if a.outcome != "ok"]
                why: dict[str, str] = {}
                for oc in result.outcomes.values():
                    if oc.lost:
                        lost[oc.host.name] = oc.host
                        why[oc.host.name] = "lost"
                # Hosts known lost are not asked again (each would cost a whole deadline).
                if _stopped(session, cur, spec, tuple(h for h in cur.hosts if h.name not in lost)):
                    result.stopped = True
                    break
                if restarts_used >= policy.restarts:
                    break
                restarts_used += 1
                o = result.first_failure
                if o is not None and not o.lost and not result.hung:
                    failed_on[o.host.name] += 1
                    if failed_on[o.host.name] >= 2:
                        why[o.host.name] = "failed twice"
                teardown(session, spec.job_id, 0, tuple(h for h in cur.hosts if h.name not in lost))
                cur = _replace(console, cur, list(why), spares, min_nodes, why)
                pause = recovery.backoff(number + 1)
                console.print(f"[yellow]job {spec.job_id}: attempt {number} failed ({_failure_line(result)}); "
                              f"restart {restarts_used} of {policy.restarts} in {pause:g}s[/]", highlight=False)
                time.sleep(pause)
        except KeyboardInterrupt as exc:  # Ctrl+C while starting or between attempts
            result.interrupted = getattr(exc, "signum", signal.SIGINT)
            result.teardown_seconds = teardown(session, spec.job_id, inv.job.stop_grace,
                                               tuple(h for h in used.values() if h.name not in lost) or cur.hosts)
        except UserError as exc:  # no hosts left to go on with, or a failed start
            error = exc
        except BaseException:
            teardown(session, spec.job_id, 0, tuple(h for h in used.values() if h.name not in lost) or cur.hosts)
            raise
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        record.state = ("finished" if result.ok and error is None else "interrupted" if result.interrupted
                        else "stopped" if result.stopped else "failed")
        record.save(run_dir)
        reachable = tuple(h for h in used.values() if h.name not in lost)
        if reachable:
            fetched = fetch_outputs(session, inv, spec, run_dir, reachable)
            for host, status in fetched.items():
                if status != "ok":
                    console.print(f"[yellow]could not fetch outputs from {host}: {status}[/]")
            # Logs and outputs are on this machine now; nothing of the job stays behind on the hosts.
            teardown(session, spec.job_id, 0, reachable)
            cleanup(session, inv, spec, reachable)
        if lost:
            console.print(f"[yellow]lost during the job: {', '.join(lost)}; its container may still exist: "
                          "run 'fab stop' once it answers again[/]")
    try:  # curves and summary.json from what was fetched, failed runs included
        data, _ = report.finish(run_dir)
        if data["per_host"]:
            console.print(report.timing_table(data))
        for st in data["stragglers"]:
            console.print(f"[red]{sanitize(report.straggler_line(st['rank'], st['compute_ms_median'], st['times_median']))}[/]",
                          highlight=False)
    except Exception as exc:  # noqa: BLE001 - a drawing problem must not hide how the job ended
        console.print(f"[yellow]could not write the run's curves and summary: {sanitize(str(exc))}[/]")
    if error is not None:
        if result.failures:
            raise UserError(f"{error}\n  failed attempts:\n" + "\n".join("    " + f for f in result.failures))
        raise error
    return result


def _replace(console, cur: Inventory, names: list[str], spares: list[Host], min_nodes: int,
             why: dict[str, str]) -> Inventory:
    if not names:
        return cur
    nxt = recovery.next_hosts(cur, names, spares, min_nodes, why)
    for note in nxt.notes:
        console.print(f"[yellow]{note}[/]", highlight=False)
    return nxt.inventory


def _write_plan(run_dir: Path, inv: Inventory, spec: plan.JobSpec, number: int) -> None:
    """plan.txt: every command of every attempt, as it was run."""
    with (run_dir / "plan.txt").open("a") as fh:
        fh.write(f"# ---- attempt {number}: {', '.join(f'{h.name}=rank {h.rank}' for h in inv.hosts)}\n")
        fh.write(dry_run(inv, spec) + "\n")


def _stopped(session: Session, inv: Inventory, spec: plan.JobSpec, hosts: tuple[Host, ...]) -> bool:
    """Whether `fab stop` ended the job (its marker on any of these hosts)."""
    command = plan.shell(["test", "-e", plan.stopped_marker(inv, spec.job_id)])
    results = session.fan_out(lambda h: session.run(h, command, timeout=STATUS_TIMEOUT, what="checking for fab stop"),
                              hosts)
    return any(r.ok for r in results.values_ok())


def _failure_line(result: JobResult) -> str:
    o = result.first_failure or next((o for o in result.outcomes.values() if o.exit_code != 0), None)
    if o is None:
        return "failed"
    return f"{o.host.name} (node rank {o.host.rank}) " + (o.error or f"exited with code {o.exit_code}{worker_failure(o.tail)}")


def explain(result: JobResult) -> UserError | None:
    """The error a finished job exits with, naming host, rank, exit code and the last log lines."""
    if result.ok:
        return None
    if result.interrupted is not None:
        name = signal.Signals(result.interrupted).name
        return UserError(f"job {result.job_id} interrupted ({name}); every container was stopped "
                         f"(teardown {result.teardown_seconds or 0:.1f}s). Continue it with: fab train "
                         f"--resume {result.job_id}. Logs: {result.run_dir}",
                         exit_code=128 + int(result.interrupted))
    o = result.first_failure or next(o for o in result.outcomes.values() if o.exit_code != 0)
    torn = (f"; the other nodes were stopped in {result.teardown_seconds:.1f}s"
            if result.teardown_seconds is not None else "")
    tail = "\n".join("    " + line for line in sanitize(o.tail).splitlines()[-20:])
    head = f"job {result.job_id} failed: {_failure_line(result)}{torn}."
    if result.stopped:
        head = f"job {result.job_id} was ended by 'fab stop' ({_failure_line(result)})."
    if len(result.failures) > 1:
        head += (f"\n  every attempt failed ({result.attempts}):\n"
                 + "\n".join("    " + sanitize(f) for f in result.failures))
    return UserError(f"{head}\n  last lines of {o.host.name}:\n{tail}\n  full logs: {result.run_dir}\n"
                     f"  continue from the newest snapshot with: fab train --resume {result.job_id}")


def worker_failure(tail: str) -> str:
    """torchrun's agent exits 1 whatever its worker did; its root-cause report says which worker."""
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", tail, re.S)
    return f" (worker rank {m.group(1)} exited with code {m.group(2)})" if m else ""
