"""Notifications and events.jsonl (progress/notify.py): which events become which notices, and
delivery to a real command and a real HTTP server on loopback, with retries and deadlines."""

import http.server
import json
import threading
import time

import pytest

from orchestrator.core.errors import UserError
from orchestrator.progress import notify

RESTARTED_JOB = [  # the events of a job whose first attempt failed and whose second finished
    ("stage", {"attempt": 1, "stage": "plan"}),
    ("attempt", {"attempt": 1, "hosts": {"node1": 0, "node2": 1}}),
    ("stage", {"attempt": 1, "stage": "watch"}),
    ("progress", {"attempt": 1, "host": "node1", "step": 3}),
    ("attempt_end", {"attempt": 1, "ok": False, "outcome": "node2 exited with code 137"}),
    ("decision", {"attempt": 1, "next": True, "reason": "restart 1 of 1"}),
    ("attempt", {"attempt": 2, "hosts": {"node1": 0, "node3": 1}}),
    ("stage", {"attempt": 2, "stage": "watch"}),
    ("attempt_end", {"attempt": 2, "ok": True, "outcome": "ok"}),
    ("finished", {"state": "finished", "attempts": 2}),
]


def notices(events, **kw):
    n = notify.Notices("gpt-1", "ann@ws", **kw)
    return [x for x in (n.of(e, f) for e, f in events) if x is not None]


def test_a_restarted_job_notifies_started_attempt_failed_restarted_finished_each_once():
    got = notices(RESTARTED_JOB)
    assert [n["event"] for n in got] == ["started", "attempt_failed", "restarted", "finished"]
    assert got[1]["detail"] == "node2 exited with code 137" and got[1]["attempt"] == 1
    assert got[2]["hosts"] == ["node1", "node3"] and got[3]["attempt"] == 2
    assert all(n["job"] == "gpt-1" and n["owner"] == "ann@ws" for n in got)
    assert set(got[0]) == {"event", "job", "time", "owner", "attempt", "hosts", "detail"}


def test_a_job_taken_over_does_not_say_started_again_and_ends_by_state():
    got = notices([("stage", {"stage": "watch"}), ("finished", {"state": "interrupted"})], started=True)
    assert [(n["event"], n["detail"]) for n in got] == [("restarted", ""), ("stopped", "interrupted")]
    assert [n["event"] for n in notices([("finished", {"state": "failed"})])] == ["failed"]
    assert [n["event"] for n in notices([("hang", {"ranks": ["rank 0 on node1: x.py:3"]})])] == ["hung"]


def test_payload_text_is_sanitized_and_secrets_masked():
    got = notices(
        [("attempt_end", {"ok": False, "outcome": "token hunter2-xyz \x1b]52;c;AAAA\x07 leaked"})],
        secrets=("hunter2-xyz", "ab"),
    )
    assert "\x1b" not in got[0]["detail"] and "hunter2" not in got[0]["detail"] and "***" in got[0]["detail"]


class Hook(http.server.BaseHTTPRequestHandler):
    got: list = []
    fail_first = 0

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if Hook.fail_first > 0:
            Hook.fail_first -= 1
            self.send_response(503)
        else:
            Hook.got.append((self.headers["Content-Type"], json.loads(body)))
            self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Hook.got, Hook.fail_first = [], 0
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/hook/secret-path"
    srv.shutdown()


def test_command_and_url_hooks_get_every_notice_in_order_with_retries(tmp_path, server):
    out = tmp_path / "got.jsonl"
    warnings = []
    Hook.fail_first = 1  # the first POST answered 503: tried again
    n = notify.Notifier(
        notify.Notices("gpt-1", "ann@ws"),
        f"cat >> {out}; echo >> {out}",
        server,
        warnings.append,
        backoff=0.01,
    )
    for event, fields in RESTARTED_JOB:
        n.emit(event, **fields)
    n.close()
    by_command = [json.loads(line)["event"] for line in out.read_text().splitlines()]
    assert by_command == ["started", "attempt_failed", "restarted", "finished"]
    assert [(t, b["event"]) for t, b in Hook.got] == [("application/json", e) for e in by_command]
    assert warnings == []


def test_a_failing_or_hanging_hook_warns_once_and_never_holds_the_job(tmp_path, monkeypatch):
    monkeypatch.setattr(notify, "NOTIFY_TIMEOUT", 0.3)
    warnings = []
    n = notify.Notifier(
        notify.Notices("j", "o"), "exit 3", "http://127.0.0.1:9/x", warnings.append, backoff=0.01
    )
    start = time.monotonic()
    for event, fields in RESTARTED_JOB:
        n.emit(event, **fields)  # returns at once: delivery is the notifier's thread's
    assert time.monotonic() - start < 0.2
    n.close()
    assert len(warnings) == 2, warnings
    assert "notification started not delivered by --notify after 3 tries: exit 3" in warnings[0]
    assert "--notify-url http://127.0.0.1:9 after 3 tries" in warnings[1]  # the URL's path is not shown
    assert notify.run_hook("sleep 5", b"{}", timeout=0.3) == "did not end within 0.3s"


def test_urls_other_than_http_are_refused():
    assert notify.check_url("https://hooks.example.com/T/x", "--notify-url")
    for bad in ("file:///etc/passwd", "ftp://x/y", "http://", "hooks.example.com"):
        with pytest.raises(UserError, match="is not an http:// or https:// URL"):
            notify.check_url(bad, "--notify-url")


def test_event_log_keeps_every_event_and_one_progress_a_second_per_host(tmp_path):
    log = notify.EventLog(tmp_path / "job" / notify.EVENTS_FILE)
    for event, fields in RESTARTED_JOB:
        log.emit(event, job="j", **fields)
    log.emit("progress", job="j", host="node1", step=4)  # within the second: dropped
    lines = [json.loads(x) for x in (tmp_path / "job" / notify.EVENTS_FILE).read_text().splitlines()]
    assert [x["event"] for x in lines] == [e for e, _ in RESTARTED_JOB]


def test_every_object_of_the_event_log_carries_its_schema_version_and_readers_take_both(tmp_path):
    """`"v": 1` in every object of events.jsonl and telemetry.jsonl (a reader of a file's tail sees it
    too); the readers (fab metrics, the dashboard) read such a file and one written before `v` alike."""
    from orchestrator.progress import latest

    run = tmp_path / "job"
    log = notify.EventLog(run / notify.EVENTS_FILE, skip=notify.TELEMETRY)
    samples = notify.EventLog(run / notify.TELEMETRY_FILE, only=notify.TELEMETRY)
    ranks = [{"rank": 0, "step": 3, "loss": 2.5, "tokens_per_s": 10.0, "step_ms": None, "compute_ms": None}]
    for event, fields in [
        *RESTARTED_JOB[:3],
        ("progress", {"attempt": 1, "host": "node1", "step": 3, "ranks": ranks}),
        ("telemetry", {"attempt": 1, "host": "node1", "sample": {"vendor": "none"}}),
    ]:
        log.emit(event, job="j", **fields)
        samples.emit(event, job="j", **fields)
    for name in (notify.EVENTS_FILE, notify.TELEMETRY_FILE):
        objects = [json.loads(x) for x in (run / name).read_text().splitlines()]
        assert objects and all(o["v"] == notify.EVENTS_VERSION == 1 for o in objects), objects
    new = latest.latest(run)
    assert new["attempt"] == 1 and new["ranks"] == [{"host": "node1", **ranks[0]}]
    assert new["hosts"] == {"node1": {"time": new["hosts"]["node1"]["time"], "vendor": "none"}}
    for name in (notify.EVENTS_FILE, notify.TELEMETRY_FILE):  # as written before the field
        path = run / name
        path.write_text(
            "".join(
                json.dumps({k: v for k, v in json.loads(x).items() if k != "v"}) + "\n"
                for x in path.read_text().splitlines()
            )
        )
    assert latest.latest(run) == new


def test_a_dry_run_writes_no_event_log(tmp_path):
    from pathlib import Path

    from orchestrator.backends.ssh.job import Job
    from orchestrator.config.inventory import parse
    from orchestrator.core import jobspec
    from orchestrator.core.events import Reporter
    from orchestrator.core.policy import Policy

    inv = parse("hosts:\n  - {name: n1, address: 10.0.0.1, interface: eth0}\n", Path("i.yaml"))
    job = Job(inv, jobspec.JobSpec(job_id="gpt-1", script="x.py"), Policy(), tmp_path / "runs", Reporter())
    job.note("planned")  # what plan() emits on a dry run, before Job.open
    assert not (tmp_path / "runs").exists()
    job.events.enabled = True  # Job.open
    job.note("started")
    assert (tmp_path / "runs" / "gpt-1" / notify.EVENTS_FILE).read_text().count("\n") == 1


def test_progress_is_throttled_but_the_newest_is_never_lost():
    """At most one progress event a second per host; one that came too soon is held and written
    before the next event of another kind (the last step of a short attempt is not dropped)."""
    from orchestrator.core.events import Throttle

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Clock()
    t = Throttle(clock)
    assert [f["step"] for _, _, f in t.take("progress", {"host": "a", "step": 1})] == [1]
    clock.t = 0.3
    assert t.take("progress", {"host": "a", "step": 2}) == []
    assert t.take("progress", {"host": "a", "step": 3}) == []  # replaces step 2
    assert [f["step"] for _, _, f in t.take("progress", {"host": "b", "step": 9})] == [9]  # another host
    out = t.take("stage", {"stage": "teardown"})
    assert [(e, f.get("step")) for e, _, f in out] == [("progress", 3), ("stage", None)]
    clock.t = 1.5
    assert [f["step"] for _, _, f in t.take("progress", {"host": "a", "step": 4})] == [4]
    assert t.take("stage", {"stage": "decide"})[0][0] == "stage"  # nothing held
