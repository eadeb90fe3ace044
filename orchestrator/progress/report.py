"""What a finished (or failed) run leaves for a person: curves, a summary, the list of runs.

Drawn on this machine with matplotlib from what was fetched into runs/JOB: the trainers' metrics
(`outputs/HOST/metrics.jsonl`, written by global rank 0 wherever it ran in each attempt) and every
rank's step lines in `HOST.log` (read by progress/steps.py). The training image needs no plotting
library.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core import hostile, recovery
from orchestrator.progress.steps import file_lines, rank_rates, timings

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from rich.table import Table


def load_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) by step. A resumed attempt logs again the steps after its
    snapshot; the newest record of a step wins."""
    by_key: dict[tuple[str, int], dict] = {}
    for path in sorted(run_dir.glob("outputs/*/metrics.jsonl")):
        for line in file_lines(path):
            try:
                rec = json.loads(line)
                key = (rec["kind"], int(rec["step"]))
            except (ValueError, KeyError, TypeError):
                continue
            if key not in by_key or rec.get("time", 0) >= by_key[key].get("time", 0):
                by_key[key] = rec
    train = sorted((r for (k, _), r in by_key.items() if k == "train"), key=lambda r: r["step"])
    evals = sorted((r for (k, _), r in by_key.items() if k == "eval"), key=lambda r: r["step"])
    return train, evals


def timing_table(data: dict) -> Table:
    """The end-of-run table: one row per host, then one per rank; stragglers in red."""
    from rich.table import Table

    slow = {s["rank"] for s in data.get("stragglers", [])}
    table = Table(title="step times (ms per optimizer step: median / p95)", title_justify="left")
    for col in ("host / rank", "step ms", "compute ms", "tokens/s", "samples"):
        table.add_column(col, justify="left" if col == "host / rank" else "right")
    for host, h in data.get("per_host", {}).items():
        flag = any(r in slow for r in h["ranks"])
        table.add_row(
            hostile.rich_text(host, "bold red" if flag else "bold"),
            f"{h['step_ms_median']} / {h['step_ms_p95']}",
            f"{h['compute_ms_median']} / {h['compute_ms_p95']}",
            f"{h['tokens_per_s_median']:,.0f}",
            "",
        )
        for r in h["ranks"]:
            e = data["ranks"][r]
            table.add_row(
                hostile.rich_text(
                    "  " + r + ("  straggler" if r in slow else ""), "red" if r in slow else ""
                ),
                f"{e['step_ms_median']} / {e['step_ms_p95']}",
                f"{e['compute_ms_median']} / {e['compute_ms_p95']}",
                f"{e['tokens_per_s_median']:,.0f}",
                str(e["samples"]),
            )
    return table


def describe_run(run_dir: Path) -> dict:
    """The job's record (runs/JOB/job.json) in a few fields, read as leniently as a listing may (any
    version of record.py's format, a part missing or null); {} when there is none."""
    try:
        rec = json.loads((run_dir / recovery.RECORD).read_text())
    except (OSError, ValueError):
        return {}
    attempts = rec.get("attempts", [])
    args = rec.get("spec", {}).get("args", [])
    model = args[args.index("--model") + 1] if "--model" in args[:-1] else None
    hosts = list(dict.fromkeys(h for a in attempts for h in a.get("hosts", [])))
    ends = [a["ended"] for a in attempts if a.get("ended")]
    return {
        "job": rec.get("spec", {}).get("job_id", run_dir.name),
        "state": rec.get("state"),
        "attempts": len(attempts),
        "hosts": hosts,
        "model": model,
        "script": rec.get("spec", {}).get("script"),
        "on": (rec.get("backend") or {}).get("on", "ssh"),
        "seconds": round(max(ends) - attempts[0]["started"], 1) if attempts and ends else None,
    }


def figure(run_dirs: list[Path]) -> Figure:
    """Loss per step (train line, eval markers) and tokens/s per rank, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = load_telemetry(run_dirs[0]) if len(run_dirs) == 1 else []
    rows = 3 if samples else 2
    fig, axes = plt.subplots(rows, 1, figsize=(9, 3.5 * rows), constrained_layout=True)
    loss_ax, rate_ax = axes[0], axes[1]
    if samples:
        telemetry_panel(axes[2], samples)
    titles = []
    for run_dir in run_dirs:
        info = describe_run(run_dir) or {"job": run_dir.name}
        train, evals = load_metrics(run_dir)
        label = info["job"] if len(run_dirs) > 1 else ""
        if train:
            (line,) = loss_ax.plot(
                [r["step"] for r in train], [r["loss"] for r in train], label=f"{label} train".strip()
            )
            colour = line.get_color()
        else:
            colour = None
        if evals:
            loss_ax.plot(
                [r["step"] for r in evals],
                [r["loss"] for r in evals],
                "o--",
                color=colour,
                label=f"{label} eval (per epoch)".strip(),
            )
        for name, points in rank_rates(run_dir).items():
            # A rank's name is what its program printed: never matplotlib's $math$ markup.
            rate_ax.plot(
                [s for s, _ in points],
                [r for _, r in points],
                label=f"{label} {name}".strip().replace("$", r"\$"),
                linewidth=1,
            )
        parts = [info["job"]]
        if info.get("model"):
            parts.append(f"model {info['model']}")
        if info.get("hosts"):
            parts.append(f"hosts {', '.join(info['hosts'])}")
        if info.get("attempts"):
            parts.append(f"{info['attempts']} attempt{'s' if info['attempts'] > 1 else ''}")
        titles.append(" - ".join(parts))
    loss_ax.set_title("\n".join(titles), fontsize=10)
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("cross-entropy loss (nats per token)")
    rate_ax.set_xlabel("optimizer step")
    rate_ax.set_ylabel("throughput (tokens/s, as each rank measured it)")
    rate_ax.set_title("tokens/s per rank", fontsize=10)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return fig


def load_telemetry(run_dir: Path) -> list[dict]:
    """runs/JOB/telemetry.jsonl's samples, each {"time", "host", "sample"}, in order."""
    out: list[dict] = []
    path = run_dir / "telemetry.jsonl"
    if not path.is_file():
        return out
    for line in file_lines(path):
        try:
            rec = json.loads(line)
            if isinstance(rec.get("sample"), dict) and isinstance(rec.get("host"), str):
                out.append({"time": float(rec["time"]), "host": rec["host"], "sample": rec["sample"]})
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return out


def telemetry_panel(ax: Axes, samples: list[dict]) -> None:
    """GPU utilisation (%) per GPU where the hosts have GPUs; else each job container's CPU (cores),
    with its memory (GiB, dashed) on a second axis. x: seconds since the first sample."""
    start = samples[0]["time"]
    gpu: dict[str, list[tuple[float, float]]] = {}
    cpu: dict[str, list[tuple[float, float]]] = {}
    mem: dict[str, list[tuple[float, float]]] = {}
    for rec in samples:
        t, host, sample = rec["time"] - start, rec["host"], rec["sample"]
        for g in sample.get("gpus") or ():
            if isinstance(g, dict) and isinstance(g.get("util"), (int, float)):
                gpu.setdefault(f"{host} GPU {g.get('index')}", []).append((t, 100 * g["util"]))
        for c in sample.get("containers") or ():
            if isinstance(c, dict) and isinstance(c.get("cpu"), (int, float)):
                cpu.setdefault(host, []).append((t, c["cpu"]))
                if isinstance(c.get("mem"), (int, float)):
                    mem.setdefault(host, []).append((t, c["mem"] / 2**30))

    def plot(axis: Axes, series: dict[str, list[tuple[float, float]]], style: str = "-") -> None:
        for name, points in sorted(series.items()):
            # Names come from hosts: never matplotlib's $math$ markup.
            axis.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                style,
                linewidth=1,
                label=name.replace("$", r"\$") + (" memory" if style != "-" else ""),
            )

    if gpu:
        plot(ax, gpu)
        ax.set_ylabel("GPU utilisation (%)")
        ax.set_title("GPU utilisation per GPU the job holds", fontsize=10)
    else:
        plot(ax, cpu)
        ax.set_ylabel("CPU of the job's container (cores)")
        ax.set_title("the job's containers: CPU (solid) and memory (dashed)", fontsize=10)
        if mem:
            right = ax.twinx()
            plot(right, mem, "--")
            right.set_ylabel("memory (GiB)")
    ax.set_xlabel("seconds since the first sample")


def write_plot(run_dirs: list[Path], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = figure(run_dirs)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary(run_dir: Path) -> dict:
    """runs/JOB/summary.json: the run's record, final losses, per-rank and per-host step times and
    throughput, stragglers."""
    train, evals = load_metrics(run_dir)
    return {
        **describe_run(run_dir),
        "final_train_loss": train[-1]["loss"] if train else None,
        "final_eval_loss": evals[-1]["loss"] if evals else None,
        "steps": train[-1]["step"] if train else None,
        **timings(run_dir),
        "telemetry": telemetry_summary(load_telemetry(run_dir)),
    }


def telemetry_summary(samples: list[dict]) -> dict:
    """Per host: telemetry/samples.summarise of its samples, and how many there were."""
    from orchestrator.telemetry.samples import summarise

    by_host: dict[str, list[dict]] = {}
    for rec in samples:
        by_host.setdefault(rec["host"], []).append(rec["sample"])
    return {host: {"samples": len(got), **summarise(got)} for host, got in sorted(by_host.items())}


TB_FILES = "events.out.tfevents.*"
TB_MAX = 1000  # event files gathered (one per attempt of rank 0: a job has few)


def gather_tensorboard(run_dir: Path) -> Path | None:
    """runs/JOB/tb: the TensorBoard event files of every host's fetched outputs (rank 0's, on the
    host that held it in each attempt) in one folder, so that `tensorboard --logdir runs/JOB/tb`
    shows one curve; a later attempt's purge_step drops the steps an earlier one logged past its
    snapshot, across hosts too. Regular files only, linked (or copied) as they came; None when
    there are none."""
    found = [
        p
        for p in sorted(run_dir.glob(f"outputs/*/tb/{TB_FILES}"))[:TB_MAX]
        if p.is_file() and not p.is_symlink()
    ]
    if not found:
        return None
    tb = run_dir / "tb"
    tb.mkdir(exist_ok=True)
    for p in found:
        target = tb / p.name
        if target.exists():
            continue
        try:
            os.link(p, target)
        except OSError:
            shutil.copyfile(p, target)
    return tb


def finish(run_dir: Path) -> tuple[dict, list[Path]]:
    """At the end of every run (failed ones too): summary.json, loss.png when there are metrics to
    draw, runs/JOB/tb when the trainers wrote TensorBoard files. Returns the summary and the files
    written."""
    tb = gather_tensorboard(run_dir)
    data = summary(run_dir)
    written = [run_dir / "summary.json", *([tb] if tb else [])]
    written[0].write_text(json.dumps(data, indent=2) + "\n")
    if data["final_train_loss"] is not None or data["ranks"]:
        written.append(write_plot([run_dir], run_dir / "loss.png"))
    return data, written


def runs(run_root: Path) -> list[dict]:
    """Every run with a record under run_root, newest first."""
    out = []
    for path in run_root.glob(f"*/{recovery.RECORD}"):
        info = describe_run(path.parent)
        if info:
            _, evals = load_metrics(path.parent)
            info["final_eval_loss"] = evals[-1]["loss"] if evals else None
            info["mtime"] = path.stat().st_mtime
            out.append(info)
    return sorted(out, key=lambda i: i["mtime"], reverse=True)
