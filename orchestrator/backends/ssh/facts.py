"""PLAN's read-only looks at the hosts, each returning its answer and the Facts the plan shows
with it (attempt.Fact: where, the command that read it, what it said): how each GPU host hands
out GPUs, which GPUs (slots) the attempt takes given what other jobs hold, a free master port,
and where the newest snapshot is. Nothing here writes on a host; the claim makes the choice atomic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator import preflight
from orchestrator.backends.ssh.attempt import Fact
from orchestrator.backends.ssh.state import Refused
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import dockerargs, ports, sshargs
from orchestrator.hosts import claimdir, claims, survey
from orchestrator.snapshots import store
from orchestrator.snapshots.checks import local_digest, remote_newest
from orchestrator.snapshots.commands import checksum_command, list_command
from orchestrator.transport import deadlines
from orchestrator.transport.remote import describe

if TYPE_CHECKING:
    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.core import jobspec
    from orchestrator.transport.remote import PerHost, Result, Session


def gpu_access(session: Session, hosts: tuple[Host, ...]) -> tuple[dict, list[Fact]]:
    """How each GPU host hands out GPUs (NVIDIA's runtime hook or CDI, AMD's devices); a host that
    does not answer is assumed to use NVIDIA's hook (its preflight names it)."""
    access, facts = {}, []
    for h in hosts:
        probe = dockerargs.gpu_probe_argv(h)
        if not probe:
            continue
        try:
            access[h.name] = preflight.gpu_access(session, h)
            facts.append(Fact(h.name, sshargs.shell(probe), str(access[h.name])))
        except Exception as exc:  # noqa: BLE001 - the start then assumes NVIDIA's hook
            facts.append(
                Fact(
                    h.name,
                    sshargs.shell(probe),
                    f"no answer ({describe(h, exc)}); assumed NVIDIA's runtime hook",
                )
            )
    return access, facts


@dataclass(frozen=True)
class Units:
    """The GPUs (CPU slots) the attempt claims on each host, and the master ports other jobs
    claimed on its rank-0 host (not to be chosen)."""

    units: dict[str, tuple[int, ...]]
    claimed_ports: frozenset[int]
    facts: tuple[Fact, ...]
    refused: frozenset[str] = frozenset()  # hosts that cannot give them now


def what_runs(session: Session, inv: Inventory, hosts: tuple[Host, ...]) -> PerHost:
    """What other jobs hold on these hosts now (survey.survey), each once."""
    return survey.survey(session, inv, tuple({h.name: h for h in hosts}.values()))


def choose_units(
    found: PerHost,
    inv: Inventory,
    spec: jobspec.JobSpec,
    hosts: tuple[Host, ...],
    *,
    refuse: bool,
    queue: bool,
) -> Units:
    """The GPUs (CPU slots) the attempt claims on each host: those asked for, or the first free
    ones, from what other jobs hold there now (`found`: what_runs). With `refuse` (a new job's
    first attempt, not a dry run) a host that cannot give them refuses the job, naming the holder
    (Refused); with `queue` (fab train --queue) only what no wait can give is refused. Otherwise
    the claim of such a host fails and the policy takes another."""
    want = claims.want_of(spec, inv.job.nproc_per_node)
    units, refusals, impossible, facts, refused = {}, [], [], [], set()
    master = found.value(hosts[0].name)
    claimed = {c.port for c in master.holders(but=spec.job_id) if c.port} if master else set()
    for h in hosts:
        hj = found.value(h.name)
        cap = claims.capacity(h, hj.cpus if hj else 1)
        holders = hj.holders(but=spec.job_id) if hj else []
        asked = want.of(h, cap)
        try:
            units[h.name] = claims.choose(h, cap, holders, asked)
            answer = f"takes {claims.kind(h)}s {claimdir.units_text(units[h.name])} of {cap}"
        except UserError as exc:
            refused.add(h.name)
            refusals.append(str(exc))
            units[h.name] = asked if isinstance(asked, tuple) else tuple(range(min(asked, cap)))
            answer = f"refused: {exc}"
            if queue and hj:
                try:  # what no wait can give (GPU 7 of 4) is refused in the queue too
                    claims.choose(h, cap, [], asked)
                except UserError as never:
                    impossible.append(str(never).split("; free there")[0])
        if hj:
            held = "; ".join(c.describe(h) for c in holders) or "nothing"
            seen = f"held by other jobs: {held}; "
        else:
            error = found.error(h.name)
            assert error is not None, "survey: a host without HostJobs raised"  # HostJobs is truthy
            seen = f"no answer ({describe(h, error)}); "
        facts.append(Fact(h.name, "docker ps + ls .runtime + cat .claims (survey.survey)", seen + answer))
    if refusals and refuse and not queue:
        raise Refused("\n".join(refusals))
    if impossible and refuse:
        raise Refused(
            "\n".join(impossible) + "; no wait in the queue gives that: ask for what the hosts have"
        )
    return Units(units, frozenset(claimed), tuple(facts), frozenset(refused))


def listening(session: Session, inv: Inventory) -> Result | Exception:
    """The ports something listens on at rank 0's host (ports.port_command), or why there is no
    answer (its preflight names the host)."""
    try:
        return session.run(
            inv.master, ports.port_command(), timeout=deadlines.STATUS_TIMEOUT, what="listing ports"
        )
    except Exception as exc:  # noqa: BLE001 - the plan says the port was not checked
        return exc


def free_port(listed: Result | Exception, inv: Inventory, taken: set[int]) -> tuple[int, Fact]:
    """The first master port from job.master_port that nothing listens on at rank 0's host
    (`listed`: listening) and is not in `taken`; with no answer, the first not taken."""
    base = inv.job.master_port
    if isinstance(listed, Exception):
        port, answer = None, f"no answer ({describe(inv.master, listed)}); not checked"
    else:
        port = ports.free_port(listed.stdout, base, taken) if listed.ok else None
        answer = f"{port} free" if port else f"no free port in {base}..{base + ports.PORT_RANGE - 1}"
    if port is None:
        port = next(p for p in range(base, base + ports.PORT_RANGE) if p not in taken)
    return port, Fact(inv.master.name, ports.port_command(), answer)


@dataclass(frozen=True)
class Newest:
    """The newest complete snapshot (None: there is none) and the attempt's hosts that lack it."""

    name: str | None
    missing: tuple[str, ...]
    facts: tuple[Fact, ...]


def newest_snapshot(
    session: Session,
    snaps: store.Snapshots,
    inv: Inventory,
    spec: jobspec.JobSpec,
    asked: tuple[Host, ...],
    fetch: bool,
) -> Newest:
    """The newest complete snapshot on this machine or on any host `asked`, copied here when
    `fetch`; and which of the attempt's hosts that read it lack it: a holder's copy is checked by
    its bytes, since the same name is not the same bytes. Our trainers' snapshots are read on rank
    0's host alone (inv.master): every other rank gets rank 0's bytes over the job's own process
    group, checked by SHA-256 on arrival (trainers/snapshot.py load_agreed), so a restart places
    nothing on the others through this machine. A program's own checkpoint (--checkpoint) is read
    by every host: each gets it."""
    by_name = {h.name: h for h in asked}
    found = session.fan_out(lambda h: remote_newest(session, h, inv, spec, warn=snaps.warn), asked)
    facts = [Fact(n, list_command(inv, spec), str(found.value(n) or "none")) for n in by_name]
    remote = max(((snap, name) for name, snap in found.items() if found.value(name)), default=None)
    if remote and fetch:
        snaps.fetch(session, by_name[remote[1]], remote[0])
    local = snaps.local_newest()
    best = local if fetch else max(filter(None, [local, remote[0] if remote else None]), default=None)
    if best is None:
        return Newest(None, (), tuple(facts))
    readers = inv.hosts if spec.checkpoint else inv.hosts[:1]  # rank 0's host (none: the job's end)
    holders = tuple(h for h in readers if found.value(h.name) == best)
    if fetch and holders:
        digest = local_digest(snaps.local_path(best))
        dest = snaps.remote_path(best)
        same = session.fan_out(lambda h: snaps.holds(session, h, dest, digest), holders)
        holders = tuple(h for h in holders if same.value(h.name))
        facts += [
            Fact(
                h.name,
                checksum_command(dest),
                "same bytes" if same.value(h.name) else "different bytes: placed again",
            )
            for h in inv.hosts
            if h.name in same
        ]
    return Newest(best, tuple(h.name for h in readers if h not in holders), tuple(facts))
