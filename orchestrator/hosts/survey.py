"""What runs on the hosts, as one survey of each (fab status, fab stop, --num-nodes, the plan, the
preflight): our containers, the runtime directories with their leases' ages, the claims and the
queue (HostJobs), and what is read from them (the jobs running or live, each job's view, the hosts
busy, the runtime directories left over).

A job is found on a host by its containers (labels) and by its runtime directory
(output_dir/.runtime/JOB), which exists from the job's claim to its end, between attempts too. A
runtime directory with no container of its job and a lease older than hostfiles.LEASE_STALE is left
over (its `fab train` is gone, or the host was lost while the job ran): `fab stop` and preflight
clear it (hostops.clear_stale).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import dockerargs, hostfiles, sshargs, touched
from orchestrator.hosts import claims, queue
from orchestrator.hosts.claimdir import renewed_within
from orchestrator.transport.deadlines import STATUS_TIMEOUT
from orchestrator.transport.remote import PerHost, Session


@dataclass(frozen=True)
class HostJobs:
    """What one host holds of our jobs."""

    running: dict[str, int]  # job -> node rank, containers running
    containers: frozenset[str]  # jobs with any container, running or not
    runtime: dict[str, float | None]  # job -> its lease's age in seconds (None: no lease)
    owners: dict[str, str] = field(default_factory=dict)  # job -> who started it (container label)
    attempts: dict[str, str] = field(default_factory=dict)  # job -> its containers' attempt
    states: dict[str, str] = field(default_factory=dict)  # job -> its container's state here
    cpus: int = 1  # the host's CPUs (its slots, without GPUs)
    claimed: tuple[claims.Holder, ...] = ()  # every claim file there, stale ones included
    ranks: dict[str, int] = field(default_factory=dict)  # job -> node rank of its container, any state
    controllers: dict[str, str] = field(default_factory=dict)  # job -> state of its controller container
    queued: tuple[queue.Waiting, ...] = ()  # the host's queue (queue.QUEUE), any order

    def holders(self, but: str = "") -> list[claims.Holder]:
        """Who holds units here, other than job `but`: claims whose job runs here or has a lease
        renewed within hostfiles.LEASE_STALE, not dated ahead (as the claim script judges them), and a
        job running here with no claim file (it holds the whole host)."""

        def alive(job: str) -> bool:
            return job in self.running or renewed_within(self.runtime.get(job), hostfiles.LEASE_STALE)

        held = [c for c in self.claimed if c.job != but and alive(c.job)]
        named = {c.job for c in self.claimed}
        return held + [claims.Holder(j) for j in sorted(self.running) if j != but and j not in named]


# The label of a detached job's controller container (backends/ssh/detached.py): its job id.
CONTROLLER_LABEL = "fabtrain.controller"


def survey_script(inv: Inventory) -> str:
    """One round trip: our containers, each runtime directory with its lease's age, the claims."""
    rt = sshargs.shell([f"{inv.job.output_dir}/.runtime"])
    return (
        f"{sshargs.shell(dockerargs.status_argv())}; echo @@runtime; now=$(date +%s); "
        f'for d in {rt}/*/; do [ -d "$d" ] || continue; j=$(basename "$d"); '
        # Only a job id's characters: a name with a newline cannot add a line of its own.
        f'case "$j" in *[!A-Za-z0-9._-]*) continue;; esac; '
        f'if [ -e "${{d}}{hostfiles.LEASE}" ]; then '
        f'echo "$j $((now - $(stat -c %Y "${{d}}{hostfiles.LEASE}")))"; '
        'else echo "$j none"; fi; done; echo @@controllers; '
        + sshargs.shell(
            [
                "docker",
                "ps",
                "--all",
                "--filter",
                "label=" + CONTROLLER_LABEL,
                "--format",
                '{{.Label "' + CONTROLLER_LABEL + '"}}\t{{.State}}',
            ]
        )
        + "; "
        + claims.survey_script(inv)
    )


def parse_survey(text: str) -> HostJobs:
    containers, _, runtime = text.partition("@@runtime\n")
    runtime, _, claimed = runtime.partition("@@claims\n")
    runtime, _, controlling = runtime.partition("@@controllers\n")
    controllers = {}
    for line in controlling.splitlines():
        job, _, state = line.partition("\t")
        if jobspec.valid_job_id(job):
            controllers[job] = hostile.line(state, 40)
    cpus, held, queued = claims.parse_survey(claimed)
    running, any_container, owners, attempts, states, ranks = {}, set(), {}, {}, {}, {}
    for line in containers.splitlines():
        f = line.split("\t")
        if len(f) >= 4 and jobspec.valid_job_id(f[0]):
            any_container.add(f[0])
            states[f[0]] = f[3]
            # A hot spare that took a rank keeps its label (spare): its name says the rank.
            rank = int(f[1]) if f[1].isdigit() else jobspec.rank_of_container(f[0], f[2])
            if rank is not None:
                ranks[f[0]] = rank
            if len(f) >= 7:
                owners[f[0]], attempts[f[0]] = f[5], f[6]
            if f[3] in ("running", "created", "restarting") and rank is not None:
                running[f[0]] = rank
    dirs: dict[str, float | None] = {}
    for line in runtime.splitlines():
        job, _, age = line.partition(" ")
        if jobspec.valid_job_id(job) and job != hostfiles.IMAGE_CACHE:
            dirs[job] = float(age) if age.lstrip("-").isdigit() else None
    return HostJobs(
        running,
        frozenset(any_container),
        dirs,
        owners,
        attempts,
        states,
        cpus,
        tuple(held),
        ranks,
        controllers,
        tuple(queued),
    )


def survey(session: Session, inv: Inventory, hosts: tuple[Host, ...] | None = None) -> PerHost:
    """host -> HostJobs (or the error that host gave), each within STATUS_TIMEOUT."""
    script = survey_script(inv)

    def one(h: Host) -> HostJobs:
        r = session.run(h, script, timeout=STATUS_TIMEOUT, what="docker ps")
        return parse_survey(r.stdout)

    return session.fan_out(one, hosts or inv.all_hosts)


def running_jobs(found: PerHost) -> dict[str, dict[str, int]]:
    """job id -> {host: node rank} where a container of it is running (from survey)."""
    jobs: dict[str, dict[str, int]] = {}
    for host, hj in found.items():
        if isinstance(hj, HostJobs):
            for job, rank in hj.running.items():
                jobs.setdefault(job, {})[host] = rank
    return jobs


def live_jobs(found: PerHost) -> dict[str, list[str]]:
    """job id -> hosts where it runs or its `fab train` still holds a fresh lease."""
    jobs: dict[str, list[str]] = {}
    for host, hj in found.items():
        if isinstance(hj, HostJobs):
            for job in {
                *hj.running,
                *(j for j, age in hj.runtime.items() if renewed_within(age, hostfiles.LEASE_LIVE)),
            }:
                jobs.setdefault(job, []).append(host)
    return jobs


@dataclass
class JobView:
    """A job as the hosts show it (`fab status`, `fab stop`): from its claims, containers and leases."""

    job: str
    who: str = ""
    since: float = 0.0
    hosts: dict[str, tuple[int, ...] | None] = field(
        default_factory=dict
    )  # host -> units (None: not claimed)
    ranks: dict[str, int] = field(default_factory=dict)  # host -> node rank, where a container runs
    states: dict[str, str] = field(default_factory=dict)  # host -> container state, or 'claimed'/'left over'
    attempt: str = ""
    live: bool = False  # a container runs, or its fab train holds a fresh lease
    queue: dict[str, int] = field(default_factory=dict)  # host -> its position in that host's queue
    waits: list[str] = field(default_factory=list)  # what a queued job waits for, per host

    @property
    def state(self) -> str:
        if self.ranks:
            return "running"
        if self.queue and not self.live:
            return f"queued ({max(self.queue.values())})"
        if self.live:
            return "starting" if not self.states or "claimed" in self.states.values() else "between attempts"
        return "left over"


def job_views(found: PerHost) -> dict[str, JobView]:
    """Every job the hosts know of (claim files, containers, runtime directories), by id."""
    views: dict[str, JobView] = {}

    def view(job: str) -> JobView:
        return views.setdefault(job, JobView(job))

    for host, hj in found.items():
        if not isinstance(hj, HostJobs):
            continue
        for c in hj.claimed:
            v = view(c.job)
            v.who, v.since = v.who or c.who, min(filter(None, (v.since, c.since)), default=0.0)
            v.hosts[host] = c.units
            v.states.setdefault(host, "claimed")
        for job in hj.containers:
            v = view(job)
            v.hosts.setdefault(host, None)
            v.states[host] = hj.states.get(job, "?")
            v.who = v.who or hj.owners.get(job, "")
            v.attempt = max(v.attempt, hj.attempts.get(job, ""))
        for job, rank in hj.running.items():
            view(job).ranks[host] = rank
        for job, age in hj.runtime.items():
            if renewed_within(age, hostfiles.LEASE_LIVE):
                view(job).live = True
                view(job).hosts.setdefault(host, None)
        # As the claim script obeys them: renewed lately, not dated ahead, with a ticket.
        fresh = queue.queue_order(
            [w for w in hj.queued if w.ticket and renewed_within(w.age, hostfiles.LEASE_STALE)]
        )
        for i, w in enumerate(fresh):
            v = view(w.job)
            v.who, v.since = v.who or w.who, min(filter(None, (v.since, w.since)), default=0.0)
            v.hosts.setdefault(host, None)
            v.states.setdefault(host, "queued")
            v.queue[host] = i + 1
            ahead = [x.job for x in fresh[:i]]
            held = [c.job for c in hj.claimed if c.job != w.job]
            v.waits.append(
                f"{host}: "
                + (
                    f"behind {', '.join(ahead)}"
                    if ahead
                    else f"held by {', '.join(held)}"
                    if held
                    else "free now"
                )
            )
    for v in views.values():
        v.live = v.live or bool(v.ranks)
    return views


STEP_MARK = "@@fabtrain-step "  # before each job's console tail in last_steps_script's output


def last_steps_script(files: dict[str, tuple[str, str]]) -> str:
    """One round trip for every job whose rank 0 runs on a host: each job's console file tail
    (job -> its directory and the file's path there, read as touched.py reads what a container
    wrote), after a marker line naming the job."""
    return (
        "; ".join(
            f"echo; echo {sshargs.shell([STEP_MARK + job])}; "
            f"{touched.tail(sshargs.shell([root]), rel, 8192)} 2>/dev/null"
            for job, (root, rel) in files.items()
        )
        + "; true"
    )


def parse_last_steps(text: bytes) -> dict[str, int]:
    """job -> the last step its tail shows, from last_steps_script's output (jobs with none left out)."""
    from orchestrator.progress.live import STEP

    out = {}
    for part in text.split(b"\n" + STEP_MARK.encode())[1:]:
        job, _, tail = part.partition(b"\n")
        found = STEP.findall(tail)
        if found:
            out[job.decode(errors="replace")] = int(found[-1])
    return out


def last_steps(session: Session, inv: Inventory, views: dict[str, JobView]) -> dict[str, int]:
    """The last step each running job's rank-0 node printed (its console file's tail), by job: one
    command per host holding a rank 0, all hosts at once (a host with many jobs is still one round
    trip, and many jobs do not add up to many round trips one after another)."""
    hosts = {h.name: h for h in inv.all_hosts}
    files: dict[str, dict[str, tuple[str, str]]] = {}
    for job, v in views.items():
        for host, rank in v.ranks.items():
            if rank == 0 and host in hosts:
                files.setdefault(host, {})[job] = (
                    hostfiles.job_dir(inv, jobspec.JobSpec(job_id=job, script="")),
                    jobspec.console_name(0),
                )

    def one(h: Host) -> dict[str, int]:
        r = session.run(
            h, last_steps_script(files[h.name]), timeout=STATUS_TIMEOUT, what="reading the last steps"
        )
        return parse_last_steps(r.stdout.encode())

    got: dict[str, int] = {}
    for steps in session.fan_out(one, tuple(hosts[n] for n in files)).values_ok():  # a step not read is '-'
        got.update(steps)
    return got


def busy_hosts(found: PerHost, inv: Inventory, want: claims.Want) -> set[str]:
    """Hosts where a job asking `want` does not fit beside the other jobs' claims (or that did not
    answer): what --num-nodes passes over."""
    busy = set()
    for h in inv.all_hosts:
        hj = found.value(h.name)
        if not isinstance(hj, HostJobs):
            busy.add(h.name)
            continue
        cap = claims.capacity(h, hj.cpus)
        try:
            claims.choose(h, cap, hj.holders(), want.of(h, cap))
        except UserError:
            busy.add(h.name)
    return busy


def stale_runtime(found: PerHost) -> dict[str, list[str]]:
    """host -> the jobs whose runtime directory there is left over (see the module's docstring)."""
    out: dict[str, list[str]] = {}
    for host, hj in found.items():
        if isinstance(hj, HostJobs):
            left = [
                j
                for j, age in hj.runtime.items()
                if j not in hj.containers and not renewed_within(age, hostfiles.LEASE_STALE)
            ]
            if left:
                out[host] = sorted(left)
    return out
