"""Progress bars and transfer events: rsync's and docker's progress read as hostile text."""

import io
import json

from rich.console import Console

from orchestrator.core import events
from orchestrator.progress import bars


def test_progress2_lines_give_bytes_done():
    line = b"     20,000,004 100%   95.24MB/s    0:00:00 (xfr#3, to-chk=0/7)"
    assert bars.parse_progress2(line) == 20_000_004
    assert bars.parse_progress2(b"              2   0%    0.00kB/s    0:00:00") == 2
    assert bars.parse_progress2(b"  1.234.567  45%  1,2MB/s") == 1_234_567  # another locale's separator
    assert bars.parse_progress2(b"  1'234'567  45%") == 1_234_567


def test_progress2_hostile_input_is_bounded_and_never_raises():
    for line in (
        b"",
        b"sending incremental file list",
        b"%%%",
        b"\x1b[2J 12 34%",
        b"9" * 100000 + b" 1%",
        b" 12abc 5%",
        "é 3%".encode(),
        b"\xff\xfe 1 2%",
        b"  99999999999999999999999999 100%",
    ):
        got = bars.parse_progress2(line)
        assert got is None or 0 <= got <= bars.MAX_BYTES
    assert bars.parse_progress2(b"  99999999999999999999999 100%") == bars.MAX_BYTES


def test_lines_split_at_cr_and_keep_a_bounded_tail():
    seen = []
    cut = bars.Lines(seen.append)
    cut.feed(b"\r  1 0%\r  2")
    cut.feed(b"0 1%\r")
    assert seen == [b"", b"  1 0%", b"  20 1%"]
    cut.feed(b"x" * 10_000_000)  # no end of line: memory stays bounded
    assert len(cut.tail) == bars.LINE_KEEP


def test_build_steps():
    assert bars.parse_build_step(b"Step 3/7 : RUN pip install -r /ctx/requirements.txt\n") == (
        3,
        7,
        "RUN pip install -r /ctx/requirements.txt",
    )
    assert bars.parse_build_step(b"Step 9/7 : \x1b]52;c;evil\x07COPY") == (7, 7, "]52;c;evilCOPY")
    assert bars.parse_build_step(b"Step 1/0 : FROM x") is None
    assert bars.parse_build_step(b" ---> Running in 1234") is None


def test_a_transfer_becomes_bounded_events_and_completes_on_success():
    got = []
    t = bars.Transfers(emit=lambda e, **f: got.append((e, f))).start("node1", "code sync", 1000)
    t.output(b"\r     500  50%  1MB/s 0:00:01\r  5,000,000 100% 1MB/s 0:00:01")  # the second: no end yet
    t.output(b"\r")
    t.finish(True)
    assert got == [
        ("transfer", {"host": "node1", "what": "code sync", "bytes_done": 500, "bytes_total": 1000}),
        ("transfer", {"host": "node1", "what": "code sync", "bytes_done": 1000, "bytes_total": 1000}),
    ]
    assert bars.transfer_fields("h", "w", -5, -1) == {
        "host": "h",
        "what": "w",
        "bytes_done": 0,
        "bytes_total": 0,
    }


def test_no_bar_when_the_output_is_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with bars.bar(console) as progress:
        t = bars.Transfers(progress).start("node1", "code sync", 100)
        t.update(50)
        t.finish(True)
    assert progress.disable and out.getvalue() == ""
    shown = io.StringIO()
    with bars.bar(Console(file=shown, force_terminal=True, width=100)) as progress:
        t = bars.Transfers(progress).start("node1", "code sync", 100)
        t.update(50)
        progress.refresh()
    assert "code sync node1" in shown.getvalue()


def test_transfer_events_are_throttled_per_host_and_what_and_the_last_is_never_held():
    now = [0.0]
    th = events.Throttle(clock=lambda: now[0])
    f = bars.transfer_fields
    assert len(th.take("transfer", f("a", "code sync", 1, 10))) == 1
    assert th.take("transfer", f("a", "code sync", 2, 10)) == []  # too soon: held
    assert len(th.take("transfer", f("b", "code sync", 1, 10))) == 1  # another host
    assert len(th.take("transfer", f("a", "snapshot push", 1, 10))) == 1  # another copy
    done = th.take("transfer", f("a", "code sync", 10, 10))  # complete: at once, the held one dropped
    assert [x[2]["bytes_done"] for x in done] == [10]
    assert th.take("transfer", f("a", "code sync", 3, 10)) == []
    assert [x[0] for x in th.take("note", {"text": "x"})] == ["transfer", "note"]  # held let out first


def test_json_lines_write_transfer_events():
    out = io.StringIO()
    events.JsonLines(out).emit("transfer", job="j", **bars.transfer_fields("a", "code sync", 5, 10))
    got = json.loads(out.getvalue())
    assert {k: got[k] for k in ("event", "job", "host", "what", "bytes_done", "bytes_total")} == {
        "event": "transfer",
        "job": "j",
        "host": "a",
        "what": "code sync",
        "bytes_done": 5,
        "bytes_total": 10,
    }
    assert "transfer" in events.KINDS


class FakeSession:
    """Session's fan-out and local(): rsync's progress handed to on_output as a real run would."""

    def __init__(self):
        self.calls = []

    def local(self, argv, timeout, on_output=None):
        from orchestrator.transport.remote import Result

        self.calls.append((argv[-1], on_output is not None))
        if on_output is not None:
            on_output(b"\r         40  40%   1kB/s 0:00:00\r")
        return Result("", "", 0, 0.01)

    def fan_out(self, fn, hosts):
        from orchestrator.transport.remote import PerHost

        out = PerHost()
        for h in hosts:
            out[h.name] = fn(h)
        return out


def test_a_jobs_code_sync_becomes_transfer_events_and_a_note(tmp_path):
    from types import SimpleNamespace

    from orchestrator.backends.ssh import gate, steps
    from orchestrator.backends.ssh.planstep import Step
    from orchestrator.core import jobspec

    code = tmp_path / "proj"
    (code / "data").mkdir(parents=True)
    (code / "main.py").write_bytes(b"m" * 100)
    (code / "data" / "x.bin").write_bytes(b"d" * 5000)
    (code / ".gitignore").write_text("data/\n")
    got, notes = [], []
    job = SimpleNamespace(
        emit=lambda e, **f: got.append((e, f)), note=lambda t, level="info": notes.append(t)
    )
    a = SimpleNamespace(spec=SimpleNamespace(code=str(code), code_only=""), number=1)
    transfer = gate.code_transfers(job, a)
    assert notes == [
        f"code: 2 files, 106 B from {code}",
        "left out by .gitignore/.fabtrainignore: 1 files, 5.0 kB (data/ 5.0 kB)",
    ]
    hosts = [SimpleNamespace(name="node1"), SimpleNamespace(name="node2")]
    plan = [
        Step(jobspec.LOCAL, "sync", "rsync ...", 60, argv=("rsync", f"{h.name}:/c/"), host=h.name)
        for h in hosts
    ]
    session = FakeSession()
    steps.run_steps(session, hosts, plan, transfer)
    assert session.calls == [("node1:/c/", True), ("node2:/c/", True)]
    assert [(f["host"], f["bytes_done"], f["bytes_total"]) for _, f in got] == [
        ("node1", 40, 106),
        ("node1", 106, 106),
        ("node2", 40, 106),
        ("node2", 106, 106),
    ]
    steps.run_steps(session, hosts, plan)  # no watcher: Session.local as before
    assert session.calls[-1] == ("node2:/c/", False)


def test_an_image_build_shows_docker_steps_and_keeps_its_errors(tmp_path):
    from orchestrator.images import images

    class Recorded:
        def __init__(self):
            self.calls = []

        def add_task(self, label, **kw):
            self.calls.append(("add", label))
            return 1

        def update(self, task, **kw):
            self.calls.append(("update", kw["completed"], kw["total"], kw["step"]))

        def remove_task(self, task):
            self.calls.append(("remove",))

    fake = tmp_path / "docker"
    fake.write_text(
        "#!/bin/sh\nprintf 'Step 1/2 : FROM base\\n ---> abc\\nStep 2/2 : RUN pip install x\\n'\n"
        "echo 'no space left on device' >&2\nexit 3\n"
    )
    fake.chmod(0o755)
    progress = Recorded()
    code, err = images.run_build([str(fake)], "build t", progress)
    assert (code, err) == (3, "no space left on device\n")
    assert progress.calls == [
        ("add", "build t"),
        ("update", 0, 2, "FROM base"),
        ("update", 1, 2, "RUN pip install x"),
        ("remove",),
    ]
    assert images.run_build([str(fake)], "build t", None)[0] == 3  # no bar: the same run


def test_snapshot_copies_become_transfer_events_with_the_real_runner(tmp_path):
    from pathlib import Path

    from orchestrator.config.inventory import parse
    from orchestrator.core import jobspec
    from orchestrator.snapshots import store

    inv = parse(
        "ssh: {user: u, key: /k/id, known_hosts: /k/kh}\njob: {output_dir: /out}\nhosts:\n"
        "  - {name: a, address: 10.0.0.1, interface: eth0}\n",
        Path("/i/inv.yaml"),
    )
    fake = tmp_path / "rsync"
    fake.write_text(
        "#!/bin/sh\nprintf '\\r        500  50%%  1MB/s 0:00:01\\r      1,000 100%%'\n"
        "[ \"$1\" = fail ] && { echo 'disk full' >&2; exit 11; }; exit 0\n"
    )
    fake.chmod(0o755)
    got = []
    snaps = store.Snapshots(
        tmp_path / "run",
        inv,
        jobspec.JobSpec(job_id="j-1", script="t.py"),
        keep=1,
        report=print,
        transfers=bars.Transfers(emit=lambda e, **f: got.append(f)),
    )
    snaps._copy([str(fake), "ok"], "a", "snapshot push", 1000)
    assert [(f["what"], f["bytes_done"], f["bytes_total"]) for f in got] == [
        ("snapshot push", 500, 1000),
        ("snapshot push", 1000, 1000),
    ]
    got.clear()
    try:
        snaps._copy([str(fake), "fail"], "a", "snapshot fetch", 4000)
    except store.CopyFailed as exc:
        assert "rsync exited 11: disk full" in str(exc)
    else:
        raise AssertionError("a failed copy must raise")
    assert [f["bytes_done"] for f in got] == [500]  # not completed: the copy failed
    # Without transfers (the tests' stand-ins, a quiet job) the copy is subprocess.run's, as before.
    quiet = store.Snapshots(
        tmp_path / "run2", inv, jobspec.JobSpec(job_id="j-1", script="t.py"), keep=1, report=print
    )
    quiet._copy([str(fake), "ok"], "a", "snapshot push", 1000)
