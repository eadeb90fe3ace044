"""PLAN: the facts an attempt depends on, read-only from its hosts at once (facts.py: GPU access,
what runs there, the listening ports, the newest snapshot), then the attempt's frozen plan
(attempt.build). The code tree is keyed again first (key_code): a tree edited since the last attempt
runs under its new key.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.ssh import attempt as attempt_mod
from orchestrator.backends.ssh import facts
from orchestrator.backends.ssh.attempt import AttemptPlan, Fact, Stage
from orchestrator.config import codetree
from orchestrator.core.errors import UserError

if TYPE_CHECKING:
    from orchestrator.backends.ssh.jobcontext import JobContext
    from orchestrator.backends.ssh.jobstate import JobState
    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.core import jobspec
    from orchestrator.transport.remote import PerHost, Result


@dataclass(frozen=True)
class Looked:
    """What the plan stage read from the hosts."""

    access: dict
    seen: list[Fact]
    found: PerHost
    listed: Result | Exception
    newest: facts.Newest


def plan(job: JobContext, state: JobState, dry: bool = False) -> tuple[JobState, AttemptPlan]:
    """PLAN: the facts the attempt depends on, read-only (facts.py), then the frozen plan; the state
    with the spec as keyed now."""
    number = state.number
    job.stage(Stage.PLAN, number)
    state = replace(state, spec=key_code(job, state.spec))
    inv = replace(job.inv, hosts=state.roster.hosts)
    hot = state.roster.spares if job.hot_spares else ()
    first = state.last is None
    looked = look(job, state, inv, hot, dry)
    queue = job.place_in_queue is not None
    units = facts.choose_units(
        looked.found, job.inv, state.spec, inv.hosts, refuse=first and not dry, queue=queue
    )
    if hot:  # a spare whose GPUs (slots) another job holds now stays cold
        spare = facts.choose_units(looked.found, job.inv, state.spec, hot, refuse=False, queue=False)
        hot = tuple(h for h in hot if h.name not in spare.refused)
        units = replace(
            units,
            units={**units.units, **{h.name: spare.units[h.name] for h in hot}},
            facts=(*units.facts, *(f for f in spare.facts if f.where in {h.name for h in hot})),
        )
    taken = ({state.last.port} if state.last else set()) | units.claimed_ports
    port, port_fact = facts.free_port(looked.listed, inv, taken)
    seen = [*looked.seen, *units.facts, port_fact, *looked.newest.facts]
    if first and (number > 1 or job.resuming):  # what a resumed job goes on from, said once
        say_resumed_from(job, looked.newest.name)
    place = job.place_in_queue
    return state, attempt_mod.build(
        inv,
        state.spec,
        number,
        port,
        looked.newest.name,
        looked.newest.missing,
        looked.access,
        tuple(seen),
        keep=job.inv.job.keep_snapshots,
        first=first,
        run_dir=str(job.run_dir),
        # A spare made hot only now (busy until now) has never had the code: sync then too.
        sync=not state.all_warm(inv.hosts, job.warm) or any(h.name not in state.used for h in hot),
        units=units.units,
        ticket=None if state.started or not place else place.ticket,
        warm=job.warm,
        hot=hot,
    )


def look(job: JobContext, state: JobState, inv: Inventory, hot: tuple[Host, ...], dry: bool) -> Looked:
    """The plan's looks at the hosts: they read different things, each host at once, all of them at
    once too."""
    newest = facts.Newest(None, (), ())
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="plan") as pool:
        accessing = pool.submit(facts.gpu_access, job.ssh, (*inv.hosts, *hot))
        # The spares too (what `fab status` shows of them), but never a host known lost.
        looked = (*inv.hosts, *hot, *state.answering(job.inv.spares))
        surveying = pool.submit(facts.what_runs, job.ssh, job.inv, looked)
        listing = pool.submit(facts.listening, job.ssh, inv)
        if state.number > 1 or job.resuming:
            asked = state.answering((*inv.hosts, *state.used.values()))
            newest = pool.submit(
                facts.newest_snapshot, job.ssh, job.open_snapshots(), inv, state.spec, asked, fetch=not dry
            ).result()
        access, seen = accessing.result()
        found, listed = surveying.result(), listing.result()
    return Looked(access, seen, found, listed, newest)


def say_resumed_from(job: JobContext, snapshot: str | None) -> None:
    job.note(
        f"resuming from {job.open_snapshots().layout.describe(snapshot)}"
        if snapshot
        else f"no {'checkpoint' if job.spec.checkpoint else 'snapshot'} of job "
        f"{job.spec.job_id} found here or on its hosts: it starts from the beginning",
        "info" if snapshot else "warning",
    )


def key_code(job: JobContext, spec: jobspec.JobSpec) -> jobspec.JobSpec:
    """The job's code tree and its key (codetree.py), read again before every attempt: a tree
    edited since the last one runs under its new key, and the job says so."""
    if not Path(spec.code).is_dir():
        raise UserError(f"the job's code {spec.code} is not there any more; give the folder with --code DIR")
    key = codetree.key(spec.code, spec.code_only)
    if key == spec.code_key:
        return spec
    if spec.code_key:
        job.note(
            f"the code in {spec.code} changed since the last attempt: this one runs tree "
            f"{key} (was {spec.code_key})",
            "warning",
        )
    job.record_code_key(key)
    return replace(spec, code_key=key)
