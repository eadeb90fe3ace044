"""What a finished (or failed) run leaves for a person: curves, a summary, the list of runs.

Drawn on this machine with matplotlib from what was fetched into runs/JOB: the trainers' metrics
(`outputs/HOST/metrics.jsonl`, written by global rank 0 wherever it ran in each attempt) and every
rank's step lines in `HOST.log`. The training image needs no plotting library.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from . import recovery

# "[node1 rank0] epoch 0 | step 10 | loss 2.1234 | lr 3.00e-03 | 12,345 tok/s" (trainers/gpt.py)
STEP_LINE = re.compile(r"\[(?P<node>\S+) rank(?P<rank>\d+)\] epoch \d+ \| step (?P<step>\d+) \| "
                       r"loss (?P<loss>[\d.]+) \| lr \S+ \| (?P<rate>[\d,]+) tok/s")


def load_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) by step. A resumed attempt logs again the steps after its
    snapshot; the newest record of a step wins."""
    by_key: dict[tuple[str, int], dict] = {}
    for path in sorted(run_dir.glob("outputs/*/metrics.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
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


def rank_rates(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """'node1 rank0' -> [(step, tokens/s)] from every host's log."""
    rates: dict[str, list[tuple[int, float]]] = {}
    for log in sorted(run_dir.glob("*.log")):
        for m in STEP_LINE.finditer(log.read_text(errors="replace")):
            rates.setdefault(f"{m['node']} rank{m['rank']}", []).append(
                (int(m["step"]), float(m["rate"].replace(",", ""))))
    return dict(sorted(rates.items(), key=lambda kv: int(kv[0].rsplit("rank", 1)[1])))


def describe_run(run_dir: Path) -> dict:
    """The job's record (runs/JOB/job.json) in a few fields; {} when there is none."""
    try:
        rec = json.loads((run_dir / recovery.RECORD).read_text())
    except (OSError, ValueError):
        return {}
    attempts = rec.get("attempts", [])
    args = rec.get("spec", {}).get("args", [])
    model = args[args.index("--model") + 1] if "--model" in args[:-1] else None
    hosts = list(dict.fromkeys(h for a in attempts for h in a.get("hosts", [])))
    ends = [a["ended"] for a in attempts if a.get("ended")]
    return {"job": rec.get("spec", {}).get("job_id", run_dir.name), "state": rec.get("state"),
            "attempts": len(attempts), "hosts": hosts, "model": model,
            "script": rec.get("spec", {}).get("script"),
            "seconds": round(max(ends) - attempts[0]["started"], 1) if attempts and ends else None}


def figure(run_dirs: list[Path]):
    """Loss per step (train line, eval markers) and tokens/s per rank, one colour per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (loss_ax, rate_ax) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    titles = []
    for run_dir in run_dirs:
        info = describe_run(run_dir) or {"job": run_dir.name}
        train, evals = load_metrics(run_dir)
        label = info["job"] if len(run_dirs) > 1 else ""
        if train:
            line, = loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train],
                                 label=f"{label} train".strip())
            colour = line.get_color()
        else:
            colour = None
        if evals:
            loss_ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o--", color=colour,
                         label=f"{label} eval (per epoch)".strip())
        for name, points in rank_rates(run_dir).items():
            rate_ax.plot([s for s, _ in points], [r for _, r in points],
                         label=f"{label} {name}".strip(), linewidth=1)
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
    for ax in (loss_ax, rate_ax):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return fig


def write_plot(run_dirs: list[Path], out: Path) -> Path:
    import matplotlib.pyplot as plt
    fig = figure(run_dirs)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary(run_dir: Path) -> dict:
    """runs/JOB/summary.json: the run's record, final losses and per-rank throughput."""
    train, evals = load_metrics(run_dir)
    ranks = {}
    for name, points in rank_rates(run_dir).items():
        rates = sorted(r for _, r in points)
        ranks[name] = {"tokens_per_s_median": round(statistics.median(rates), 1),
                       "tokens_per_s_p5": round(rates[int(0.05 * (len(rates) - 1))], 1), "samples": len(rates)}
    return {**describe_run(run_dir), "final_train_loss": train[-1]["loss"] if train else None,
            "final_eval_loss": evals[-1]["loss"] if evals else None,
            "steps": train[-1]["step"] if train else None, "ranks": ranks}


def finish(run_dir: Path) -> list[Path]:
    """At the end of every run (failed ones too): summary.json, and loss.png when there are
    metrics to draw."""
    data = summary(run_dir)
    written = [run_dir / "summary.json"]
    written[0].write_text(json.dumps(data, indent=2) + "\n")
    if data["final_train_loss"] is not None or data["ranks"]:
        written.append(write_plot([run_dir], run_dir / "loss.png"))
    return written


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
