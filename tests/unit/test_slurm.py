"""fab train --on slurm without a cluster: the inventory's slurm: section, the commands run on the
login node (exact text), what Slurm prints parsed, each node's lines split out of the output
file, and --dry-run == what is submitted (a recording stand-in for the SSH session)."""

import shlex
from pathlib import Path

import pytest

from orchestrator.backends.slurm import commands, follow, slurm
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.transport.logs import Multiplexer
from orchestrator.transport.remote import Result, put_command

SECRET = "tok-never-on-a-command-line"
HOSTS = """\
hosts:
  - {name: node1, address: 10.0.0.1, interface: eth0}
  - {name: node2, address: 10.0.0.2, interface: eth0}
"""


def inv(tmp_path: Path, slurm_section: str, job: str = ""):
    return parse(f"ssh: {{user: alice}}\n{job}{HOSTS}slurm:\n{slurm_section}", tmp_path / "inventory.yaml")


def test_the_slurm_section_defaults_and_the_login_node_uses_the_hosts_ssh_settings(tmp_path):
    i = inv(tmp_path, "  login: login1.example.com\n")
    s = i.slurm
    assert (s.login.name, s.login.address, s.login.ssh.user) == (
        "login1.example.com",
        "login1.example.com",
        "alice",
    )
    assert (s.workdir, s.nodes, s.runtime, s.partition, s.account, s.time) == (
        "/opt/fabtrain/output/slurm",
        2,
        "docker",
        None,
        None,
        None,
    )
    i = inv(
        tmp_path,
        "  login: l1\n  ssh: {user: bob, port: 2222}\n  workdir: /home/bob/jobs/\n  nodes: 4\n"
        "  partition: gpu\n  account: proj1\n  time: '04:00:00'\n  runtime: pyxis\n",
    )
    s = i.slurm
    assert (
        s.login.ssh.user,
        s.login.ssh.port,
        s.workdir,
        s.nodes,
        s.partition,
        s.account,
        s.time,
        s.runtime,
    ) == ("bob", 2222, "/home/bob/jobs", 4, "gpu", "proj1", "04:00:00", "pyxis")
    assert parse(HOSTS, tmp_path / "i.yaml").slurm is None


@pytest.mark.parametrize(
    "section,expected",
    [
        ("  partition: gpu\n", "inventory.yaml:5: slurm.login: is missing; add 'login:' to slurm"),
        ("  login: '-oProxyCommand=x'\n", "slurm.login: '-oProxyCommand=x' is neither a host name"),
        (
            "  login: l1\n  partition: 'gpu; rm -rf /'\n",
            "inventory.yaml:7: slurm.partition: 'gpu; rm -rf /' is not a Slurm partition",
        ),
        ("  login: l1\n  runtime: singularity\n", "slurm.runtime: 'singularity' is not a container runtime"),
        ("  login: l1\n  nodes: 0\n", "slurm.nodes: 0 is not a number of nodes; use a number from 1"),
        ("  login: l1\n  workdir: jobs\n", "slurm.workdir: 'jobs' is not an absolute path"),
        (
            "  login: l1\n  queue: gpu\n",
            "inventory.yaml:7: slurm.queue: unknown field; use one of: login, ssh, workdir",
        ),
    ],
)
def test_slurm_section_mistakes_name_the_line_and_field(tmp_path, section, expected):
    with pytest.raises(UserError) as e:
        inv(tmp_path, section)
    assert expected in str(e.value)


def test_commands_on_the_login_node_are_quoted_once(tmp_path):
    s = inv(tmp_path, "  login: l1\n  workdir: /home/a b/jobs\n").slurm
    assert commands.submit_command(s, "gpt-1") == "cd '/home/a b/jobs' && sbatch --parsable gpt-1.sbatch"
    assert (
        commands.submit_command(s, "gpt-1", secrets=True)
        == "cd '/home/a b/jobs' && FABTRAIN_SECRETS='/home/a b/jobs/.secrets/gpt-1.env' sbatch --parsable "
        "gpt-1.sbatch"
    )
    assert commands.follow_command(commands.out_file(s, "gpt-1", "42")) == (
        "while [ ! -e '/home/a b/jobs/gpt-1-42.out' ]; do sleep 0.2; done; "
        "exec tail -n +1 -s 0.2 -F '/home/a b/jobs/gpt-1-42.out'"
    )
    assert commands.show_command("42") == "scontrol show job --oneliner 42"
    assert commands.sacct_command("42") == (
        "sacct --allocations --noheader --parsable2 --format JobID,State,ExitCode --jobs 42 2>/dev/null || "
        "sacct --completion --noheader --parsable2 --format JobID,State,ExitCode --jobs 42"
    )
    assert commands.squeue_command() == "squeue --me --noheader --format '%i|%j|%T|%N|%S|%k|%u|%r'"


def test_what_slurm_prints_is_read_right():
    shown = commands.parse_show(
        "JobId=42 JobName=gpt-1 UserId=root(0) JobState=PENDING Reason=BeginTime "
        "Requeue=1 Restarts=1 BatchFlag=1 ExitCode=0:0 NodeList=(null) Comment=fabtrain"
    )
    assert (shown["JobState"], shown["Reason"], shown["Restarts"], shown["NodeList"]) == (
        "PENDING",
        "BeginTime",
        "1",
        "(null)",
    )
    # sacct --completion keeps a record per end of a requeued job; the last one is the job's end.
    text = "42|NODE_FAIL|0:0\n42|COMPLETED|0:0\n43|FAILED|1:0\n"
    assert commands.parse_sacct(text, "42") == ("COMPLETED", "0:0")
    assert commands.parse_sacct("42|CANCELLED by 0|0:15\n", "42") == ("CANCELLED", "0:15")
    assert commands.parse_sacct("", "42") is None
    assert [
        commands.exit_code(*a)
        for a in (
            ("COMPLETED", "0:0"),
            ("FAILED", "3:0"),
            ("CANCELLED", "0:15"),
            ("TIMEOUT", "0:0"),
            ("NODE_FAIL", "0:0"),
        )
    ] == [0, 3, 143, 1, 1]
    rows = commands.parse_squeue(
        "42|gpt-1|RUNNING|node[1-2]|2026-11-23T21:00:00|fabtrain|alice|None\n"
        "43|other|RUNNING|node3|2026-11-23T21:00:00|(null)|alice|None\n"
    )
    assert rows == [
        {
            "slurm_id": "42",
            "job": "gpt-1",
            "state": "RUNNING",
            "nodes": "node[1-2]",
            "start": "2026-11-23T21:00:00",
            "who": "alice",
            "reason": "None",
        }
    ]


def test_each_nodes_lines_go_to_its_log_with_the_ssh_jobs_prefix(tmp_path):
    out = tmp_path / "terminal"
    with out.open("wb") as f:
        mux = Multiplexer(tmp_path / "run", out=f, colour=False)
        allocations = {0: ["node1", "node2"], 1: ["node1", "node3"]}
        d = follow.Demux(mux, lambda restart: allocations[restart])
        stream = (
            b"[fabtrain] job gpt-1: slurm job 42 (restart 0), 2 node(s), master 10.0.0.1\n"
            b"0: [node1 rank0] step 1\n1: [node2 ra"
            b"nk2] step 1\n"
            b"slurmstepd: error: *** JOB 42 ON node1 CANCELLED ***\n"
            b"[fabtrain] job gpt-1: slurm job 42 (restart 1), 2 node(s), master 10.0.0.1\n"
            b"1: [node3 rank2] resumed\n 0: padded label\n"
        )
        for i in range(0, len(stream), 7):  # arriving in pieces that cut lines
            d.feed(stream[i : i + 7])
        d.close()
    run = tmp_path / "run"
    assert (run / "node1.log").read_text() == "[node1 rank0] step 1\npadded label\n"
    assert (run / "node2.log").read_text() == "[node2 rank2] step 1\n"
    assert (run / "node3.log").read_text() == "[node3 rank2] resumed\n"
    assert (run / "slurm.log").read_text().count("[fabtrain] job gpt-1") == 2
    assert "node1 r0 | [node1 rank0] step 1\n" in out.read_text()
    assert "node3 r1 | [node3 rank2] resumed\n" in out.read_text()
    assert d.received == len(stream)


class Recorder:
    """The Session calls slurm.submit makes, recorded; sbatch answers with a job id."""

    def __init__(self):
        self.calls: list[tuple[str, str, bytes | None]] = []

    def local(self, argv, timeout):
        self.calls.append(("local", shlex.join(argv), None))
        return Result("", "", 0, 0.01)

    def run(self, host, command, timeout=60, stdin=None, what=""):
        assert timeout is not None
        self.calls.append((host.name, command, stdin))
        return Result("42;cluster\n" if "sbatch" in command else "", "", 0, 0.01)

    def put(self, host, data, path, mode=0o600, timeout=30):
        self.run(host, put_command(path, mode), timeout, stdin=data)

    def fan_out(self, fn, hosts):
        from orchestrator.transport.remote import PerHost

        return PerHost({h.name: fn(h) for h in hosts})


def test_dry_run_is_what_is_submitted_and_secrets_travel_on_stdin(tmp_path):
    (tmp_path / "token").write_text(SECRET + "\n")
    code = tmp_path / "project"
    (code / "trainers").mkdir(parents=True)
    (code / "trainers" / "gpt.py").write_text("print('hi')\n")
    i = inv(
        tmp_path,
        "  login: l1\n  workdir: /jobs\n  partition: gpu\n",
        job=f"job: {{secret_files: {{API_TOKEN: {tmp_path}/token}}}}\n",
    )
    spec = jobspec.JobSpec(job_id="gpt-1", script="trainers/gpt.py", args=("--epochs", "2"), code=str(code))
    text = slurm.dry_run(i, spec)
    spec, script = slurm.prepared(i, spec)
    rec = Recorder()
    job = slurm.submit(rec, i, spec, script, note=lambda line: None)
    assert job.slurm_id == "42"
    steps = [c[1] for c in rec.calls]
    listed = [line.split(". ", 1)[1] for line in text.split("\n\n--- ")[0].splitlines()[1:]]
    assert steps[0] == listed[0] and steps[1] == listed[1]  # rsync to the login node, mkdir
    assert steps[2] == put_command("/jobs/gpt-1.sbatch", 0o644) and rec.calls[2][2].decode() == script
    assert listed[2] == "write /jobs/gpt-1.sbatch (below)" and text.endswith("---\n" + script)
    assert steps[3] == listed[3] == "mkdir -p -m 700 /jobs/.secrets"
    assert rec.calls[4] == (
        "l1",
        put_command("/jobs/.secrets/gpt-1.env", 0o600),
        f"API_TOKEN={SECRET}\n".encode(),
    )
    assert listed[4] == "write /jobs/.secrets/gpt-1.env (mode 600: API_TOKEN)"
    assert steps[5] == listed[5] == commands.submit_command(i.slurm, "gpt-1", secrets=True)
    assert len(steps) == 6
    assert "#SBATCH --partition=gpu" in script and "--comment=fabtrain" in script
    assert all(SECRET not in c[1] for c in rec.calls) and SECRET not in text + script


def test_a_job_sbatch_refuses_is_a_clear_error(tmp_path):
    code = tmp_path / "project"
    code.mkdir()
    i = inv(tmp_path, "  login: l1\n")
    spec, script = slurm.prepared(i, jobspec.JobSpec(job_id="gpt-1", script="x.py", code=str(code)))

    class Refusing(Recorder):
        def run(self, host, command, timeout=60, stdin=None, what=""):
            if "sbatch" in command:
                return Result("", "sbatch: error: invalid partition specified: gpu\n", 1, 0.01)
            return super().run(host, command, timeout, stdin, what)

    with pytest.raises(UserError) as e:
        slurm.submit(Refusing(), i, spec, script, note=lambda line: None)
    assert str(e.value).startswith(
        "sbatch on l1 refused the job: sbatch: error: invalid partition specified: gpu; "
        "the script is /opt/fabtrain/output/slurm/gpt-1.sbatch there"
    )


def test_without_a_slurm_section_on_slurm_says_what_to_add(tmp_path):
    with pytest.raises(UserError) as e:
        slurm.cfg_of(parse(HOSTS, tmp_path / "i.yaml"))
    assert "no slurm: section; add one with at least login:" in str(e.value) and e.value.exit_code == 2


class FakeJob:
    """A SlurmJob whose login node answers from a list of scontrol results (an exception: no answer)."""

    def __init__(self, cfg, answers, files_exist=True):
        self.cfg, self.job_id, self.slurm_id = cfg, "gpt-1", "42"
        self.answers, self.queries, self.files_exist = list(answers), [], files_exist

        class Cmd:
            chan = None

            def __enter__(self):
                return self

            def __exit__(self, *a):
                pass

            def recv(self, n=0):
                return b""

        class Sess:
            def command(self, *a):
                return Cmd()

        self.session = Sess()

    def show(self):
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    def query(self, command, what):
        self.queries.append(command)
        return Result("", "", 0 if self.files_exist else 1, 0.01)

    def nodes(self, nodelist):
        return ["node1", "node2"]

    def end(self, shown):
        return commands.End(shown.get("JobState", "UNKNOWN"), shown.get("ExitCode", "0:0"), self.slurm_id)

    def cancel(self):
        pass


def test_a_login_node_that_stops_answering_is_named_and_following_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(follow, "POLL", 0)
    s = inv(tmp_path, "  login: l1\n").slurm
    job = FakeJob(
        s,
        [
            {"JobState": "RUNNING", "NodeList": "node[1-2]", "Restarts": "0"},
            OSError("x"),
            {"JobState": "RUNNING", "Restarts": "0"},
        ]
        + [UserError("l1 (alice@l1:22): no route")] * 3,
    )
    with pytest.raises(UserError) as e:
        follow.Follower(job, tmp_path / "run", echo=False).run()
    assert str(e.value).startswith(
        "the job's state could not be read 3 times in a row: l1 (alice@l1:22): no route; "
        "the job may still run: 'fab status' or 'fab logs --job gpt-1' once l1 answers"
    )
    # One failed read between good ones is not enough; the job ending is followed to its end.
    job = FakeJob(
        s,
        [
            {"JobState": "PENDING", "Reason": "Priority"},
            OSError("x"),
            {"JobState": "COMPLETED", "ExitCode": "0:0"},
        ],
    )
    assert follow.Follower(job, tmp_path / "run2", echo=False).run().exit_code == 0


def test_a_running_job_whose_output_file_the_login_node_cannot_see_is_explained(tmp_path, monkeypatch):
    monkeypatch.setattr(follow, "POLL", 0)
    monkeypatch.setattr(follow, "UNSEEN_AFTER", 0)
    s = inv(tmp_path, "  login: l1\n").slurm
    job = FakeJob(
        s,
        [{"JobState": "RUNNING", "NodeList": "node1"}] * 3 + [{"JobState": "FAILED", "ExitCode": "1:0"}],
        files_exist=False,
    )
    out = tmp_path / "terminal"
    with out.open("wb") as f:
        follower = follow.Follower(job, tmp_path / "run", echo=True)
        follower.mux.out, follower.mux.colour = f, False
        assert follower.run().exit_code == 1
    text = out.read_text()
    assert (
        text.count(
            "/opt/fabtrain/output/slurm/gpt-1-42.out is not there on l1: Slurm writes it on the job's "
            "first node; put slurm.workdir on a filesystem"
        )
        == 1
    )
    assert (
        "[fabtrain] slurm job 42: RUNNING on node1\n" in text and "[fabtrain] slurm job 42: FAILED\n" in text
    )


def test_the_live_view_follows_a_job_on_a_terminal(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    monkeypatch.setattr(follow, "POLL", 0)
    s = inv(tmp_path, "  login: l1\n").slurm
    job = FakeJob(s, [{"JobState": "RUNNING", "NodeList": "node[1-2]"}] * 2 + [{"JobState": "COMPLETED"}])
    term = io.StringIO()
    follower = follow.Follower(
        job, tmp_path / "run", console=Console(file=term, force_terminal=True, width=120), live=True
    )
    assert follower.live and follower.run().exit_code == 0
    job.answers.append({"JobState": "RUNNING", "NodeList": "node[1-2]"})
    follower.demux.on_attempt(0)  # the allocation's nodes become the board's hosts
    assert [h for h in follower.board.hosts] == ["node1", "node2"]
    assert "slurm job 42: RUNNING on node[1-2]" in term.getvalue()


class Squeue(Recorder):
    """The login node answering every command with `answer` (squeue's listing, or its failure)."""

    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    def run(self, host, command, timeout=60, stdin=None, what=""):
        super().run(host, command, timeout, stdin, what)
        return self.answer


SQUEUE = "squeue --me --noheader --format '%i|%j|%T|%N|%S|%k|%u|%r'"


def test_resuming_a_job_slurm_still_has_is_refused_naming_it(tmp_path, monkeypatch):
    i = inv(tmp_path, "  login: l1\n")
    listing = (
        "42|gpt-1|RUNNING|node[1-2]|2026-11-23T21:00:00|fabtrain|alice|None\n"
        "43|gpt-2|PENDING||N/A|fabtrain|alice|Resources\n"
        "44|gpt-1|PENDING||N/A|(null)|alice|None\n"
    )  # not fabtrain's: another job of that name
    session = Squeue(Result(listing, "", 0, 0.01))
    with pytest.raises(UserError) as e:
        slurm.refuse_if_running(session, i, "gpt-1", "--resume")
    assert session.calls == [("l1", SQUEUE, None)]
    assert str(e.value) == (
        "--resume gpt-1: that job is still on Slurm (slurm job 42 RUNNING); it was left alone. Follow it "
        "with 'fab logs --job gpt-1', or end it with 'fab stop --job gpt-1' (or wait for its end) and then "
        "resume it"
    )
    assert e.value.exit_code == 2
    # Pending (a requeued job is pending again) is still there too.
    with pytest.raises(UserError, match=r"still on Slurm \(slurm job 43 PENDING\)"):
        slurm.refuse_if_running(Squeue(Result(listing, "", 0, 0.01)), i, "gpt-2", "--resume")
    # A job squeue no longer lists has ended: resuming it goes on.
    slurm.refuse_if_running(Squeue(Result(listing, "", 0, 0.01)), i, "gpt-3", "--resume")
    # Slurm not answering is said, never taken for "not running".
    down = Squeue(Result("", "slurm_load_jobs error: Unable to contact slurm controller\n", 1, 0.01))
    with pytest.raises(UserError) as e:
        slurm.refuse_if_running(down, i, "gpt-1", "--resume")
    assert down.calls == [("l1", SQUEUE, None)]
    assert str(e.value) == (
        "--resume gpt-1: cannot tell whether Slurm still runs that job: squeue on l1 failed: "
        "slurm_load_jobs error: Unable to contact slurm controller; try again once l1 answers"
    )
    # The backend asks through a Session to the login node.
    from orchestrator.backends.slurm import backend

    class Opened:
        def __init__(self, hosts):
            assert [h.name for h in hosts] == ["l1"]

        def __enter__(self):
            return Squeue(Result(listing, "", 0, 0.01))

        def __exit__(self, *a):
            pass

    monkeypatch.setattr(backend, "Session", Opened)
    with pytest.raises(UserError, match=r"--resume gpt-1: that job is still on Slurm \(slurm job 42"):
        backend.SlurmBackend().refuse_if_running(i, "gpt-1", "--resume")
    backend.SlurmBackend().refuse_if_running(i, "gpt-3", "--resume")
