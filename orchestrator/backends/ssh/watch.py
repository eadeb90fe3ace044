"""Watch one attempt: follow every node's output until all end, and decide when it has failed.

A node ends when its container exits (its exit code read through Docker), or when the node's own
last line says how its ranks ended (`[fabtrain] node exit code N`, printed by our entrypoint) and
Docker has not answered within ENGINE_GRACE (a frozen engine: the node is judged by its own
exit, and the host is named as one whose engine is stuck). The attempt fails at the first node
that exits non-zero, the first host lost (no SSH keepalive answer), or a hang (`Progress`); the
other nodes are then stopped at once. A node whose ranks a broken peer connection brought down is
named only when no other node fails of itself within SETTLE seconds (`own_failure`).

Following one node (its output, its exit, how it ended) is nodefollow.py's; here are the loop over
them all and the verdicts: a host lost, an engine stuck, a hang, and the others stopped. What counts
as progress, and the looks into the hosts that tell it (heartbeats, where the ranks are, at a hang
their stacks and the flight recorder's blame), are in hangs.py.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from rich.live import Live

from orchestrator.backends.ssh.attempt import AttemptPlan
from orchestrator.backends.ssh.hangs import Looks, Progress
from orchestrator.backends.ssh.nodefollow import NodeEnd, brought_down_by_a_peer, follow_node
from orchestrator.backends.ssh.planstep import Step, When
from orchestrator.config.inventory import Host
from orchestrator.core.events import Reporter
from orchestrator.core.policy import Failure
from orchestrator.hosts import hostops
from orchestrator.progress.live import Board
from orchestrator.telemetry.sampler import Sampler
from orchestrator.transport.logs import Multiplexer
from orchestrator.transport.remote import Session

if TYPE_CHECKING:
    from rich.console import Console

ENGINE_GRACE = 10.0  # seconds Docker may take to confirm an exit the node itself reported
DRAIN = 5.0  # seconds to collect the other nodes' ends after a failure
SETTLE = 2.0  # seconds a node brought down by a peer waits for the peer's own end before it is blamed


@dataclass
class Watched:
    """What watching an attempt found."""

    ends: dict[str, NodeEnd] = field(default_factory=dict)
    failures: list[NodeEnd] = field(default_factory=list)
    interrupted: int | None = None
    hung: list[str] = field(default_factory=list)  # one line per rank of a hung job
    stuck_engines: list[str] = field(default_factory=list)
    teardown_seconds: float | None = None

    @property
    def ok(self) -> bool:
        return (
            not self.failures
            and self.interrupted is None
            and all(e.exit_code == 0 for e in self.ends.values())
        )


class Tee:
    """Lets the log multiplexer feed both the live board and the progress tracker."""

    def __init__(self, *observers) -> None:
        self.observers = observers

    def observe(self, host: str, block: bytes) -> None:
        for o in self.observers:
            o.observe(host, block)


class Watcher:
    """Follows one attempt's nodes (see the module's docstring). `detach`: Ctrl+C only stops
    watching (a re-attached `fab logs`); `known_lost`: host -> why it was found silent before this
    watch began (a failover's survey): that node ends lost at once, its host never asked again."""

    def __init__(
        self,
        session: Session,
        attempt: AttemptPlan,
        run_dir: Path,
        reporter: Reporter,
        hang_timeout: float = 0,
        echo: bool = True,
        out: BinaryIO | None = None,
        console: Console | None = None,
        live: bool = False,
        detach: bool = False,
        lost_after: float | None = None,
        known_lost: dict[str, str] | None = None,
    ) -> None:
        self.session, self.attempt, self.reporter = session, attempt, reporter
        names = {h.name for h in attempt.hosts}
        self.known_lost = {n: why for n, why in (known_lost or {}).items() if n in names}
        self.hosts = attempt.hosts
        self.hang_timeout, self.detach = hang_timeout, detach
        self.board = Board([(h.name, h.rank) for h in self.hosts])
        self.progress = Progress([h.name for h in self.hosts])
        self.live = live and echo and console is not None and console.is_terminal
        self.console = console
        self.mux = Multiplexer(
            run_dir,
            out=out,
            echo=echo,
            console=console if self.live else None,
            board=Tee(self.board, self.progress),
        )
        width = max(len(f"{h.name} r{h.rank}") for h in self.hosts)
        self.sinks = {h.name: self.mux.sink(h.name, h.rank, width) for h in self.hosts}
        self.events: queue.Queue[NodeEnd] = queue.Queue()
        self.pending = {h.name for h in self.hosts}
        self.lost_after = lost_after or 3 * max(h.ssh.keepalive for h in self.hosts)
        self.result = Watched()
        self.last_step: dict[str, int] = {}
        self.unreadable = 0
        self.looks = Looks(session, attempt, self.progress, hang_timeout, self.sinks, self.mux)

    # ------------------------------------------------------------ following one node

    def follow(self, host: Host) -> None:
        """One node followed to its end (nodefollow.py), in its own thread; its end queued."""
        follow_node(self.session, self.attempt, host, self.sinks[host.name], self.note, self.events.put)

    # ------------------------------------------------------------ the loop

    def run(self) -> Watched:
        for h in self.hosts:
            if h.name in self.known_lost:  # found silent before this watch began: not asked again
                self.sinks[h.name].close()
                self.events.put(NodeEnd(h, failure=Failure.LOST, detail=self.known_lost[h.name]))
                continue
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
        sampler = Sampler(
            self.session,
            self.attempt,
            self.emit,
            self.note,
            self.stop_idle,
            watched=lambda host: host in self.pending,
        )
        sampler.start()
        try:
            with view:
                self.until_done()
        except KeyboardInterrupt as exc:
            if self.detach:
                raise
            self.result.interrupted = getattr(exc, "signum", signal.SIGINT)
            self.stop_others(When.ON_INTERRUPT)
        finally:
            sampler.stop()
        return self.result

    def emit(self, event: str, **fields) -> None:
        self.reporter.emit(event, job=self.attempt.job_id, attempt=self.attempt.number, **fields)

    def note(self, text: str, level: str = "info") -> None:
        self.reporter.emit("note", job=self.attempt.job_id, level=level, text=text)

    def stop_idle(self, why: str) -> None:
        """--stop-idle: the job ended as `fab stop` ends it (its marker left, its containers stopped),
        from the sampler's thread; the watch then sees the nodes end."""
        hosts = tuple(h for h in self.hosts if h.name in self.pending)
        hostops.mark_stopped(self.session, self.attempt.inv, {self.attempt.job_id: [h.name for h in hosts]})
        steps = {s.where: s for s in self.attempt.steps if s.when == When.ON_INTERRUPT}
        self.session.fan_out(
            lambda h: self.session.run(
                h, steps[h.name].command, timeout=steps[h.name].deadline, what=steps[h.name].what
            ),
            hosts,
        )
        self.note(f"job stopped: {why} (--stop-idle)", "warning")

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
                    self.looks.look_where_ranks_are(self.pending)
                    continue
            if end.host.name not in self.pending:
                continue
            self.pending.discard(end.host.name)
            self.result.ends[end.host.name] = end
            if end.failure is not None:
                end = self.own_failure(end)
                self.result.failures.append(end)
                self.reporter.emit(
                    "host_failed",
                    job=self.attempt.job_id,
                    attempt=self.attempt.number,
                    host=end.host.name,
                    kind=(end.failure or Failure.EXIT).value,
                    detail=end.detail,
                )
                self.stop_others(When.ON_FAILURE)
                return

    def own_failure(self, first: NodeEnd) -> NodeEnd:
        """The node to blame for an attempt's failure: `first`, unless its ranks were brought down
        by a peer whose connection broke (nodefollow.brought_down_by_a_peer), which often reaches
        here before the peer's own end (a killed worker's node reports it moments later). Then the
        other nodes' ends that come within SETTLE seconds are taken: the first that failed of
        itself is blamed, and `first` ends as one stopped by another's failure. A failure of
        itself comes first at once: no wait."""
        if not brought_down_by_a_peer(first):
            return first
        deadline = time.monotonic() + SETTLE
        while (end := self.next_end(deadline)) is not None:
            self.result.ends[end.host.name] = end
            if end.failure is None:
                continue
            if not brought_down_by_a_peer(end):
                first.by_us, first.failure = True, None
                return end
            end.by_us, end.failure = True, None  # brought down too: `first` stays the one named
        return first

    def report_progress(self) -> None:
        for name, step in list(self.progress.step.items()):
            if self.last_step.get(name) != step:
                self.last_step[name] = step
                self.reporter.emit(
                    "progress",
                    job=self.attempt.job_id,
                    attempt=self.attempt.number,
                    host=name,
                    step=step,
                    ranks=self.board.ranks(name),
                )

    def lost_host(self) -> NodeEnd | None:
        now = time.monotonic()
        for h in self.hosts:
            seen = self.session.alive_since(h)
            if h.name in self.pending and seen is not None and now - seen > self.lost_after:
                return NodeEnd(
                    h,
                    failure=Failure.LOST,
                    detail=f"no SSH keepalive answer for {now - seen:.0f}s; host lost",
                )
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
        self.looks.look_again(stale)
        stale = self.progress.stale(self.pending, self.hang_timeout)
        if not stale:
            return None  # their ranks moved
        beats = self.looks.read_heartbeats(stale)
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
        self.result.hung = self.looks.dump_stacks(self.pending)
        self.reporter.emit(
            "hang", job=self.attempt.job_id, attempt=self.attempt.number, ranks=self.result.hung
        )
        blamed = self.looks.blame(stale, self.pending, self.result.hung)
        whole = set(stale) == self.pending and len(self.pending) > 1
        what = "no progress from any node" if whole else f"no progress from {blamed.name}"
        return NodeEnd(
            blamed,
            failure=Failure.HUNG,
            detail=f"{what} for {silent:.0f}s (--hang-timeout {self.hang_timeout:g}); heartbeat: "
            f"{', '.join(f'{n} {beats[n]}' for n in stale)}; stuck: "
            f"{'; '.join(self.result.hung) or 'no stacks could be read'}",
            tail=self.sinks[blamed.name].last_lines(),
        )

    def stop_others(self, when: When) -> None:
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
        while (end := self.next_end(deadline)) is not None:
            end.by_us, end.failure = True, None
            self.result.ends.setdefault(end.host.name, end)

    def next_end(self, deadline: float) -> NodeEnd | None:
        """The next end of a node still pending, if one comes before `deadline` (monotonic): taken
        off `pending`. None when every node has ended or the time is up."""
        while self.pending and (left := deadline - time.monotonic()) > 0:
            try:
                end = self.events.get(timeout=max(0.05, left))
            except queue.Empty:
                return None
            if end.host.name in self.pending:
                self.pending.discard(end.host.name)
                return end
        return None


def watch(
    session: Session, attempt: AttemptPlan, run_dir: Path, reporter: Reporter | None = None, **options
) -> Watched:
    """Follow an attempt's nodes until they end (see Watcher); events go nowhere without a reporter."""
    return Watcher(session, attempt, run_dir, Reporter() if reporter is None else reporter, **options).run()
