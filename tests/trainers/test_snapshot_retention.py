"""The trainer keeps only the newest K snapshots: pruned after each durable write, never the one
just written, K from FABTRAIN_KEEP_SNAPSHOTS (default 2, at least 1)."""

import os

import pytest
import snapshot  # noqa: E402
import torch

from .conftest import TRAINERS  # noqa: F401 - puts trainers/ on the path


def names(d):
    return sorted(p.name for p in d.iterdir())


def snap(step: int) -> str:
    return f"snapshot-{step:09d}.pt"


@pytest.mark.parametrize("env,keep", [(None, 2), ("1", 1), ("3", 3)])
def test_a_thousand_snapshots_leave_the_newest_k(tmp_path, monkeypatch, env, keep):
    if env is None:
        monkeypatch.delenv(snapshot.KEEP_ENV, raising=False)
    else:
        monkeypatch.setenv(snapshot.KEEP_ENV, env)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = snapshot.Writer(tmp_path, keep=snapshot.keep_from_env())
    for step in range(1, 1001):
        with torch.no_grad():
            model.weight.fill_(step)
        writer.save(model, opt, epoch=0, step=step)
    writer.wait()
    assert names(tmp_path) == [snap(s) for s in range(1001 - keep, 1001)]
    latest = snapshot.load_latest(tmp_path)
    assert latest["step"] == 1000 and latest["model"]["weight"][0, 0].item() == 1000.0


@pytest.mark.parametrize(
    "raw,expected",
    [
        (None, 2),
        ("", 2),
        ("  ", 2),
        ("1", 1),
        (" 5 ", 5),
        ("0", ValueError),
        ("-1", ValueError),
        ("two", ValueError),
        ("1.5", ValueError),
    ],
)
def test_keep_from_env(raw, expected):
    environ = {} if raw is None else {snapshot.KEEP_ENV: raw}
    if expected is ValueError:
        with pytest.raises(
            ValueError,
            match=f"{snapshot.KEEP_ENV}={raw!r}: .* whole number, 1 or more; set job.keep_snapshots",
        ):
            snapshot.keep_from_env(environ)
    else:
        assert snapshot.keep_from_env(environ) == expected


def test_the_snapshot_just_written_is_never_pruned(tmp_path):
    # A newer name already there (say one that did not load, so the job resumed from an older one):
    # the one just written stays, as the newest that loads.
    (tmp_path / snap(900)).write_bytes(b"damaged")
    (tmp_path / snap(3)).write_bytes(b"old")
    state = {"step": 5}
    snapshot.write(tmp_path, state, 5, keep=1)
    assert names(tmp_path) == [snap(5), snap(900)]
    assert snapshot.load_latest(tmp_path)["step"] == 5


def test_only_complete_snapshots_are_pruned(tmp_path):
    others = ["notes.txt", "snapshot-latest.pt", "snapshot-1.pt", ".snapshot-000000001.pt.copy.tmp.x"]
    for n in others:
        (tmp_path / n).write_text("x")
    for step in (1, 2, 3):
        snapshot.write(tmp_path, {"step": step}, step, keep=1)
    assert names(tmp_path) == sorted([*others, snap(3)])


def test_pruning_happens_only_after_the_new_snapshot_is_durable(tmp_path, monkeypatch):
    for step in (1, 2):
        snapshot.write(tmp_path, {"step": step}, step)
    events = []
    real_replace, real_fsync, real_unlink = os.replace, os.fsync, snapshot.Path.unlink

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        return real_replace(src, dst)

    def fsync(fd):
        events.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"))
        return real_fsync(fd)

    def unlink(self, missing_ok=False):
        events.append(("unlink", self.name))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(snapshot.os, "replace", replace)
    monkeypatch.setattr(snapshot.os, "fsync", fsync)
    monkeypatch.setattr(snapshot.Path, "unlink", unlink)
    snapshot.write(tmp_path, {"step": 3}, 3, keep=1)
    assert events == [
        ("fsync", "file"),
        ("rename", snap(3)),
        ("fsync", "dir"),
        ("unlink", snap(1)),
        ("unlink", snap(2)),
    ]


def test_keep_none_keeps_every_snapshot(tmp_path):
    for step in range(1, 6):
        snapshot.save(
            tmp_path,
            torch.nn.Linear(1, 1),
            torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1),
            0,
            step,
        )
    assert names(tmp_path) == [snap(s) for s in range(1, 6)]


def test_keep_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep=0"):
        snapshot.write(tmp_path, {"step": 1}, 1, keep=0)
    with pytest.raises(ValueError, match="keep=0"):
        snapshot.Writer(tmp_path, keep=0)
    assert not list(tmp_path.glob("snapshot-*"))


def test_gpt_keeps_as_many_as_the_environment_says(tmp_path, monkeypatch):
    import gpt

    monkeypatch.setenv(snapshot.KEEP_ENV, "1")
    gpt.main(
        [
            "--model",
            "tiny",
            "--max-steps-per-epoch",
            "12",
            "--log-every",
            "100",
            "--sample-chars",
            "0",
            "--snapshot-every",
            "5",
            "--epochs",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert names(tmp_path / "snapshots") == [snap(24)]
