"""One attempt of a job as a frozen plan: the hosts with their ranks, the master port, the
snapshot to place, and every command per host in order, from the sync to the teardown.

`fab train --dry-run` prints `render()` of this object, `runs/JOB/plan.txt` holds the same text
for every attempt, and the job's stages execute its steps and nothing else (a unit test runs a
whole job against a recording session and compares). The few facts a plan depends on (how a GPU
host hands out its GPUs, which master port is free, where the newest snapshot is) are read from
the hosts first, read-only, and shown in the rendering with the commands that read them.

Here: the stages, the plan and `build`, which puts it together; a step and when it runs are
planstep.py's, the steps themselves are built by stagesteps.py (those every attempt runs) and
conditionalsteps.py (those that run when something happens).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from orchestrator.backends.ssh.conditionalsteps import conditional_steps, telemetry_steps
from orchestrator.backends.ssh.planstep import Step, When
from orchestrator.backends.ssh.stagesteps import (
    claim_steps,
    end_steps,
    gate_steps,
    snapshot_steps,
    start_steps,
    teardown_steps,
    watch_steps,
)
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import jobspec
from orchestrator.hostcmds import dockerargs
from orchestrator.hosts import claimdir, claims


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
    inv, spec = for_attempt(inv, spec, number, port, keep)
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


def for_attempt(
    inv: Inventory, spec: jobspec.JobSpec, number: int, port: int, keep: int
) -> tuple[Inventory, jobspec.JobSpec]:
    """The inventory and the spec as one attempt runs them: its master port, and in the job's
    environment its number and how many snapshots are kept."""
    inv = replace(inv, job=replace(inv.job, master_port=port))
    spec = replace(
        spec,
        master_port=port,
        env=(*spec.env, ("FABTRAIN_ATTEMPT", str(number)), ("FABTRAIN_KEEP_SNAPSHOTS", str(keep))),
    )
    return inv, spec
