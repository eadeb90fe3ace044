"""Time from a host is hostile too: a `docker run` past its deadline is ended on the host (GNU
timeout, before fab gives up), and whatever a late one left is removed by label at the teardown and
again at the job's finish, on every host used that answers, the one whose start timed out included.
"""

import os
import shlex
import subprocess
import time
from pathlib import Path

from test_job import Recorder, inventory, new_job

from orchestrator.backends.ssh import job, jobcontrol
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.hostcmds import dockerargs, node, sshargs
from orchestrator.hosts import claims
from orchestrator.transport import deadlines
from orchestrator.transport.remote import CommandTimedOut, Result


def test_the_host_ends_a_command_before_fab_stops_waiting_for_it():
    assert sshargs.host_deadline(120) == (110, 5)
    assert sshargs.bounded(["docker", "run", "x"], 120) == ["timeout", "-k", "5", "110", "docker", "run", "x"]
    for timeout in (1, 4, 8, 20, 30, 120, 600):
        term, kill = sshargs.host_deadline(timeout)
        assert 0 < term and 0 < kill and term + kill < timeout, timeout


def test_the_start_step_runs_docker_run_under_timeout_quoted_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    j = new_job(tmp_path, Recorder(inventory(tmp_path).hosts))
    a = j.plan(dry=True)
    h = a.hosts[1]
    step = a.step(h.name, "start")
    assert step.timeout == deadlines.START_TIMEOUT == 120
    run = node.docker_run_argv(a.inv, h, a.spec, None, a.units.get(h.name))
    bounded = sshargs.shell(["timeout", "-k", "5", "110", *run])
    assert (
        f"/.runtime/{a.spec.job_id}) && {bounded} >/dev/null || {{ rc=$?; case $rc in 124|137) echo "
        "'not done within 110s: ended on the host (timeout); check its Docker engine and disks' >&2;; "
        "esac; exit $rc; }" in step.command
    )
    # One quoting: the part after `timeout -k 5 110` splits back into docker run's exact argv.
    words = shlex.split(step.command.split(" && ")[-1].split(" >/dev/null")[0])
    assert words == ["timeout", "-k", "5", "110", *run]
    # What runs is what the plan shows: the dry run's text holds the same line.
    assert step.render(h.rank) in a.render()


def test_a_late_docker_run_is_ended_on_the_host_and_never_starts(tmp_path):
    """The start script itself, run by a local shell with a `docker` that sleeps past the deadline
    before it would make the container: timeout ends it (and its sleep) before fab's deadline, the
    container is never made, and stderr names the deadline."""
    out = tmp_path / "out"
    inv = parse(
        f"job: {{output_dir: {out}, code_dir: {tmp_path}/code}}\n"
        "hosts:\n  - {name: node2, address: 10.0.0.2, interface: eth0}\n",
        tmp_path / "i.yaml",
    )
    spec = jobspec.JobSpec(job_id="late-1", script="t.py")
    made, pidfile = tmp_path / "made", tmp_path / "pid"
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "docker").write_text(f"#!/bin/sh\necho $$ > {pidfile}\nsleep 30\ntouch {made}\n")
    (bin_ / "docker").chmod(0o755)
    deadline = 4  # the host ends it after 2 s (SIGKILL 1 s later at most), fab would give up at 4
    script = node.start_script(inv, inv.hosts[0], spec, timeout=deadline)
    start = time.monotonic()
    r = subprocess.run(
        ["sh", "-c", script],
        input=dockerargs.runtime_files(),
        capture_output=True,
        timeout=30,
        env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"},
    )
    took = time.monotonic() - start
    assert r.returncode == 124 and took < deadline, (r.returncode, took, r.stderr)
    assert r.stderr.decode() == (
        "not done within 2s: ended on the host (timeout); check its Docker engine and disks\n"
    )
    # The runtime files arrived whole from stdin (a tar), before docker run was tried.
    for name, source in dockerargs.RUNTIME_SOURCES.items():
        assert (out / ".runtime/late-1" / name).read_bytes() == source.read_bytes()
        assert (out / ".runtime/late-1" / name).stat().st_mode & 0o777 == 0o644
    pid = int(pidfile.read_text())
    time.sleep(0.3)
    assert not Path(f"/proc/{pid}").exists() or b"sleep" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert not made.exists()


class LateStart(Recorder):
    """node2's start comes back as a host ends a late docker run (exit 124 with timeout's note), or
    never (fab's own deadline); its sweep at the finish finds a container that appeared after the
    teardown."""

    def __init__(self, hosts, how="host"):
        super().__init__(hosts)
        self.how = how

    def run(self, host, command, timeout=60, stdin=None, what=""):
        if host.name == "node2" and "docker run" in command and self.how == "fab":
            self.calls.append((host.name, host.name, command, stdin))
            raise CommandTimedOut(host, what, timeout)
        return super().run(host, command, timeout, stdin, what)

    def answer(self, host, command):
        if host.name == "node2" and "docker run" in command:
            return Result(
                "",
                "not done within 110s: ended on the host (timeout); check its Docker engine and disks\n",
                124,
                110.0,
            )
        if host.name == "node2" and command == dockerargs.stop_script("gpt-1", 0):
            stops = sum(1 for c in self.calls if c[0] == "node2" and c[2] == command)
            if stops == 2:  # the sweep at the finish: one came up after the teardown looked
                return Result("0123456789ab\n", "", 0, 0.01)
        return super().answer(host, command)


def run_late(tmp_path, how):
    rec = LateStart(inventory(tmp_path).hosts, how)
    notes = []
    j = new_job(tmp_path, rec)
    j.note = lambda text, level="info": notes.append((level, text))
    result = job.run(j)
    return j, rec, result, notes


def test_a_host_whose_start_ran_late_is_torn_down_and_swept_not_skipped_as_lost(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for how, said in (
        ("host", "not done within 110s: ended on the host"),
        ("fab", "node2: no answer within 120s (docker run)"),
    ):
        (tmp_path / how).mkdir()
        j, rec, result, notes = run_late(tmp_path / how, how)
        assert result.state == "failed" and result.lost == [], how
        err = str(jobcontrol.explain(result))
        assert "node2" in err and said in err, err
        node2 = [c[2] for c in rec.calls if c[0] == "node2" and c[1] == "node2"]
        stop = dockerargs.stop_script("gpt-1", 0)
        release = claims.release_command(j.inv, ["gpt-1"])
        started = max(i for i, c in enumerate(node2) if "docker run" in c)
        # After the late start: the teardown's stop, then the finish's sweep, before its claim goes.
        after = [c for c in node2[started + 1 :] if c in (stop, release)]
        assert after == [stop, stop, release], (how, after)
        # node1, which started, was stopped at the failure, at the teardown and swept at the finish.
        assert sum(c[2] == stop for c in rec.calls if c[0] == "node1") == 3
        assert (
            "warning",
            "node2: removed 1 container(s) of the job still there after its teardown (a docker run "
            "that came back after its deadline?)",
        ) in notes, notes


def test_the_plan_shows_the_sweep_at_the_finish(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = new_job(tmp_path, Recorder(inventory(tmp_path).hosts)).plan(dry=True)
    text = a.render()
    finish = text.index("## finish (at the job's end, on every host it used)")
    for h in a.hosts:
        sweep = a.step(h.name, "sweep")
        assert sweep.command == dockerargs.stop_script("gpt-1", 0) and sweep.timeout == deadlines.STOP_MARGIN
        line = sweep.render(h.rank)
        assert text.index(line, finish) < text.index(a.step(h.name, "cleanup").render(h.rank), finish)


def test_the_deep_checks_measuring_container_is_ended_on_the_host_and_removed(tmp_path):
    from orchestrator.preflight import deepphases

    inv = inventory(tmp_path)
    h = inv.hosts[0]
    cmd = deepphases.container(inv, h, "fabtrain-health-x", "print(1)", ["2"], "img:1")
    term, kill = sshargs.host_deadline(deepphases.CONTAINER_TIMEOUT)
    assert cmd.startswith(f"timeout -k {kill:g} {term:g} docker run --rm --name fabtrain-health-x ")
    assert cmd.endswith("; rc=$?; docker rm -f fabtrain-health-x >/dev/null 2>&1; exit $rc")
