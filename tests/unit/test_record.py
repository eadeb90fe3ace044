"""The job's record (runs/JOB/job.json) as typed parts (core/record.py): written with its format's
version and read back the same; the format written before versions read as it was; a newer version,
an unknown key, a missing field and a value of the wrong kind refused, naming the file and the field."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.core import record as parts
from orchestrator.core.errors import UserError
from orchestrator.core.jobspec import JobSpec
from orchestrator.core.record import BackendPlace, Controller, ControllerPlace, Notify, Resume
from orchestrator.core.recovery import Attempt, JobRecord

JOB = "gpt-20261124-101010-abcd"

# As fabtrain wrote job.json before it had versions (asdict of the record), a detached job's.
UNVERSIONED = {
    "spec": {
        "job_id": JOB,
        "script": "trainers/gpt.py",
        "module": False,
        "args": ["--model", "tiny"],
        "image": None,
        "nproc_per_node": "2",
        "master_port": 29500,
        "env": [["K", "v"]],
        "code": "/home/ann/proj",
        "code_only": "",
        "code_key": "abc123",
        "checkpoint": "",
        "units": "a:0,1",
        "gpus": 2,
        "cpuset": False,
        "owner": "ann@ws",
    },
    "inventory": "/home/ann/inv.yaml",
    "state": "finished",
    "restarts": 2,
    "min_nodes": None,
    "hang_timeout": 0,
    "attempts": [
        {
            "number": 1,
            "hosts": ["a", "b"],
            "started": 10,
            "ended": 20.5,
            "outcome": "ok",
            "resumed_from": None,
        }
    ],
    "resumes": [{"time": 5.0, "after_attempt": 1, "state": "failed", "changed": {"args": ["--lr", "2"]}}],
    "selected": ["a", "b"],
    "backend": {},
    "notify": {"command": "mail ann@example.com"},
    "controller": {
        "host": "b",
        "dir": "/out/.controllers/x",
        "container": "fabtrain-ctl-x",
        "standby": {"host": "a", "dir": "/out/.controllers/x", "container": "fabtrain-ctl-x"},
        "keys": ["a"],
        "fetched": 30.0,
        "ended_on": "b",
    },
}


def full_record() -> JobRecord:
    spec = JobSpec(
        job_id=JOB,
        script="trainers/gpt.py",
        args=("--lr", "a b"),
        env=(("K", "v"),),
        master_port=29500,
        gpus=2,
        owner="ann@ws",
    )
    return JobRecord(
        spec=spec,
        inventory="/home/ann/inv.yaml",
        state="failed",
        restarts=2,
        min_nodes=1,
        hang_timeout=30.0,
        attempts=[
            Attempt(1, ["a", "b"], 1.0, 2.0, "a exited with code 137"),
            Attempt(2, ["b"], 3.0, None, "running", "snapshot-000000010.pt"),
        ],
        resumes=[Resume(5.0, 1, "failed", {"args": ["--lr", "2"]})],
        selected=["a", "b"],
        backend=BackendPlace("slurm", login="login1", workdir="/scratch/ann", slurm_id="42", earlier=("41",)),
        notify=Notify(command="mail ann@example.com", url="https://hooks.example/x"),
        controller=Controller(
            "b",
            "/out/.controllers/x",
            "fabtrain-ctl-x",
            ControllerPlace("a", "/out/.controllers/x", "fabtrain-ctl-x"),
            keys=("a", "b"),
            fetched=30.0,
            ended_on="b",
            taken_over=None,
        ),
    )


def write(tmp_path: Path, doc: object) -> Path:
    (tmp_path / JOB).mkdir(exist_ok=True)
    path = tmp_path / JOB / "job.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_record_round_trips_with_every_part_and_its_version(tmp_path):
    rec = full_record()
    (tmp_path / JOB).mkdir()
    rec.save(tmp_path / JOB)
    doc = json.loads((tmp_path / JOB / "job.json").read_text())
    assert doc["version"] == parts.VERSION == 2
    assert doc["backend"] == {
        "on": "slurm",
        "login": "login1",
        "workdir": "/scratch/ann",
        "slurm_id": "42",
        "earlier": ["41"],
    }
    assert doc["spec"]["env"] == [["K", "v"]] and doc["controller"]["standby"]["host"] == "a"
    assert doc["notify"] == {"command": "mail ann@example.com", "url": "https://hooks.example/x"}
    back = JobRecord.load(tmp_path, JOB)
    assert back == rec and back.on == "slurm" and back.spec.args == ("--lr", "a b")
    assert JobRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    # The parts that are absent: null (backend, controller), a Notify with neither.
    plain = JobRecord(spec=JobSpec(job_id=JOB, script="t.py"), inventory="inv.yaml")
    plain.save(tmp_path / JOB)
    doc = json.loads((tmp_path / JOB / "job.json").read_text())
    assert (doc["backend"], doc["controller"], doc["notify"]) == (None, None, {})
    assert JobRecord.load(tmp_path, JOB) == plain and plain.on == "ssh"
    assert parts.plain(Notify(command="mail ann@example.com")) == {"command": "mail ann@example.com"}


def test_the_format_written_before_versions_is_read_and_written_again_with_one(tmp_path):
    write(tmp_path, UNVERSIONED)
    rec = JobRecord.load(tmp_path, JOB)
    assert rec.spec == JobSpec(
        job_id=JOB,
        script="trainers/gpt.py",
        args=("--model", "tiny"),
        nproc_per_node="2",
        master_port=29500,
        env=(("K", "v"),),
        code="/home/ann/proj",
        code_key="abc123",
        units="a:0,1",
        gpus=2,
        owner="ann@ws",
    )
    assert rec.backend is None and rec.on == "ssh"  # {}: over SSH
    assert rec.notify == Notify(command="mail ann@example.com")
    assert rec.controller == Controller(
        "b",
        "/out/.controllers/x",
        "fabtrain-ctl-x",
        ControllerPlace("a", "/out/.controllers/x", "fabtrain-ctl-x"),
        keys=("a",),
        fetched=30.0,
        ended_on="b",
    )
    assert rec.attempts == [Attempt(1, ["a", "b"], 10.0, 20.5, "ok")] and rec.hang_timeout == 0
    assert rec.resumes == [Resume(5.0, 1, "failed", {"args": ["--lr", "2"]})]
    rec.save(tmp_path / JOB)
    assert json.loads((tmp_path / JOB / "job.json").read_text())["version"] == 2
    assert JobRecord.load(tmp_path, JOB) == rec
    # The oldest records: no backend, notify, controller, resumes or selected; a Slurm job's backend.
    oldest = {k: UNVERSIONED[k] for k in ("spec", "inventory", "state", "restarts", "attempts")}
    write(tmp_path, {**oldest, "controller": {}, "backend": {"on": "slurm", "login": "l", "workdir": "/w"}})
    rec = JobRecord.load(tmp_path, JOB)
    assert rec.controller is None and rec.notify == Notify() and rec.resumes == [] and rec.selected is None
    assert rec.backend == BackendPlace("slurm", login="l", workdir="/w") and rec.on == "slurm"


def test_a_record_written_by_a_newer_fabtrain_is_refused_saying_what_to_do(tmp_path):
    path = write(tmp_path, {**UNVERSIONED, "version": 3, "something_new": {}})
    with pytest.raises(UserError) as refused:
        JobRecord.load(tmp_path, JOB)
    assert str(refused.value).startswith(
        f"{path}: written by a newer fabtrain (job record version 3; this one reads versions up to 2): "
        "update this fabtrain (git pull in "
    )
    assert str(refused.value).endswith("), or use the one that wrote it") and refused.value.exit_code == 2


@pytest.mark.parametrize(
    "change, key",
    [
        ({"colour": "blue"}, "colour"),
        ({"version": 2, "backend": None, "notes": []}, "notes"),
        (
            {"version": 2, "backend": None, "controller": {**UNVERSIONED["controller"], "pid": 4}},
            "controller.pid",
        ),
        ({"spec": {**UNVERSIONED["spec"], "image_digest": "sha256:x"}}, "spec.image_digest"),
        ({"attempts": [{**UNVERSIONED["attempts"][0], "extra": 1}]}, "attempts[0].extra"),
        ({"backend": {"on": "slurm", "partition": "gpu"}}, "backend.partition"),
    ],
)
def test_an_unknown_key_is_refused_naming_it(tmp_path, change, key):
    path = write(tmp_path, {**UNVERSIONED, **change})
    with pytest.raises(UserError) as refused:
        JobRecord.load(tmp_path, JOB)
    assert str(refused.value) == (
        f"{path}: not a job record this version can read (unknown key {key!r}, which no fabtrain writes in a "
        "record of its version): was it edited? Remove that key, or start a new job instead"
    )
    assert refused.value.exit_code == 2


@pytest.mark.parametrize(
    "change, says",
    [
        (
            {"spec": {**UNVERSIONED["spec"], "args": "--model tiny"}},
            "spec.args is str '--model tiny', not a list of text",
        ),
        (
            {"spec": {**UNVERSIONED["spec"], "master_port": "29500"}},
            "spec.master_port is str '29500', not a whole number or null",
        ),
        (
            {"spec": {**UNVERSIONED["spec"], "env": [["K"]]}},
            "spec.env[0] is list ['K'], not a list of 2 (text, text)",
        ),
        ({"restarts": True}, "restarts is bool True, not a whole number"),
        ({"hang_timeout": "30"}, "hang_timeout is str '30', not a number"),
        (
            {"controller": {**UNVERSIONED["controller"], "standby": "not a dict"}},
            "controller.standby is str 'not a dict', not a JSON object or null",
        ),
        (
            {"controller": {**UNVERSIONED["controller"], "keys": ["a", 7]}},
            "controller.keys[1] is int 7, not text",
        ),
        ({"backend": {"on": "slurm", "slurm_id": 42}}, "backend.slurm_id is int 42, not text or null"),
        ({"notify": {"url": ["x"]}}, "notify.url is list ['x'], not text or null"),
        (
            {"attempts": [{**UNVERSIONED["attempts"][0], "started": "noon"}]},
            "attempts[0].started is str 'noon', not a number",
        ),
        (
            {"resumes": [{"time": 1.0, "after_attempt": 1.5, "state": "failed"}]},
            "resumes[0].after_attempt is float 1.5, not a whole number",
        ),
        ({"selected": "a@b"}, "selected is str 'a@b', not a list of text or null"),
        ({"version": "2"}, "version is '2', not a version number"),
        ({"version": 0}, "version is 0, not a version number"),
        ({"inventory": None}, "inventory is NoneType None, not text"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_naming_the_field(tmp_path, change, says):
    path = write(tmp_path, {**UNVERSIONED, **change})
    with pytest.raises(UserError) as refused:
        JobRecord.load(tmp_path, JOB)
    assert str(refused.value) == (
        f"{path}: not a job record this version can read ({says}); start a new job instead"
    )
    assert refused.value.exit_code == 2


@pytest.mark.parametrize(
    "doc, says",
    [
        ({k: v for k, v in UNVERSIONED.items() if k != "inventory"}, "inventory is missing"),
        ({**UNVERSIONED, "spec": {"job_id": JOB}}, "spec.script is missing"),
        ({**UNVERSIONED, "controller": {"host": "b"}}, "controller.dir is missing"),
        ([UNVERSIONED], "it is list, not a JSON object"),
    ],
)
def test_a_record_missing_a_field_is_refused_naming_it(tmp_path, doc, says):
    write(tmp_path, doc)
    with pytest.raises(UserError, match=f"not a job record this version can read \\({says}\\)"):
        JobRecord.load(tmp_path, JOB)


def test_the_parts_are_frozen_and_a_change_is_a_new_value():
    rec = full_record()
    with pytest.raises(AttributeError):
        rec.controller.keys = ()  # type: ignore[misc]
    taken = replace(rec.controller, taken_over=40.0)
    assert rec.controller.taken_over is None and taken.taken_over == 40.0
    assert Controller.at(ControllerPlace("h", "/d", "c"), None, ["b", "a"]) == Controller(
        "h", "/d", "c", keys=("a", "b")
    )
