"""Watch one attempt: follow every node's output until all end, and decide when it has failed.

A node ends when its container exits (its exit code read through Docker), or when the node's own
last line says how its ranks ended (`[fabtrain] node exit code N`, printed by our entrypoint) and
Docker has not answered within ENGINE_GRACE (a frozen engine: the node is judged by its own
exit, and the host is named as one whose engine is stuck). The attempt fails at the first node
that exits non-zero, the first host lost (no SSH keepalive answer), or a hang (`Progress`); the
other nodes are then stopped at once.

What counts as progress (README: progress), per node:
- a step number higher than the last one the node printed (our trainers' step and progress
  lines, or any line with `step N` / `step: N` / `step=N`);
- its heartbeat file touched (FABTRAIN_HEARTBEAT, given to every rank by the entrypoint);
- its ranks' main threads somewhere else than at the last look: with a hang timeout, the watchdog
  looks where every rank is every STACKS_EVERY (a faulthandler dump, kept out of the log), so a
  thread that keeps printing while the main thread waits is no progress;
- until a node has shown any of these, any output of it (an image whose ranks cannot be looked
  at is judged this way throughout).
A node that has shown progress is hung when it shows none for the hang timeout (however much
else it prints); the whole job is hung when no node has shown progress or output for that long.
"""
from __future__ import annotations

import contextlib
import queue
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from rich.live import Live

from orchestrator.backends.ssh.attempt import ON_FAILURE, ON_INTERRUPT, AttemptPlan, Step
from orchestrator.commands import hostfiles
from orchestrator.config.inventory import Host
from orchestrator.core import hostile, recovery
from orchestrator.core.errors import UserError
from orchestrator.core.events import Reporter
from orchestrator.core.policy import Failure, HostFailure
from orchestrator.progress.live import STEP, Board
from orchestrator.transport.logs import Multiplexer, missing_output
from orchestrator.transport.remote import CommandTimedOut, PerHost, Result, Session, describe

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

ENGINE_GRACE = 10.0   # seconds Docker may take to confirm an exit the node itself reported
STACKS_EVERY = (1.0, 30.0)  # the looks at where the ranks are: hang timeout / 5, within these bounds
DRAIN = 5.0           # seconds to collect the other nodes' ends after a failure
EXIT_LINE = re.compile(rb"\[fabtrain\] node exit code (-?\d+)")


@dataclass
class NodeEnd:
    """How one node of an attempt ended."""

    host: Host
    exit_code: int | None = None      # None: never read (lost host, stuck engine before the end)
    failure: Failure | None = None
    detail: str = ""
    tail: str = ""
    by_us: bool = False                # stopped because another node failed, or by Ctrl+C
    warm: bool = False                 # its container waits for the next generation (attempt.build)

    def failure_line(self) -> HostFailure:
        return HostFailure(
            self.host.name, self.failure or Failure.EXIT, self.detail + worker_failure(self.tail)
        )

    def summary(self) -> str:
        """'exited with code 3', 'lost: no SSH keepalive answer ...', 'hung: no progress ...'."""
        if self.failure in (None, Failure.EXIT):
            return self.detail
        return f"{self.failure.value}: {self.detail}"


@dataclass
class Watched:
    """What watching an attempt found."""

    ends: dict[str, NodeEnd] = field(default_factory=dict)
    failures: list[NodeEnd] = field(default_factory=list)
    interrupted: int | None = None
    hung: list[str] = field(default_factory=list)      # one line per rank of a hung job
    stuck_engines: list[str] = field(default_factory=list)
    teardown_seconds: float | None = None

    @property
    def ok(self) -> bool:
        return (not self.failures and self.interrupted is None
                and all(e.exit_code == 0 for e in self.ends.values()))


class Progress:
    """Per node: when it last made progress (see the module's docstring), with the clock injected."""

    def __init__(self, names: list[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        now = clock()
        self.last = {n: now for n in names}          # progress, or output until `signalled`
        self.step: dict[str, int] = {}
        self.signalled: set[str] = set()
        self.exits: dict[str, tuple[int, float]] = {}  # the node's own exit line: (code, when seen)
        self.where: dict[str, tuple] = {}            # the node's ranks at the last look (stacks)
        self.moved = {n: now for n in names}         # its last step, heartbeat or move of its ranks

    def observe(self, host: str, block: bytes) -> None:
        """Complete lines a node sent (called from its follower thread)."""
        now = self.clock()
        if host not in self.signalled:
            self.last[host] = now
        if b"tep" in block or b"TEP" in block:
            for m in STEP.finditer(block):
                n = int(m.group(1))
                if n > self.step.get(host, -1):
                    self.step[host] = n
                    self.last[host] = self.moved[host] = now
                    self.signalled.add(host)
        if b"[fabtrain] node exit code" in block:
            exits = list(EXIT_LINE.finditer(block))
            if exits:  # the last one
                self.exits[host] = (int(exits[-1].group(1)), now)

    def heartbeat(self, host: str, age: float) -> None:
        """The node's heartbeat file was touched `age` seconds ago."""
        self.signalled.add(host)
        self.last[host] = max(self.last[host], self.clock() - age)
        self.moved[host] = max(self.moved[host], self.clock() - age)

    def stacks(self, host: str, where: tuple) -> None:
        """Where the node's ranks are now (recovery.stack_signature); moved since the last look is
        progress. From the first look on, output alone no longer is."""
        if not where:
            return
        self.signalled.add(host)
        if self.where.get(host) != where:
            self.where[host] = where
            self.last[host] = self.moved[host] = self.clock()

    def unsure(self, pending: set[str], every: float) -> list[str]:
        """The nodes worth a look at where their ranks are: no step, heartbeat or move for `every`
        seconds (a node printing steps is never signalled: SIGUSR1 only reaches quiet ranks)."""
        now = self.clock()
        return sorted(n for n in pending if now - self.moved[n] > every)

    def stale(self, pending: set[str], timeout: float) -> list[str]:
        """The nodes to check for a hang: each signalled node silent for `timeout`, or every pending
        node when none of them has shown anything for that long."""
        now = self.clock()
        alone = [n for n in pending if n in self.signalled and now - self.last[n] > timeout]
        if alone:
            return sorted(alone)
        if pending and all(now - self.last[n] > timeout for n in pending):
            return sorted(pending)
        return []


class Tee:
    """Lets the log multiplexer feed both the live board and the progress tracker."""

    def __init__(self, *observers) -> None:
        self.observers = observers

    def observe(self, host: str, block: bytes) -> None:
        for o in self.observers:
            o.observe(host, block)


class Watcher:
    """Follows one attempt's nodes (see the module's docstring). `detach`: Ctrl+C only stops
    watching (a re-attached `fab logs`); `known_lost`: hosts never asked again."""

    def __init__(self, session: Session, attempt: AttemptPlan, run_dir: Path, reporter: Reporter,
                 hang_timeout: float = 0, echo: bool = True, out: BinaryIO | None = None,
                 console: Console | None = None, live: bool = False, detach: bool = False,
                 lost_after: float | None = None) -> None:
        self.session, self.attempt, self.reporter = session, attempt, reporter
        self.hosts = attempt.hosts
        self.hang_timeout, self.detach = hang_timeout, detach
        self.board = Board([(h.name, h.rank) for h in self.hosts])
        self.progress = Progress([h.name for h in self.hosts])
        self.live = live and echo and console is not None and console.is_terminal
        self.console = console
        self.mux = Multiplexer(run_dir, out=out, echo=echo, console=console if self.live else None,
                               board=Tee(self.board, self.progress))
        width = max(len(f"{h.name} r{h.rank}") for h in self.hosts)
        self.sinks = {h.name: self.mux.sink(h.name, h.rank, width) for h in self.hosts}
        self.events: queue.Queue[NodeEnd] = queue.Queue()
        self.pending = {h.name for h in self.hosts}
        self.lost_after = lost_after or 3 * max(h.ssh.keepalive for h in self.hosts)
        self.result = Watched()
        self.last_step: dict[str, int] = {}
        self.unreadable = 0
        self.flight_blame = ""  # the host of a rank the flight recorder found missing from a collective
        self.looking: threading.Thread | None = None  # the look at where the ranks are, under way
        self.looked = 0.0

    # ------------------------------------------------------------ following one node

    def follow(self, host: Host) -> None:
        sink, end = self.sinks[host.name], NodeEnd(host)
        received, window = 0, bytearray()

        def feed(data: bytes) -> None:
            nonlocal received
            received += len(data)
            window.extend(data)
            del window[:-4096]  # enough to find where the stream stopped in the log's tail
            sink.feed(data)
        try:
            self.session.stream(host, self.attempt.step(host.name, "follow").command, feed)
            finish = self.attempt.step(host.name, "finish")
            r = self.session.run(host, finish.command, timeout=finish.deadline, what=finish.what)
            first, _, tail = r.stdout.encode().partition(b"\n")
            code = first.split()
            end.exit_code, end.warm = int(code[0] if code else 255), code[1:] == [b"warm"]
            missed = missing_output(received, bytes(window), tail, hostfiles.TAIL_BYTES)
            if missed is None:
                rest = self.attempt.step(host.name, "remainder")
                self.session.stream(host, rest.command.replace("+OFFSET", f"+{received + 1}"), sink.feed,
                                    timeout=rest.timeout)
            elif missed:
                sink.feed(missed)
            if end.exit_code != 0:
                end.failure, end.detail = Failure.EXIT, f"exited with code {end.exit_code}"
        except BaseException as exc:  # noqa: BLE001 - a lost link is an outcome, not a crash
            end.detail = describe(host, exc)
            end.failure = Failure.ENGINE if isinstance(exc, CommandTimedOut) else (
                Failure.EXIT if isinstance(exc, UserError) else Failure.LOST)
        finally:
            sink.close()
            end.tail = sink.last_lines()
            self.events.put(end)

    # ------------------------------------------------------------ the loop

    def run(self) -> Watched:
        for h in self.hosts:
            threading.Thread(target=self.follow, args=(h,), daemon=True, name=f"follow-{h.name}").start()
        view = (
            Live(
                get_renderable=self.board.render,
                console=self.console,
                refresh_per_second=2,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            if self.live
            else contextlib.nullcontext()
        )
        try:
            with view:
                self.until_done()
        except KeyboardInterrupt as exc:
            if self.detach:
                raise
            self.result.interrupted = getattr(exc, "signum", signal.SIGINT)
            self.stop_others(ON_INTERRUPT)
        return self.result

    def until_done(self) -> None:
        while self.pending:
            for line in self.board.new_stragglers():
                self.mux.note(line)
            self.report_progress()
            end: NodeEnd | None
            try:
                end = self.events.get(timeout=0.2)
            except queue.Empty:
                end = self.lost_host() or self.reported_exit() or self.hang()
                if end is None:
                    self.look_where_ranks_are()
                    continue
            if end.host.name not in self.pending:
                continue
            self.pending.discard(end.host.name)
            self.result.ends[end.host.name] = end
            if end.failure is not None:
                self.result.failures.append(end)
                self.reporter.emit("host_failed", job=self.attempt.job_id, attempt=self.attempt.number,
                                   host=end.host.name, kind=end.failure.value, detail=end.detail)
                self.stop_others(ON_FAILURE)
                return

    def report_progress(self) -> None:
        for name, step in list(self.progress.step.items()):
            if self.last_step.get(name) != step:
                self.last_step[name] = step
                self.reporter.emit("progress", job=self.attempt.job_id, attempt=self.attempt.number,
                                   host=name, step=step)

    def lost_host(self) -> NodeEnd | None:
        now = time.monotonic()
        for h in self.hosts:
            seen = self.session.alive_since(h)
            if h.name in self.pending and seen is not None and now - seen > self.lost_after:
                return NodeEnd(h, failure=Failure.LOST,
                               detail=f"no SSH keepalive answer for {now - seen:.0f}s; host lost")
        return None

    def reported_exit(self) -> NodeEnd | None:
        """A node that said how it ended while Docker stays silent about it: its engine is stuck."""
        now = time.monotonic()
        for name, (code, seen) in list(self.progress.exits.items()):
            if name in self.pending and now - seen > ENGINE_GRACE:
                h = self.attempt.host(name)
                self.result.stuck_engines.append(name)
                self.reporter.emit(
                    "note",
                    job=self.attempt.job_id,
                    level="warning",
                    text=f"{name}: its ranks exited with code {code}, but its Docker engine has not "
                    f"confirmed it for {ENGINE_GRACE:g}s (engine stuck?); judging the node by its "
                    "own exit",
                )
                end = NodeEnd(h, exit_code=code, tail=self.sinks[name].last_lines())
                if code != 0:
                    end.failure, end.detail = Failure.EXIT, f"exited with code {code}"
                return end
        return None

    def hang(self) -> NodeEnd | None:
        if not self.hang_timeout:
            return None
        stale = self.progress.stale(self.pending, self.hang_timeout)
        if not stale:
            return None
        beats = self.read_heartbeats(stale)
        # Only nodes whose heartbeat was just read are judged: another may have gone stale meanwhile
        # (it is judged at the next look, with its own heartbeat).
        stale = [n for n in self.progress.stale(self.pending, self.hang_timeout) if n in beats]
        if not stale:
            return None
        if any(beats.get(n, "").startswith("unreadable") for n in stale) and self.unreadable < 2:
            self.unreadable += 1  # a heartbeat that could not be read is asked again, not taken as none
            return None
        self.unreadable = 0
        silent = time.monotonic() - max(self.progress.last[n] for n in stale)
        self.result.hung = self.dump_stacks()
        self.reporter.emit(
            "hang", job=self.attempt.job_id, attempt=self.attempt.number, ranks=self.result.hung
        )
        blamed = self.blame(stale)
        whole = set(stale) == self.pending and len(self.pending) > 1
        what = "no progress from any node" if whole else f"no progress from {blamed.name}"
        return NodeEnd(blamed, failure=Failure.HUNG,
                       detail=f"{what} for {silent:.0f}s (--hang-timeout {self.hang_timeout:g}); heartbeat: "
                              f"{', '.join(f'{n} {beats[n]}' for n in stale)}; stuck: "
                              f"{'; '.join(self.result.hung) or 'no stacks could be read'}",
                       tail=self.sinks[blamed.name].last_lines())

    def look_where_ranks_are(self) -> None:
        """Every STACKS_EVERY, in the background (the loop goes on serving the other nodes), the
        stacks of each pending node without a step or heartbeat for that long into Progress (a job
        printing steps is not looked at); a host that does not answer within the step's deadline
        is only not looked at this time."""
        low, high = STACKS_EVERY
        every = min(high, max(low, self.hang_timeout / 5))
        if (not self.hang_timeout or (self.looking is not None and self.looking.is_alive())
                or time.monotonic() - self.looked < every):
            return
        unsure = self.progress.unsure(self.pending, every)
        if not unsure:
            return
        self.looked = time.monotonic()
        hosts = tuple(h for h in self.hosts if h.name in unsure)

        def look() -> None:
            got = self.session.fan_out(
                lambda h: self.session.run(
                    h, (s := self.attempt.step(h.name, "stacks")).command, timeout=s.deadline, what=s.what
                ),
                hosts,
            )
            for h in hosts:
                r = got.value(h.name)
                if r is not None and r.ok:
                    self.progress.stacks(h.name, recovery.stack_signature(r.stdout))

        self.looking = threading.Thread(target=look, daemon=True, name="where-ranks-are")
        self.looking.start()

    def read_heartbeats(self, names: list[str]) -> dict[str, str]:
        """Each node's heartbeat age, read on its host, into Progress; per node what was read
        ('3s ago', 'none': never touched, 'unreadable: ...')."""
        timeout = self.attempt.step(names[0], "progress").deadline
        got = self.session.fan_out(
            lambda h: self.session.run(h, self.attempt.step(h.name, "progress").command, timeout=timeout,
                                       what="reading the heartbeat"),
            tuple(self.attempt.host(n) for n in names))
        seen = {}
        for n in names:
            r, answer = got.value(n), ""
            answer = r.stdout.strip() if r is not None and r.ok else ""
            if answer.lstrip("-").isdigit():
                self.progress.heartbeat(n, max(0.0, float(answer)))
                seen[n] = f"{answer}s ago"
            elif answer == "none":
                seen[n] = "none"
            else:
                err = got.error(n)
                seen[n] = "unreadable: " + hostile.text(
                    str(err) if err else (r.stderr.strip()[-100:] or answer[-100:])
                )
        return seen

    def blame(self, stale: list[str]) -> Host:
        """The host of the first stuck rank that is not waiting in a collective (it is what the
        others wait for), else the first stale node."""
        hosts = {h.name: h for h in self.hosts}
        if self.flight_blame in self.pending:  # the flight recorder named the rank the others wait for
            return hosts[self.flight_blame]
        for line in self.result.hung:
            m = re.match(r"rank \S+ on (\S+): (.*)", line)
            if (
                m
                and m.group(1) in hosts
                and m.group(1) in self.pending
                and not recovery.in_collective(m.group(2))
            ):
                return hosts[m.group(1)]
        return hosts[stale[0]]

    def dump_stacks(self) -> list[str]:
        """Every pending rank's Python stacks (the watchdog hook, docker/entrypoint.py), into each
        host's log; one line per rank saying where it is."""
        if self.looking is not None:  # its signals would cut into these dumps
            self.looking.join(timeout=self.attempt.step(self.hosts[0].name, "stacks").deadline)
        hosts = tuple(h for h in self.hosts if h.name in self.pending)

        def look(h: Host) -> tuple[Result, Result | None]:
            s, f = self.attempt.step(h.name, "stacks"), self.attempt.step(h.name, "flight")
            stacks = self.session.run(h, s.command, timeout=s.deadline, what=s.what)
            try:
                return stacks, self.session.run(h, f.command, timeout=f.deadline, what=f.what)
            except Exception:  # noqa: BLE001 - the stacks alone still say where the ranks are
                return stacks, None

        looked = self.session.fan_out(look, hosts)
        results = PerHost({n: v[0] if isinstance(v, tuple) else v for n, v in looked.items()})
        flights = [s for h in hosts if (v := looked.value(h.name)) and v[1] is not None and v[1].ok
                   for s in recovery.flight_summaries(h.name, v[1].stdout)]
        verdict = recovery.flight_verdict(flights)
        self.flight_blame = next((h for h, _ in verdict if h), "")
        summary = [line for _, line in verdict]
        for line in summary:
            self.mux.note(f"hang watchdog: {line}")
        for h in hosts:
            r, err = results.value(h.name), results.error(h.name)
            text = r.stdout if r else ""
            if not text.strip():
                why = describe(h, err) if err else (r.stderr.strip()[-200:] or "no stacks")
                summary.append(f"{h.name}: stacks unreadable ({hostile.text(why)})")
                continue
            self.sinks[h.name].feed(
                f"[fabtrain] hang watchdog: stacks of every rank on {h.name}\n{text}".encode()
            )
            for line in recovery.stack_summary(text):
                rank, _, where = line.partition(": ")
                src = recovery.source_line(
                    self.attempt.spec.code, where.rsplit(" from ", 1)[-1].split(" in ")[0]
                )
                summary.append(f"{rank} on {h.name}: {where}" + (f" `{src}`" if src else ""))
        return summary

    def stop_others(self, when: str) -> None:
        """Stop the job's containers on every host still running (not known lost), all at once;
        then collect how they ended, for at most DRAIN seconds."""
        lost = {e.host.name for e in self.result.failures if e.failure is Failure.LOST}
        steps: dict[str, Step] = {s.where: s for s in self.attempt.steps if s.when == when}
        hosts = tuple(h for h in self.hosts if h.name in self.pending and h.name not in lost)
        start = time.monotonic()
        self.session.fan_out(
            lambda h: self.session.run(
                h, steps[h.name].command, timeout=steps[h.name].deadline, what=steps[h.name].what
            ),
            hosts,
        )
        self.result.teardown_seconds = time.monotonic() - start
        deadline = time.monotonic() + DRAIN
        while self.pending and time.monotonic() < deadline:
            try:
                end = self.events.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                break
            if end.host.name in self.pending:
                self.pending.discard(end.host.name)
                end.by_us, end.failure = True, None
                self.result.ends.setdefault(end.host.name, end)


def watch(
    session: Session, attempt: AttemptPlan, run_dir: Path, reporter: Reporter | None = None, **options
) -> Watched:
    """Follow an attempt's nodes until they end (see Watcher); events go nowhere without a reporter."""
    return Watcher(session, attempt, run_dir, Reporter() if reporter is None else reporter, **options).run()


def worker_failure(tail: str) -> str:
    """Which worker failed: torchrun's agent exits 1 whatever its worker did, and its root-cause
    report says which; the entrypoint's direct launch says it in one line (and exits with its code)."""
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", tail, re.S) or re.search(
        r"\[fabtrain\] worker rank (\d+) exited with code (-?\d+)", tail)
    return f" (worker rank {m.group(1)} exited with code {m.group(2)})" if m else ""
