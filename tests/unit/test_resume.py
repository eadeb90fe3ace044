"""--resume and --continue from the command line: what a resumed job may change, and finding a
named job's newest run."""
import json

import pytest

from orchestrator.commandline import cli
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec, recovery
from orchestrator.core.errors import UserError

TRAINERS = {"gpt": "trainers/gpt.py"}
INV = parse(
    "hosts:\n  - {name: a, address: 10.0.0.1, interface: eth0}\n", __import__("pathlib").Path("i.yaml")
)


def record(state="running", **spec_kw) -> recovery.JobRecord:
    spec = jobspec.JobSpec(**{"job_id": "gpt-20261123-101500-ab12", "script": "trainers/gpt.py",
                           "args": ("--model", "tiny", "--epochs", "5"), **spec_kw})
    rec = recovery.JobRecord.new(spec, INV, 0, None, 0)
    rec.state = state
    rec.attempts.append(recovery.Attempt(1, ["a"], 1.0, 2.0, "ok"))
    return rec


def test_a_finished_job_is_extended_with_new_epochs_and_the_change_is_recorded():
    rec = record("finished")
    with pytest.raises(UserError, match="already finished; to train it further give --epochs N"):
        cli.resumed_spec(rec, {}, TRAINERS)
    spec, changed = cli.resumed_spec(rec, {"epochs": 8}, TRAINERS)
    assert spec.args == ("--model", "tiny", "--epochs", "8") and spec.job_id == rec.job_id
    assert changed == {"args": ("--model", "tiny", "--epochs", "8")}
    entry = cli.resume_entry(rec, changed)
    assert entry["after_attempt"] == 1 and entry["state"] == "finished"
    assert entry["changed"] == {"args": ["--model", "tiny", "--epochs", "8"]}
    assert json.dumps(entry)  # kept in job.json
    assert cli.changes_line(changed) == "; now args '--model tiny --epochs 8'"
    # --continue: the same command again; the program decides what is left.
    spec, changed = cli.resumed_spec(rec, {"epochs": 5, "model": "tiny", "name": "gpt"}, TRAINERS, again=True)
    assert changed == {}


def test_an_option_that_would_make_another_job_is_refused_but_the_same_value_is_fine():
    rec = record(script="main.py", args=("--lr", "1"))
    with pytest.raises(UserError, match="--script cannot change when resuming"):
        cli.resumed_spec(rec, {"script": "other.py"}, TRAINERS)
    with pytest.raises(UserError, match="--name cannot change"):
        cli.resumed_spec(rec, {"name": "other"}, TRAINERS)
    spec, changed = cli.resumed_spec(rec, {"script": "main.py", "name": "gpt", "args": "--lr 2",
                                           "checkpoint": "ckpt/"}, TRAINERS)
    assert spec.args == ("--lr", "2") and spec.checkpoint == "work/ckpt/*"
    assert changed == {"args": ("--lr", "2"), "checkpoint": "work/ckpt/*"}


def test_find_named_takes_the_newest_run_of_that_name_only(tmp_path):
    for job in ("mingpt-20261120-090000-aaaa", "mingpt-20261122-080000-bbbb", "mingpt-x-20261123-080000-cccc",
                "other-20261123-090000-dddd", "mingpt-20261123-070000-eeee"):
        (tmp_path / job).mkdir()
        (tmp_path / job / "job.json").write_text("{}")
    (tmp_path / "mingpt-20261124-000000-ffff").mkdir()  # no record: not a run
    assert cli.find_named(tmp_path, "mingpt") == "mingpt-20261123-070000-eeee"
    assert cli.find_named(tmp_path, "mingpt-x") == "mingpt-x-20261123-080000-cccc"
    assert cli.find_named(tmp_path, "nothing") is None
    assert cli.job_name("mingpt-x-20261123-080000-cccc") == "mingpt-x"


@pytest.mark.parametrize("given, stored", [("checkpoints/ckpt.pt", "work/checkpoints/ckpt.pt"),
                                           ("./snapshot.pt", "work/snapshot.pt"),
                                           ("/output/ckpt/*.pt", "ckpt/*.pt"), ("ckpts/", "work/ckpts/*")])
def test_checkpoint_paths(given, stored):
    assert jobspec.checkpoint_pattern(given) == stored
    inv = parse(f"job: {{checkpoint: '{given}'}}\nhosts:\n  - {{address: h, interface: eth0}}\n",
                __import__("pathlib").Path("i.yaml"))
    assert inv.job.checkpoint == stored
    assert jobspec.checkpoint_pattern(cli.inventory_checkpoint(inv)) == stored


@pytest.mark.parametrize("given, message", [
    ("/etc/ckpt.pt", "outside the job's folders"), ("../up.pt", "not a plain path"),
    ("/output/.console/x", "fabtrain's own folder")])
def test_bad_checkpoint_paths_are_refused_with_the_reason(given, message):
    with pytest.raises(UserError, match=message):
        cli.checkpoint_option(given)
    with pytest.raises(UserError, match=f"i.yaml:1: job.checkpoint: .*{message}"):
        parse(f"job: {{checkpoint: '{given}'}}\nhosts:\n  - {{address: h, interface: eth0}}\n",
              __import__("pathlib").Path("i.yaml"))


def test_checkpoint_is_for_your_own_program(tmp_path):
    with pytest.raises(UserError, match="built-in trainers' snapshots are kept without it"):
        cli.new_spec({"checkpoint": "x.pt"}, TRAINERS)
