"""The job lifecycle against a recording stand-in for the SSH session: what runs is what the plan
says, command for command; --dry-run, plan.txt and the executed commands are the same text.
"""

import json
import shlex
import time
from pathlib import Path

import pytest

from orchestrator.backends.ssh import attempt, job, jobcontrol, planstep, state
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.core.events import JsonLines, Reporter
from orchestrator.core.policy import Policy, Roster
from orchestrator.hostcmds import dockerargs, ports, sshargs
from orchestrator.hosts import claims, survey
from orchestrator.transport.remote import PerHost, Result

SECRET = "s3cr3t-value-never-shown"


def inventory(tmp_path: Path):
    (tmp_path / "token").write_text(SECRET + "\n")
    return parse(
        f"""\
job: {{output_dir: /opt/out, code_dir: /opt/code, secret_files: {{API_TOKEN: {tmp_path}/token}}}}
hosts:
  - {{name: node1, address: 10.0.0.1, interface: eth0, gpus: {{vendor: nvidia, count: 2}}}}
  - {{name: node2, address: 10.0.0.2, interface: eth0}}
""",
        tmp_path / "inventory.yaml",
    )


class Recorder:
    """Session's interface, answering from a script and recording every command: (peer host,
    where it ran: the host or 'local', the command, what it read on stdin)."""

    def __init__(self, hosts, exit_codes=None, listening="LISTEN 0 4096 *:29500 *:*\n"):
        self.hosts = tuple(hosts)
        self.calls: list[tuple[str, str, str, bytes | None]] = []
        self.exit_codes = exit_codes or {}
        self.listening = listening

    def answer(self, host, command: str) -> Result:
        if command == ports.port_command():
            return Result(self.listening, "", 0, 0.01)
        if command.startswith("sh -c 'echo runtimes"):
            return Result("runtimes {}\ncdi 2\n", "", 0, 0.01)  # CDI specs, no runtime hook
        if 'echo "${code:-255}' in command:  # a node's exit (a warm node's: from its end file)
            return Result(f"{self.exit_codes.get(host.name, 0)}\n", "", 0, 0.01)
        if command.startswith("test -e"):
            return Result("", "", 1, 0.01)  # no `fab stop` marker
        return Result("", "", 0, 0.01)

    def run(self, host, command, timeout=60, stdin=None, what=""):
        assert timeout is not None, f"no deadline: {command}"
        self.calls.append((host.name, host.name, command, stdin))
        return self.answer(host, command)

    def stream(self, host, command, on_data, chunk=1 << 16, timeout=None):
        self.calls.append((host.name, host.name, command, None))
        if "tail -c +1" in command:
            code = self.exit_codes.get(host.name, 0)
            on_data(
                f"[{host.name} rank0] epoch 0 | step 1 | loss 4.0\n[fabtrain] node exit code "
                f"{code}\n".encode()
            )
        return 0

    def local(self, argv, timeout, on_output=None):
        peer = next(h.name for h in self.all_hosts if any(f"{h.ssh.hostname}:" in a for a in argv))
        self.calls.append((peer, "local", shlex.join(argv), None))
        return Result("", "", 0, 0.01)

    def fan_out(self, fn, hosts=None):
        out = PerHost()
        for h in self.hosts if hosts is None else hosts:
            try:
                out[h.name] = fn(h)
            except BaseException as exc:  # noqa: BLE001 - as Session.fan_out
                out[h.name] = exc
        return out

    def alive_since(self, host):
        return time.monotonic()

    def close(self):
        pass

    @property
    def all_hosts(self):
        return self.hosts


def new_job(tmp_path, rec, **kw):
    inv = inventory(tmp_path)
    code = tmp_path / "project"
    if not code.is_dir():
        (code / "trainers").mkdir(parents=True)
        (code / "trainers" / "gpt.py").write_text("print('hi')\n")
    spec = jobspec.JobSpec(job_id="gpt-1", script="trainers/gpt.py", args=("--model", "tiny"), code=str(code))
    return job.Job(
        inv,
        spec,
        Policy(hang_timeout=0),
        tmp_path / "runs",
        Reporter(),
        session=rec,
        checks=False,
        watch_options={"echo": False},
        **kw,
    )


def event_lines(j) -> list[str]:
    """The job's events from now on, as the JSON lines `fab train --json` prints."""
    lines: list[str] = []

    class Out:
        def write(self, s):
            lines.append(s)

        def flush(self):
            pass

    j.reporter = JsonLines(Out())
    return lines


def expected(a: attempt.AttemptPlan) -> list[tuple[str, str, str]]:
    return [(s.host or s.where, s.where, s.command) for s in a.steps if s.when == planstep.When.ALWAYS]


def per_peer(calls, names):
    return {n: [c[1:3] for c in calls if c[0] == n] for n in names}


def test_what_runs_is_the_rendered_plan_command_for_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hosts = inventory(tmp_path).hosts
    dry = new_job(tmp_path, Recorder(hosts))
    text = jobcontrol.dry_run(dry)
    rec = Recorder(hosts)
    j = new_job(tmp_path, rec)
    result = job.run(j)
    assert result.ok and result.state == "finished"
    a = j.last
    # --dry-run and plan.txt are the same text, and it is the plan the job ran.
    assert text == a.render()
    assert (tmp_path / "runs/gpt-1/plan.txt").read_text() == text + "\n"
    sampling = {s.command for s in j.last.steps if s.key == "telemetry"}
    ran = [
        c for c in rec.calls if not c[2].startswith(("touch ", "ls -1 ")) and c[2] not in sampling
    ]  # periodic: lease, snapshot copies, telemetry
    # The plan stage's read-only look (other jobs, free port, GPU access), then exactly the steps.
    looks = {
        survey.survey_script(j.inv),
        ports.port_command(),
        sshargs.shell(dockerargs.gpu_probe_argv(hosts[0])),
    }
    want = expected(a)
    got = [c[:3] for c in ran]
    for n in ("node1", "node2"):
        assert [c[1:] for c in got if c[0] == n and c[2] not in looks] == [w[1:] for w in want if w[0] == n]
    # The port was read and the next free one taken; the GPU flags came from the host's answer.
    assert a.port == 29501 and "MASTER_PORT=29501" in a.step("node1", "start").command
    assert "--device nvidia.com/gpu=all" in a.step("node1", "start").command
    # The secret travels on stdin only, and is never in the rendering.
    secret_writes = [c for c in rec.calls if c[3] and SECRET.encode() in c[3]]
    assert len(secret_writes) == 2 and all(SECRET not in c[2] for c in rec.calls)
    assert SECRET not in text and "API_TOKEN=<redacted>" in text


def test_plan_lists_conditional_steps_under_their_condition(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = job.Job(
        inventory(tmp_path),
        jobspec.JobSpec(job_id="j-1", script="x.py"),
        Policy(),
        tmp_path,
        Reporter(),
        session=Recorder(inventory(tmp_path).hosts),
    )
    text = a.plan(dry=True).render()
    for when in (
        planstep.When.ON_FAILURE.value,
        planstep.When.ON_INTERRUPT.value,
        planstep.When.ON_HANG.value,
        planstep.When.ON_MISSED.value,
        planstep.When.ON_FAILED.value,
    ):
        assert f"## {when}:" in text
    assert (
        text.index("## claim")
        < text.index("## sync+preflight")
        < text.index("## start")
        < text.index("## watch")
    )


def test_a_failing_node_is_named_and_the_job_stops_without_restarts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rec = Recorder(inventory(tmp_path).hosts, exit_codes={"node2": 3})
    j = new_job(tmp_path, rec)
    lines = event_lines(j)
    result = job.run(j)
    assert result.state == "failed" and result.reason == "no --restarts"
    events = [json.loads(x) for x in lines]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "stage" and kinds[-1] == "finished"
    failed = [e for e in events if e["event"] == "host_failed"]
    assert failed and failed[0]["host"] == "node2" and failed[0]["kind"] == "exited"
    err = str(jobcontrol.explain(result))
    assert "node2 (node rank 1) exited with code 3" in err and "--resume gpt-1" in err
    # The failing attempt still ends with every container removed and the runtime files gone.
    stops = [c for c in rec.calls if c[2] == dockerargs.stop_script("gpt-1", 0)]
    cleanups = [c for c in rec.calls if c[2] == claims.release_command(j.inv, ["gpt-1"])]
    assert {c[0] for c in stops} >= {"node1", "node2"} and {c[0] for c in cleanups} == {"node1", "node2"}


def test_runtime_files_left_on_a_host_at_the_end_are_named_with_what_removes_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    release = claims.release_command(inventory(tmp_path), ["gpt-1"])

    class CleanupFails(Recorder):
        def answer(self, host, command):
            if host.name == "node2" and command == release:
                return Result("", "rm: cannot remove '/opt/out/.runtime/gpt-1': Busy\n", 1, 0.01)
            return super().answer(host, command)

    j = new_job(tmp_path, CleanupFails(inventory(tmp_path).hosts))
    lines = event_lines(j)
    assert job.run(j).state == "finished"
    warnings = [e["text"] for e in map(json.loads, lines) if e["event"] == "note" and e["level"] == "warning"]
    assert warnings == [
        "node2: removing the job's runtime files and claim failed (exit 1): rm: cannot remove "
        "'/opt/out/.runtime/gpt-1': Busy; 'fab stop --job gpt-1' removes them once it answers"
    ], warnings


def test_a_failure_to_start_spends_a_restart_and_the_next_attempt_gets_another_port(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class FailFirstStart(Recorder):
        starts = 0

        def answer(self, host, command):
            if "docker run" in command and host.name == "node2":
                FailFirstStart.starts += 1
                if FailFirstStart.starts == 1:
                    return Result("", "docker: Error response from daemon: port is taken", 125, 0.01)
            return super().answer(host, command)

    rec = FailFirstStart(inventory(tmp_path).hosts)
    j = new_job(tmp_path, rec)
    j.policy = Policy(restarts=1, hang_timeout=0)
    import orchestrator.backends.ssh.gate as gm
    import orchestrator.backends.ssh.job as jm

    monkeypatch.setattr(jm, "backoff", lambda n: 0)
    monkeypatch.setattr(gm.preflight, "run", lambda *a, **k: [])  # a restart's preflight: all well
    result = job.run(j)
    assert result.ok and result.attempts == 2
    rec_ = j.record.attempts
    assert "node2 failed to start" in rec_[0].outcome and rec_[1].outcome == "ok"
    ports = [
        line
        for line in (tmp_path / "runs/gpt-1/plan.txt").read_text().splitlines()
        if line.startswith("# ---- job")
    ]
    assert "10.0.0.1:29501" in ports[0] and "10.0.0.1:29502" in ports[1]


def test_a_warm_restart_keeps_the_containers_and_runs_its_plan(tmp_path, monkeypatch):
    """node2 exits 3 in attempt 1; both nodes' containers wait warm. Attempt 2 syncs nothing and runs
    no preflight, tells each container to start its next generation (or starts it cold when it is
    not waiting), and what runs is its plan; the teardown only ended generations, the job's end
    removes the containers."""
    monkeypatch.chdir(tmp_path)

    class Warm(Recorder):
        ends = 0

        def answer(self, host, command):
            if 'echo "${code:-255}$w"' in command:  # the warm finish: the generation's end
                Warm.ends += 1
                code = 3 if host.name == "node2" and Warm.ends <= 2 else 0
                return Result(f"{code}{' warm' if Warm.ends <= 2 else ''}\n", "", 0, 0.01)
            return super().answer(host, command)

    rec = Warm(inventory(tmp_path).hosts)
    j = new_job(tmp_path, rec)
    j.policy = Policy(restarts=1, hang_timeout=0)
    import orchestrator.backends.ssh.gate as jm

    monkeypatch.setattr(jm.preflight, "run", lambda *a, **k: pytest.fail("a warm restart runs no preflight"))
    result = job.run(j)
    assert result.ok and result.attempts == 2 and j.last.number == 2 and j.last.warm
    a = j.last
    assert a.select("sync") == [] and "warm nodes" in a.render()
    start = a.step("node2", "start").command
    assert start.startswith('if [ "$(docker inspect -f ') and "fabtrain.warm" in start
    assert (
        "FABTRAIN_ATTEMPT=2 FABTRAIN_LAUNCH=direct" in start
        and "docker rm --force fabtrain-gpt-1-r1" in start
    )
    assert "--env FABTRAIN_WARM=1" in start and "--label fabtrain.warm=" in start
    # What attempt 2 ran is its plan: from its claim to its teardown.
    first = next(i for i, c in enumerate(rec.calls) if c[2] == a.step("node1", "claim").command)
    ran = [c[:3] for c in rec.calls[first:] if not c[2].startswith(("touch ", "ls -1 "))]
    for n in ("node1", "node2"):
        mine = [c[1:] for c in ran if c[0] == n]
        want = [w[1:] for w in expected(a) if w[0] == n and w[1] not in ("fetch",)]
        assert [w for w in want if w in mine] == want
    # Attempt 1's teardown ended the generations; no container was removed before the job's end.
    kills = [c for c in rec.calls if c[2].startswith("docker kill --signal USR2 fabtrain-gpt-1-r")]
    removals = [i for i, c in enumerate(rec.calls) if c[2] == dockerargs.stop_script("gpt-1", 0)]
    assert len(kills) >= 2 and removals and min(removals) > first


def test_a_lost_host_is_never_asked_again_and_the_others_are_torn_down_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class LoseNode2(Recorder):
        def stream(self, host, command, on_data, chunk=1 << 16, timeout=None):
            if host.name == "node2" and "tail -c +1" in command:
                self.calls.append((host.name, host.name, command, None))
                raise EOFError("link dropped")  # not a UserError: the host is lost
            if "tail -c +1" in command:
                time.sleep(2.0)  # node1 is still running when node2 goes (even on a loaded machine)
            return super().stream(host, command, on_data, chunk, timeout)

    rec = LoseNode2(inventory(tmp_path).hosts)
    j = new_job(tmp_path, rec)
    result = job.run(j)
    assert result.state == "failed" and result.lost == ["node2"]
    lost_at = max(i for i, c in enumerate(rec.calls) if c[0] == "node2" and "tail -c +1" in c[2])
    assert [
        c for c in rec.calls[lost_at + 1 :] if c[0] == "node2"
    ] == []  # nothing more asked of it or copied
    stops = [c for c in rec.calls[lost_at:] if c[0] == "node1" and "docker rm --force" in c[2]]
    # The failure's stop of the others, the attempt's teardown, then the job's sweep at its finish.
    assert len(stops) == 3
    assert "lost: " in str(jobcontrol.explain(result))


def test_a_host_claimed_meanwhile_refuses_the_job_and_nothing_of_it_is_left(tmp_path):
    """node2's slot went to bob between the plan and the claim: node1 (claimed first, by address) is
    released and the attempt planned again; when bob still holds it after three plans, nothing is
    started and the new job's run directory is gone."""

    class Taken(Recorder):
        def answer(self, host, command):
            if host.name == "node2" and "flock -w" in command:
                return Result(
                    "held bob-20261123-101500-ab12 who=bob@ws2 since=1763892900 units=0\n",
                    "",
                    claims.REFUSED,
                    0.01,
                )
            return super().answer(host, command)

    rec = Taken(inventory(tmp_path).hosts)
    j = new_job(tmp_path, rec)
    try:
        job.run(j)
        raise AssertionError("the job ran")
    except state.Refused as exc:
        text = str(exc)
    assert text.startswith(
        "node2: slots 0 were claimed meanwhile by bob-20261123-101500-ab12 (started by bob@ws2 at "
    )
    assert "nothing was started" in text
    commands = [(h, c) for h, _, c, _ in rec.calls]
    claimed = [h for h, c in commands if "flock -w" in c]
    assert claimed == ["node1", "node2"] * 4  # in claims.order, stopping at the refusal; 3 plans again
    assert ("node1", claims.release_command(j.inv, ["gpt-1"], queue=False)) in commands
    assert not any(c.startswith("mkdir -p /opt/out/gpt-1 ") or "docker run" in c for _, c in commands)
    assert not j.run_dir.exists()


def test_a_first_preflight_that_fails_sweeps_and_fetches_nothing_and_releases_the_claims(
    tmp_path, monkeypatch
):
    """node2's engine does not answer its check: the job ends before any container was started, so
    neither its teardown nor its end looks for containers (on a stuck engine each waited out its
    deadline again) and no output is fetched (there is none: rsync's errors on the terminal); each
    host's claim and runtime files are still removed."""
    from orchestrator.backends.ssh import gate
    from orchestrator.preflight.checks import Check

    failing = [Check("node1", "docker", "ok", "engine"), Check("node2", "docker", "fail", "no answer")]
    monkeypatch.setattr(gate.preflight, "run", lambda *a, **k: failing)
    rec = Recorder(inventory(tmp_path).hosts)
    j = new_job(tmp_path, rec)
    j.checks = True
    with pytest.raises(state.PreflightFailed) as failed:
        job.run(j)
    assert "preflight failed on node2; nothing was started" in str(failed.value)
    commands = [(h, where, c) for h, where, c, _ in rec.calls]
    assert not any(where == "local" and "/outputs/" in c for _, where, c in commands), commands
    assert not any(c == dockerargs.stop_script("gpt-1", 0) for _, _, c in commands), commands
    release = claims.release_command(j.inv, ["gpt-1"])
    assert [h for h, _, c in commands if c == release] == ["node1", "node2"]
    assert not any("docker run" in c for _, _, c in commands)


def test_a_hot_spare_waits_from_the_start_and_takes_the_rank_of_a_node_whose_container_is_gone(
    tmp_path, monkeypatch
):
    """--hot-spares with one spare: attempt 1 claims, syncs and starts the spare beside the nodes;
    node2's container ends (exit 137, not waiting warm), so the spare takes rank 1 in attempt 2,
    which syncs nothing and runs no preflight: its start step renames the waiting spare and tells it
    the rank. What ran is each attempt's plan."""
    monkeypatch.chdir(tmp_path)
    inv = parse(
        """\
job: {output_dir: /opt/out, code_dir: /opt/code, hot_spares: true}
hosts:
  - {name: node1, address: 10.0.0.1, interface: eth0}
  - {name: node2, address: 10.0.0.2, interface: eth0}
spares:
  - {name: node3, address: 10.0.0.3, interface: eth0}
""",
        tmp_path / "inventory.yaml",
    )

    class Hot(Recorder):
        ends = 0

        def answer(self, host, command):
            if 'echo "${code:-255}$w"' in command:  # node2's container was killed; node1 waits warm
                Hot.ends += 1
                code = "137" if host.name == "node2" else "0 warm" if Hot.ends <= 2 else "0"
                return Result(f"{code}\n", "", 0, 0.01)
            return super().answer(host, command)

    rec = Hot(inv.all_hosts)
    j = new_job(tmp_path, rec)
    j.inv = inv
    j.roster = Roster(inv.hosts, inv.spares)
    j.policy = Policy(restarts=1, hang_timeout=0)
    import orchestrator.backends.ssh.gate as jm

    monkeypatch.setattr(jm.preflight, "run", lambda *a, **k: [])
    result = job.run(j)
    assert [h.name for h in j.history[0].plan.hot] == ["node3"], j.history[0].plan.render()[:300]
    assert result.ok and result.attempts == 2, result
    first, second = j.history[0].plan, j.history[1].plan
    assert [h.name for h in first.hot] == ["node3"] and "hot spares node3" in first.render()
    assert {s.where for s in first.select("claim")} == {"node1", "node2", "node3"}
    assert {s.host for s in first.select("sync")} == {"node1", "node2", "node3"}
    spare = first.step("node3", "spare").command
    assert "FABTRAIN_SPARE=1" in spare and "--name fabtrain-gpt-1-spare" in spare
    assert [(h.name, h.rank) for h in second.hosts] == [("node1", 0), ("node3", 1)]
    assert [h.name for h in second.hot] == ["node2"]  # its host answers: the next hot spare
    assert j.history[0].warm_ranks == {"node1": 0}, j.history[0].watched
    assert second.select("sync") == []  # node1 warm, node3 the hot spare: nothing to sync or check
    start = second.step("node3", "start").command
    assert (
        "docker rename fabtrain-gpt-1-spare fabtrain-gpt-1-r1" in start
        and "FABTRAIN_SPARE=0" in start
        and "FABTRAIN_CONSOLE_PATH=/output/.console/node-1.log" in start
        and "echo hot" in start
    )
    for a in (first, second):  # what ran is the plan, host by host, in order
        begin = next(i for i, c in enumerate(rec.calls) if c[2] == a.select("claim")[0].command)
        ran = [c[:3] for c in rec.calls[begin:] if not c[2].startswith(("touch ", "ls -1 "))]
        for n in ("node1", "node2", "node3"):
            mine = [c[1:] for c in ran if c[0] == n]
            want = [w[1:] for w in expected(a) if w[0] == n and w[1] not in ("fetch",)]
            assert [w for w in want if w in mine] == want, n
    notes = (tmp_path / "runs" / "gpt-1" / "events.jsonl").read_text()
    assert "spare node3 takes the place of node2 (its container is gone; a hot spare is ready)" in notes
    # The job's end sweeps every host it used, the spare's included.
    sweeps = {c[0] for c in rec.calls if c[2] == dockerargs.stop_script("gpt-1", 0)}
    assert sweeps == {"node1", "node2", "node3"}


def test_fab_stop_knows_a_job_by_the_hosts_or_by_this_machines_record(tmp_path):
    from orchestrator.backends.ssh.jobcontrol import known_job

    (tmp_path / "gpt-1").mkdir()
    (tmp_path / "gpt-1" / "job.json").write_text("{}")
    assert known_job("gpt-1", {}, {}, False, tmp_path)  # recorded here
    assert known_job("bob-2", {"bob-2": object()}, {}, False, tmp_path)  # on the hosts
    assert known_job("ctl-3", {}, {"ctl-3": "node1 running"}, False, tmp_path)
    assert known_job("typo-4", {}, {}, True, tmp_path)  # a host did not answer
    assert not known_job("typo-4", {}, {}, False, tmp_path)
    assert not known_job("../gpt-1", {}, {}, False, tmp_path / "x")
