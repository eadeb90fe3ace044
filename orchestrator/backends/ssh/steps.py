"""Running a plan's steps (planstep.Step) on their hosts, and the short jobs of fabtrain's own that
run a plan without the job's stages: the preflight's smoke test and the benchmarks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from orchestrator.backends.ssh import attempt as attempt_mod
from orchestrator.backends.ssh.attempt import AttemptPlan
from orchestrator.backends.ssh.nodefollow import NodeEnd
from orchestrator.backends.ssh.planstep import Step, When
from orchestrator.backends.ssh.watch import Watched, watch
from orchestrator.config import codetree
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.policy import Failure

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from pathlib import Path

    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.progress.bars import Transfer
    from orchestrator.transport.remote import PerHost, Result, Session


def run_steps(
    session: Session,
    hosts: Iterable[Host],
    steps: list[Step],
    transfer: Callable[[Step], Transfer | None] | None = None,
) -> PerHost:
    """Run steps on their hosts at once (several on one host in order): host -> last Result or error.
    `transfer`: for a local step (a copy), what follows its progress (progress/bars.py), or None."""
    by_host: dict[str, list[Step]] = {}
    for s in steps:
        by_host.setdefault(s.host or s.where, []).append(s)
    named = {h.name: h for h in hosts}

    def one(h: Host) -> Result | None:
        r = None
        for s in by_host[h.name]:
            t = transfer(s) if transfer is not None and s.where == jobspec.LOCAL else None
            if t is not None:
                r = session.local(list(s.argv), s.deadline, on_output=t.output)
                t.finish(r.ok)
            else:
                r = (
                    session.local(list(s.argv), s.deadline)
                    if s.where == jobspec.LOCAL
                    else session.run(h, s.command, timeout=s.deadline, stdin=s.stdin, what=s.what)
                )
            if not r.ok:
                raise UserError(
                    f"{h.name}: {s.what} failed (exit {r.exited}): {hostile.text(r.stderr.strip()[-300:])}"
                )
        return r

    return session.fan_out(one, tuple(named[n] for n in by_host))


def start_quiet(session: Session, inv: Inventory, spec: jobspec.JobSpec) -> AttemptPlan:
    """Start a short job's containers on every host (no sync, no events, no copies): the
    preflight's smoke test and the benchmarks. UserError naming the hosts that failed to start."""
    spec = replace(spec, code_key=codetree.key(spec.code, spec.code_only))
    a = attempt_mod.build(inv, spec, 1, inv.job.master_port)
    errors = run_steps(
        session,
        a.hosts,
        a.select("claim")
        + a.select("sync")
        + [s for s in a.steps if s.key in ("secrets", "start") and s.when is When.ALWAYS],
    ).errors()
    if errors:
        end_quiet(session, a)
        raise UserError("starting the job failed:\n" + "\n".join(str(e) for e in errors.values()))
    return a


def end_quiet(session: Session, a: AttemptPlan) -> None:
    """Remove a short job's containers and runtime files from every host."""
    run_steps(session, a.hosts, a.select("stop") + a.select("cleanup"))


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
