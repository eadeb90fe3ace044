"""A detached job's brain out of the blast radius, without a cluster (placement.py, failover.py,
detached.py's choices): where the controller and its standby run and why, which directory holds a
job's end or its newest run, the heartbeat, fence and probe scripts run by sh on this machine, the
standby's decision to take over, and the job asking the fence before it starts or removes
containers. The real failover (a frozen host, a killed controller): tests/integration/test_failover.py."""

import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.backends.ssh import detached, failover, job, placement
from orchestrator.config.inventory import parse
from orchestrator.core.errors import UserError
from orchestrator.core.jobspec import JobSpec

JOB = "gpt-20261127-101010-abcd"


def inv(hosts=2, spares=0, controller=None):
    text = "ssh: {config: none}\njob: {output_dir: /data/out}\nhosts:\n"
    line = "  - {{name: {}{}, address: 10.0.{}.{}, interface: eth0}}\n"
    text += "".join(line.format("node", i + 1, 0, i + 1) for i in range(hosts))
    if spares:
        text += "spares:\n" + "".join(line.format("spare", i + 1, 1, i + 1) for i in range(spares))
    if controller:
        text += f"controller: {{host: {controller}}}\n"
    return parse(text, Path("inv.yaml"))


@pytest.mark.parametrize(
    "shape, active, standby, risk",
    [
        ((2, 0, None), "node2", "node1", "node2 also runs rank 1 of the job"),
        ((2, 1, None), "spare1", "node2", ""),
        ((2, 2, None), "spare1", "spare2", ""),
        ((2, 1, "node1"), "node1", "spare1", "node1 also runs rank 0 of the job"),
        ((3, 0, "node2"), "node2", "node3", "node2 also runs rank 1"),
        ((1, 0, None), "node1", None, "node1 also runs rank 0"),
    ],
)
def test_the_controller_runs_out_of_the_blast_radius_and_its_standby_on_the_next_candidate(
    shape, active, standby, risk
):
    p = placement.placement(inv(*shape), JOB)
    assert p.active.host.name == active
    assert (p.standby.host.name if p.standby else None) == standby
    assert p.risk.startswith(risk) if risk else p.risk == ""
    assert p.active.dir == f"/data/out/.controllers/{JOB}" and p.active.container == f"fabtrain-ctl-{JOB}"
    said = p.said()
    assert said.startswith(f"controller on {active} (") and (
        f"its standby on {standby}" in said if standby else "no standby" in said
    )
    assert ("Risk: " in said) == bool(risk)
    assert p.record().standby == (p.standby.record() if p.standby else None)


def test_a_controller_host_the_inventory_lacks_is_refused():
    broken = inv(2)
    broken = broken.__class__(**{**broken.__dict__, "controller": broken.controller.__class__(host="nodeX")})
    with pytest.raises(UserError, match="nodeX .* is not among this job's hosts and spares"):
        placement.placement(broken, JOB)


def test_the_places_a_record_names_are_read_as_data():
    i = inv(2, 1)
    p = placement.placement(i, JOB)
    record = detached.JobRecord(
        spec=JobSpec(job_id=JOB, script="t.py"), inventory="inv.yaml", controller=p.record()
    )
    assert [x.host.name for x in placement.places_of(i, record)] == ["spare1", "node2"]
    record.controller = replace(record.controller, standby=None)  # none of another kind is read: record.py
    assert [x.host.name for x in placement.places_of(i, record)] == ["spare1"]
    record.controller = replace(record.controller, host="elsewhere")
    assert placement.places_of(i, record) == [] and placement.place_of(i, record) is None


def test_where_the_end_and_the_newest_run_are_read():
    i = inv(2, 1)
    p = placement.placement(i, JOB)
    both = [p.active, p.standby]
    E, M, T, F = detached.ENDED, detached.MIRRORED, detached.TAKEN, detached.FENCED
    # The active one ended the job: read there.
    assert detached.ended_at(both, [{E}, {M}]) == p.active
    # Its host is gone: the standby's mirror of that end.
    assert detached.ended_at(both, [None, {M}]) == p.standby.mirror()
    assert p.standby.mirror().dir == f"{p.standby.dir}/mirror"
    # The standby took over and ended it; the old one (fenced) has no end of its own to offer.
    assert detached.ended_at(both, [{F}, {T, E}]) == p.standby
    assert detached.ended_at(both, [{F, E}, {T}]) is None
    assert detached.ended_at(both, [set(), set()]) is None and detached.ended_at(both, [None, None]) is None
    # Running: the standby once it took over, else the active one; its mirror when the active is silent.
    assert detached.running_at(both, [set(), set()]) == p.active
    assert detached.running_at(both, [None, {T}]) == p.standby
    assert detached.newest_run(both, [set(), set()]) == p.active
    assert detached.newest_run(both, [None, set()]) == p.standby.mirror()
    assert detached.newest_run(both, [set(), {T}]) == p.standby
    assert detached.newest_run(both, [None, None]) is None


def sh(command, tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)


def test_the_heartbeat_touches_the_standbys_mirror_until_the_standby_took_over(tmp_path):
    d = tmp_path / "ctl dir"
    d.mkdir()
    r = sh(failover.beat_script(str(d)), tmp_path)
    assert r.returncode == 0 and r.stdout == "" and (d / "mirror" / "heartbeat").is_file()
    os.utime(d / "mirror" / "heartbeat", (1, 1))
    (d / failover.TAKEN).write_text("{}")
    r = sh(failover.beat_script(str(d)), tmp_path)
    assert r.stdout.strip() == failover.TAKEN
    assert (d / "mirror" / "heartbeat").stat().st_mtime == 1  # a fenced controller's beat changes nothing
    # The job ended and its directories were cleared: a controller that wakes after that is fenced too.
    gone = tmp_path / "cleared"
    said = sh(failover.beat_script(str(gone)), tmp_path).stdout.strip()
    assert said == failover.TAKEN and not gone.exists()


@pytest.mark.parametrize(
    "docker_says, done, verdict",
    [("true", False, "running"), ("false", False, "gone"), ("", False, "gone"), ("true", True, "done")],
)
def test_the_probe_says_whether_the_active_controller_runs(tmp_path, docker_says, done, verdict):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "docker").write_text(f"#!/bin/sh\necho '{docker_says}'\n")
    (tmp_path / "bin" / "docker").chmod(0o755)
    d = tmp_path / "ctl"
    d.mkdir()
    if done:
        (d / failover.DONE).write_text("{}")
    r = sh(failover.probe_script(f"fabtrain-ctl-{JOB}", str(d)), tmp_path)
    assert r.stdout.strip() == verdict


class Standby:
    """stand_by's looks played: the heartbeat file's age, the probe's verdicts, the lease."""

    def __init__(self, tmp_path, monkeypatch, verdicts, lease=None):
        self.root = tmp_path / "ctl"
        (self.root / "mirror").mkdir(parents=True)
        self.verdicts, self.lease, self.took = list(verdicts), lease, []
        monkeypatch.setattr(failover.time, "sleep", lambda s: None)
        monkeypatch.setattr(failover, "Session", lambda hosts: self)
        monkeypatch.setattr(failover, "verdict", lambda *a: self.verdicts.pop(0))
        monkeypatch.setattr(failover, "lease_fresh", lambda *a: self.lease)
        monkeypatch.setattr(
            failover,
            "take_over",
            lambda root, launch, s, lost, own, why, age, answers: (
                self.took.append((lost, own, why, answers)) or "taken"
            ),
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Launch:
    def __init__(self, i):
        self.inv = i


def test_the_standby_takes_over_at_once_when_the_controller_is_gone(tmp_path, monkeypatch):
    s = Standby(tmp_path, monkeypatch, ["running", "gone"])
    (s.root / "mirror" / "heartbeat").touch()
    os.utime(s.root / "mirror" / "heartbeat", (time.time() - 60, time.time() - 60))
    called = []
    i = inv(2, 1)
    took = failover.stand_by(s.root, Launch(i), i.hosts[1], "/d", "spare1", lambda: called.append(1))
    assert took == "taken"
    assert s.took == [("node2", "spare1", "its container is gone", True)] and called == [1]


def test_a_silent_controller_host_is_taken_over_only_once_the_jobs_lease_is_stale(tmp_path, monkeypatch):
    s = Standby(tmp_path, monkeypatch, ["silent", "silent"], lease="node2: lease renewed 3s ago")
    i = inv(2, 1)
    hb = s.root / "mirror" / "heartbeat"
    hb.touch()
    os.utime(hb, (time.time() - 60, time.time() - 60))

    def stale_after_two(*a):
        s.lease = None if len(s.verdicts) == 0 else s.lease
        return s.lease

    monkeypatch.setattr(failover, "lease_fresh", stale_after_two)
    assert failover.stand_by(s.root, Launch(i), i.hosts[0], "/d", "spare1", lambda: None) == "taken"
    lost, own, why, answers = s.took[0]
    assert (lost, own) == ("node1", "spare1") and "does not answer" in why and "lease" in why
    assert answers is False  # its host is not asked again: its node is lost from the watch's start


def test_a_controller_never_seen_alive_is_given_its_start_before_it_is_judged(tmp_path, monkeypatch):
    """Started beside the active controller, the standby may look before the active's container
    exists on a loaded host: "gone" then means "not yet", and nothing is taken over before
    START_GRACE. Once it was seen running, "gone" is taken over at once."""
    monkeypatch.setattr(failover, "START_GRACE", 0.3)
    monkeypatch.setattr(failover, "STALE", 0.01)  # looks at once: no heartbeat ever comes here
    s = Standby(tmp_path, monkeypatch, [])
    asked = []
    monkeypatch.setattr(failover, "verdict", lambda *a: asked.append(time.monotonic()) or "gone")
    i = inv(2, 1)
    start = time.monotonic()
    assert failover.stand_by(s.root, Launch(i), i.hosts[0], "/d", "spare1", lambda: None) == "taken"
    assert len(asked) > 1 and time.monotonic() - start >= 0.3
    assert s.took == [("node1", "spare1", "its container is gone", True)]
    s = Standby(tmp_path / "again", monkeypatch, ["running", "gone"])
    assert failover.stand_by(s.root, Launch(i), i.hosts[0], "/d", "spare1", lambda: None) == "taken"
    assert s.took and s.verdicts == []


def test_the_standby_ends_when_the_controllers_end_reaches_its_mirror(tmp_path, monkeypatch):
    s = Standby(tmp_path, monkeypatch, [])
    (s.root / "mirror" / failover.DONE).write_text(json.dumps({"state": "finished"}))
    i = inv(2, 1)
    assert failover.stand_by(s.root, Launch(i), i.hosts[0], "/d", "spare1", lambda: None) is None
    assert s.took == []


def test_a_fenced_controller_removes_its_credentials(tmp_path, monkeypatch):
    root = tmp_path / "ctl"
    (root / "secrets").mkdir(parents=True)
    for name in ("key", "launch.pickle", "secrets/TOKEN", "key.pub"):
        (root / name).write_text("x")
    exits = []
    monkeypatch.setattr(failover.os, "_exit", exits.append)
    failover.fence(root)
    assert exits == [0] and (root / failover.FENCED).is_file()
    assert sorted(p.name for p in root.rglob("*") if p.is_file()) == ["fenced", "key.pub"]


def test_the_job_asks_the_fence_before_it_starts_containers_and_before_its_teardown(tmp_path, monkeypatch):
    from tests.unit.test_job import Recorder, inventory, new_job

    monkeypatch.chdir(tmp_path)
    rec = Recorder(inventory(tmp_path).hosts)
    monkeypatch.setattr(job, "FENCE", lambda: rec.calls.append(("-", "-", "FENCE", None)))
    job.run(new_job(tmp_path, rec))
    order = [c[2] for c in rec.calls]
    fences = [i for i, c in enumerate(order) if c == "FENCE"]
    starts = [i for i, c in enumerate(order) if " docker run " in f" {c}"]
    stops = [i for i, c in enumerate(order) if "docker rm --force" in c]
    assert len(fences) == 2 and starts and fences[0] < min(starts)
    assert stops and fences[1] < min(i for i in stops if i > max(starts))


class Followed:
    """Stands in for the SSH session of a watch: each host's follow gives one line and ends 0;
    every host asked is recorded."""

    def __init__(self):
        self.asked: list[str] = []

    def stream(self, host, command, feed, timeout=None):
        self.asked.append(host.name)
        feed(b"step 1\n")

    def run(self, host, command, timeout=60, stdin=None, what=""):
        self.asked.append(host.name)
        from orchestrator.transport.remote import Result

        return Result("0\n", "", 0, 0.0)

    def alive_since(self, host):
        return None

    def fan_out(self, fn, hosts):
        return {h.name: fn(h) for h in hosts}


def test_a_host_the_standby_found_silent_is_lost_from_the_watchs_start_and_never_asked(tmp_path):
    from orchestrator.backends.ssh import attempt
    from orchestrator.backends.ssh.watch import watch
    from orchestrator.core import jobspec
    from orchestrator.core.policy import Failure

    i = inv(2)
    a = attempt.build(i, jobspec.JobSpec(job_id="j-1", script="x.py"), 2, 29500)
    session = Followed()
    w = watch(session, a, tmp_path, echo=False, known_lost={"node1": "node1 did not answer", "gone": "x"})
    assert "node1" not in session.asked and "node2" in session.asked
    (lost,) = w.failures
    assert (lost.host.name, lost.failure, lost.detail) == ("node1", Failure.LOST, "node1 did not answer")


def test_the_controllers_copy_of_fabtrain_imports_and_finds_every_file_a_node_start_ships(tmp_path):
    """controllerfiles.code_copy: what a detached job's controller runs (its container's python, this code
    alone on its path) loads the controller and finds the entrypoint and the memory module a node's
    start unpacks (a file missing there made every detached job's controller die at import)."""
    import sys

    from orchestrator.backends.ssh import controllerfiles

    controllerfiles.code_copy(tmp_path / "fabtrain")
    probe = (
        "import orchestrator, orchestrator.backends.ssh.controller as c\n"
        "from orchestrator.hostcmds import dockerargs\n"
        "print(orchestrator.__file__); print(len(dockerargs.runtime_files()))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path / "fabtrain",
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "fabtrain")},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    where, size = r.stdout.split()
    assert where.startswith(str(tmp_path / "fabtrain")) and int(size) > 0
