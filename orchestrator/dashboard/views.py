"""What the dashboard's page shows, as JSON documents (pure but for bounded reads of runs/JOB).

- `overview`: the hosts with who holds each GPU (CPU slot) and their use (progress/top.py's snapshot),
  the jobs as `fab status` lists them (backends/ssh/jobcontrol.status_rows over the same answers), each
  with its step rate and, where this machine has its run, its newest loss and tokens/s
  (progress/latest.py), the queue, and the hosts that did not answer.
- `job_page`: one job from runs/JOB: its record's attempts and their outcomes, the failures, the
  loss and tokens/s curves (the `progress` events), the newest figures per rank and telemetry per
  host, and the tail of each host's log; `plan_page`: its plan.txt.

Every string that came from a host, a container or a file is passed through hostile.text (`clean`);
the page puts text in with textContent only, so a log line holding ESC bytes or `<script>` is shown
as the text it is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from orchestrator.backends.ssh import jobcontrol
from orchestrator.config.inventory import Inventory
from orchestrator.core import hostile, jobspec, recovery
from orchestrator.core.errors import UserError
from orchestrator.hosts import survey
from orchestrator.progress import latest, top
from orchestrator.progress.notify import EVENTS_FILE

OVERVIEW_TAIL = 256 * 1024  # bytes of a job's events.jsonl and telemetry.jsonl read for the job list
LOG_TAIL = 16 * 1024  # bytes read from the end of each host's log
LOG_LINES = 80  # lines of it shown
LINE_CHARS = 2000  # characters of one log line shown
LOGS_MAX = 64  # host logs shown on a job page
PLAN_MAX = 256 * 1024  # bytes of plan.txt shown
POINTS_MAX = 2000  # points of a curve (the newest)
FAILURES_MAX = 50  # the newest host failures shown


class NotFound(Exception):
    """A request for something that is not there (or may not be asked for): HTTP 404, with why."""


def clean(value: Any) -> Any:
    """A document with every string in it (keys too) made plain text (hostile.text), and every number
    that JSON cannot carry (NaN, infinity) as null."""
    if isinstance(value, str):
        return hostile.text(value)
    if isinstance(value, dict):
        return {clean(str(k)): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def figures(doc: dict[str, Any]) -> dict[str, Any]:
    """A job's newest loss (its lowest rank's) and tokens/s (all ranks together) from latest.latest."""
    ranks = [r for r in doc.get("ranks", ()) if isinstance(r, dict)]
    loss = next(
        (
            _number(r.get("loss"))
            for r in sorted(ranks, key=lambda r: r.get("rank", 0))
            if _number(r.get("loss")) is not None
        ),
        None,
    )
    rates = [t for r in ranks if (t := _number(r.get("tokens_per_s"))) is not None]
    return {"loss": loss, "tokens_per_s": sum(rates) if rates else None, "updated": doc.get("updated")}


def overview(
    inv: Inventory,
    answers: dict[str, top.Answer | str],
    now: float,
    before: dict[str, tuple[float, int]] | None,
    local: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The cluster page from one refresh's answers (top.ask): `top`'s snapshot of the hosts, `fab
    status`'s rows of the jobs (with the step rate since `before` and `local`'s figures: job ->
    figures() of its run here) and the queue (the queued jobs, first first)."""
    snap = top.snapshot(inv, answers, now, before)
    found, steps = top.surveyed(answers)
    rates = {j["job"]: j["rate"] for j in snap["jobs"]}
    rows = []
    for r in jobcontrol.status_rows(survey.job_views(found), steps):
        mine = local.get(r["job"], {})
        rows.append(
            {
                **r,
                "rate": rates.get(r["job"]),
                "loss": mine.get("loss"),
                "tokens_per_s": mine.get("tokens_per_s"),
                "local": r["job"] in local,
            }
        )
    queue = sorted((r for r in rows if r["queue"]), key=lambda r: (r["queue"]["position"], r["since"] or 0))
    return clean(
        {
            "time": now,
            "inventory": str(inv.path),
            "hosts": snap["hosts"],
            "jobs": rows,
            "queue": queue,
            "errors": snap["errors"],
        }
    )


def run_dir(runs: Path, job_id: str) -> Path:
    """runs/JOB for a job id from a URL: a fabtrain job id, a directory inside runs/ (no link out)."""
    if not jobspec.valid_job_id(job_id):
        raise NotFound(f"{hostile.line(repr(job_id), 80)} is not a fabtrain job id")
    try:
        where = runs / hostile.component(job_id)
        hostile.relpath(job_id, runs)
    except hostile.UnsafeName as exc:
        raise NotFound(str(exc)) from None
    if not where.is_dir():
        raise NotFound(
            f"no run {job_id} in {runs}/ on this machine (a job started elsewhere keeps its "
            "run where it was started)"
        )
    return where


def read_tail(path: Path, size: int) -> tuple[bytes, bool]:
    """The last `size` bytes of a regular file (no link) and whether it was cut; (b"", False) when
    there is none."""
    if path.is_symlink() or not path.is_file():
        return b"", False
    return latest.tail_bytes(path, size) or (b"", False)


def log_lines(data: bytes, cut: bool, lines: int = LOG_LINES) -> list[str]:
    """A log's tail as the terminal shows it: plain text (hostile.text), the first line dropped when
    the tail began inside it, the last `lines` lines, each at most LINE_CHARS characters."""
    text = data.decode("utf-8", "replace").splitlines()
    if cut and text:
        text = text[1:]
    out = []
    for line in text[-lines:]:
        safe = hostile.text(line)
        out.append(safe if len(safe) <= LINE_CHARS else safe[:LINE_CHARS] + "...[cut]")
    return out


def curves(records: list[dict]) -> dict[str, list[list[float]]]:
    """Loss (the lowest rank's) and tokens/s (the ranks' sum) per step, from the `progress` events'
    step lines; a later attempt's line for a step replaces an earlier one's (a resumed job repeats
    the steps after its snapshot). The newest POINTS_MAX steps."""
    by_key: dict[tuple[int, int], dict] = {}
    for rec in records:
        if rec.get("event") != "progress":
            continue
        for r in rec.get("ranks") or ():
            if isinstance(r, dict) and type(r.get("rank")) is int and type(r.get("step")) is int:
                by_key[(r["rank"], r["step"])] = r
    loss: dict[int, tuple[int, float]] = {}
    rate: dict[int, float] = {}
    for (rank, step), r in by_key.items():
        if (x := _number(r.get("loss"))) is not None and (step not in loss or rank < loss[step][0]):
            loss[step] = (rank, x)
        if (t := _number(r.get("tokens_per_s"))) is not None:
            rate[step] = rate.get(step, 0.0) + t
    return {
        "loss": [[s, loss[s][1]] for s in sorted(loss)][-POINTS_MAX:],
        "tokens_per_s": [[s, rate[s]] for s in sorted(rate)][-POINTS_MAX:],
    }


def failures(records: list[dict]) -> list[dict]:
    """The hosts that failed (host_failed events) and the attempts' ends, newest last."""
    out = []
    for rec in records:
        if rec.get("event") == "host_failed":
            out.append(
                {
                    "time": rec.get("time"),
                    "attempt": rec.get("attempt"),
                    "host": rec.get("host"),
                    "kind": rec.get("kind"),
                    "detail": hostile.line(str(rec.get("detail", "")), 2000),
                }
            )
    return out[-FAILURES_MAX:]


def attempts(record: recovery.JobRecord | None) -> list[dict]:
    if record is None:
        return []
    return [
        {
            "number": a.number,
            "hosts": list(a.hosts),
            "started": a.started,
            "ended": a.ended,
            "outcome": hostile.line(str(a.outcome), 2000),
            "resumed_from": a.resumed_from,
        }
        for a in record.attempts
    ]


def job_page(runs: Path, job_id: str) -> dict[str, Any]:
    """One job's page from runs/JOB (NotFound when there is no such run here)."""
    where = run_dir(runs, job_id)
    try:
        record: recovery.JobRecord | None = recovery.JobRecord.load(runs, job_id, "the dashboard")
        problem = None
    except UserError as exc:
        record, problem = None, str(exc)
    events = latest.tail_records(where / EVENTS_FILE)
    newest = latest.latest(where)
    logs = {}
    for path in sorted(where.glob("*.log"))[:LOGS_MAX]:
        try:
            host = hostile.component(path.stem)
        except hostile.UnsafeName:
            continue
        if path.is_file() and not path.is_symlink():
            logs[host] = log_lines(*read_tail(path, LOG_TAIL))
    return clean(
        {
            "job": job_id,
            "state": record.state if record else newest["state"],
            "owner": record.spec.owner if record else None,
            "script": record.spec.script if record else None,
            "args": list(record.spec.args) if record else [],
            "record_error": problem,
            "attempts": attempts(record),
            "failures": failures(events),
            "curves": curves(events),
            "newest": newest,
            "figures": figures(newest),
            "logs": logs,
        }
    )


def plan_page(runs: Path, job_id: str) -> dict[str, Any]:
    """runs/JOB/plan.txt (every attempt's plan: large, and the same while an attempt runs, so the
    page asks for it apart from the job's page, when it opens the job or an attempt begins)."""
    plan, cut = read_head(run_dir(runs, job_id) / "plan.txt", PLAN_MAX)
    return clean({"job": job_id, "plan": plan.decode("utf-8", "replace") + ("\n...[cut]" if cut else "")})


def read_head(path: Path, size: int) -> tuple[bytes, bool]:
    """The first `size` bytes of a regular file (no link) and whether there was more."""
    try:
        if path.is_symlink() or not path.is_file():
            return b"", False
        with path.open("rb") as fh:
            data = fh.read(size + 1)
    except OSError:
        return b"", False
    return data[:size], len(data) > size


def to_json(doc: Any) -> bytes:
    """A document as the page reads it (strict JSON: no NaN)."""
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
