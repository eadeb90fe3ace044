"""GATE, the stage between a claim and a start: the code synced to every host of the attempt (its
hot spares too) at once with every preflight check. On the first attempt a failure ends the job
with the preflight's table; at a restart the hosts that failed are handed to the policy."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import preflight
from orchestrator.backends.ssh.attempt import AttemptPlan
from orchestrator.backends.ssh.state import PreflightFailed
from orchestrator.backends.ssh.steps import run_quiet
from orchestrator.config import codetree
from orchestrator.core import jobspec
from orchestrator.hosts.hostops import tree_lines
from orchestrator.progress import bars

if TYPE_CHECKING:
    from collections.abc import Callable

    from orchestrator.backends.ssh.jobcontext import JobContext
    from orchestrator.backends.ssh.jobstate import JobState
    from orchestrator.backends.ssh.planstep import Step
    from orchestrator.progress.bars import Transfer


def code_transfers(job: JobContext, a: AttemptPlan) -> Callable[[Step], Transfer | None]:
    """Each host's code sync as `transfer` events (--json); on the first attempt, a note of what the
    sync copies and what a user's tree's ignore rules leave out (hostops.tree_lines)."""
    code, only = Path(a.spec.code), a.spec.code_only
    if a.number == 1 and not only:  # the built-in trainers: nothing to say
        for line in tree_lines(code, only):
            warning = line.startswith("warning: ")
            job.note(line.removeprefix("warning: "), "warning" if warning else "info")
    total = codetree.select(code, only).bytes
    transfers = bars.Transfers(emit=job.emit)
    return lambda s: transfers.start(s.host or s.where, "code sync", total) if s.key == "sync" else None


def sync_and_check(job: JobContext, state: JobState, a: AttemptPlan) -> dict[str, str]:
    """Sync and preflight at once: the hosts that failed, with why. On the first attempt a
    failure ends the job with the preflight's table (nothing was started)."""
    reach = state.reach(a)
    syncs = a.select("sync")
    if not syncs and a.warm and a.number > 1:  # every node warm (all_warm): nothing to sync or check
        return {}
    transfer = code_transfers(job, a) if syncs else None
    if not (job.checks or a.number > 1 or job.resuming):
        synced = job.run_steps(reach, syncs, transfer)
        return {n: str(e) for n, e in synced.errors().items()}
    with ThreadPoolExecutor(max_workers=1) as pool:
        syncing = pool.submit(job.run_steps, reach, syncs, transfer)
        checked = replace(a.inv, hosts=(*a.hosts, *a.hot))  # a hot spare is checked as it starts
        checks = preflight.run(job.ssh, checked, image=a.spec.image, code=False)
        synced = syncing.result()
    here = [c for c in preflight.failed(checks) if c.host == jobspec.LOCAL]
    if here and a.number == 1:  # this machine's own check (rsync): no host to leave out, resumed or not
        raise PreflightFailed(
            checks,
            [],
            f"preflight failed on this machine ({here[0].check}); nothing "
            "was started. Fix the checks above, then run the command again",
        )
    bad = {c.host: f"{c.check}: {c.detail}" for c in preflight.failed(checks) if c.host != jobspec.LOCAL}
    bad.update({n: str(e) for n, e in synced.errors().items() if n not in bad})
    if bad and a.number == 1 and not job.resuming:
        raise PreflightFailed(checks, sorted(bad, key=[h.name for h in (*a.hosts, *a.hot)].index))
    for h in a.hot:  # at a restart a spare failing its checks only stays out; its start is tried
        if h.name in bad:
            job.note(f"{h.name}: the hot spare failed its checks ({bad.pop(h.name)})", "warning")
    if not bad and job.smoke and a.number == 1:
        smoke = preflight.smoke_test(job.ssh, a.inv, a.spec.image, checks, run_quiet, within=a.spec.job_id)
        if preflight.failed(smoke):
            raise PreflightFailed(smoke, [], "the collective smoke test failed; nothing was started")
    if not bad:
        seconds = max((r.seconds for r in synced.values_ok()), default=0)
        job.note(f"synced code to {len(syncs)} host(s) in {seconds:.1f}s; preflight ok")
    return bad
