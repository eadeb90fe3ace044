"""What happens after an attempt: pure decisions from (outcome, policy, roster) to the next roster
or the reason to stop. Nothing here touches a host, so every case is a row in a unit test.

A failure is one host's, of one kind (`Failure`); an attempt's outcome is its failures plus
whether the user ended it (`fab stop`, Ctrl+C). The policy is the user's: restarts for the whole
job, down to `min_nodes` nodes. The roster is who runs the next attempt: the hosts in rank order,
the unused spares, and how often each host has failed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the core imports no other layer
    from orchestrator.config.inventory import Host


# Seconds without progress before the watchdog dumps stacks and fails the attempt: as long as
# NCCL's own collective timeout, so only a job that NCCL would also call stuck is ended.
HANG_TIMEOUT = 600.0
BACKOFF_MAX = 30.0


class Failure(enum.StrEnum):
    """How a host failed an attempt. `value` is the word used in messages and the JSON events."""

    EXIT = "exited"  # its container exited non-zero
    START = "failed to start"  # docker run, the secrets file or the snapshot push failed there
    HUNG = "hung"  # no progress for the hang timeout
    LOST = "lost"  # no SSH keepalive answer: the host is gone
    ENGINE = "engine stuck"  # SSH answers but its Docker engine does not
    PREFLIGHT = "failed preflight"  # at a restart, before anything started

    @property
    def host_is_gone(self) -> bool:
        """The host cannot take part again without a person looking at it: give its rank away."""
        return self in (Failure.LOST, Failure.ENGINE, Failure.PREFLIGHT)


@dataclass(frozen=True)
class HostFailure:
    host: str
    kind: Failure
    detail: str = ""

    def line(self) -> str:
        if self.kind is Failure.EXIT and self.detail:
            return f"{self.host} {self.detail}"  # "node2 exited with code 137"
        return f"{self.host} {self.kind.value}" + (f": {self.detail}" if self.detail else "")


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended: no failures and not ended by the user is success."""

    failures: tuple[HostFailure, ...] = ()
    stopped: bool = False  # `fab stop` ended it
    interrupted: int | None = None  # the signal that ended it (Ctrl+C, SIGTERM)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.stopped and self.interrupted is None


@dataclass(frozen=True)
class Policy:
    """How a job meets failures: `restarts` more attempts at most (for the whole job, not per
    node), down to `min_nodes` nodes when no spare is left, and a hang watchdog."""

    restarts: int = 0
    min_nodes: int | None = None  # None: every node the job started with
    hang_timeout: float = HANG_TIMEOUT


@dataclass(frozen=True)
class Roster:
    hosts: tuple[Host, ...]  # the next attempt's, in rank order
    spares: tuple[Host, ...] = ()  # not used yet
    failed: tuple[tuple[str, int], ...] = ()  # host -> failures of its own (exit, start, hang)
    restarts_used: int = 0

    def failures_of(self, name: str) -> int:
        return dict(self.failed).get(name, 0)


@dataclass(frozen=True)
class Decision:
    """Go on with `roster`, or stop (roster None) for `reason`. `notes` say what changed."""

    roster: Roster | None
    reason: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    restart: bool = False  # this decision spends one of the policy's restarts


def decide(
    outcome: Outcome,
    policy: Policy,
    roster: Roster,
    target_nodes: int,
    warm: frozenset[str] = frozenset(),
    hot: frozenset[str] = frozenset(),
) -> Decision:
    """The next attempt's roster, or why the job ends. `target_nodes` is the job's node count,
    which `policy.min_nodes` (default: all of them) may lower. `warm`: the hosts whose containers
    wait for the next generation; `hot`: the spares kept hot (waiting, workers warm).

    - success, `fab stop` and Ctrl+C end the job;
    - hosts that failed preflight at a restart are replaced without spending a restart (nothing ran);
    - any other failure spends one restart, or ends the job when none is left;
    - a lost host, a stuck engine, or a host failing a second time on its own gives its node rank
      to the next spare; with none left it is dropped, down to min_nodes nodes;
    - a host that failed once and would start cold (its container is gone: not `warm`) gives its
      rank to a hot spare while one is left, and becomes a spare itself (last in line).
    """
    if outcome.interrupted is not None:
        return Decision(None, "interrupted")
    if outcome.stopped:
        return Decision(None, "ended by 'fab stop'")
    if outcome.ok:
        return Decision(None, "finished")
    preflight_only = all(f.kind is Failure.PREFLIGHT for f in outcome.failures)
    if not preflight_only and roster.restarts_used >= policy.restarts:
        spent = f"no restarts left (--restarts {policy.restarts})" if policy.restarts else "no --restarts"
        return Decision(None, spent)
    failed, why, cold = _judge_failures(outcome, roster, warm, hot)
    nxt = replace(
        roster,
        failed=tuple(sorted(failed.items())),
        restarts_used=roster.restarts_used + (0 if preflight_only else 1),
    )
    min_nodes = policy.min_nodes or target_nodes
    # Hot spares first: a rank given to one starts without a cold start.
    spares = sorted(roster.spares, key=lambda s: s.name not in hot)
    hosts, spares, notes = _swap(roster.hosts, spares, why, min_nodes)
    spares += cold
    if len(hosts) < min_nodes:
        gone = [n for n in why if n not in {h.name for h in hosts}]
        return Decision(
            None,
            f"no spare host left to replace {', '.join(gone)} "
            f"({'; '.join(why[n] for n in gone)}), and {len(hosts)} node(s) are fewer than the "
            f"{min_nodes} the job needs. Add hosts under 'spares:' in the inventory, or allow "
            "fewer nodes with --min-nodes, then 'fab train --resume JOB'",
        )
    return Decision(
        replace(nxt, hosts=hosts, spares=tuple(spares)), notes=tuple(notes), restart=not preflight_only
    )


def _judge_failures(
    outcome: Outcome, roster: Roster, warm: frozenset[str], hot: frozenset[str]
) -> tuple[dict[str, int], dict[str, str], list[Host]]:
    """Each failure of `outcome` counted and judged (see decide): the failures of each host so far,
    why each host that gives its rank away does so, and the failed hosts that step aside for a hot
    spare (spares themselves from now)."""
    failed = dict(roster.failed)
    why: dict[str, str] = {}
    gone = [f.host for f in outcome.failures if f.kind.host_is_gone]
    ready = len([s for s in roster.spares if s.name in hot]) - len(gone)  # hot spares left for the rest
    cold: list[Host] = []  # failed hosts that step aside for a hot spare, spares themselves from now
    for f in outcome.failures:
        if f.kind.host_is_gone:
            why[f.host] = f.kind.value
            continue
        failed[f.host] = failed.get(f.host, 0) + 1
        if failed[f.host] >= 2:
            why[f.host] = "failed twice"
        elif f.kind is not Failure.PREFLIGHT and f.host not in warm and len(cold) < ready:
            why[f.host] = "its container is gone; a hot spare is ready"
            cold += [h for h in roster.hosts if h.name == f.host]
    return failed, why, cold


def _swap(
    hosts: tuple[Host, ...], spares: list[Host], why: dict[str, str], min_nodes: int
) -> tuple[tuple[Host, ...], list[Host], list[str]]:
    """Each host in `why` gives its node rank to the next spare (a new rank 0 when rank 0's host
    goes); with no spare left it is dropped and the ranks close up."""
    out, notes, dropped = [], [], []
    for h in hosts:
        if h.name not in why:
            out.append(h)
        elif spares:
            spare = spares.pop(0)
            out.append(replace(spare, rank=h.rank))
            notes.append(
                f"spare {spare.name} takes the place of {h.name} ({why[h.name]}) as node rank {h.rank}"
            )
        else:
            dropped.append(h.name)
    if dropped:
        out = [replace(h, rank=i) for i, h in enumerate(out)]
        notes.append(
            f"no spare left: going on without {', '.join(dropped)} with {len(out)} node(s) "
            f"(--min-nodes {min_nodes})"
        )
    return tuple(out), spares, notes


def backoff(attempt: int) -> float:
    """Seconds to wait before attempt `attempt` (2, 3, ...): none before the first restart (one
    failure is the common case, and recovery is measured in seconds), then 1, 2, 4, ... at most
    BACKOFF_MAX."""
    return 0.0 if attempt <= 2 else min(BACKOFF_MAX, 2.0 ** (attempt - 3))
