"""fab top: every host of the inventory at a glance, refreshed in place. For each host its units
(GPUs, or CPU slots on a host without GPUs) and which job and owner holds each (the claims and
containers `fab status` reads: hosts/survey.py), each GPU's utilisation and memory (one telemetry
sample: telemetry/commands.py, telemetry/samples.py), each job container's CPU and memory, and each
job's last step and its rate between two refreshes.

One command per host per refresh (top_script: the survey, the steps of the jobs whose rank 0 runs
there, the telemetry), all hosts at once, each within TOP_TIMEOUT; a host that does not answer is
named and the others are shown. `snapshot` (pure) turns the answers into one JSON-able document,
`render` (pure) into what the terminal shows; `take` and `live` do the I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.hostcmds import hostfiles, sshargs, touched
from orchestrator.hostcmds.dockerargs import label_filter
from orchestrator.hosts import claims, survey
from orchestrator.telemetry.commands import TOOL_TIMEOUT, telemetry_script
from orchestrator.telemetry.samples import parse_sample
from orchestrator.transport.remote import PerHost, Session, describe

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

REFRESH = 2.0  # seconds between two refreshes of the live view
TOP_TIMEOUT = 20.0  # seconds one host has to answer a refresh (telemetry's tools are bounded inside)
STEPS_MARK = "@@fabtrain-top steps"
TELEMETRY_MARK = "@@fabtrain-top telemetry"
JOBS_MAX = 64  # jobs whose last step one host is asked for
_PLACE = "JOBID"  # a job id's place in a path or a container name, filled in on the host


def steps_script(inv: Inventory) -> str:
    """The console tail of each job whose rank-0 container is on this host (its name says rank 0,
    a hot spare that took rank 0 too), after survey.STEP_MARK and the job id, as
    survey.parse_last_steps reads them."""
    before = hostfiles.job_dir(inv, jobspec.JobSpec(job_id=_PLACE, script="")).removesuffix(_PLACE)
    root = f'{sshargs.shell([before])}"$j"'
    tail = touched.tail(root, jobspec.console_name(0), 8192)
    name_before, _, name_after = jobspec.container_name(_PLACE, 0).partition(_PLACE)
    ps = sshargs.shell(
        ["docker", "ps", *label_filter(None), "--format", '{{.Label "' + jobspec.LABEL_JOB + '"}} {{.Names}}']
    )
    return (
        f"timeout -k 2 {TOOL_TIMEOUT} {ps} 2>/dev/null | head -n {JOBS_MAX} | while read -r j n; do "
        # Only a job id's characters: the id goes into a path and a marker line.
        'case "$j" in ""|*[!A-Za-z0-9._-]*) continue;; esac; '
        f'[ "$n" = {sshargs.shell([name_before])}"$j"{sshargs.shell([name_after])} ] || continue; '
        f'echo; echo "{survey.STEP_MARK}$j"; '
        f"{tail} 2>/dev/null; done; true"
    )


def top_script(inv: Inventory) -> str:
    """One refresh of one host: the survey (survey.survey_script), the jobs' last steps
    (steps_script), the telemetry (telemetry_script, every container of ours), apart by marker lines."""
    return (
        f"{survey.survey_script(inv)}; echo; echo {sshargs.shell([STEPS_MARK])}; {steps_script(inv)}; "
        f"echo; echo {sshargs.shell([TELEMETRY_MARK])}; {telemetry_script(inv, None)}"
    )


@dataclass(frozen=True)
class Answer:
    """What one host said in one refresh."""

    jobs: survey.HostJobs
    steps: dict[str, int]
    sample: dict[str, Any]


def parse_answer(text: str) -> Answer:
    """top_script's output. The survey comes first: what a host's telemetry prints cannot reach it."""
    head, _, tele = text.partition(f"\n{TELEMETRY_MARK}\n")
    found, _, steps = head.partition(f"\n{STEPS_MARK}\n")
    return Answer(survey.parse_survey(found), survey.parse_last_steps(steps.encode()), parse_sample(tele))


# ------------------------------------------------------------------ the snapshot (pure)


def rate(before: tuple[float, int] | None, now: tuple[float, int] | None) -> float | None:
    """Steps per second between two (time, step) readings of a job; None without two readings, with
    no time between them, or when the step went back (a restart from a snapshot)."""
    if before is None or now is None or now[0] <= before[0] or now[1] < before[1]:
        return None
    return (now[1] - before[1]) / (now[0] - before[0])


def _holders(hj: survey.HostJobs, cap: int) -> dict[int, claims.Holder]:
    """unit -> the claim holding it (a claim of no units in particular holds them all)."""
    held: dict[int, claims.Holder] = {}
    for h in hj.holders():
        for u in h.units or range(cap):
            if 0 <= u < cap:
                held.setdefault(u, h)
    return held


def _job_of(name: str, jobs: frozenset[str]) -> str | None:
    """The job whose container this is (a rank's, or a hot spare's), by its name."""
    for job in sorted(jobs):
        spare = jobspec.container_name(job, jobspec.SPARE)
        if name == spare or jobspec.rank_of_container(job, name) is not None:
            return job
    return None


def host_view(host: Host, answer: Answer) -> dict[str, Any]:
    """One host's part of the snapshot."""
    hj, sample = answer.jobs, answer.sample
    cap = claims.capacity(host, hj.cpus)
    held = _holders(hj, cap)
    gpus = {g["index"]: g for g in sample["gpus"]}
    slots = []
    for u in range(cap):
        h = held.get(u)
        g = gpus.get(u, {}) if host.gpu_vendor != "none" else {}
        slots.append(
            {
                "unit": u,
                "job": h.job if h else None,
                "who": (h.who or hj.owners.get(h.job) or None) if h else None,
                "util": g.get("util"),
                "mem_used": g.get("mem_used"),
                "mem_total": g.get("mem_total"),
            }
        )
    containers = [{**c, "job": _job_of(c["name"], hj.containers)} for c in sample["containers"]]
    return {
        "host": host.name,
        "answered": True,
        "error": None,
        "kind": claims.kind(host),
        "vendor": sample["vendor"],
        "slots": slots,
        "containers": containers,
        "load": sample["host"],
        "xid": sample["xid"],
        "telemetry_errors": sample["errors"],
    }


def surveyed(answers: dict[str, Answer | str]) -> tuple[PerHost, dict[str, int]]:
    """The answers as `fab status` reads the hosts: host -> HostJobs (or the error), and job -> its
    last step."""
    found = PerHost({n: (a.jobs if isinstance(a, Answer) else RuntimeError(a)) for n, a in answers.items()})
    steps: dict[str, int] = {}
    for a in answers.values():
        if isinstance(a, Answer):
            steps.update(a.steps)
    return found, steps


def snapshot(
    inv: Inventory,
    answers: dict[str, Answer | str],
    now: float,
    before: dict[str, tuple[float, int]] | None = None,
) -> dict[str, Any]:
    """The whole view as one JSON-able document: hosts (in the inventory's order), jobs (as
    `fab status` lists them, with the step rate since `before`: job -> (time, step) of the last
    refresh) and errors (a host that did not answer: `answers` holds the reason as text)."""
    found, steps = surveyed(answers)
    hosts = []
    for h in inv.all_hosts:
        a = answers.get(h.name, "not asked")
        if isinstance(a, Answer):
            hosts.append(host_view(h, a))
        else:
            hosts.append(
                {
                    "host": h.name,
                    "answered": False,
                    "error": a,
                    "kind": claims.kind(h),
                    "vendor": None,
                    "slots": [],
                    "containers": [],
                    "load": None,
                    "xid": [],
                    "telemetry_errors": [],
                }
            )
    jobs = []
    for v in sorted(survey.job_views(found).values(), key=lambda v: (-v.since, v.job)):
        step = steps.get(v.job)
        jobs.append(
            {
                "job": v.job,
                "who": v.who or None,
                "state": v.state,
                "step": step,
                "rate": rate((before or {}).get(v.job), (now, step) if step is not None else None),
                "hosts": {n: list(u) if u is not None else None for n, u in v.hosts.items()},
            }
        )
    return {
        "time": now,
        "hosts": hosts,
        "jobs": jobs,
        "errors": [a for n, a in answers.items() if not isinstance(a, Answer)],
    }


def readings(snap: dict[str, Any]) -> dict[str, tuple[float, int]]:
    """job -> (time, step) of a snapshot: the `before` of the next one."""
    return {j["job"]: (snap["time"], j["step"]) for j in snap["jobs"] if j["step"] is not None}


# ------------------------------------------------------------------ what the terminal shows (pure)


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.1f}G"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _spans(slots: list[dict]) -> list[tuple[str, dict]]:
    """CPU slots in runs of the same holder ("0-3"), each with its first slot."""
    out: list[tuple[str, dict]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or (slots[i]["job"], slots[i]["who"]) != (
            slots[start]["job"],
            slots[start]["who"],
        ):
            a, b = slots[start]["unit"], slots[i - 1]["unit"]
            out.append((str(a) if a == b else f"{a}-{b}", slots[start]))
            start = i
    return out


def _units(snap: dict[str, Any]) -> Table:
    """The hosts and their units (a GPU each, or CPU slots in runs of one holder), with each host's
    load and memory under its name."""
    from rich.table import Table
    from rich.text import Text

    t = hostile.rich_text
    units = Table(title=time.strftime("fabtrain top  %H:%M:%S", time.localtime(snap["time"])), expand=False)
    for col in ("host", "unit", "job", "who", "util", "memory"):
        units.add_column(col, no_wrap=col in ("host", "job"))
    for h in snap["hosts"]:
        if not h["answered"]:
            units.add_row(t(h["host"]), "-", Text("not answering", style="red"), "-", "-", "-")
            continue
        load = h["load"] or {}
        where = t(h["host"])
        where.append(
            f"\nload {load.get('load1') if load.get('load1') is not None else '-'}"
            f" / {load.get('cpus') or '-'} cpus\nmemory {_bytes(load.get('mem_used'))}"
            f" / {_bytes(load.get('mem_total'))}",
            style="dim",
        )
        rows = (
            [(f"GPU {s['unit']}", s) for s in h["slots"]]
            if h["kind"] == "GPU"
            else [(f"slots {span}", s) for span, s in _spans(h["slots"])]
        )
        for i, (label, s) in enumerate(rows or [("-", {"job": None, "who": None})]):
            memory = (
                f"{_bytes(s.get('mem_used'))} / {_bytes(s.get('mem_total'))}"
                if s.get("mem_total") is not None
                else "-"
            )
            units.add_row(
                where if i == 0 else "",
                label,
                t(s["job"] or "free", "" if s["job"] else "dim"),
                t(s["who"] or "-"),
                _pct(s.get("util")),
                memory,
            )
    return units


def _containers(snap: dict[str, Any]) -> Table:
    """Every job container of every host: its CPU (cores) and memory."""
    from rich.table import Table

    t = hostile.rich_text
    containers = Table(title="containers")
    for col in ("host", "container", "job", "cpu (cores)", "memory"):
        containers.add_column(col, no_wrap=col == "container")
    for h in snap["hosts"]:
        for c in h["containers"]:
            limit = f" / {_bytes(c['mem_limit'])}" if c["mem_limit"] else ""
            containers.add_row(
                t(h["host"]), t(c["name"]), t(c["job"] or "-"), f"{c['cpu']:.2f}", _bytes(c["mem"]) + limit
            )
    return containers


def _jobs(snap: dict[str, Any]) -> Table:
    """The jobs as `fab status` lists them, with each one's last step and steps/s."""
    from rich.table import Table

    t = hostile.rich_text
    jobs = Table(title="jobs")
    for col in ("job", "who", "state", "step", "steps/s", "hosts"):
        jobs.add_column(col, no_wrap=col == "job")
    for j in snap["jobs"]:
        jobs.add_row(
            t(j["job"]),
            t(j["who"] or "-"),
            t(j["state"]),
            "-" if j["step"] is None else str(j["step"]),
            "-" if j["rate"] is None else f"{j['rate']:.2f}",
            t(", ".join(j["hosts"])),
        )
    return jobs


def render(snap: dict[str, Any]) -> RenderableType:
    """The live view of a snapshot: hosts and their units, containers, jobs, and hosts not answering.
    Everything a host sent is shown as plain text (hostile.rich_text), never as markup."""
    from rich.console import Group
    from rich.text import Text

    parts: list[RenderableType] = [_units(snap)]
    containers = _containers(snap)
    if containers.row_count:
        parts.append(containers)
    parts.append(_jobs(snap) if snap["jobs"] else Text("no jobs", style="dim"))
    for line in snap["errors"]:
        parts.append(hostile.rich_text(line, "red"))
    return Group(*parts)


# ------------------------------------------------------------------ I/O


def ask(session: Session, inv: Inventory) -> dict[str, Answer | str]:
    """top_script on every host at once, each within TOP_TIMEOUT: host -> its Answer, or why it
    gave none (the web dashboard builds `fab status`'s rows from the same answers)."""
    script = top_script(inv)

    def one(h: Host) -> Answer:
        return parse_answer(session.run(h, script, timeout=TOP_TIMEOUT, what="fab top").stdout)

    got = session.fan_out(one, inv.all_hosts)
    by_name = {h.name: h for h in inv.all_hosts}
    return {n: a if isinstance(a, Answer) else describe(by_name[n], a) for n, a in got.items()}


def take(
    session: Session,
    inv: Inventory,
    before: dict[str, tuple[float, int]] | None = None,
    clock: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """One refresh: the hosts' answers (ask), the snapshot."""
    return snapshot(inv, ask(session, inv), clock(), before)


def once(inv: Inventory) -> dict[str, Any]:
    """One snapshot (fab top --json)."""
    with Session(inv.all_hosts) as session:
        return take(session, inv)


def live(inv: Inventory, console: Console, every: float = REFRESH) -> None:
    """The view refreshed in place every `every` seconds until Ctrl+C (which ends it quietly)."""
    from rich.live import Live

    before: dict[str, tuple[float, int]] = {}
    try:
        with (
            Session(inv.all_hosts) as session,
            Live(console=console, auto_refresh=False, transient=False) as view,
        ):
            while True:
                started = time.monotonic()
                snap = take(session, inv, before)
                before = readings(snap)
                view.update(render(snap), refresh=True)
                time.sleep(max(0.0, every - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return
