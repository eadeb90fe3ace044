"""Looking at the hosts and the runs, changing nothing, as the tasks print it: every host live (fab
top), the past runs in runs/ (fab runs), their curves (fab plot) and a job's newest figures (fab
metrics)."""

from __future__ import annotations

import json as _json
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.ssh.jobcontrol import unknown_job
from orchestrator.config import inventory as inventory_file
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console


def top(inventory: str | None, json: bool, console: Console) -> None:
    """fab top: the hosts watched live until Ctrl+C; with `json`, one look as JSON (UserError naming
    the hosts that did not answer)."""
    from orchestrator.progress import top as _top

    inv = inventory_file.load(inventory)
    if not json:
        _top.live(inv, console)
        return
    snap = _top.once(inv)
    print(_json.dumps(snap, indent=2))
    if snap["errors"]:
        raise UserError("\n".join(snap["errors"]))


def runs(root: Path, json: bool, console: Console) -> None:
    """fab runs: the runs under `root` (runs/), newest first, as a table or JSON."""
    from rich.table import Table

    from orchestrator.progress import report

    if json:
        print(_json.dumps({"runs": report.runs(root)}, indent=2, default=str))
        return
    table = Table(title=f"runs in {root}/")
    table.add_column("job", no_wrap=True)  # a job id is what 'fab plot' and '--resume' take: never cut
    for col in ("state", "attempts", "duration", "eval loss", "hosts"):
        table.add_column(col)
    for r in report.runs(root):
        loss = f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] is not None else "-"
        took = f"{r['seconds']:.0f}s" if r["seconds"] is not None else "-"
        table.add_row(
            *(
                hostile.rich_text(str(x))
                for x in (r["job"], r["state"] or "-", r["attempts"], took, loss, ", ".join(r["hosts"]))
            )
        )
    console.print(table)


def plot(root: Path, jobs: str, out: str | None) -> None:
    """fab plot: the curves of the runs `jobs` names (comma- or space-separated ids under `root`)
    drawn into one PNG (`out`; default: the run's loss.png, or compare.png for several)."""
    from orchestrator.progress import report

    names = [j for j in jobs.replace(" ", ",").split(",") if j]
    dirs = []
    for name in names:
        if not jobspec.valid_job_id(name) or not (root / name).is_dir():
            raise UserError(f"no run {hostile.text(name)!r} in {root}/; 'fab runs' lists them", exit_code=2)
        dirs.append(root / name)
    target = Path(out) if out else (dirs[0] / "loss.png" if len(dirs) == 1 else root / "compare.png")
    print(f"wrote {report.write_plot(dirs, target)}")


def metrics(root: Path, job: str | None, json: bool) -> None:
    """fab metrics: a run's newest figures (`job`; default: the newest run under `root`), as lines
    or JSON."""
    from orchestrator.progress import latest, report

    if job is None:
        found = report.runs(root)
        if not found:
            raise UserError(f"no runs in {root}/ yet; start one with fab train", exit_code=2)
        job = found[0]["job"]
    if not jobspec.valid_job_id(job):
        raise unknown_job(job)
    if not (root / job).is_dir():  # a detached job started elsewhere: fab logs --job copies it here
        raise unknown_job(job, f" in {root}/")
    doc = latest.latest(root / job)
    if json:
        print(_json.dumps(doc, indent=2))
        return
    for line in latest.lines(doc):
        print(line)
