"""One attempt of a job as a frozen plan: the hosts with their ranks, the master port, the
snapshot to place, and every command per host in order, from the sync to the teardown.

`fab train --dry-run` prints `render()` of this object, `runs/JOB/plan.txt` holds the same text
for every attempt, and the job's stages execute its steps and nothing else (a unit test runs a
whole job against a recording session and compares). The few facts a plan depends on (how a GPU
host hands out its GPUs, which master port is free, where the newest snapshot is) are read from
the hosts first, read-only, and shown in the rendering with the commands that read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.jobspec import LOCAL
from orchestrator.hostcmds import dockerargs, hostfiles, node, sshargs
from orchestrator.hosts import claimdir, claims
from orchestrator.snapshots.checks import CHECKSUM_TIMEOUT
from orchestrator.snapshots.commands import layout, local_dir_name
from orchestrator.telemetry.commands import telemetry_script
from orchestrator.transport.deadlines import COPY_TIMEOUT, START_TIMEOUT, STATUS_TIMEOUT, STOP_MARGIN
from orchestrator.transport.remote import put_command


class Stage(enum.StrEnum):
    """A job's stages, in order; an attempt walks PLAN to DECIDE, the job ends with FINISH. The value
    is the one spelling: in `stage` events, in the plan's headings and in the docs."""

    PLAN = "plan"  # read the facts (GPU access, free port, newest snapshot); freeze the plan
    CLAIM = "claim"  # the job's runtime directory on its hosts: `fab stop` finds it from here on
    GATE = "sync+preflight"  # code synced and every check run, at once; nothing starts if one fails
    SNAPSHOT = "snapshot"  # the newest snapshot placed on every host that lacks it
    START = "start"  # the secrets file, then docker run, on every host at once
    WATCH = "watch"  # output followed until every node ends; first failure stops the rest
    TEARDOWN = "teardown"  # the attempt's containers removed
    DECIDE = "decide"  # policy.decide: another attempt (which hosts), or the end
    FINISH = "finish"  # outputs fetched, runtime files removed, the record closed


class When(enum.Enum):
    """When a step runs. ALWAYS steps run in every attempt that gets that far, in order; the others
    when what their value says happens (the value is the plan's heading for them)."""

    ALWAYS = ""
    ON_LEASE = "every 5 s while fab train looks after the job: its hosts"
    ON_SNAPSHOT = "every 0.5 s on rank 0's host, and when a new snapshot appears"
    ON_SILENT = "when a node shows no progress for a while: its heartbeat file's age"
    ON_HANG = (
        "when the hang watchdog fires: every rank's stacks and flight recorder (the stacks also every "
        "hang timeout / 5, to see whether the ranks move)"
    )
    ON_MISSED = "when the follow missed output (OFFSET: the bytes it received + 1)"
    ON_FAILURE = "when a node fails or a host is lost: the other hosts"
    ON_INTERRUPT = "on Ctrl+C, SIGTERM or fab stop: every host"
    ON_FAILED = "after a failed attempt, and between attempts: did fab stop end it? (every host used)"
    ON_SAMPLE = "every job.telemetry_every seconds while the job is watched: GPUs, containers, load, memory"


@dataclass(frozen=True)
class Step:
    """One command: on a host (a remote command string, quoted once) or on this machine (an argv)."""

    where: str  # a host name, or LOCAL
    key: str  # what it is for: sync, secrets, start, follow, stop, ...
    command: str  # the exact remote command, or the local argv quoted for reading
    timeout: float | None
    when: When = When.ALWAYS
    argv: tuple[str, ...] = ()  # a local step's argv, run as is
    stdin: bytes | None = field(default=None, repr=False, compare=False)
    stdin_note: str = ""  # what stdin holds, as rendered (secret values never shown)
    what: str = ""  # for error messages
    host: str = ""  # a local step's peer host

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
    snapshot: str | None  # placed on every host before the start
    spec: jobspec.JobSpec  # with this attempt's variables
    inv: Inventory = field(repr=False, compare=False)  # hosts and the chosen port, for this attempt
    facts: tuple[Fact, ...] = ()
    steps: tuple[Step, ...] = ()
    grace: float = 30.0
    units: dict[str, tuple[int, ...]] = field(
        default_factory=dict, compare=False
    )  # host -> GPUs (slots) held
    warm: bool = False  # build()'s `warm`: its nodes keep their containers between generations
    hot: tuple[Host, ...] = ()  # hot spares kept waiting beside the attempt (build()'s `hot`)

    @property
    def master(self) -> Host:
        return self.hosts[0]

    def step(self, where: str, key: str) -> Step:
        return next(s for s in self.steps if s.where == where and s.key == key)

    def select(self, key: str, when: When = When.ALWAYS, where: str | None = None) -> list[Step]:
        return [
            s for s in self.steps if s.key == key and s.when == when and (where is None or s.where == where)
        ]

    def host(self, name: str) -> Host:
        return next(h for h in (*self.hosts, *self.hot) if h.name == name)

    def render(self) -> str:
        """Every command, per host, in order; conditional ones under the condition that runs them."""
        ranks = {h.name: h.rank for h in self.hosts}
        lines = [
            f"# ---- job {self.job_id} attempt {self.number}: "
            + ", ".join(
                f"{h.name}=rank {h.rank}"
                + (
                    f" {claims.kind(h)}s {claimdir.units_text(self.units[h.name])}"
                    if h.name in self.units
                    else ""
                )
                for h in self.hosts
            )
            + f"; master {self.master.hostname}:{self.port}"
            + (f"; from snapshot {self.snapshot}" if self.snapshot else "")
            + ("; warm nodes (a failure restarts the workers, the containers stay)" if self.warm else "")
            + (f"; hot spares {', '.join(h.name for h in self.hot)}" if self.hot else "")
        ]
        if self.facts:
            lines.append("# built from (read-only, on the hosts):")
            lines += [f"#   [{f.where}] {f.command}  -> {f.answer}" for f in self.facts]
        stage = None
        for s in (s for s in self.steps if s.when == When.ALWAYS):
            if STAGE_OF[s.key] != stage:
                stage = STAGE_OF[s.key]
                lines.append(f"## {stage.value}{HEADING_NOTE.get(stage, '')}")
                if stage is Stage.GATE:
                    lines.append(
                        "# preflight: read-only checks on every host at once (fab preflight), beside the sync"
                    )
            lines.append(s.render(ranks.get(s.where)))
        for when in When:
            steps = [s for s in self.steps if s.when == when and when is not When.ALWAYS]
            if steps:
                lines.append(f"## {when.value}:")
                lines += [s.render(ranks.get(s.where)) for s in steps]
        return "\n".join(lines)


# The stage each step belongs to, in the order they run.
STAGE_OF = {
    "claim": Stage.CLAIM,
    "sync": Stage.GATE,
    "place": Stage.SNAPSHOT,
    "place-check": Stage.SNAPSHOT,
    "place-rename": Stage.SNAPSHOT,
    "secrets": Stage.START,
    "start": Stage.START,
    "spare": Stage.START,
    "follow": Stage.WATCH,
    "finish": Stage.WATCH,
    "stopped": Stage.DECIDE,
    "stop-check": Stage.GATE,
    "stop": Stage.TEARDOWN,
    "fetch": Stage.FINISH,
    "cleanup": Stage.FINISH,
    "sweep": Stage.FINISH,
    "snapshot-list": Stage.WATCH,
    "snapshot-fetch": Stage.WATCH,
    "progress": Stage.WATCH,
    "stacks": Stage.WATCH,
    "flight": Stage.WATCH,
    "remainder": Stage.WATCH,
    "stop-on-failure": Stage.TEARDOWN,
    "stop-on-interrupt": Stage.TEARDOWN,
    "lease": Stage.WATCH,
    "telemetry": Stage.WATCH,
}
HEADING_NOTE = {  # what the plan's heading adds to a stage's name
    Stage.CLAIM: " (fab stop finds the job from here on)",
    Stage.FINISH: " (at the job's end, on every host it used)",
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
            raise UserError(
                f"{inv.path}: job.secret_files.{name}: {path} holds several lines; a secret must be one line"
            )
        body.append(f"{name}={value}\n")
    return "".join(body).encode()


def local_step(host: Host, key: str, argv: list[str], when: When = When.ALWAYS, what: str = "") -> Step:
    return Step(
        LOCAL, key, sshargs.shell(argv), COPY_TIMEOUT, when, tuple(argv), what=what or key, host=host.name
    )


def remote_step(
    host: Host,
    key: str,
    command: str,
    timeout: float | None,
    when: When = When.ALWAYS,
    what: str = "",
    stdin: bytes | None = None,
    stdin_note: str = "",
) -> Step:
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
    hot: tuple[Host, ...] = (),
) -> AttemptPlan:
    """The attempt's plan, pure: `inv.hosts` are its hosts in rank order; `snapshot` (a name in
    runs/JOB/snapshots) is pushed to the hosts in `snapshot_missing`; `access` says how each GPU
    host hands out GPUs (None: NVIDIA's runtime hook assumed); `units` the GPUs (CPU slots) the job
    claims on each host (None: a short job of fabtrain's own that claims nothing, the preflight's
    smoke test). `warm`: the nodes are warm (docs/recovery.md): a node's container that is
    between generations is told to start the next instead of being started again, and a failure or
    the teardown ends only the generation; the containers go at the job's end (sweep) or on
    Ctrl+C and fab stop. A warm job launches its workers without torchrun, from its first
    attempt on and on every node alike, warm or cold (node.start_script: direct): the entrypoint
    sees a worker end at once, where torchrun's agent takes its own time to notice and stop.
    `hot` (a warm job's spares kept hot): claimed and synced with the hosts, each its spare's
    container kept waiting (node.spare_script), stopped on Ctrl+C and at the end; a rank's start
    takes a spare waiting on its host."""
    inv = replace(inv, job=replace(inv.job, master_port=port))
    spec = replace(
        spec,
        master_port=port,
        env=(*spec.env, ("FABTRAIN_ATTEMPT", str(number)), ("FABTRAIN_KEEP_SNAPSHOTS", str(keep))),
    )
    run_dir = run_dir or f"runs/{spec.job_id}"
    hot = hot if warm else ()
    steps = [
        *claim_steps(inv, spec, units, first, ticket, hot),
        *gate_steps(inv, spec, sync, hot),
        *snapshot_steps(inv, spec, snapshot, snapshot_missing, run_dir),
        *start_steps(inv, spec, access or {}, units or {}, warm, direct=warm, hot=hot),
        *watch_steps(inv, spec, warm),
        *teardown_steps(inv, spec, warm),
        *end_steps(inv, spec, inv.hosts, run_dir),
        *conditional_steps(inv, spec, run_dir, warm, hot),
        *(telemetry_steps(inv, spec) if units is not None else ()),
    ]
    return AttemptPlan(
        spec.job_id,
        number,
        inv.hosts,
        port,
        snapshot,
        spec,
        inv,
        facts,
        tuple(steps),
        inv.job.stop_grace,
        units or {},
        warm,
        hot,
    )


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
            steps.append(
                remote_step(
                    h,
                    "secrets",
                    put_command(hostfiles.secrets_file(inv, spec), 0o600),
                    30,
                    what="writing the secrets file",
                    stdin=secrets,
                    stdin_note=", ".join(f"{n}=<redacted>" for n, _ in job.secret_files),
                )
            )
        if h in hot:
            steps.append(
                remote_step(
                    h,
                    "spare",
                    node.spare_script(inv, h, spec, access.get(h.name), units.get(h.name), START_TIMEOUT),
                    START_TIMEOUT,
                    what="keeping the hot spare waiting",
                    stdin=dockerargs.runtime_files(),
                    stdin_note=dockerargs.RUNTIME_NOTE,
                )
            )
            continue
        steps.append(
            remote_step(
                h,
                "start",
                node.start_script(
                    inv,
                    h,
                    spec,
                    access.get(h.name),
                    units.get(h.name),
                    START_TIMEOUT,
                    warm,
                    direct,
                    hot=inv.job.hot_spares and warm,
                ),
                START_TIMEOUT,
                what="docker run" + (" (or the next generation of its warm container)" if warm else ""),
                stdin=dockerargs.runtime_files(),
                stdin_note=dockerargs.RUNTIME_NOTE,
            )
        )
    return steps


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


def conditional_steps(
    inv: Inventory, spec: jobspec.JobSpec, run_dir: str, warm: bool, hot: tuple[Host, ...] = ()
) -> list[Step]:
    """The steps that run only when their When says so: which run depends on what happens."""
    hosts, m, job = inv.hosts, inv.master, inv.job
    shape = layout(spec)
    local = Path(run_dir) / local_dir_name(spec)
    lease = sshargs.shell(["touch", f"{hostfiles.runtime_dir(inv, spec)}/{hostfiles.LEASE}"])
    steps = [
        remote_step(h, "lease", lease, STATUS_TIMEOUT, When.ON_LEASE, what="touching the job's lease")
        for h in (*hosts, *hot)
    ]
    steps.append(
        remote_step(
            m,
            "snapshot-list",
            shape.list_command(inv, spec),
            STATUS_TIMEOUT,
            When.ON_SNAPSHOT,
            what="listing snapshots",
        )
    )
    some = "NAME" if not spec.checkpoint else "00000000000000000000"  # the name found, when it runs
    steps.append(
        local_step(
            m,
            "snapshot-fetch",
            sshargs.fetch_file_argv(m, shape.remote(inv, spec, some), str(shape.local(local, some))),
            When.ON_SNAPSHOT,
            what="copying a snapshot",
        )
    )
    steps += [
        remote_step(
            h,
            "progress",
            hostfiles.progress_script(inv, spec, h.rank),
            STATUS_TIMEOUT,
            When.ON_SILENT,
            what="reading the heartbeat",
        )
        for h in hosts
    ]
    looks = (
        ("stacks", dockerargs.STACKS_PY, "reading stacks"),
        ("flight", dockerargs.FLIGHT_PY, "reading the flight recorder"),
    )
    for h in hosts:
        steps += [
            remote_step(
                h,
                key,
                sshargs.shell(dockerargs.python_in_node(spec, h.rank, code)),
                STACKS_TIMEOUT,
                When.ON_HANG,
                what=what,
            )
            for key, code, what in looks
        ]
    steps += [
        remote_step(
            h,
            "remainder",
            hostfiles.remainder_logs_script(inv, spec, h.rank, "OFFSET"),
            STATUS_TIMEOUT + 20,
            When.ON_MISSED,
            what="reading the rest of the output",
        )
        for h in hosts
    ]
    steps += [
        remote_step(
            h,
            "stopped",
            stopped_command(inv, spec.job_id),
            STATUS_TIMEOUT,
            When.ON_FAILED,
            what="checking for fab stop",
        )
        for h in hosts
    ]
    steps += [
        remote_step(
            h,
            "stop-on-failure",
            stop_command(inv, spec, h, warm),
            STOP_MARGIN,
            When.ON_FAILURE,
            what=stopping(warm),
        )
        for h in hosts
    ]
    return steps + [
        remote_step(
            h,
            "stop-on-interrupt",
            dockerargs.stop_script(spec.job_id, job.stop_grace),
            job.stop_grace + STOP_MARGIN,
            When.ON_INTERRUPT,
            what="stopping containers",
        )
        for h in (*hosts, *hot)
    ]


STACKS_TIMEOUT = 15
TELEMETRY_TIMEOUT = 20  # seconds one host's sample may take (nvidia-smi and docker stats are bounded inside)


def telemetry_steps(inv: Inventory, spec: jobspec.JobSpec) -> list[Step]:
    """WATCH's samples of every host (telemetry/sampler.py), when job.telemetry_every is not 0."""
    if not inv.job.telemetry_every:
        return []
    return [
        remote_step(
            h,
            "telemetry",
            telemetry_script(inv, spec.job_id),
            TELEMETRY_TIMEOUT,
            When.ON_SAMPLE,
            what="sampling the host's telemetry",
        )
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
