"""What a running job knows between two of its stages, as one frozen value (`JobState`): the spec as
last keyed, the roster of the next attempt (its spares and the restarts spent), the attempts done
and the one under way. Each stage (job.py's `course`) takes a JobState and returns the next one;
what it knows of its hosts (used, lost, stuck, warm) is read from the attempts, never kept apart.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from orchestrator.backends.ssh.attempt import AttemptPlan
    from orchestrator.backends.ssh.state import Attempted
    from orchestrator.config.inventory import Host
    from orchestrator.core.jobspec import JobSpec
    from orchestrator.core.policy import Roster


@dataclass(frozen=True)
class JobState:
    """The job between two stages: everything a stage decides from that changes as the job goes."""

    spec: JobSpec  # its code_key as the last PLAN read it (planning.key_code)
    roster: Roster  # the next attempt's hosts, the spares, the restarts spent
    recorded: int = 0  # attempts in the job's record, a resumed job's earlier ones too
    history: tuple[Attempted, ...] = ()  # the attempts done, each as its stages left it
    current: AttemptPlan | None = None  # the attempt under way, from its claim to DECIDE
    started: bool = False  # a container of this job was started by this process
    # A failover's standby found these hosts silent (host -> why): lost from the start of the next
    # watch only (the watch after it asks them again).
    known_lost: tuple[tuple[str, str], ...] = ()

    @property
    def number(self) -> int:
        """The number of the next attempt to plan."""
        return self.recorded + 1

    @property
    def ran(self) -> bool:
        """A container of this job may exist: this process started one, or an earlier attempt of a
        resumed job did (its record holds attempts before the one under way)."""
        return self.started or self.recorded > 1

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

    def answering(self, hosts: Iterable[Host]) -> tuple[Host, ...]:
        """These hosts but the lost ones."""
        lost = self.lost
        return tuple(h for h in hosts if h.name not in lost)

    def reach(self, a: AttemptPlan) -> tuple[Host, ...]:
        """The hosts a step of attempt `a` may run on: its own and every one the job used."""
        return (*a.hosts, *self.used.values())

    def all_warm(self, hosts: tuple[Host, ...], warm: bool) -> bool:
        """Every host of the next attempt holds its rank's container waiting warm, as the last
        watch found it a moment ago: their code (its key unchanged) and checks are as they were,
        so the attempt syncs nothing and runs no preflight. `warm`: the job keeps its nodes warm."""
        if not (warm and hosts and self.history):
            return False
        last = self.history[-1]
        ranks, hot = last.warm_ranks, {h.name for h in last.plan.hot}
        return last.plan.spec.code_key == self.spec.code_key and all(
            ranks.get(h.name) == h.rank or h.name in hot for h in hosts
        )

    # ------------------------------------------------------------ the transitions the stages make

    def begun(self, a: AttemptPlan) -> JobState:
        """Attempt `a` recorded and under way."""
        return replace(self, recorded=self.recorded + 1, current=a)

    def taken_over(self, a: AttemptPlan) -> JobState:
        """Attempt `a`, whose containers another process started, under way here (fab attach)."""
        return replace(self, current=a, started=True)

    def retracted(self) -> JobState:
        """The attempt under way as if it never was: its claim found the hosts taken meanwhile."""
        return replace(self, recorded=self.recorded - 1, current=None)

    def judged(self, done: Attempted, roster: Roster | None) -> JobState:
        """The attempt under way done as `done`; the next one on `roster` (None: none follows)."""
        return replace(self, history=(*self.history, done), current=None, roster=roster or self.roster)

    def watched(self) -> JobState:
        """After a watch: what a failover found lost held for that watch only."""
        return replace(self, known_lost=())
