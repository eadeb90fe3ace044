"""CLAIM: the attempt's hosts claimed one at a time (claims.claim_script, in claims.order), and
what a refusal means: plan again (another job took the units or the port meanwhile), wait in the
queue (--queue), end a new job naming the holder, or fail that host at a restart."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.backends.ssh.attempt import AttemptPlan
from orchestrator.backends.ssh.starting import failed_to_start
from orchestrator.backends.ssh.state import Again, Attempted, Queued, Refused
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.hosts import claimdir, claims
from orchestrator.hosts.queue import QUEUED, parse_queue_output
from orchestrator.transport import deadlines
from orchestrator.transport.remote import PerHost, Result

if TYPE_CHECKING:
    from orchestrator.backends.ssh.jobcontext import JobContext
    from orchestrator.backends.ssh.jobstate import JobState
    from orchestrator.config.inventory import Host


def claim(job: JobContext, state: JobState, a: AttemptPlan, may_replan: bool) -> Attempted | Again | None:
    """CLAIM: the attempt's hosts one at a time, in claims.order (the plan's order of the claim
    steps). A host whose units another job took meanwhile refuses: what this attempt claimed is
    released; the attempt is planned again (Again), or waits in the queue, or, the first
    attempt, ends the job naming the holder (Refused: nothing of the job is left on its hosts to
    fetch or clean); a later one fails that host."""
    done: list[Host] = []
    for s in a.select("claim"):
        h = a.host(s.where)
        try:
            r = job.ssh.run(h, s.command, timeout=s.deadline, what=s.what)
        except Exception as exc:  # noqa: BLE001 - lost or stuck: that host fails to start
            release(job, done)
            return failed_to_start(job, state, a, PerHost({h.name: exc}))
        held, _ = claims.parse_claim_output(r.stdout)
        for warning in claims.claim_warnings(h, r.stdout):
            job.note(warning, "warning")
        if r.ok:
            done.append(h)
            shared_note(job, state.started, h, held)
            continue
        release(job, done)
        if r.exited in (claims.REFUSED, QUEUED) and job.place_in_queue and not state.started:
            return Again(Queued(h, tuple(held), tuple(parse_queue_output(r.stdout)[0])))
        if r.exited in (claims.REFUSED, claims.PORT_TAKEN) and may_replan:
            # Another job planned at the same moment took these units or this master port: plan
            # the attempt again from the claims as they are now (other free units and port, or a
            # refusal naming the holder), as if this one never was.
            taken = "master port " + str(a.port) if r.exited == claims.PORT_TAKEN else "its units"
            job.note(f"{h.name}: {taken} claimed meanwhile by another job; planning again", "warning")
            return Again()
        why = claim_refusal(h, a, r, s.what, held)
        if a.number == 1 and not job.resuming:
            raise Refused(
                f"{why}; nothing was started. Wait for that job (--queue waits in line and starts "
                "by itself), or choose other hosts or GPUs (--include/--exclude/--num-nodes/--gpus)"
            )
        return failed_to_start(job, state, a, PerHost({h.name: UserError(why)}))
    return None


def shared_note(job: JobContext, started: bool, h: Host, held: list[claims.Holder]) -> None:
    """Say when the host runs another owner's job while this one shares the host's IPC namespace:
    with --network host and --ipc host, the two jobs' containers share /dev/shm and the loopback."""
    others = [x for x in held if x.who != job.spec.owner]
    if others and job.inv.job.ipc == "host" and not started:  # once: the first attempt's claims
        job.note(
            f"{h.name} also runs {hostile.line(others[0].describe(h), 200)}: both jobs share the "
            "host's /dev/shm and loopback there (--ipc host, --network host); job.ipc: private gives "
            "this job its own IPC namespace (docs/security.md)",
            "warning",
        )


def release(job: JobContext, hosts: list[Host], queue: bool = False) -> None:
    """Remove this job's claims and runtime directories (with `queue`, its places in their
    queues and stop markers too) from these hosts."""
    command = claims.release_command(job.inv, [job.spec.job_id], queue=queue)
    job.ssh.fan_out(
        lambda h: job.ssh.run(h, command, timeout=deadlines.STATUS_TIMEOUT, what="releasing the claim"),
        tuple(hosts),
    )


def claim_refusal(h: Host, a: AttemptPlan, r: Result, what: str, held: list[claims.Holder]) -> str:
    """Why a host's claim refused the attempt, from the claim script's exit and output."""
    if r.exited == claims.REFUSED:
        return (
            f"{h.name}: {claims.kind(h)}s {claimdir.units_text(a.units.get(h.name, ())) or '(all)'} were "
            f"claimed meanwhile by {'; '.join(c.describe(h) for c in held) or 'another job'}"
        )
    if r.exited == QUEUED:
        ahead, _ = parse_queue_output(r.stdout)
        return (
            f"{h.name}: jobs queued before this one wait for it: {'; '.join(w.describe() for w in ahead)}; "
            "add --queue to wait in line behind them"
        )
    return f"{h.name}: {what} failed (exit {r.exited}): {hostile.text(r.stderr.strip()[-300:])}"
