"""Run reports: metrics merged across attempts, the figure's axes and series, summary, runs list."""

import json

from orchestrator.progress import report, steps


def make_run(root, job="gpt-1", hosts=("node1", "node2")):
    run = root / job
    (run / "outputs" / "node1").mkdir(parents=True)
    (run / "outputs" / "node3").mkdir(parents=True)
    # Attempt 1 on node1 reached step 30; attempt 2 (rank 0 on node3) resumed from step 20.
    first = [{"kind": "train", "step": s, "loss": 3.0 - s / 100, "time": 100 + s} for s in (10, 20, 30)]
    second = [{"kind": "train", "step": s, "loss": 2.5 - s / 100, "time": 200 + s} for s in (30, 40)]
    second.append({"kind": "eval", "epoch": 0, "step": 40, "loss": 2.0, "time": 300})
    (run / "outputs" / "node1" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in first) + "{broken\n"
    )
    (run / "outputs" / "node3" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in second))
    (run / "node1.log").write_text(
        "".join(
            f"[node1 rank{r}] epoch 0 | step {s} | loss 2.9 | lr 3.00e-03 | {1000 + s:,} tok/s\n"
            for s in (10, 20)
            for r in (0, 1)
        )
    )
    (run / "node2.log").write_text(
        "[node2 rank2] epoch 0 | step 10 | loss 2.9 | lr 3.00e-03 | 1,500 tok/s\nsome other line\n"
    )
    (run / "job.json").write_text(
        json.dumps(
            {
                "spec": {
                    "job_id": job,
                    "script": "trainers/gpt.py",
                    "args": ["--model", "tiny", "--epochs", "1"],
                },
                "state": "finished",
                "attempts": [
                    {"number": 1, "hosts": list(hosts), "started": 1000.0, "ended": 1030.0, "outcome": "x"},
                    {
                        "number": 2,
                        "hosts": ["node3", "node2"],
                        "started": 1035.0,
                        "ended": 1090.5,
                        "outcome": "ok",
                    },
                ],
            }
        )
    )
    return run


def test_metrics_from_every_attempt_newest_record_of_a_step_wins(tmp_path):
    train, evals = report.load_metrics(make_run(tmp_path))
    assert [(r["step"], r["loss"]) for r in train] == [(10, 2.9), (20, 2.8), (30, 2.2), (40, 2.1)]
    assert [r["loss"] for r in evals] == [2.0]


def test_figure_has_labelled_axes_a_title_naming_the_job_and_every_series(tmp_path):
    fig = report.figure([make_run(tmp_path)])
    loss_ax, rate_ax = fig.axes
    assert loss_ax.get_xlabel() == "optimizer step"
    assert loss_ax.get_ylabel() == "cross-entropy loss (nats per token)"
    assert loss_ax.get_title() == "gpt-1 - model tiny - hosts node1, node2, node3 - 2 attempts"
    assert [ln.get_label() for ln in loss_ax.get_lines()] == ["train", "eval (per epoch)"]
    assert list(loss_ax.get_lines()[0].get_xdata()) == [10, 20, 30, 40]
    assert rate_ax.get_ylabel() == "throughput (tokens/s, as each rank measured it)"
    assert [ln.get_label() for ln in rate_ax.get_lines()] == ["node1 rank0", "node1 rank1", "node2 rank2"]
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == ["train", "eval (per epoch)"]


def test_two_runs_overlay_with_their_names(tmp_path):
    fig = report.figure([make_run(tmp_path, "a"), make_run(tmp_path, "b")])
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert labels == ["a train", "a eval (per epoch)", "b train", "b eval (per epoch)"]
    assert fig.axes[0].get_title().count("\n") == 1


def test_finish_writes_summary_and_png_and_runs_lists_them(tmp_path):
    run = make_run(tmp_path)
    data, written = report.finish(run)
    assert [p.name for p in written] == ["summary.json", "loss.png"]
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    s = json.loads((run / "summary.json").read_text())
    assert (s["job"], s["state"], s["attempts"], s["seconds"]) == ("gpt-1", "finished", 2, 90.5)
    assert (s["final_eval_loss"], s["steps"], s["hosts"]) == (2.0, 40, ["node1", "node2", "node3"])
    assert s["ranks"]["node1 rank0"] == {
        "tokens_per_s_median": 1015.0,
        "tokens_per_s_p5": 1010.0,
        "samples": 2,
    }
    assert s == data and s["per_host"] == {} and s["stragglers"] == []  # these logs carry no step times
    (tmp_path / "no-record").mkdir()
    listed = report.runs(tmp_path)
    assert [(r["job"], r["final_eval_loss"]) for r in listed] == [("gpt-1", 2.0)]


def test_a_failed_run_without_metrics_still_gets_a_summary(tmp_path):
    run = tmp_path / "x"
    run.mkdir()
    assert [p.name for p in report.finish(run)[1]] == ["summary.json"]
    assert json.loads((run / "summary.json").read_text())["final_eval_loss"] is None


def timed_log(node: str, ranks: range, compute: float, steps=range(10, 110, 10)) -> str:
    return "".join(
        f"[{node} rank{r}] epoch 0 | step {s} | loss 2.9 | lr 3.00e-03 | 80,000 tok/s "
        f"| step {compute + 5 + s / 50:.1f} ms | compute {compute + s / 50:.1f} ms\n"
        for s in steps
        for r in ranks
    )


def test_stragglers_against_the_median_rank():
    assert steps.stragglers({"a rank0": 10.0, "a rank1": 10.0, "b rank2": 30.0, "b rank3": 29.0}) == [
        ("b rank2", 30.0, 3.0),
        ("b rank3", 29.0, 2.9),
    ]  # two hosts: the faster is the reference
    eight = {f"n{i} rank{i}": 10.0 + i * 0.1 for i in range(8)} | {"n8 rank8": 16.0}
    assert [n for n, *_ in steps.stragglers(eight)] == ["n8 rank8"]  # 16.0 > 1.5 x 10.4
    assert steps.stragglers({**eight, "n8 rank8": 15.5}) == []  # within the margin
    assert steps.stragglers({**eight, "n8 rank8": 12.5}) == []  # 1.2x: an idle machine's jitter
    assert steps.stragglers({"a rank0": 50.0}) == []  # one rank: nothing to compare with


def test_step_times_per_rank_and_host_and_the_slow_host_named(tmp_path):
    run = tmp_path / "job"
    run.mkdir()
    (run / "node1.log").write_text(timed_log("node1", range(0, 2), 20.0) + "noise\n")
    (run / "node2.log").write_text(timed_log("node2", range(2, 4), 60.0))
    t = steps.timings(run)
    assert t["ranks"]["node1 rank0"] == {
        "tokens_per_s_median": 80000.0,
        "tokens_per_s_p5": 80000.0,
        "samples": 10,
        "step_ms_median": 26.1,
        "step_ms_p95": 27.0,
        "compute_ms_median": 21.1,
        "compute_ms_p95": 22.0,
    }
    assert t["per_host"]["node2"]["ranks"] == ["node2 rank2", "node2 rank3"]
    assert (t["per_host"]["node2"]["compute_ms_median"], t["per_host"]["node1"]["compute_ms_median"]) == (
        61.1,
        21.1,
    )
    assert [(s["rank"], s["host"], s["times_median"]) for s in t["stragglers"]] == [
        ("node2 rank2", "node2", 2.9),
        ("node2 rank3", "node2", 2.9),
    ]
    from rich.console import Console

    console = Console(width=100, record=True, color_system=None)
    console.print(report.timing_table(t))
    text = console.export_text()
    assert "node2 rank3  straggler" in text and "61.1 / 62.0" in text and "node1 rank0  straggler" not in text


def test_tensorboard_files_of_every_host_are_gathered_in_runs_job_tb(tmp_path):
    from orchestrator.progress import report

    run = tmp_path / "gpt-1"
    for host, name in (("node1", "events.out.tfevents.1.a"), ("node3", "events.out.tfevents.2.b")):
        (run / "outputs" / host / "tb").mkdir(parents=True)
        (run / "outputs" / host / "tb" / name).write_bytes(b"event")
    (run / "outputs" / "node3" / "tb" / "events.out.tfevents.3.c").symlink_to("/etc/passwd")
    assert report.gather_tensorboard(tmp_path / "none") is None
    tb = report.gather_tensorboard(run)
    assert tb == run / "tb" and sorted(p.name for p in tb.iterdir()) == [
        "events.out.tfevents.1.a",
        "events.out.tfevents.2.b",
    ]  # regular files only
    assert report.gather_tensorboard(run) == tb  # again: nothing changes
