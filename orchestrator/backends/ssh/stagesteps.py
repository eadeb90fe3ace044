"""The steps every attempt runs (When.ALWAYS), stage by stage: CLAIM, GATE, SNAPSHOT, START, WATCH
and TEARDOWN, then the job's end on every host it used. attempt.build puts them in its plan, in
this order; the steps that run only when something happens are conditionalsteps.py's."""

from __future__ import annotations

from pathlib import Path

from orchestrator.backends.ssh.planstep import Step, local_step, remote_step
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import dockerargs, hostfiles, node, sshargs
from orchestrator.hosts import claimdir, claims
from orchestrator.snapshots.checks import CHECKSUM_TIMEOUT
from orchestrator.snapshots.commands import layout, local_dir_name
from orchestrator.transport.deadlines import START_TIMEOUT, STATUS_TIMEOUT, STOP_MARGIN
from orchestrator.transport.remote import put_command


def secrets_body(inv: Inventory) -> bytes:
    """The secrets file's content (NAME=value lines) from job.secret_files, read on this machine."""
    body = []
    for name, path in inv.job.secret_files:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise UserError(
                f"{inv.path}: job.secret_files.{name}: cannot read {path}: {exc.strerror}"
            ) from None
        if "\n" in value:
            raise UserError(
                f"{inv.path}: job.secret_files.{name}: {path} holds several lines; a secret must be one line"
            )
        body.append(f"{name}={value}\n")
    return "".join(body).encode()


def claim_steps(
    inv: Inventory,
    spec: jobspec.JobSpec,
    units: dict[str, tuple[int, ...]] | None,
    first: bool,
    ticket: str | None,
    hot: tuple[Host, ...] = (),
) -> list[Step]:
    """CLAIM, one host at a time, in claims.order: of two jobs claiming overlapping hosts at once,
    exactly one gets them (claims.py). A claim waits up to claimdir.LOCK_WAIT for the host's lock.
    `units` None: a short job of fabtrain's own that claims no GPUs (slots). A hot spare's claim
    holds its units only: no master port, no place in the queue (a busy spare is not made hot)."""
    port = inv.job.master_port
    return [
        remote_step(
            h,
            "claim",
            claims.claim_script(
                inv,
                spec.job_id,
                units.get(h.name, ()) if units is not None else None,
                spec.owner,
                first and h not in hot,
                port if h.rank == 0 and h not in hot else None,
                None if h in hot else ticket,
            ),
            STATUS_TIMEOUT + claimdir.LOCK_WAIT,
            what="claiming GPUs/slots and the runtime directory",
        )
        for h in claims.order((*inv.hosts, *hot))
    ]


def gate_steps(inv: Inventory, spec: jobspec.JobSpec, sync: bool, hot: tuple[Host, ...] = ()) -> list[Step]:
    """GATE: the code synced to every host (beside the preflight, which reads only), then a look
    for `fab stop`'s marker: a stop during the preflight ends the job before anything starts."""
    steps = []
    if sync:
        steps += [
            local_step(
                h,
                "sync",
                sshargs.rsync_argv(h, spec.code, hostfiles.code_path(inv, spec), spec.code_only),
                what="syncing the code",
            )
            for h in (*inv.hosts, *hot)
        ]
    return steps + [
        remote_step(
            h, "stop-check", stopped_command(inv, spec.job_id), STATUS_TIMEOUT, what="checking for fab stop"
        )
        for h in inv.hosts
    ]


def snapshot_steps(
    inv: Inventory, spec: jobspec.JobSpec, snapshot: str | None, missing: tuple[str, ...], run_dir: str
) -> list[Step]:
    """SNAPSHOT: runs/JOB's copy of `snapshot` onto each host in `missing`, checked by size and
    SHA-256 there before the rename puts it in place (Snapshots.push runs exactly these)."""
    if not snapshot:
        return []
    shape = layout(spec)  # our snapshots, or the program's own checkpoints
    local = Path(run_dir) / local_dir_name(spec)
    steps = []
    for h in inv.hosts:
        if h.name in missing:
            push, check, rename = shape.push_commands(h, inv, spec, snapshot, local)
            steps += [
                local_step(h, "place", push, what="placing the snapshot"),
                remote_step(h, "place-check", check, CHECKSUM_TIMEOUT, what="checking the snapshot's copy"),
                remote_step(h, "place-rename", rename, STATUS_TIMEOUT, what="renaming the checked copy"),
            ]
    return steps


def start_steps(
    inv: Inventory,
    spec: jobspec.JobSpec,
    access: dict[str, dockerargs.GpuAccess | None],
    units: dict[str, tuple[int, ...]],
    warm: bool,
    direct: bool,
    hot: tuple[Host, ...] = (),
) -> list[Step]:
    """START: the secrets file (from stdin, never on a command line), then the node's start script
    (docker run, the next generation of its warm container, or a hot spare's) with the entrypoint
    on stdin; on each hot spare's host, its container kept waiting."""
    job = inv.job
    secrets = secrets_body(inv) if job.secret_files else None
    steps = []
    for h in (*inv.hosts, *hot):
        if secrets is not None:
            steps.append(secrets_step(inv, spec, h, secrets))
        if h in hot:
            steps.append(spare_step(inv, spec, h, access.get(h.name), units.get(h.name)))
        else:
            steps.append(node_start_step(inv, spec, h, access.get(h.name), units.get(h.name), warm, direct))
    return steps


def secrets_step(inv: Inventory, spec: jobspec.JobSpec, h: Host, secrets: bytes) -> Step:
    """The secrets file written on a host from stdin (its values never rendered)."""
    return remote_step(
        h,
        "secrets",
        put_command(hostfiles.secrets_file(inv, spec), 0o600),
        30,
        what="writing the secrets file",
        stdin=secrets,
        stdin_note=", ".join(f"{n}=<redacted>" for n, _ in inv.job.secret_files),
    )


def spare_step(
    inv: Inventory,
    spec: jobspec.JobSpec,
    h: Host,
    access: dockerargs.GpuAccess | None,
    units: tuple[int, ...] | None,
) -> Step:
    """A hot spare's container started on its host and kept waiting (node.spare_script)."""
    return remote_step(
        h,
        "spare",
        node.spare_script(inv, h, spec, access, units, START_TIMEOUT),
        START_TIMEOUT,
        what="keeping the hot spare waiting",
        stdin=dockerargs.runtime_files(),
        stdin_note=dockerargs.RUNTIME_NOTE,
    )


def node_start_step(
    inv: Inventory,
    spec: jobspec.JobSpec,
    h: Host,
    access: dockerargs.GpuAccess | None,
    units: tuple[int, ...] | None,
    warm: bool,
    direct: bool,
) -> Step:
    """A node started on its host: docker run, or the next generation of its warm container."""
    return remote_step(
        h,
        "start",
        node.start_script(
            inv, h, spec, access, units, START_TIMEOUT, warm, direct, hot=inv.job.hot_spares and warm
        ),
        START_TIMEOUT,
        what="docker run" + (" (or the next generation of its warm container)" if warm else ""),
        stdin=dockerargs.runtime_files(),
        stdin_note=dockerargs.RUNTIME_NOTE,
    )


def watch_steps(inv: Inventory, spec: jobspec.JobSpec, warm: bool) -> list[Step]:
    """WATCH: each node's output followed (streamed, no deadline of its own), then its exit read."""
    steps = []
    for h in inv.hosts:
        steps.append(
            remote_step(
                h,
                "follow",
                hostfiles.follow_logs_script(inv, spec, h.rank, warm),
                None,
                what="following the node's output",
            )
        )
        steps.append(
            remote_step(
                h,
                "finish",
                hostfiles.finish_logs_script(inv, spec, h.rank, warm),
                STATUS_TIMEOUT + 20,
                what="reading the node's exit",
            )
        )
    return steps


def stop_command(inv: Inventory, spec: jobspec.JobSpec, h: Host, warm: bool) -> str:
    """The teardown's command on a host: end the generation (warm), or remove the containers."""
    return node.end_generation_script(inv, spec, h.rank) if warm else dockerargs.stop_script(spec.job_id, 0)


def stopping(warm: bool) -> str:
    return "ending the generation (the container stays warm)" if warm else "removing containers"


def teardown_steps(inv: Inventory, spec: jobspec.JobSpec, warm: bool) -> list[Step]:
    """TEARDOWN: every host's part of the attempt ended, whatever happened."""
    return [
        remote_step(h, "stop", stop_command(inv, spec, h, warm), STOP_MARGIN, what=stopping(warm))
        for h in inv.hosts
    ]


def end_steps(inv: Inventory, spec: jobspec.JobSpec, hosts: tuple[Host, ...], run_dir: str) -> list[Step]:
    """At the job's end, on every host it used: any container of the job removed again (one whose
    `docker run` returned after its deadline, or after the teardown looked), its outputs fetched,
    then its runtime files (entrypoint, secrets, lease) and its claim removed."""
    steps = [
        remote_step(
            h,
            "sweep",
            dockerargs.stop_script(spec.job_id, 0),
            STOP_MARGIN,
            what="removing containers of the job left after its teardown",
        )
        for h in hosts
    ]
    steps += [
        local_step(
            h,
            "fetch",
            sshargs.fetch_argv(h, f"{inv.job.output_dir}/{spec.job_id}", f"{run_dir}/outputs/{h.name}"),
            what="fetching outputs",
        )
        for h in hosts
    ]
    return steps + [
        remote_step(
            h,
            "cleanup",
            claims.release_command(inv, [spec.job_id]),
            STATUS_TIMEOUT,
            what="removing the job's runtime files and claim",
        )
        for h in hosts
    ]


def stopped_command(inv: Inventory, job_id: str) -> str:
    """Succeeds when `fab stop` left its marker (hostops.mark_stopped) for the job on a host."""
    return sshargs.shell(["test", "-e", hostfiles.stopped_marker(inv, job_id)])
