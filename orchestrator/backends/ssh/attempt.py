"""One attempt of a job as a frozen plan: the hosts with their ranks, the master port, the
snapshot to place, and every command per host in order, from the sync to the teardown.

`fab train --dry-run` prints `render()` of this object, `runs/JOB/plan.txt` holds the same text
for every attempt, and the job's stages execute its steps and nothing else (a unit test runs a
whole job against a recording session and compares). The few facts a plan depends on (how a GPU
host hands out its GPUs, which master port is free, where the newest snapshot is) are read from
the hosts first, read-only, and shown in the rendering with the commands that read them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from orchestrator.backends.ssh.snapshots import CHECKSUM_TIMEOUT, layout, local_dir_name
from orchestrator.commands import dockerargs, hostfiles, node, sshargs
from orchestrator.config import resources
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.jobspec import LOCAL
from orchestrator.hosts import claims
from orchestrator.transport.deadlines import COPY_TIMEOUT, START_TIMEOUT, STATUS_TIMEOUT, STOP_MARGIN
from orchestrator.transport.remote import put_command

# When a step runs; ALWAYS steps run in every attempt that gets that far, in order.
ALWAYS = ""
ON_FAILURE = "when a node fails or a host is lost: the other hosts"
ON_INTERRUPT = "on Ctrl+C, SIGTERM or fab stop: every host"
ON_MISSED = "when the follow missed output (OFFSET: the bytes it received + 1)"
ON_SILENT = "when a node shows no progress for a while: its heartbeat file's age"
ON_HANG = ("when the hang watchdog fires: every rank's stacks and flight recorder (the stacks also every "
           "hang timeout / 5, to see whether the ranks move)")
ON_SNAPSHOT = "every 0.5 s on rank 0's host, and when a new snapshot appears"
ON_FAILED = "after a failed attempt, and between attempts: did fab stop end it? (every host used)"
ON_LEASE = "every 5 s while fab train looks after the job: its hosts"


@dataclass(frozen=True)
class Step:
    """One command: on a host (a remote command string, quoted once) or on this machine (an argv)."""

    where: str                       # a host name, or LOCAL
    key: str                         # what it is for: sync, secrets, start, follow, stop, ...
    command: str                     # the exact remote command, or the local argv quoted for reading
    timeout: float | None
    when: str = ALWAYS
    argv: tuple[str, ...] = ()       # a local step's argv, run as is
    stdin: bytes | None = field(default=None, repr=False, compare=False)
    stdin_note: str = ""             # what stdin holds, as rendered (secret values never shown)
    what: str = ""                   # for error messages
    host: str = ""                   # a local step's peer host

    @property
    def deadline(self) -> float:
        """The timeout of a step that is run to its end: every step but the follow, which is only
        streamed (its liveness is the keepalive's, remote.Command)."""
        if self.timeout is None:
            raise ValueError(f"the {self.key} step on {self.where} has no timeout: it is only streamed")
        return self.timeout

    def render(self, rank: int | None = None) -> str:
        where = f"[{self.where}" + (f" rank {rank}" if rank is not None else "") + "]"
        note = f"  # stdin: {self.stdin_note}" if self.stdin_note else ""
        return f"{where} {self.command}{note}"


@dataclass(frozen=True)
class Fact:
    """Something the plan was built from, read on a host, with the command that read it."""

    where: str
    command: str
    answer: str


@dataclass(frozen=True)
class AttemptPlan:
    job_id: str
    number: int
    hosts: tuple[Host, ...]
    port: int
    snapshot: str | None             # placed on every host before the start
    spec: jobspec.JobSpec               # with this attempt's variables
    inv: Inventory = field(repr=False, compare=False)  # hosts and the chosen port, for this attempt
    facts: tuple[Fact, ...] = ()
    steps: tuple[Step, ...] = ()
    grace: float = 30.0
    units: dict[str, tuple[int, ...]] = field(
        default_factory=dict, compare=False
    )  # host -> GPUs (slots) held
    warm: bool = False  # build()'s `warm`: its nodes keep their containers between generations

    @property
    def master(self) -> Host:
        return self.hosts[0]

    def step(self, where: str, key: str) -> Step:
        return next(s for s in self.steps if s.where == where and s.key == key)

    def select(self, key: str, when: str = ALWAYS, where: str | None = None) -> list[Step]:
        return [
            s for s in self.steps if s.key == key and s.when == when and (where is None or s.where == where)
        ]

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def render(self) -> str:
        """Every command, per host, in order; conditional ones under the condition that runs them."""
        ranks = {h.name: h.rank for h in self.hosts}
        lines = [
            f"# ---- job {self.job_id} attempt {self.number}: "
            + ", ".join(
                f"{h.name}=rank {h.rank}"
                + (
                    f" {claims.kind(h)}s {claims.units_text(self.units[h.name])}"
                    if h.name in self.units
                    else ""
                )
                for h in self.hosts
            )
            + f"; master {self.master.hostname}:{self.port}"
            + (f"; from snapshot {self.snapshot}" if self.snapshot else "")
            + ("; warm nodes (a failure restarts the workers, the containers stay)" if self.warm else "")
        ]
        if self.facts:
            lines.append("# built from (read-only, on the hosts):")
            lines += [f"#   [{f.where}] {f.command}  -> {f.answer}" for f in self.facts]
        stage = None
        for s in (s for s in self.steps if s.when == ALWAYS):
            if STAGE_OF[s.key] != stage:
                stage = STAGE_OF[s.key]
                lines.append(f"## {stage}")
                if stage == "sync + preflight":
                    lines.append("# preflight: read-only checks on every host at once (fab preflight), "
                                 "beside the sync")
            lines.append(s.render(ranks.get(s.where)))
        for when in (
            ON_LEASE,
            ON_SNAPSHOT,
            ON_SILENT,
            ON_HANG,
            ON_MISSED,
            ON_FAILURE,
            ON_INTERRUPT,
            ON_FAILED,
        ):
            steps = [s for s in self.steps if s.when == when]
            if steps:
                lines.append(f"## {when}:")
                lines += [s.render(ranks.get(s.where)) for s in steps]
        return "\n".join(lines)


# The stage each unconditional step belongs to, in the order they run.
STAGE_OF = {
    "claim": "claim (fab stop finds the job from here on)",
    "sync": "sync + preflight",
    "place": "snapshot",
    "place-check": "snapshot",
    "place-rename": "snapshot",
    "secrets": "start",
    "start": "start",
    "follow": "watch",
    "finish": "watch",
    "stopped": "decide",
    "stop-check": "sync + preflight",
    "stop": "teardown",
    "fetch": "finish (at the job's end, on every host it used)",
    "cleanup": "finish (at the job's end, on every host it used)",
    "sweep": "finish (at the job's end, on every host it used)",
    "snapshot-list": "watch",
    "snapshot-fetch": "watch",
    "progress": "watch",
    "stacks": "watch",
    "flight": "watch",
    "remainder": "watch",
    "stop-on-failure": "teardown",
    "stop-on-interrupt": "teardown",
    "lease": "watch",
}


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
            raise UserError(f"{inv.path}: job.secret_files.{name}: {path} holds several lines; "
                            "a secret must be one line")
        body.append(f"{name}={value}\n")
    return "".join(body).encode()


def local_step(host: Host, key: str, argv: list[str], when: str = ALWAYS, what: str = "") -> Step:
    return Step(
        LOCAL, key, sshargs.shell(argv), COPY_TIMEOUT, when, tuple(argv), what=what or key, host=host.name
    )


def remote_step(host: Host, key: str, command: str, timeout: float | None, when: str = ALWAYS,
                what: str = "", stdin: bytes | None = None, stdin_note: str = "") -> Step:
    return Step(host.name, key, command, timeout, when, stdin=stdin, stdin_note=stdin_note, what=what or key)


def build(
    inv: Inventory,
    spec: jobspec.JobSpec,
    number: int,
    port: int,
    snapshot: str | None = None,
    snapshot_missing: tuple[str, ...] = (),
    access: dict[str, dockerargs.GpuAccess | None] | None = None,
    facts: tuple[Fact, ...] = (),
    sync: bool = True,
    keep: int = 2,
    first: bool = True,
    run_dir: str | None = None,
    units: dict[str, tuple[int, ...]] | None = None,
    ticket: str | None = None,
    warm: bool = False,
) -> AttemptPlan:
    """The attempt's plan, pure: `inv.hosts` are its hosts in rank order; `snapshot` (a name in
    runs/JOB/snapshots) is pushed to the hosts in `snapshot_missing`; `access` says how each GPU
    host hands out GPUs (None: NVIDIA's runtime hook assumed); `units` the GPUs (CPU slots) the job
    claims on each host (None: a short job of fabtrain's own that claims nothing, the preflight's
    smoke test). `warm`: the nodes are warm (README: recovery): a node's container that is
    between generations is told to start the next instead of being started again, and a failure or
    the teardown ends only the generation; the containers go at the job's end (sweep) or on
    Ctrl+C and fab stop. A warm job's restarts launch their workers without torchrun, on every
    node alike, warm or cold (node.start_script: direct)."""
    access, claim = access or {}, units is not None
    direct = warm and number > 1
    units = units or {}
    job = replace(inv.job, master_port=port)
    inv = replace(inv, job=job)
    spec = replace(spec, master_port=port, env=(*spec.env, ("FABTRAIN_ATTEMPT", str(number)),
                                                ("FABTRAIN_KEEP_SNAPSHOTS", str(keep))))
    hosts = inv.hosts
    # One host at a time, in claims.order: of two jobs claiming overlapping hosts at once, exactly one
    # gets them (claims.py). A claim waits up to claims.LOCK_WAIT for the host's lock.
    steps = [
        remote_step(
            h,
            "claim",
            claims.claim_script(
                inv,
                spec.job_id,
                units.get(h.name, ()) if claim else None,
                spec.owner,
                first,
                port if h.rank == 0 else None,
                ticket,
            ),
            STATUS_TIMEOUT + claims.LOCK_WAIT,
            what="claiming GPUs/slots and the runtime directory",
        )
        for h in claims.order(hosts)
    ]
    if sync:
        steps += [
            local_step(
                h,
                "sync",
                sshargs.rsync_argv(h, spec.code, hostfiles.code_path(inv, spec), spec.code_only),
                what="syncing the code",
            )
            for h in hosts
        ]
    # After the gate: `fab stop` during the preflight ends the job before anything starts.
    steps += [remote_step(h, "stop-check", stopped_command(inv, spec.job_id), STATUS_TIMEOUT,
                          what="checking for fab stop") for h in hosts]
    run_dir = run_dir or f"runs/{spec.job_id}"
    shape = layout(spec)  # our snapshots, or the program's own checkpoints
    local = Path(run_dir) / local_dir_name(spec)
    if snapshot:
        for h in hosts:
            if h.name in snapshot_missing:  # checked by size and SHA-256 before the rename (snapshots.py)
                push, check, rename = shape.push_commands(h, inv, spec, snapshot, local)
                steps += [
                    local_step(h, "place", push, what="placing the snapshot"),
                    remote_step(h, "place-check", check, CHECKSUM_TIMEOUT,
                                what="checking the snapshot's copy"),
                    remote_step(h, "place-rename", rename, STATUS_TIMEOUT, what="renaming the checked copy"),
                ]
    secrets = secrets_body(inv) if job.secret_files else None
    for h in hosts:
        if secrets is not None:
            steps.append(remote_step(h, "secrets", put_command(hostfiles.secrets_file(inv, spec), 0o600), 30,
                                     what="writing the secrets file", stdin=secrets,
                                     stdin_note=", ".join(f"{n}=<redacted>" for n, _ in job.secret_files)))
        steps.append(
            remote_step(
                h,
                "start",
                node.start_script(
                    inv, h, spec, access.get(h.name), units.get(h.name), START_TIMEOUT, warm, direct
                ),
                START_TIMEOUT,
                what="docker run" + (" (or the next generation of its warm container)" if warm else ""),
                stdin=dockerargs.ENTRYPOINT_SOURCE.read_bytes(),
                stdin_note=resources.ENTRYPOINT_NAME,
            )
        )
    for h in hosts:
        steps.append(remote_step(h, "follow", hostfiles.follow_logs_script(inv, spec, h.rank, warm), None,
                                 what="following the node's output"))
        steps.append(
            remote_step(
                h,
                "finish",
                hostfiles.finish_logs_script(inv, spec, h.rank, warm),
                STATUS_TIMEOUT + 20,
                what="reading the node's exit",
            )
        )
    def stop(h: Host) -> str:
        return (
            node.end_generation_script(inv, spec, h.rank) if warm else dockerargs.stop_script(spec.job_id, 0)
        )

    stopping = "ending the generation (the container stays warm)" if warm else "removing containers"
    steps += [remote_step(h, "stop", stop(h), STOP_MARGIN, what=stopping) for h in hosts]
    steps += end_steps(inv, spec, hosts, run_dir)
    # Conditional steps: which run depends on what happens.
    steps += [
        remote_step(
            h,
            "lease",
            sshargs.shell(["touch", f"{hostfiles.runtime_dir(inv, spec)}/{hostfiles.LEASE}"]),
            STATUS_TIMEOUT,
            ON_LEASE,
            what="touching the job's lease",
        )
        for h in hosts
    ]
    m = inv.master
    steps.append(remote_step(m, "snapshot-list", shape.list_command(inv, spec), STATUS_TIMEOUT, ON_SNAPSHOT,
                             what="listing snapshots"))
    some = "NAME" if not spec.checkpoint else "00000000000000000000"  # the name found, when it runs
    steps.append(local_step(m, "snapshot-fetch", sshargs.fetch_file_argv(m, shape.remote(inv, spec, some),
                                                                      str(shape.local(local, some))),
                            ON_SNAPSHOT, what="copying a snapshot"))
    for h in hosts:
        steps.append(
            remote_step(
                h,
                "progress",
                hostfiles.progress_script(inv, spec, h.rank),
                STATUS_TIMEOUT,
                ON_SILENT,
                what="reading the heartbeat",
            )
        )
    looks = (("stacks", dockerargs.STACKS_PY, "reading stacks"),
             ("flight", dockerargs.FLIGHT_PY, "reading the flight recorder"))
    for h in hosts:
        steps += [
            remote_step(
                h,
                key,
                sshargs.shell(dockerargs.python_in_node(spec, h.rank, code)),
                STACKS_TIMEOUT,
                ON_HANG,
                what=what,
            )
            for key, code, what in looks
        ]
    for h in hosts:
        steps.append(remote_step(h, "remainder", hostfiles.remainder_logs_script(inv, spec, h.rank, "OFFSET"),
                                 STATUS_TIMEOUT + 20, ON_MISSED, what="reading the rest of the output"))
    steps += [remote_step(h, "stopped", stopped_command(inv, spec.job_id), STATUS_TIMEOUT, ON_FAILED,
                          what="checking for fab stop") for h in hosts]
    for h in hosts:
        steps.append(
            remote_step(
                h,
                "stop-on-failure",
                stop(h),
                STOP_MARGIN,
                ON_FAILURE,
                what=stopping,
            )
        )
    for h in hosts:
        steps.append(remote_step(h, "stop-on-interrupt", dockerargs.stop_script(spec.job_id, job.stop_grace),
                                 job.stop_grace + STOP_MARGIN, ON_INTERRUPT, what="stopping containers"))
    return AttemptPlan(
        spec.job_id,
        number,
        hosts,
        port,
        snapshot,
        spec,
        inv,
        facts,
        tuple(steps),
        job.stop_grace,
        units,
        warm,
    )


STACKS_TIMEOUT = 15


def end_steps(inv: Inventory, spec: jobspec.JobSpec, hosts: tuple[Host, ...], run_dir: str) -> list[Step]:
    """At the job's end, on every host it used: any container of the job removed again (one whose
    `docker run` returned after its deadline, or after the teardown looked), its outputs fetched,
    then its runtime files (entrypoint, secrets, lease) and its claim removed."""
    steps = [remote_step(h, "sweep", dockerargs.stop_script(spec.job_id, 0), STOP_MARGIN,
                         what="removing containers of the job left after its teardown") for h in hosts]
    steps += [local_step(h, "fetch", sshargs.fetch_argv(h, f"{inv.job.output_dir}/{spec.job_id}",
                                                     f"{run_dir}/outputs/{h.name}"), what="fetching outputs")
              for h in hosts]
    return steps + [remote_step(h, "cleanup", claims.release_command(inv, [spec.job_id]), STATUS_TIMEOUT,
                                what="removing the job's runtime files and claim") for h in hosts]


def stopped_command(inv: Inventory, job_id: str) -> str:
    """Succeeds when `fab stop` left its marker (hostops.mark_stopped) for the job on a host."""
    return sshargs.shell(["test", "-e", hostfiles.stopped_marker(inv, job_id)])
