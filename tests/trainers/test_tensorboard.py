"""The trainers' TensorBoard event files (OUT/tb, rank 0), read back as TensorBoard reads them: the
logged steps and the epochs' eval losses, one curve across a resume, nothing without tensorboard."""

import json
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from .conftest import TRAINERS, free_port

ARGS = [
    "--model",
    "tiny",
    "--max-steps-per-epoch",
    "12",
    "--log-every",
    "4",
    "--sample-chars",
    "0",
    "--snapshot-every",
    "5",
]


def curves(out) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def metrics(out, kind: str) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


def test_gpt_writes_train_and_eval_curves_by_global_step(tmp_path):
    import gpt

    gpt.main(ARGS + ["--epochs", "2", "--out", str(tmp_path)])
    got = curves(tmp_path)
    assert sorted(got) == ["eval/loss", "train/loss", "train/lr", "train/tokens_per_s"]  # no MFU on a CPU
    train = metrics(tmp_path, "train")
    assert [s for s, _ in got["train/loss"]] == [r["step"] for r in train] == [4, 8, 12, 16, 20, 24]
    assert [v for _, v in got["train/loss"]] == pytest.approx([r["loss"] for r in train])
    assert [v for _, v in got["train/lr"]] == pytest.approx([r["lr"] for r in train])
    assert [s for s, _ in got["train/tokens_per_s"]] == [4, 8, 12, 16, 20, 24]
    assert all(v > 0 for _, v in got["train/tokens_per_s"])
    evals = metrics(tmp_path, "eval")
    assert got["eval/loss"] == [(12, pytest.approx(evals[0]["loss"])), (24, pytest.approx(evals[1]["loss"]))]


def test_a_resumed_run_continues_the_same_curves_with_no_step_twice(tmp_path):
    """The run dies after step 22, its newest snapshot at step 20: the restart logs from step 21 on,
    and TensorBoard shows the first attempt's steps up to 20 and the second's after, once each."""
    import gpt

    gpt.main(ARGS + ["--epochs", "2", "--out", str(tmp_path / "a")])
    b = tmp_path / "b"
    gpt.main(ARGS + ["--epochs", "2", "--out", str(b)])
    first = curves(b)
    for p in (b / "snapshots").glob("snapshot-*.pt"):
        if not p.name.endswith("000000020.pt"):
            p.unlink()
    gpt.main(ARGS + ["--epochs", "2", "--out", str(b)])
    assert len(list((b / "tb").glob("events.out.tfevents.*"))) == 2  # one file per attempt
    got, unbroken = curves(b), curves(tmp_path / "a")
    for tag in got:
        assert [s for s, _ in got[tag]] == [s for s, _ in unbroken[tag]], tag
    # Up to the snapshot the first attempt's values; after it the second's (the metrics' last lines).
    assert got["train/loss"][:5] == first["train/loss"][:5]
    resumed = [r["loss"] for r in metrics(b, "train")][-1:]
    assert [v for _, v in got["train/loss"][5:]] == pytest.approx(resumed)
    assert got["eval/loss"][0] == first["eval/loss"][0]
    assert got["eval/loss"][1][1] == pytest.approx(metrics(b, "eval")[-1]["loss"])


# A process killed as its second snapshot is handed to the writer (step 10): nothing closes the
# event file, as when a container is killed.
KILLED_AT_SNAPSHOT = """
import os, sys
sys.path.insert(0, {trainers!r})
import gpt, snapshot
snapshot.Writer.save = lambda self, model, opt, epoch, step: os._exit(9) if step == 10 else None
gpt.main({args!r})
"""


def test_the_curves_up_to_a_snapshot_are_on_disk_before_it_is_written(tmp_path):
    """A restart resumes from the newest snapshot and logs only the steps after it: those before it
    must have reached the event file, however the process ended."""
    args = ARGS + ["--epochs", "2", "--out", str(tmp_path)]
    script = KILLED_AT_SNAPSHOT.format(trainers=str(TRAINERS), args=args)
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120).returncode == 9
    logged = [(r["step"], pytest.approx(r["loss"])) for r in metrics(tmp_path, "train")]
    assert curves(tmp_path)["train/loss"] == logged and [s for s, _ in logged] == [4, 8]


def test_without_tensorboard_the_run_goes_on_and_says_so_once(tmp_path, monkeypatch, capsys):
    import gpt

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when not installed
    result = gpt.main(ARGS + ["--epochs", "1", "--out", str(tmp_path)])
    assert result["step"] == 12 and not (tmp_path / "tb").exists()
    lines = [line for line in capsys.readouterr().out.splitlines() if "tensorboard" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "] tensorboard: no event files "
        "(ModuleNotFoundError: import of torch.utils.tensorboard "
        "halted; None in sys.modules)"
    ), lines


def test_only_global_rank_0_writes(tmp_path):
    import tensorboard_events

    board = tensorboard_events.Board(tmp_path, 1, "[n rank1]", first_step=1)
    board.scalars(1, {"train/loss": 1.0})
    board.flush()
    board.close()
    assert list(tmp_path.iterdir()) == []


def test_mlp_writes_its_loss_by_the_step_its_log_lines_name(tmp_path, monkeypatch):
    import mlp_tp

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    loss = mlp_tp.main(["--tp", "1", "--steps", "12", "--out", str(tmp_path)])
    got = curves(tmp_path)
    assert sorted(got) == ["train/loss", "train/lr", "train/samples_per_s"]
    assert [s for s, _ in got["train/loss"]] == [0, 10, 11]
    assert got["train/loss"][-1][1] == pytest.approx(loss)
    assert all(v == pytest.approx(0.1) for _, v in got["train/lr"])
