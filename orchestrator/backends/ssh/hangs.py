"""What counts as a watched node's progress, and the looks into its host that tell it.

What counts as progress (docs/recovery.md), per node:
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
At a hang, every rank's stacks and the flight recorder's verdict say which host to blame.
"""

from __future__ import annotations

import re
import threading
import time
from typing import TYPE_CHECKING

from orchestrator.backends.ssh.attempt import AttemptPlan
from orchestrator.config.inventory import Host
from orchestrator.core import hostile, recovery
from orchestrator.progress.live import STEP
from orchestrator.transport.logs import HostSink, Multiplexer
from orchestrator.transport.remote import PerHost, Result, Session, describe

if TYPE_CHECKING:
    from collections.abc import Callable

STACKS_EVERY = (1.0, 30.0)  # the looks at where the ranks are: hang timeout / 5, within these bounds
EXIT_LINE = re.compile(rb"\[fabtrain\] node exit code (-?\d{1,9})")


class Progress:
    """Per node: when it last made progress (see the module's docstring), with the clock injected."""

    def __init__(self, names: list[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        now = clock()
        self.last = {n: now for n in names}  # progress, or output until `signalled`
        self.step: dict[str, int] = {}
        self.signalled: set[str] = set()
        self.exits: dict[str, tuple[int, float]] = {}  # the node's own exit line: (code, when seen)
        self.where: dict[str, tuple] = {}  # the node's ranks at the last look (stacks)
        self.moved = {n: now for n in names}  # its last step, heartbeat or move of its ranks

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
        seconds (a node printing steps is never signalled: the look's signal only reaches quiet ranks)."""
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


class Looks:
    """The looks into the hosts of an attempt's nodes over its session: where their ranks are (in
    the background, into Progress), their heartbeats, and at a hang every rank's stacks and the
    flight recorder's blame."""

    def __init__(
        self,
        session: Session,
        attempt: AttemptPlan,
        progress: Progress,
        hang_timeout: float,
        sinks: dict[str, HostSink],
        mux: Multiplexer,
    ) -> None:
        self.session, self.attempt, self.progress = session, attempt, progress
        self.hosts = attempt.hosts
        self.hang_timeout = hang_timeout
        self.sinks, self.mux = sinks, mux
        self.flight_blame = ""  # the host of a rank the flight recorder found missing from a collective
        self.looking: threading.Thread | None = None  # the look at where the ranks are, under way
        self.looked = 0.0

    def look_where_ranks_are(self, pending: set[str]) -> None:
        """Every STACKS_EVERY, in the background (the loop goes on serving the other nodes), the
        stacks of each pending node without a step or heartbeat for that long into Progress (a job
        printing steps is not looked at); a host that does not answer within the step's deadline
        is only not looked at this time."""
        low, high = STACKS_EVERY
        every = min(high, max(low, self.hang_timeout / 5))
        if (
            not self.hang_timeout
            or (self.looking is not None and self.looking.is_alive())
            or time.monotonic() - self.looked < every
        ):
            return
        unsure = self.progress.unsure(pending, every)
        if not unsure:
            return
        self.looked = time.monotonic()
        hosts = tuple(h for h in self.hosts if h.name in unsure)

        self.looking = threading.Thread(
            target=self.look_at, args=(hosts,), daemon=True, name="where-ranks-are"
        )
        self.looking.start()

    def look_at(self, hosts: tuple[Host, ...]) -> None:
        """Where these nodes' ranks are now (each host's stacks step), into Progress; a host that
        does not answer within the step's deadline is only not looked at this time."""
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

    def look_again(self, names: list[str]) -> None:
        """Before a hang is declared: the look under way finished, and one more look at where these
        nodes' ranks are (within the stacks step's deadline), so that ranks that moved since the
        last look (a slow `import torch` on a loaded host) are progress, not a hang."""
        deadline = self.attempt.step(self.hosts[0].name, "stacks").deadline
        if self.looking is not None:
            self.looking.join(timeout=deadline)
        hosts = tuple(h for h in self.hosts if h.name in names and h.name in self.progress.where)
        if not hosts:
            return  # never looked at: nothing to compare with
        self.look_at(hosts)
        self.looked = time.monotonic()

    def read_heartbeats(self, names: list[str]) -> dict[str, str]:
        """Each node's heartbeat age, read on its host, into Progress; per node what was read
        ('3s ago', 'none': never touched, 'unreadable: ...')."""
        timeout = self.attempt.step(names[0], "progress").deadline
        got = self.session.fan_out(
            lambda h: self.session.run(
                h,
                self.attempt.step(h.name, "progress").command,
                timeout=timeout,
                what="reading the heartbeat",
            ),
            tuple(self.attempt.host(n) for n in names),
        )
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

    def blame(self, stale: list[str], pending: set[str], hung: list[str]) -> Host:
        """The host of the first stuck rank that is not waiting in a collective (it is what the
        others wait for), else the first stale node."""
        hosts = {h.name: h for h in self.hosts}
        if self.flight_blame in pending:  # the flight recorder named the rank the others wait for
            return hosts[self.flight_blame]
        for line in hung:
            m = re.match(r"rank \S+ on (\S+): (.*)", line)
            if m and m.group(1) in hosts and m.group(1) in pending and not recovery.in_collective(m.group(2)):
                return hosts[m.group(1)]
        return hosts[stale[0]]

    def dump_stacks(self, pending: set[str]) -> list[str]:
        """Every pending rank's Python stacks (the watchdog hook, docker/fabtrain_hook.py), into each
        host's log; one line per rank saying where it is."""
        if self.looking is not None:  # its signals would cut into these dumps
            self.looking.join(timeout=self.attempt.step(self.hosts[0].name, "stacks").deadline)
        hosts = tuple(h for h in self.hosts if h.name in pending)

        def look(h: Host) -> tuple[Result, Result | None]:
            s, f = self.attempt.step(h.name, "stacks"), self.attempt.step(h.name, "flight")
            stacks = self.session.run(h, s.command, timeout=s.deadline, what=s.what)
            try:
                return stacks, self.session.run(h, f.command, timeout=f.deadline, what=f.what)
            except Exception:  # noqa: BLE001 - the stacks alone still say where the ranks are
                return stacks, None

        looked = self.session.fan_out(look, hosts)
        results = PerHost({n: v[0] if isinstance(v, tuple) else v for n, v in looked.items()})
        flights = [
            s
            for h in hosts
            if (v := looked.value(h.name)) and v[1] is not None and v[1].ok
            for s in recovery.flight_summaries(h.name, v[1].stdout)
        ]
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
