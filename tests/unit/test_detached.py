"""Detached jobs (backends/ssh/detached.py, submit.py, controller.py), without a cluster: a job's
end fetched with its record taken as data (a host's copy never replaces this machine's notify,
inventory, code or image) and its key taken back, checked and named where it is left (the hosts
played by this machine: commands run by sh with HOME a temporary folder, rsync copied here); which
jobs' keys `fab stop` removes; the inventory the controller uses, the addresses its key is limited
to, a mount that would show its directory to the job refused, its renewal, and the command that
starts it. The key's scripts themselves: test_keys.py."""

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import paramiko
import pytest
from rich.console import Console

from orchestrator.backends.base import Launch
from orchestrator.backends.ssh import controller, controllerfiles, detached, detachedview, runcopy, submit
from orchestrator.backends.ssh.placement import placement
from orchestrator.config.inventory import parse
from orchestrator.core.errors import UserError
from orchestrator.core.jobspec import JobSpec
from orchestrator.core.policy import Policy
from orchestrator.core.record import Controller, Notify
from orchestrator.core.recovery import Attempt, JobRecord
from orchestrator.hosts import keys
from orchestrator.hosts.survey import HostJobs
from orchestrator.transport.remote import CommandTimedOut, PerHost, Result

JOB = "gpt-20261124-101010-abcd"
OTHER = "gpt-20261124-101010-ef01"


def test_fab_stop_removes_the_keys_of_jobs_a_controller_or_a_record_shows_unless_it_runs(tmp_path):
    """Only jobs known to be detached, by the survey (a controller container there) or by this
    machine's record, have a key to remove; a controller that still runs keeps its own."""
    ran, gone, recorded, plain, unknown = (f"gpt-20261124-101010-{n:04x}" for n in range(5))
    found = PerHost(
        gpu1=HostJobs({}, frozenset(), {}, controllers={ran: "running", gone: "exited"}),
        gpu2=OSError("no answer"),
    )
    for job, place in ((recorded, Controller("gpu2", "/d", "c")), (plain, None)):
        (tmp_path / job).mkdir()
        JobRecord(spec=JobSpec(job_id=job, script="t.py"), inventory="inv.yaml", controller=place).save(
            tmp_path / job
        )
    assert detached.keys_to_revoke(found, [ran, gone, recorded, plain, unknown], tmp_path) == [gone, recorded]
    assert detached.keys_to_revoke(found, [], tmp_path) == []


INV = parse(
    "ssh: {user: ann, key: /home/ann/.ssh/id_ed25519, known_hosts: /home/ann/.ssh/known_hosts,\n"
    "      config: none}\n"
    "job: {output_dir: /data/fabtrain, secret_files: {WANDB_API_KEY: /home/ann/.wandb}}\n"
    "hosts:\n  - {name: gpu1, address: 10.0.0.1, interface: eth0}\n"
    "  - {name: gpu2, address: 10.0.0.2, interface: eth0, ssh: {port: 2222}}\n"
    "controller: {host: gpu2}\n",
    Path("inv.yaml"),
)


def test_the_controller_reaches_every_host_with_the_jobs_key_and_its_copied_files():
    ctl = controllerfiles.controller_inventory(INV)
    for h in ctl.all_hosts:
        assert h.ssh.keys == ("/ctl/key",) and h.ssh.keys_only and h.ssh.known_hosts == ("/ctl/known_hosts",)
        assert h.ssh.global_known_hosts == () and h.ssh.jump == ()
    assert [(h.ssh.hostname, h.ssh.port, h.ssh.user) for h in ctl.hosts] == [
        ("10.0.0.1", 22, "ann"),
        ("10.0.0.2", 2222, "ann"),
    ]
    assert ctl.job.secret_files == (("WANDB_API_KEY", "/ctl/secrets/WANDB_API_KEY"),)


def test_the_controller_runs_on_the_named_host_as_the_users_uid_without_capabilities():
    p = detached.place(INV, JOB)
    assert (p.host.name, p.dir, p.container) == (
        "gpu2",
        f"/data/fabtrain/.controllers/{JOB}",
        f"fabtrain-ctl-{JOB}",
    )
    script = submit.start_script(p, "fabtrain/controller:latest", "ann@ws")
    passwd, run = script.split(" && ", 1)
    assert run.startswith('docker run -d --rm --user "$(id -u):$(id -g)" ')
    run, waits = run.split(" >/dev/null && ", 1)
    assert waits.startswith(
        f"i=0; while [ ! -e {p.dir}/started ]; do if ! docker inspect fabtrain-ctl-{JOB} "
    )
    argv = shlex.split(run.split('"$(id -u):$(id -g)" ', 1)[1])
    assert argv == [
        "--name",
        f"fabtrain-ctl-{JOB}",
        "--label",
        f"fabtrain.controller={JOB}",
        "--label",
        "fabtrain.owner=ann@ws",
        "--network",
        "host",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "-v",
        f"{p.dir}:/ctl",
        "-v",
        f"{p.dir}/passwd:/etc/passwd:ro",
        "-e",
        "PYTHONPATH=/ctl/fabtrain",
        "-e",
        "HOME=/ctl",
        "-w",
        "/ctl",
        "fabtrain/controller:latest",
        "sh",
        "-c",
        "exec python3 -m orchestrator.backends.ssh.controller /ctl >> /ctl/controller.log 2>&1",
    ]
    assert "--privileged" not in script and passwd.endswith(f"> {p.dir}/passwd")
    assert (
        detached.place(
            INV.__class__(**{**INV.__dict__, "controller": INV.controller.__class__()}), JOB
        ).host.name
        == "gpu2"
    )  # the default: the last host (no spare here)
    standby = shlex.split(
        submit.start_script(p, "fabtrain/controller:latest", "ann@ws", standby=True)
        .split('"$(id -u):$(id -g)" ', 1)[1]
        .split(" >/dev/null && ", 1)[0]
    )
    assert standby[:-1] == argv[:-1] and standby[-1] == (
        "exec python3 -m orchestrator.backends.ssh.controller /ctl --standby >> /ctl/controller.log 2>&1"
    )


def test_a_controller_that_exits_at_once_is_named_with_its_log_and_one_that_started_is_not(tmp_path):
    """start_script, run by a real shell with a `docker` that starts nothing: the controller's
    container is gone at once, so the script fails with the end of its log on stderr; once the
    controller wrote `started`, the same script succeeds."""
    import subprocess
    from dataclasses import replace

    p = replace(detached.place(INV, JOB), dir=str(tmp_path / "ctl"))
    (tmp_path / "ctl").mkdir()
    (tmp_path / "ctl" / "controller.log").write_text("Traceback ...\nFileNotFoundError: docker/x.py\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # run: started; inspect: no such container
    (bin_ / "docker").write_text('#!/bin/sh\n[ "$1" = run ] && exit 0\nexit 1\n')
    (bin_ / "docker").chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin"}
    script = submit.start_script(p, "fabtrain/controller:latest", "ann@ws")
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 1 and r.stderr == (
        "it exited at once; the end of its log:\nTraceback ...\nFileNotFoundError: docker/x.py\n"
    ), r.stderr
    (tmp_path / "ctl" / "started").touch()
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr


def test_the_controller_image_has_every_runtime_library_a_controller_imports():
    """A detached job's controller runs the orchestrator in fabtrain/controller, whose libraries
    build-controller.sh lists by hand: each runtime dependency of pyproject.toml is there but the
    two only this machine uses (docker: the local cluster; matplotlib: curves drawn here). pathspec,
    new and missing there, stopped every controller at its first import."""
    import re
    import tomllib

    root = Path(__file__).resolve().parents[2]
    script = (root / "docker" / "build-controller.sh").read_text()
    libs = set(re.search(r'^LIBS="([^"]+)"', script, re.M).group(1).split())
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    assert names - {"docker", "matplotlib"} <= libs, sorted(names - {"docker", "matplotlib"} - libs)


# ---------------------------------------------------------------- this machine after a detached job's end

PUBLIC = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFtPTYnYmOPCTMbyHOfaa6Rgq4C4HyQk0u1A4mVZ9xAA " + keys.marker(
    JOB
)
USER_LINE = b"ssh-ed25519 AAAAuser ann@ws"


class HostsHere:
    """A Session whose hosts are this machine: a command runs by `sh -c` with that host's HOME and
    docker stubbed; rsync from a host copies the local folder it names (its --exclude=/NAME left
    out). A host in `down` raises as one that does not answer, `down[name]` more times."""

    def __init__(self, inv, tmp: Path, down: dict[str, int] | None = None):
        self.hosts, self.tmp, self.down = inv.all_hosts, tmp, dict(down or {})
        self.ran: list[tuple[str, str]] = []
        self.copies: list[list[str]] = []
        stub = tmp / "bin"
        stub.mkdir(exist_ok=True)
        (stub / "docker").write_text("#!/bin/sh\nexit 0\n")
        (stub / "docker").chmod(0o755)

    def home(self, name: str) -> Path:
        return self.tmp / "homes" / name

    def run(self, host, command, timeout=60, stdin=None, what=""):
        self.ran.append((host.name, command))
        if self.down.get(host.name, 0) > 0:
            self.down[host.name] -= 1
            raise OSError("No route to host")
        env = {
            **os.environ,
            "HOME": str(self.home(host.name)),
            "PATH": f"{self.tmp / 'bin'}:{os.environ['PATH']}",
        }
        r = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)
        return Result(r.stdout, r.stderr, r.returncode, 0.01)

    def fan_out(self, fn, hosts=None):
        out = PerHost()
        for h in self.hosts if hosts is None else hosts:
            try:
                out[h.name] = fn(h)
            except Exception as exc:  # noqa: BLE001 - as Session.fan_out
                out[h.name] = exc
        return out

    def local(self, argv, timeout, on_output=None):
        self.copies.append(argv)
        source, dest = Path(argv[-2].split(":", 1)[1]), Path(argv[-1])
        skip = {a.split("=", 1)[1].strip("/") for a in argv if a.startswith("--exclude=/")}
        for path in source.rglob("*"):
            rel = path.relative_to(source)
            if str(rel) in skip or path.is_dir():
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest / rel)
        return Result("", "", 0, 0.01)


def two_hosts(tmp_path):
    return parse(
        f"job: {{output_dir: {tmp_path}/host/out}}\nhosts:\n"
        "  - {name: gpu1, address: 10.0.0.1, interface: eth0}\n"
        "  - {name: gpu2, address: 10.0.0.2, interface: eth0}\n"
        "controller: {host: gpu1}\n",
        Path("inv.yaml"),
    )


def detached_here(tmp_path, host_doc, down=None):
    """A detached job that ended: this machine's record, the controller's directory with its end
    and `host_doc` as its copy of the record (bytes as they are, or a dict), and its key on both
    hosts' authorized_keys (after a user's line with no final newline)."""
    inv = two_hosts(tmp_path)
    p = detached.place(inv, JOB)
    runs = tmp_path / "runs"
    (runs / JOB).mkdir(parents=True)
    rec = JobRecord(
        spec=JobSpec(job_id=JOB, script="train.py", code="/home/ann/proj"),
        inventory="/home/ann/inv.yaml",
        notify=Notify(command="mail -s done ann@example.com"),
        controller=Controller.at(p.record(), keys=["gpu1", "gpu2"]),
    )
    rec.save(runs / JOB)
    rec = JobRecord.load(runs, JOB)  # as the commands have it: read from the file
    ctl_runs = Path(p.dir) / "runs" / JOB
    ctl_runs.mkdir(parents=True)
    (Path(p.dir) / detached.DONE).write_text(json.dumps({"state": "finished", "error": "", "closing": ""}))
    (ctl_runs / "gpu1.log").write_text("step 1\n")
    if isinstance(host_doc, dict):
        (ctl_runs / "job.json").write_text(json.dumps(host_doc))
    elif host_doc is not None:
        (ctl_runs / "job.json").write_bytes(host_doc)
    session = HostsHere(inv, tmp_path)
    for h in inv.all_hosts:
        (session.home(h.name) / ".ssh").mkdir(parents=True)
        (session.home(h.name) / ".ssh" / "authorized_keys").write_bytes(USER_LINE)
        assert session.run(h, keys.authorize_script(JOB, PUBLIC, ["10.0.0.1"], 600)).exited == 0
    session.down, session.ran = dict(down or {}), []
    return inv, p, runs, rec, session


def hostile_copy(rec: JobRecord, **changes) -> dict:
    doc = rec.to_dict()
    doc.update(
        state="finished",
        inventory="/tmp/evil.yaml",
        notify={"command": "touch /tmp/pwned"},
        attempts=[
            {
                "number": 1,
                "hosts": ["gpu1", "gpu2"],
                "started": 10.0,
                "ended": 20.0,
                "outcome": "ok",
                "resumed_from": None,
            }
        ],
    )
    doc["spec"] = {**doc["spec"], "code": "/ctl/code", "image": "evil/img"}
    doc.update(changes)
    return doc


def test_a_detached_jobs_end_is_fetched_its_record_taken_as_data_and_its_key_taken_back(tmp_path):
    inv, p, runs, rec, session = detached_here(tmp_path, None)
    (Path(p.dir) / "runs" / JOB / "job.json").write_text(json.dumps(hostile_copy(rec)))
    end = detached.fetch(session, [p], rec, runs)
    assert end == {"state": "finished", "error": "", "closing": "", "keys_left": {}}
    got = JobRecord.load(runs, JOB)
    fetched_at = got.controller.fetched
    assert got.controller.ended_on == "gpu1"
    assert isinstance(fetched_at, float)
    ended = replace(Controller.at(p.record()), fetched=fetched_at, ended_on="gpu1")  # no key left
    assert got == replace(
        rec, state="finished", controller=ended, attempts=[Attempt(1, ["gpu1", "gpu2"], 10.0, 20.0, "ok")]
    )
    assert (runs / JOB / "gpu1.log").read_text() == "step 1\n"  # the rest of the run came as it was
    assert [a for a in session.copies[0] if a.startswith("--exclude")] == [
        "--exclude=/job.json",
        "--exclude=/.job.json.tmp",
    ]
    assert not Path(p.dir).exists()
    for h in inv.all_hosts:  # the user's line kept (with the newline it lacked), the controller's gone
        assert (session.home(h.name) / ".ssh" / "authorized_keys").read_bytes() == USER_LINE + b"\n"


@pytest.mark.parametrize(
    "copy, why",
    [
        (
            lambda rec: hostile_copy(rec, attempts=[{"number": 1, "hosts": ["evil"], "started": 1.0}]),
            "attempt 1 names host\\(s\\) 'evil' that this machine's inventory and record do not",
        ),
        (
            lambda rec: b'{"state": "finished", "notify": {"command": "touch /tmp/x"}',
            "Expecting ',' delimiter",
        ),
        (lambda rec: b" " * (runcopy.RECORD_MAX + 1), f"it is larger than {runcopy.RECORD_MAX} bytes"),
        ("link", "it is not a plain file"),
    ],
)
def test_a_host_copy_of_the_record_failing_its_checks_is_refused_and_this_machines_kept(tmp_path, copy, why):
    inv, p, runs, rec, session = detached_here(tmp_path, None)
    host_file = Path(p.dir) / "runs" / JOB / "job.json"
    if copy == "link":
        host_file.symlink_to(tmp_path / "elsewhere.json")
    else:
        doc = copy(rec)
        host_file.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    with pytest.raises(runcopy.HostRecordRefused) as refused:
        detached.fetch(session, [p], rec, runs)
    assert str(refused.value).startswith(
        f"gpu1:{p.dir}/runs/{JOB}/job.json: the controller's copy of job {JOB}'s record was refused: "
    )
    assert f"This machine's record (runs/{JOB}/job.json) is kept" in str(refused.value)
    assert re.search(why, str(refused.value)), str(refused.value)
    got = JobRecord.load(runs, JOB)
    fetched_at = got.controller.fetched
    assert got.controller.ended_on == "gpu1"
    # This machine's record, its state from the controller's end; the run fetched; the key gone all the same.
    ended = replace(Controller.at(p.record()), fetched=fetched_at, ended_on="gpu1")  # no key left
    assert got == replace(rec, state="finished", controller=ended)
    assert (runs / JOB / "gpu1.log").is_file() and not Path(p.dir).exists()
    for h in inv.all_hosts:
        left = (session.home(h.name) / ".ssh" / "authorized_keys").read_bytes()
        assert left == USER_LINE + b"\n"


def test_a_controller_that_ended_before_its_job_began_leaves_this_machines_record(tmp_path):
    inv, p, runs, rec, session = detached_here(tmp_path, None)
    (Path(p.dir) / detached.DONE).write_text(json.dumps({"state": "pwned", "error": "no", "closing": ""}))
    end = detached.fetch(session, [p], rec, runs)
    assert end["state"] == "failed"  # a state none of ours is not taken
    got = JobRecord.load(runs, JOB)
    assert got.state == "failed" and got.notify == rec.notify and got.attempts == []


def test_a_key_a_host_kept_is_named_and_taken_back_once_it_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(detached.time, "sleep", lambda s: None)
    inv, p, runs, rec, session = detached_here(tmp_path, None, down={"gpu2": 3})
    end = detached.fetch(session, [p], rec, runs)
    assert list(end["keys_left"]) == ["gpu2"] and "No route to host" in end["keys_left"]["gpu2"]
    assert [n for n, c in session.ran if n == "gpu2"] == ["gpu2"] * 3  # tried 3 times
    assert JobRecord.load(runs, JOB).controller.keys == ("gpu2",)
    line = detached.keys_line(JOB, end["keys_left"])
    assert line.startswith(
        f"{JOB}: its controller's key may still be in ~/.ssh/authorized_keys on gpu2 (gpu2 "
    )
    assert f"'fab status' tries again, as does 'fab stop --job {JOB}'" in line
    answering = PerHost(gpu1=HostJobs({}, frozenset(), {}), gpu2=HostJobs({}, frozenset(), {}))
    # fab status while gpu2 is still away: named, not tried (the survey saw it gone).
    lost = PerHost(gpu1=answering["gpu1"], gpu2=OSError("No route to host"))
    lines = detachedview.status_lines(session, inv, runs, lost)
    assert lines == [detached.keys_line(JOB, {"gpu2": "gpu2 does not answer"})]
    assert JobRecord.load(runs, JOB).controller.keys == ("gpu2",)
    assert keys.marker(JOB).encode() in (session.home("gpu2") / ".ssh" / "authorized_keys").read_bytes()
    # ... and once it answers, taken back.
    assert detachedview.status_lines(session, inv, runs, answering) == [
        f"{JOB}: its controller's key is now removed from gpu2"
    ]
    assert JobRecord.load(runs, JOB).controller.keys == ()
    assert (session.home("gpu2") / ".ssh" / "authorized_keys").read_bytes() == USER_LINE + b"\n"
    assert detachedview.status_lines(session, inv, runs, answering) == []


def test_a_removal_is_tried_again_where_it_failed_and_only_there(tmp_path, monkeypatch):
    naps = []
    monkeypatch.setattr(detached.time, "sleep", naps.append)
    inv, p, runs, rec, session = detached_here(tmp_path, None, down={"gpu2": 1})
    assert detached.revoke_on(session, inv.all_hosts, [JOB]) == {}
    assert [n for n, _ in session.ran] == ["gpu1", "gpu2", "gpu2"] and naps == [detached.REVOKE_PAUSE]


def test_a_host_whose_deadline_passed_is_not_tried_again(tmp_path, monkeypatch):
    """A frozen host: its connection or command timed out once; another try would only wait as long
    again (a fab logs of a job whose first controller's host froze waited 3 deadlines for it)."""
    naps = []
    monkeypatch.setattr(detached.time, "sleep", naps.append)
    inv, p, runs, rec, session = detached_here(tmp_path, None)
    frozen, run = inv.all_hosts[1], session.run

    def banner_timeout():  # what paramiko raises for a host that accepts TCP and never answers
        try:
            raise TimeoutError()
        except TimeoutError as exc:
            raise paramiko.SSHException(f"Error reading SSH protocol banner{exc}")  # noqa: B904 - as paramiko

    for exc in (CommandTimedOut(frozen, "removing the controller's key", 20), banner_timeout):
        session.ran.clear()

        def stuck(host, command, timeout=60, stdin=None, what="", exc=exc):
            if host.name != frozen.name:
                return run(host, command, timeout, stdin, what)
            session.ran.append((host.name, command))
            if callable(exc):
                exc()
            raise exc

        monkeypatch.setattr(session, "run", stuck)
        left = detached.revoke_on(session, inv.all_hosts, [JOB])
        assert list(left) == [frozen.name] and [n for n, _ in session.ran] == ["gpu1", "gpu2"]
        monkeypatch.setattr(session, "run", run)
    assert naps == []


def test_a_mount_that_would_show_the_controllers_directory_to_the_job_is_refused():
    base = (
        "ssh: {config: none}\njob: {output_dir: /data/fabtrain}\nhosts:\n  - {name: gpu1, address: h, "
        "interface: eth0, mounts: [%s]}\n"
    )
    for ok in ("'/data/corpus:/corpus:ro'", "'/data/fab:/fab'", "'/data/fabtrain/other:/x'"):
        submit.refuse_exposing_mounts(detached.place(parse(base % ok, Path("i.yaml")), JOB))
    for bad in ("'/data:/data'", "'/:/host:ro'", "'/data/fabtrain/:/o'", "'/data/fabtrain/.controllers:/c'"):
        with pytest.raises(
            UserError,
            match=f"gpu1's mount {bad.strip(chr(39)).rsplit(':', 2)[0]}.*holds "
            f"/data/fabtrain/.controllers/{JOB}, where the controller keeps",
        ):
            submit.refuse_exposing_mounts(detached.place(parse(base % bad, Path("i.yaml")), JOB))


def test_the_first_visit_leaves_the_output_dir_it_makes_open_to_every_account(tmp_path):
    """The key's line (written under umask 077) and the controller's directory share one command on
    a host where output_dir does not exist yet: that umask ends with the key's script, so the
    output_dir and its parents are made as the login's umask (022) makes them, not 0700 (other
    accounts, and root-made job directories read by non-root users, could not enter them)."""
    inv = two_hosts(tmp_path)
    pl = placement(inv, JOB)
    session = HostsHere(inv, tmp_path)
    stage = tmp_path / "stage"
    stage.mkdir()
    launch = Launch(inv, JobSpec(job_id=JOB, script="train.py"), Policy(), None, tmp_path / "runs", Console())
    old = os.umask(0o022)
    try:
        assert submit.authorize(session, pl, [pl.active], stage, launch, PUBLIC, 600, 60) == {}
    finally:
        os.umask(old)
    out = tmp_path / "host" / "out"
    assert [oct(d.stat().st_mode & 0o777) for d in (out.parent, out)] == ["0o755", "0o755"]
    assert oct(Path(pl.active.dir).stat().st_mode & 0o777) == "0o700"
    assert keys.marker(JOB).encode() in (session.home("gpu1") / ".ssh" / "authorized_keys").read_bytes()


def test_the_key_works_only_from_the_controllers_host(tmp_path):
    inv = two_hosts(tmp_path)
    p = detached.place(inv, JOB)

    class Answers(HostsHere):
        def run(self, host, command, timeout=60, stdin=None, what=""):
            self.ran.append((host.name, command))
            return Result(
                "2: eth0 inet 10.0.0.1/24 brd 10.0.0.255\n1: lo inet 127.0.0.1/8\n@@resolved\n"
                "10.0.0.1 STREAM gpu1\n",
                "",
                0,
                0.01,
            )

    session = Answers(inv, tmp_path)
    assert submit.controller_sources(session, [p], inv) == {"gpu1": ["10.0.0.1"], "gpu2": ["10.0.0.1"]}
    assert session.ran == [("gpu1", keys.addresses_script("10.0.0.1"))]


def test_the_controller_writes_its_line_again_and_adds_none_where_it_was_taken(tmp_path, monkeypatch):
    inv, p, runs, rec, session = detached_here(tmp_path, None)

    class Own(HostsHere):  # the controller's Session over the same homes
        def __init__(self, hosts):
            self.hosts, self.tmp, self.down, self.ran = tuple(hosts), tmp_path, {}, []

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(controller, "Session", Own)
    before = (session.home("gpu1") / ".ssh" / "authorized_keys").read_bytes()
    assert session.run(inv.hosts[1], keys.revoke_script([JOB])).exited == 0  # fab stop took gpu2's
    renewal = controller.Renewal(
        inv,
        JOB,
        {
            "public": PUBLIC,
            "from": {"gpu1": ["10.0.0.1", "127.0.0.0/8"], "gpu2": ["10.0.0.1"]},
            "lifetime": 7200,
            "renew": 1200,
        },
    )
    failed = renewal.once()
    assert list(failed) == ["gpu2"] and f"(exit {keys.GONE})" in failed["gpu2"]
    after = (session.home("gpu1") / ".ssh" / "authorized_keys").read_bytes()
    assert after != before and after.startswith(USER_LINE + b'\nrestrict,from="10.0.0.1,127.0.0.0/8"')
    assert keys.marker(JOB).encode() not in (session.home("gpu2") / ".ssh" / "authorized_keys").read_bytes()
    renewal.stop()  # never started: stops at once
