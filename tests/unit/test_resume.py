"""--resume and --continue from the command line: what a resumed job may change, and finding a
named job's newest run; what a detached job's record on its controller's host may change in this
machine's (JobRecord.with_host_data: data, never a command)."""

import dataclasses
import json
from dataclasses import asdict

import pytest

from orchestrator.commandline import cli
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec, recovery
from orchestrator.core.errors import UserError
from orchestrator.core.record import Controller, Notify, Resume, plain

TRAINERS = {"gpt": "trainers/gpt.py"}
INV = parse(
    "hosts:\n  - {name: a, address: 10.0.0.1, interface: eth0}\n", __import__("pathlib").Path("i.yaml")
)


def record(state="running", **spec_kw) -> recovery.JobRecord:
    spec = jobspec.JobSpec(
        **{
            "job_id": "gpt-20261123-101500-ab12",
            "script": "trainers/gpt.py",
            "args": ("--model", "tiny", "--epochs", "5"),
            **spec_kw,
        }
    )
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
    assert entry.after_attempt == 1 and entry.state == "finished"
    assert entry.changed == {"args": ["--model", "tiny", "--epochs", "8"]}
    assert json.dumps(plain(entry))  # kept in job.json
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
    spec, changed = cli.resumed_spec(
        rec, {"script": "main.py", "name": "gpt", "args": "--lr 2", "checkpoint": "ckpt/"}, TRAINERS
    )
    assert spec.args == ("--lr", "2") and spec.checkpoint == "work/ckpt/*"
    assert changed == {"args": ("--lr", "2"), "checkpoint": "work/ckpt/*"}


def test_find_named_takes_the_newest_run_of_that_name_only(tmp_path):
    for job in (
        "mingpt-20261120-090000-aaaa",
        "mingpt-20261122-080000-bbbb",
        "mingpt-x-20261123-080000-cccc",
        "other-20261123-090000-dddd",
        "mingpt-20261123-070000-eeee",
    ):
        (tmp_path / job).mkdir()
        (tmp_path / job / "job.json").write_text("{}")
    (tmp_path / "mingpt-20261124-000000-ffff").mkdir()  # no record: not a run
    assert cli.find_named(tmp_path, "mingpt") == "mingpt-20261123-070000-eeee"
    assert cli.find_named(tmp_path, "mingpt-x") == "mingpt-x-20261123-080000-cccc"
    assert cli.find_named(tmp_path, "nothing") is None
    assert cli.job_name("mingpt-x-20261123-080000-cccc") == "mingpt-x"


@pytest.mark.parametrize(
    "given, stored",
    [
        ("checkpoints/ckpt.pt", "work/checkpoints/ckpt.pt"),
        ("./snapshot.pt", "work/snapshot.pt"),
        ("/output/ckpt/*.pt", "ckpt/*.pt"),
        ("ckpts/", "work/ckpts/*"),
    ],
)
def test_checkpoint_paths(given, stored):
    assert jobspec.checkpoint_pattern(given) == stored
    inv = parse(
        f"job: {{checkpoint: '{given}'}}\nhosts:\n  - {{address: h, interface: eth0}}\n",
        __import__("pathlib").Path("i.yaml"),
    )
    assert inv.job.checkpoint == stored
    assert jobspec.checkpoint_pattern(cli.inventory_checkpoint(inv)) == stored


@pytest.mark.parametrize(
    "given, message",
    [
        ("/etc/ckpt.pt", "outside the job's folders"),
        ("../up.pt", "not a plain path"),
        ("/output/.console/x", "fabtrain's own folder"),
    ],
)
def test_bad_checkpoint_paths_are_refused_with_the_reason(given, message):
    with pytest.raises(UserError, match=message):
        cli.checkpoint_option(given)
    with pytest.raises(UserError, match=f"i.yaml:1: job.checkpoint: .*{message}"):
        parse(
            f"job: {{checkpoint: '{given}'}}\nhosts:\n  - {{address: h, interface: eth0}}\n",
            __import__("pathlib").Path("i.yaml"),
        )


def test_checkpoint_is_for_your_own_program(tmp_path):
    with pytest.raises(UserError, match="built-in trainers' snapshots are kept without it"):
        cli.new_spec({"checkpoint": "x.pt"}, TRAINERS)


# ---------------------------------------------------------------- a detached job's record from its host


def local_record() -> recovery.JobRecord:
    """This machine's record of a detached job resumed once: one attempt done before the detach."""
    rec = record("running", code="/home/ann/proj", image="team/img:1")
    rec.notify = Notify(command="mail -s fabtrain ann@example.com")
    rec.selected = ["a", "b"]
    rec.resumes = [Resume(time=5.0, after_attempt=1, state="failed", changed={})]
    rec.controller = Controller(
        host="a", dir="/out/.controllers/x", container="fabtrain-ctl-x", keys=("a", "b")
    )
    return rec


def host_doc(rec: recovery.JobRecord, **changes) -> dict:
    """The controller's copy as a hostile host may leave it: every field changed, two attempts added."""
    doc = json.loads(json.dumps(rec.to_dict()))
    doc.update(
        {
            "state": "finished",
            "inventory": "/tmp/evil.yaml",
            "restarts": 99,
            "min_nodes": 1,
            "hang_timeout": 1,
            "notify": {"command": "touch /tmp/pwned", "url": "http://evil.example/hook"},
            "backend": {"on": "slurm", "login": "evil", "workdir": "/"},
            "selected": ["evil"],
            "resumes": [],
            "controller": {"host": "b", "dir": "/", "container": "x"},
            "attempts": [
                *doc["attempts"],
                {
                    "number": 2,
                    "hosts": ["b", "a"],
                    "started": 10.0,
                    "ended": 20.0,
                    "outcome": "node2 exited with code 137\x1b]52;c;evil\x07",
                    "resumed_from": "snapshot-0000010",
                },
                {
                    "number": 3,
                    "hosts": ["a"],
                    "started": 21,
                    "ended": None,
                    "outcome": "running",
                    "resumed_from": None,
                    "extra": "ignored",
                },
            ],
        }
    )
    doc["spec"].update({"code": "/", "image": "evil/img", "script": "evil.py", "env": [["LD_PRELOAD", "/x"]]})
    doc.update(changes)
    return doc


def test_a_host_copy_gives_the_state_and_new_attempts_and_nothing_else():
    rec = local_record()
    before = asdict(rec)
    merged = rec.with_host_data(host_doc(rec), {"a", "b"})
    assert asdict(rec) == before  # this machine's record is not changed in place
    expected = {
        **before,
        "state": "finished",
        "attempts": [
            *before["attempts"],
            {
                "number": 2,
                "hosts": ["b", "a"],
                "started": 10.0,
                "ended": 20.0,
                "outcome": "node2 exited with code 137]52;c;evil",
                "resumed_from": "snapshot-0000010",
            },
            {
                "number": 3,
                "hosts": ["a"],
                "started": 21.0,
                "ended": None,
                "outcome": "running",
                "resumed_from": None,
            },
        ],
    }
    assert asdict(merged) == expected
    assert merged.notify == Notify(command="mail -s fabtrain ann@example.com")
    assert merged.inventory == "i.yaml"
    assert merged.spec.code == "/home/ann/proj" and merged.spec.image == "team/img:1"
    merged.attempts[0].outcome = "changed"
    merged.selected.append("c")
    merged.resumes[0].changed["args"] = ["x"]
    assert rec.attempts[0].outcome == "ok" and rec.selected == ["a", "b"]  # nothing shared that changes:
    assert rec.resumes[0].changed == {}  # the spec, notify, backend and controller are frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        merged.controller.keys = ("c",)


def test_a_host_copy_of_any_version_gives_only_its_state_and_new_attempts():
    """The controller writes the record's format (record.py's VERSION), but a host's copy is read for
    its state and attempts alone: its version, an unknown key, a part of the wrong kind change nothing
    else and are not refused (nothing of them is taken)."""
    rec = local_record()
    taken = rec.with_host_data(host_doc(rec), {"a", "b"})
    assert host_doc(rec)["version"] == recovery.VERSION  # as the controller writes it
    for changes in (
        {"version": 99, "backdoor": {"command": "touch /tmp/pwned"}},
        {
            "version": "x",
            "controller": "not a dict",
            "notify": ["touch /tmp/pwned"],
            "backend": 7,
            "resumes": None,
            "selected": {"evil": 1},
        },
    ):
        merged = rec.with_host_data(host_doc(rec, **changes), {"a", "b"})
        assert merged == taken and merged.controller == rec.controller and merged.notify == rec.notify
        assert merged.backend is None and merged.resumes == rec.resumes and merged.selected == ["a", "b"]


FIRST = {"number": 1, "hosts": ["a"], "started": 1.0}


def second(**fields) -> dict:
    """A host copy's attempts: this machine's first, then a second with these fields."""
    return {"attempts": [FIRST, {"number": 2, "hosts": ["a"], "started": 1.0, **fields}]}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"state": "pwned"}, "state 'pwned' is none of running, finished"),
        ({"attempts": "all"}, "attempts is not a list"),
        ({"spec": {"job_id": "gpt-20261123-101500-ffff"}}, "it names job 'gpt-20261123-101500-ffff', not"),
        (
            {"attempts": [{**FIRST, "hosts": ["b"]}]},
            "do not begin with the 1 this machine recorded \\(1 on a\\)",
        ),
        ({"attempts": []}, "do not begin with the 1"),
        (second(number=3), "attempt 2 is numbered 3: attempts count from 1 one by one"),
        (
            second(hosts=["../../x"]),
            "attempt 2 names host\\(s\\) '../../x' that this machine's inventory and",
        ),
        (second(hosts="a"), "attempt 2: hosts is not a list of host names"),
        (second(started="x"), "attempt 2: started/ended are not times"),
        (second(ended=float("nan")), "attempt 2: started/ended are not times"),
        (second(outcome=["x"]), "attempt 2: outcome is not text"),
        (second(resumed_from="../../etc/passwd"), "attempt 2: resumed_from is not a snapshot's name"),
        ({"attempts": [{**FIRST, "number": True}]}, "attempt 1 is numbered True"),
    ],
)
def test_a_host_copy_that_fails_a_check_is_refused_saying_why(change, message):
    rec = local_record()
    with pytest.raises(ValueError, match=message):
        rec.with_host_data(host_doc(rec, **change), {"a", "b"})
    with pytest.raises(ValueError, match="not a JSON object but list"):
        rec.with_host_data([], {"a"})
