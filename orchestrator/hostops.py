"""Operations on the hosts outside one attempt: `fab sync`, `status`, `stop`, and finding jobs.

A job is found on a host by its containers (labels) and by its runtime directory
(output_dir/.runtime/JOB), which exists from the job's claim to its end, between attempts too. A
runtime directory with no container of its job and a lease older than plan.LEASE_STALE is left
over (its `fab train` is gone, or the host was lost while the job ran) and is cleared by `fab stop`
and by preflight, which say so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import codetree, plan
from .attempt import COPY_TIMEOUT, STATUS_TIMEOUT, STOP_MARGIN
from .errors import UserError
from .inventory import Host, Inventory
from .logs import sanitize
from .remote import PerHost, Session


def sync(session: Session, inv: Inventory, source: Path, only: str = "",
         hosts: tuple[Host, ...] | None = None) -> tuple[str, dict[str, float]]:
    """rsync the local tree (with `only`, its top folder of that name) to job.code_dir/KEY on every
    host at once (codetree.py): where it went, and the seconds per host."""
    hosts = hosts or inv.hosts
    dest = f"{inv.job.code_dir}/{codetree.key(source, only)}"

    def one(host: Host) -> float:
        r = session.local(plan.rsync_argv(host, str(source), dest, only), COPY_TIMEOUT)
        if not r.ok:
            raise UserError(f"sync to {host.name} ({host.ssh.where()}) failed (rsync exit {r.exited}): "
                            f"{sanitize(r.stderr.strip()[-400:])}; check SSH access with: "
                            f"{plan.shell([*plan.ssh_argv(host), host.hostname, 'true'])}")
        return r.seconds

    results = session.fan_out(one, hosts)
    raise_any(hosts, results, "sync")
    return dest, {h.name: results[h.name] for h in hosts}


def raise_any(hosts: tuple[Host, ...], results: PerHost, what: str) -> None:
    from .remote import describe
    errors = [describe(h, e) for h in hosts if (e := results.error(h.name))]
    if errors:
        raise UserError(f"{what} failed:\n" + "\n".join(errors))


def list_containers(session: Session, hosts: tuple[Host, ...] | None = None) -> PerHost:
    """This project's containers on every host (`plan.status_argv` lines): host -> Result or error,
    each host within STATUS_TIMEOUT."""
    command = plan.shell(plan.status_argv())
    return session.fan_out(lambda h: session.run(h, command, timeout=STATUS_TIMEOUT, what="docker ps"), hosts)


@dataclass(frozen=True)
class HostJobs:
    """What one host holds of our jobs."""

    running: dict[str, int]           # job -> node rank, containers running
    containers: frozenset[str]        # jobs with any container, running or not
    runtime: dict[str, float | None]  # job -> its lease's age in seconds (None: no lease)


def survey_script(inv: Inventory) -> str:
    """One round trip: our containers, then each runtime directory with its lease's age."""
    rt = plan.shell([f"{inv.job.output_dir}/.runtime"])
    return (f"{plan.shell(plan.status_argv())}; echo @@runtime; now=$(date +%s); "
            f"for d in {rt}/*/; do [ -d \"$d\" ] || continue; j=$(basename \"$d\"); "
            f"if [ -e \"${{d}}{plan.LEASE}\" ]; then echo \"$j $((now - $(stat -c %Y \"${{d}}{plan.LEASE}\")))\"; "
            "else echo \"$j none\"; fi; done")


def parse_survey(text: str) -> HostJobs:
    containers, _, runtime = text.partition("@@runtime\n")
    running, any_container = {}, set()
    for line in containers.splitlines():
        f = line.split("\t")
        if len(f) >= 4 and plan.valid_job_id(f[0]):
            any_container.add(f[0])
            if f[3] in ("running", "created", "restarting") and f[1].isdigit():
                running[f[0]] = int(f[1])
    dirs: dict[str, float | None] = {}
    for line in runtime.splitlines():
        job, _, age = line.partition(" ")
        if plan.valid_job_id(job) and job != plan.IMAGE_CACHE:
            dirs[job] = float(age) if age.lstrip("-").isdigit() else None
    return HostJobs(running, frozenset(any_container), dirs)


def survey(session: Session, inv: Inventory, hosts: tuple[Host, ...] | None = None) -> PerHost:
    """host -> HostJobs (or the error that host gave), each within STATUS_TIMEOUT."""
    script = survey_script(inv)

    def one(h: Host) -> HostJobs:
        r = session.run(h, script, timeout=STATUS_TIMEOUT, what="listing jobs")
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
            for job in {*hj.running, *(j for j, age in hj.runtime.items() if age is not None and age < plan.LEASE_LIVE)}:
                jobs.setdefault(job, []).append(host)
    return jobs


def stale_runtime(found: PerHost) -> dict[str, list[str]]:
    """host -> the jobs whose runtime directory there is left over (see the module's docstring)."""
    out: dict[str, list[str]] = {}
    for host, hj in found.items():
        if isinstance(hj, HostJobs):
            left = [j for j, age in hj.runtime.items()
                    if j not in hj.containers and (age is None or age >= plan.LEASE_STALE)]
            if left:
                out[host] = sorted(left)
    return out


def clear_stale(session: Session, inv: Inventory, found: PerHost) -> list[str]:
    """Remove left-over runtime directories (secrets files included); one line per host saying so."""
    stale = stale_runtime(found)
    hosts = {h.name: h for h in inv.all_hosts}

    def one(h: Host) -> None:
        argv = ["rm", "-rf", *(f"{inv.job.output_dir}/.runtime/{j}" for j in stale[h.name])]
        session.run(h, plan.shell(argv), timeout=STATUS_TIMEOUT, what="removing left-over runtime files")
    done = session.fan_out(one, tuple(hosts[n] for n in stale if n in hosts))
    return [f"{n}: removed the left-over runtime files (secrets included) of {', '.join(stale[n])}"
            for n in stale if n in done and done.error(n) is None]


def mark_stopped(session: Session, inv: Inventory, jobs: dict[str, list[str]]) -> None:
    """Tell a watching `fab train` that these jobs (job -> its hosts) were ended on purpose: a
    marker in the job's runtime directory on its hosts, which the job looks for between stages."""
    def mark(h: Host) -> None:
        for job_id, where in jobs.items():
            if h.name in where and plan.valid_job_id(job_id):
                session.put(h, b"", plan.stopped_marker(inv, job_id), 0o644, timeout=STATUS_TIMEOUT)
    # A host that cannot take its marker is still stopped afterwards (and named there).
    session.fan_out(mark, tuple(h for h in inv.all_hosts if any(h.name in w for w in jobs.values())))


def stop(session: Session, job_id: str | None, grace: float, hosts: tuple[Host, ...] | None = None) -> PerHost:
    """Stop and remove the job's (or every project) container on each host: host -> Result or error."""
    script = plan.stop_script(job_id, grace)
    return session.fan_out(lambda h: session.run(h, script, timeout=grace + STOP_MARGIN, what="stopping containers"),
                           hosts)
