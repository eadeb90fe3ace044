"""fab train --on slurm: the same job, submitted to Slurm from its login node and followed from here.

Submit: the code synced to the login node (job.code_dir/KEY, as on SSH hosts), the batch script
(script.py) written to slurm.workdir and given to sbatch there. Follow (follow.py): the job's output
file (workdir/JOB-SLURMID.out, every node's lines labelled by srun --label) read with `tail -F` over
SSH; each node's lines go to runs/JOB/NODE.log and the terminal with the same prefixes and live view
as an SSH job. The job's state is polled with scontrol every POLL seconds; a requeue (its Restarts
rising) is a new attempt. The end: state and exit code from sacct (the job completion log where
the cluster keeps no accounting database), rank 0's metrics fetched, curves drawn. Ctrl+C and
`fab stop --job` cancel with scancel; `fab logs` follows the same way and Ctrl+C only detaches;
`fab status` lists the user's fabtrain jobs from squeue.

Everything that talks to Slurm is a command string built in commands.py (quoted once) and run on
the login node through the project's Session, so each has a deadline and a recording stand-in sees it;
a submitted job's queries are submitted.SlurmJob's.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.slurm import follow
from orchestrator.backends.slurm.commands import (
    ENDED,
    End,
    follow_command,
    out_file,
    parse_squeue,
    sacct_command,
    secrets_dir_command,
    secrets_path,
    show_command,
    squeue_command,
    submit_command,
)
from orchestrator.backends.slurm.follow import Follower
from orchestrator.backends.slurm.script import slurm_script
from orchestrator.backends.slurm.submitted import QUERY_TIMEOUT, SlurmJob
from orchestrator.backends.ssh.stagesteps import secrets_body
from orchestrator.config import codetree
from orchestrator.config.inventory import Inventory, Slurm
from orchestrator.core import hostile, jobspec, recovery
from orchestrator.core.errors import UserError
from orchestrator.core.record import BackendPlace
from orchestrator.hostcmds import hostfiles, sshargs, touched
from orchestrator.hosts import hostops
from orchestrator.transport.remote import Session, failure

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console
    from rich.table import Table


def cfg_of(inv: Inventory) -> Slurm:
    if inv.slurm is None:
        raise UserError(
            f"{inv.path}: no slurm: section; add one with at least login: (the node where sbatch "
            "runs), see docs/slurm-kubernetes.md",
            exit_code=2,
        )
    return inv.slurm


def submit(
    session: Session, inv: Inventory, spec: jobspec.JobSpec, script: str, note: Callable[[str], None]
) -> SlurmJob:
    """Code to the login node, the script (and secrets) to slurm.workdir, sbatch: the submitted job."""
    cfg = cfg_of(inv)
    login = cfg.login
    dest, _ = hostops.sync(session, inv, Path(spec.code), spec.code_only, hosts=(login,))
    note(f"code synced to {login.name}:{dest}")
    r = session.run(
        login, f"mkdir -p {sshargs.shell([cfg.workdir])}", timeout=QUERY_TIMEOUT, what="mkdir workdir"
    )
    if not r.ok:
        raise UserError(
            f"{login.name}: cannot create slurm.workdir {cfg.workdir}: {hostile.text(r.stderr.strip())}"
        )
    session.put(login, script.encode(), f"{cfg.workdir}/{spec.job_id}.sbatch", mode=0o644)
    if inv.job.secret_files:
        r = session.run(login, secrets_dir_command(cfg), timeout=QUERY_TIMEOUT, what="mkdir .secrets")
        if not r.ok:
            raise UserError(
                f"{login.name}: cannot create {cfg.workdir}/.secrets: {hostile.text(r.stderr.strip())}"
            )
        session.put(login, secrets_body(inv), secrets_path(cfg, spec.job_id), mode=0o600)
    r = session.run(
        login,
        submit_command(cfg, spec.job_id, bool(inv.job.secret_files)),
        timeout=QUERY_TIMEOUT,
        what="sbatch",
    )
    slurm_id = r.stdout.strip().split(";")[0]
    if not r.ok or not slurm_id.isdigit():
        raise UserError(
            f"sbatch on {login.name} refused the job: {hostile.text((r.stderr or r.stdout).strip()[-600:])}"
            f"; the script is {cfg.workdir}/{spec.job_id}.sbatch there"
        )
    return SlurmJob(session, cfg, spec.job_id, slurm_id)


def finish_record(record: recovery.JobRecord, run_dir: Path, end: End, cancelled: bool) -> None:
    state = (
        "finished"
        if end.exit_code == 0
        else ("interrupted" if cancelled else "stopped" if end.state == "CANCELLED" else "failed")
    )
    record.state = state
    if record.attempts:
        last = record.attempts[-1]
        last.ended = last.ended or time.time()
        last.outcome = "finished" if state == "finished" else f"{end.state} {end.code}"
    record.save(run_dir)


def fetch_metrics(session: Session, inv: Inventory, job_id: str, run_dir: Path, rank0: str) -> str | None:
    """Rank 0's metrics.jsonl, read through the login node (output_dir shared with the nodes, or the
    login node is rank 0's); a note when it cannot be read there."""
    cfg = cfg_of(inv)
    path = f"{inv.job.output_dir}/{job_id}/metrics.jsonl"
    # The job's container wrote that directory: the file is read only as the regular file it is.
    read = touched.read_from(sshargs.shell([f"{inv.job.output_dir}/{job_id}"]), "metrics.jsonl", 1)
    r = session.run(cfg.login, read, timeout=120, what="reading metrics")
    if not r.ok:
        return (
            f"{path} is not readable on {cfg.login.name} (job.output_dir is not shared with the nodes): "
            "the curves come from the step lines only"
        )
    out = run_dir / "outputs" / rank0
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text(r.stdout)
    return None


def status_rows(session: Session, inv: Inventory) -> list[dict]:
    """The user's fabtrain jobs on Slurm (fab status)."""
    cfg = cfg_of(inv)
    r = session.run(cfg.login, squeue_command(), timeout=QUERY_TIMEOUT, what="squeue")
    if not r.ok:
        raise UserError(f"squeue on {cfg.login.name} failed: {hostile.text(r.stderr.strip()[-300:])}")
    return parse_squeue(r.stdout)


def recorded(run_root: Path, job_id: str) -> tuple[recovery.JobRecord, BackendPlace] | None:
    """A job's record when it ran on Slurm (its backend entry), else None."""
    try:
        record = recovery.JobRecord.load(run_root, job_id)
    except UserError:
        return None
    backend = record.backend
    return (record, backend) if backend is not None and backend.on == "slurm" else None


def refuse_if_running(session: Session, inv: Inventory, job_id: str, how: str) -> None:
    """A job Slurm still has (pending, running, completing, requeued: what squeue lists) is never
    resumed by another command: that would submit a second Slurm job into the same output directory.
    UserError (exit 2) naming it, its Slurm job id and state; a UserError too when squeue cannot be
    asked, as the job may then still run."""
    login = cfg_of(inv).login
    try:
        rows = [r for r in status_rows(session, inv) if r["job"] == job_id]
    except Exception as exc:  # noqa: BLE001 - named: without an answer the job may still run
        raise UserError(
            f"{how} {job_id}: cannot tell whether Slurm still runs that job: "
            f"{failure(login, exc, 'squeue')}; try again once {login.name} answers"
        ) from None
    if rows:
        where = ", ".join(f"slurm job {hostile.text(r['slurm_id'])} {hostile.text(r['state'])}" for r in rows)
        raise UserError(
            f"{how} {job_id}: that job is still on Slurm ({where}); it was left alone. Follow it with "
            f"'fab logs --job {job_id}', or end it with 'fab stop --job {job_id}' (or wait for its end) "
            "and then resume it",
            exit_code=2,
        )


# ---------------------------------------------------------------- fab train --on slurm


def prepared(inv: Inventory, spec: jobspec.JobSpec) -> tuple[jobspec.JobSpec, str]:
    """The spec with its code key, and the batch script that `fab train --on slurm` submits."""
    cfg = cfg_of(inv)
    spec = replace(spec, code_key=codetree.key(spec.code, spec.code_only))
    script, _ = slurm_script(
        inv,
        spec,
        pyxis=cfg.runtime == "pyxis",
        partition=cfg.partition,
        time_limit=cfg.time,
        account=cfg.account,
        nodes=cfg.nodes,
    )
    return spec, script


def dry_run(inv: Inventory, spec: jobspec.JobSpec) -> str:
    """What --dry-run prints: every command on the login node, in order, then the script."""
    cfg = cfg_of(inv)
    spec, script = prepared(inv, spec)
    login = cfg.login
    steps = [
        sshargs.shell(sshargs.rsync_argv(login, spec.code, hostfiles.code_path(inv, spec), spec.code_only)),
        f"mkdir -p {sshargs.shell([cfg.workdir])}",
        f"write {cfg.workdir}/{spec.job_id}.sbatch (below)",
    ]
    if inv.job.secret_files:
        steps.append(secrets_dir_command(cfg))
        steps.append(
            f"write {secrets_path(cfg, spec.job_id)} (mode 600: "
            f"{', '.join(n for n, _ in inv.job.secret_files)})"
        )
    steps += [
        submit_command(cfg, spec.job_id, bool(inv.job.secret_files)),
        follow_command(out_file(cfg, spec.job_id, "SLURMID")),
        f"every {follow.POLL:g}s: {show_command('SLURMID')}",
        f"at the end: {sacct_command('SLURMID')}",
        f"Ctrl+C or fab stop --job {spec.job_id}: {sshargs.shell(['scancel', 'SLURMID'])}",
    ]
    head = [f"job {spec.job_id} on Slurm, from {login.name} ({login.ssh.where()}):"]
    head += [f"  {i}. {s}" for i, s in enumerate(steps, 1)]
    return "\n".join(head) + f"\n\n--- {cfg.workdir}/{spec.job_id}.sbatch ---\n" + script


def train(
    inv: Inventory,
    spec: jobspec.JobSpec,
    run_root: Path,
    console: Console,
    live: bool,
    echo: bool = True,
    record: recovery.JobRecord | None = None,
) -> tuple[End, Path, Follower]:
    """Submit, follow to the end, record, fetch rank 0's metrics: (End, run_dir, Follower). With
    the `record` of an earlier run (fab train --on slurm --resume JOB), the same job id and output
    directory: its trainer resumes from its newest snapshot, and the attempts go on counting."""
    cfg = cfg_of(inv)
    spec, script = prepared(inv, spec)
    run_dir = run_root / spec.job_id
    run_dir.mkdir(parents=True, exist_ok=True)
    if record is None:
        record = recovery.JobRecord.new(spec, inv, 0, None, 0)
    record.state, record.spec = "running", replace(record.spec, code_key=spec.code_key)
    was = record.backend
    earlier = (*was.earlier, was.slurm_id) if was is not None and was.slurm_id is not None else ()
    record.backend = BackendPlace("slurm", login=cfg.login.name, workdir=cfg.workdir, earlier=earlier)
    record.save(run_dir)
    (run_dir / "job.sbatch").write_text(script)
    with Session((cfg.login,)) as session:

        def note(line: str) -> None:
            if echo:
                console.print(f"[fabtrain] {hostile.text(line)}", highlight=False, markup=False)

        try:
            job = submit(session, inv, spec, script, note)
        except BaseException:
            record.state = "failed"  # nothing was submitted: the record says so, the error says why
            record.save(run_dir)
            raise
        record.backend = replace(record.backend, slurm_id=job.slurm_id)
        record.save(run_dir)
        note(f"submitted job {spec.job_id} as slurm job {job.slurm_id} on {cfg.login.name}")
        follower = Follower(job, run_dir, console, live, echo, record=record)
        try:
            end = follower.run()
        except KeyboardInterrupt:
            record.state = "interrupted"
            record.save(run_dir)
            raise
        finally:
            if inv.job.secret_files:
                session.run(
                    cfg.login,
                    sshargs.shell(["rm", "-f", secrets_path(cfg, spec.job_id)]),
                    timeout=QUERY_TIMEOUT,
                )
        finish_record(record, run_dir, end, follower.cancelled)
        rank0 = record.attempts[-1].hosts[0] if record.attempts and record.attempts[-1].hosts else "node0"
        missing = fetch_metrics(session, inv, spec.job_id, run_dir, rank0)
        if missing:
            note(missing)
    return end, run_dir, follower


# ---------------------------------------------------------------- fab stop / fab logs / fab status


def wait_gone(job: SlurmJob, timeout: float) -> str:
    """Wait until the job has ended and left its nodes (no longer COMPLETING): its state then."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        r = job.query(
            sshargs.shell(
                ["squeue", "--noheader", "--states", "all", "--format", "%T", "--jobs", job.slurm_id]
            ),
            "squeue",
        )
        state = r.stdout.strip() if r.ok else ""
        if state in ENDED or (r.ok and not state) or "Invalid job id" in r.stderr:
            return state or "ended"
        time.sleep(follow.POLL)
    raise UserError(
        f"slurm job {job.slurm_id} is still {state or 'there'} {timeout:g}s after scancel; "
        f"see: squeue --jobs {job.slurm_id} on {job.cfg.login.name}"
    )


def stop(inv: Inventory, job_ids: list[str], run_root: Path, grace: float) -> list[str]:
    """scancel each job (a fabtrain job id recorded in runs/, or a Slurm job id from squeue) and wait
    until it has left its nodes (its containers stopped by the script's trap): a line per job."""
    cfg = cfg_of(inv)
    lines = []
    with Session((cfg.login,)) as session:
        for job_id in job_ids:
            found = recorded(run_root, job_id)
            slurm_id = found[1].slurm_id if found else job_id
            if not slurm_id or not slurm_id.isdigit():
                raise UserError(f"job {job_id} has no Slurm job id recorded in {run_root}/{job_id}")
            job = SlurmJob(session, cfg, job_id, slurm_id)
            job.cancel()
            state = wait_gone(job, grace + 90)
            lines.append(f"stopped {job_id} (slurm job {slurm_id}: {state})")
    return lines


def follow_recorded(inv: Inventory, job_id: str, run_root: Path, console: Console, live: bool) -> End:
    """fab logs --job JOB for a Slurm job (one `recorded` finds): its output from the start into
    runs/JOB/attach until it ends; Ctrl+C detaches."""
    cfg = cfg_of(inv)
    found = recorded(run_root, job_id)
    if found is None:
        raise UserError(f"job {job_id} has no Slurm job recorded in {run_root}/{job_id}")
    _, backend = found
    if backend.slurm_id is None:
        raise UserError(f"job {job_id} has no Slurm job id recorded in {run_root}/{job_id}")
    with Session((cfg.login,)) as session:
        job = SlurmJob(session, cfg, job_id, backend.slurm_id)
        return Follower(job, run_root / job_id / "attach", console, live, detach=True).run()


def status_table(rows: list[dict]) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="fabtrain jobs on Slurm")
    for col in ("job", "slurm job", "who", "nodes", "state", "since"):
        table.add_column(col, no_wrap=col == "job")
    for r in rows:
        why = f" ({r['reason']})" if r["reason"] and r["reason"] != "None" else ""
        table.add_row(
            hostile.rich_text(r["job"]),
            hostile.rich_text(r["slurm_id"]),
            hostile.rich_text(r["who"]),
            hostile.rich_text(r["nodes"] or "-"),
            hostile.rich_text(r["state"] + why, "green" if r["state"] == "RUNNING" else ""),
            hostile.rich_text(r["start"]),
        )
    if not rows:
        table.add_row("-", "-", "-", "-", Text("no jobs", style="dim"), "-")
    return table
