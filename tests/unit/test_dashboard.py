"""fab dashboard's pure parts (orchestrator/dashboard/views.py) and its server's rules (server.py):
the JSON the page reads, made from what `fab top` and `fab status` read (exact documents); log tails
as the terminal shows them; job ids from a URL checked and kept inside runs/; GET and HEAD only,
strict headers, a foreign Host refused; on every address but loopback, the token (once in the URL,
then a cookie). Servers here listen on 0.0.0.0 at most and are only ever asked at 127.0.0.1."""

import http.client
import ipaddress
import json
import math
import os
import socket
import threading
from pathlib import Path

import pytest

from orchestrator.config.inventory import parse
from orchestrator.core import recovery
from orchestrator.core.errors import UserError
from orchestrator.core.jobspec import JobSpec
from orchestrator.dashboard import cache, gate, server, views
from orchestrator.progress import top

INV = parse(
    """\
ssh: {user: u, key: /k/id, known_hosts: /k/kh}
job: {image: img:1, code_dir: /opt/code, output_dir: /opt/out}
hosts:
  - {name: cpu1, address: 10.0.0.2, interface: eth0}
  - {name: cpu2, address: 10.0.0.3, interface: eth0}
""",
    Path("/i/inv.yaml"),
)

# cpu1: alice's job holds both slots (rank 0 there, at step 120); bob's job waits in its queue.
CPU1 = """\
alice-1\t0\tfabtrain-alice-1-r0\trunning\tUp 2 minutes\talice@lap\t1
@@runtime
alice-1 3
@@controllers
@@claims
2
alice-1 who=alice@lap since=1795560000 units=0,1
@@queue
bob-2 age=3 who=bob@desk since=1795560100 ticket=01795560100000000000-bob-2 wants=all

@@fabtrain-top steps

@@fabtrain-step alice-1
[rank0] step 120 loss 2.0

@@fabtrain-top telemetry
== containers
== host
1.00 1.00 1.00 1/100 1
MemTotal:       1048576 kB
MemAvailable:   1048576 kB
2
"""
REFUSED = "cpu2 (u@10.0.0.3:22): connection refused; start sshd there or fix ssh.port in the inventory"


def test_the_overview_is_top_snapshot_and_status_rows_of_one_look():
    answers = {"cpu1": top.parse_answer(CPU1), "cpu2": REFUSED}
    local = {"alice-1": {"loss": 1.5, "tokens_per_s": 4000.0, "updated": 999.0}}
    doc = views.overview(INV, answers, 1000.0, {"alice-1": (990.0, 100)}, local)
    json.dumps(doc, allow_nan=False)
    assert list(doc) == ["time", "inventory", "hosts", "jobs", "queue", "errors"]
    snap = top.snapshot(INV, answers, 1000.0, {"alice-1": (990.0, 100)})
    assert doc["hosts"] == snap["hosts"] and doc["errors"] == [REFUSED]
    cpu1, cpu2 = doc["hosts"]
    assert [(s["unit"], s["job"], s["who"]) for s in cpu1["slots"]] == [
        (0, "alice-1", "alice@lap"),
        (1, "alice-1", "alice@lap"),
    ]
    assert cpu2["answered"] is False and cpu2["error"] == REFUSED
    bob, alice = doc["jobs"]  # newest first, as fab status lists them
    assert alice == {
        "job": "alice-1",
        "who": "alice@lap",
        "state": "running",
        "attempt": 1,
        "step": 120,
        "since": 1795560000.0,
        "queue": None,
        "hosts": {"cpu1": {"units": [0, 1], "rank": 0, "container": "running"}},
        "rate": 2.0,
        "loss": 1.5,
        "tokens_per_s": 4000.0,
        "local": True,
    }
    assert bob["job"] == "bob-2" and bob["state"] == "queued (1)" and bob["who"] == "bob@desk"
    assert bob["queue"] == {"position": 1, "hosts": {"cpu1": 1}, "waits": ["cpu1: held by alice-1"]}
    assert (bob["loss"], bob["local"]) == (None, False)
    assert doc["queue"] == [bob]


def test_every_string_is_made_plain_text_and_numbers_json_can_carry():
    evil = "\x1b]52;c;cGF5bG9hZA==\x07<script>x()</script>\x9b31m"
    assert views.clean({evil: [evil, 1.5, math.nan, math.inf, None, True]}) == {
        "]52;c;cGF5bG9hZA==<script>x()</script>31m": [
            "]52;c;cGF5bG9hZA==<script>x()</script>31m",
            1.5,
            None,
            None,
            None,
            True,
        ]
    }
    with pytest.raises(ValueError):
        views.to_json({"x": math.nan})


def test_a_log_tail_as_the_terminal_shows_it():
    data = (
        b"cut part of a line\nstep 1 \x1b[31mred\x1b[0m <script>alert(1)</script>\r\n" + b"x" * 2500 + b"\n"
    )
    assert views.log_lines(data, cut=True) == [
        "step 1 [31mred[0m <script>alert(1)</script>",
        "x" * views.LINE_CHARS + "...[cut]",
    ]
    assert views.log_lines(b"a\nb\nc\n", cut=False, lines=2) == ["b", "c"]
    assert views.log_lines(b"\xff\xfeok\n", cut=False) == ["\ufffd\ufffdok"]


def test_a_tail_reads_only_the_end_and_no_link(tmp_path):
    (tmp_path / "node1.log").write_bytes(b"0123456789")
    assert views.read_tail(tmp_path / "node1.log", 4) == (b"6789", True)
    assert views.read_tail(tmp_path / "node1.log", 40) == (b"0123456789", False)
    (tmp_path / "link.log").symlink_to("/etc/passwd")
    assert views.read_tail(tmp_path / "link.log", 40) == (b"", False)
    assert views.read_head(tmp_path / "link.log", 40) == (b"", False)
    assert views.read_head(tmp_path / "node1.log", 4) == (b"0123", True)


def progress(step, ranks, attempt=1):
    return {
        "event": "progress",
        "time": 100.0 + step,
        "attempt": attempt,
        "host": "node1",
        "step": step,
        "ranks": ranks,
    }


def test_curves_loss_of_the_lowest_rank_tokens_of_all_ranks_newest_attempt_wins():
    records = [
        progress(
            10,
            [
                {"rank": 0, "step": 10, "loss": 3.0, "tokens_per_s": 100.0},
                {"rank": 1, "step": 10, "loss": 3.1, "tokens_per_s": 110.0},
            ],
        ),
        progress(20, [{"rank": 1, "step": 20, "loss": 2.9, "tokens_per_s": 120.0}]),
        # a resumed attempt logs step 20 again: its figures replace the first attempt's
        progress(20, [{"rank": 0, "step": 20, "loss": 2.5, "tokens_per_s": 90.0}], attempt=2),
        # what a container printed is hostile: no rank, a float step, NaN loss, a bool rank
        progress(
            30,
            [
                {"rank": "0", "step": 30, "loss": 1.0},
                {"rank": 0, "step": 30.5, "loss": 1.0},
                {"rank": 0, "step": 30, "loss": math.nan, "tokens_per_s": math.inf},
                {"rank": True, "step": 40, "loss": 0.1},
                "junk",
            ],
        ),
        {"event": "telemetry", "time": 1.0},
    ]
    assert views.curves(records) == {
        "loss": [[10, 3.0], [20, 2.5]],
        "tokens_per_s": [[10, 210.0], [20, 210.0]],
    }


def test_figures_newest_loss_of_the_lowest_rank_and_the_ranks_tokens_together():
    doc = {
        "updated": 5.0,
        "ranks": [
            {"rank": 1, "loss": 2.0, "tokens_per_s": 10.0},
            {"rank": 0, "loss": 1.0, "tokens_per_s": 30.0},
        ],
    }
    assert views.figures(doc) == {"loss": 1.0, "tokens_per_s": 40.0, "updated": 5.0}
    assert views.figures({"ranks": []}) == {"loss": None, "tokens_per_s": None, "updated": None}


@pytest.mark.parametrize("job", ["..", "../etc", "a/b", "", ".hidden", "x" * 300, "a\nb", "%2e%2e"])
def test_a_job_id_from_a_url_is_a_job_id_inside_runs(tmp_path, job):
    with pytest.raises(views.NotFound):
        views.run_dir(tmp_path, job)


def test_a_job_id_that_is_not_here_or_leads_out_is_not_found(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "runs" / "gpt-1").mkdir()
    (tmp_path / "runs" / "gpt-2").symlink_to(tmp_path / "elsewhere")
    assert views.run_dir(tmp_path / "runs", "gpt-1") == tmp_path / "runs" / "gpt-1"
    with pytest.raises(views.NotFound, match="leads out"):
        views.run_dir(tmp_path / "runs", "gpt-2")
    with pytest.raises(views.NotFound, match="no run gpt-3"):
        views.run_dir(tmp_path / "runs", "gpt-3")


def job_dir(tmp_path):
    runs = tmp_path / "runs"
    d = runs / "gpt-20261125-010203-abcd"
    d.mkdir(parents=True)
    rec = recovery.JobRecord(
        spec=JobSpec(job_id=d.name, script="trainers/gpt.py", args=("--model", "tiny"), owner="alice@lap"),
        inventory="/i/inv.yaml",
        state="running",
        attempts=[
            recovery.Attempt(1, ["node1", "node2"], 10.0, 20.0, "node2 exited 1: \x1b[2Jboom"),
            recovery.Attempt(2, ["node1", "node3"], 21.0),
        ],
    )
    rec.save(d)
    events = [
        {"event": "attempt", "time": 21.0, "attempt": 2},
        {
            "event": "host_failed",
            "time": 19.0,
            "attempt": 1,
            "host": "node2",
            "kind": "exited",
            "detail": "line one\nline \x1b[31mtwo",
        },
        progress(5, [{"rank": 0, "step": 5, "loss": 2.0, "tokens_per_s": 50.0}], attempt=2),
        progress(6, [{"rank": 0, "step": 6, "loss": 1.9, "tokens_per_s": 55.0}], attempt=2),
    ]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (d / "plan.txt").write_text("attempt 2\n  node1: docker run \x1b[31m...\n")
    (d / "node1.log").write_bytes(b"[node1 rank0] hello\n\x1b]0;pwn\x07<script>x()</script>\n")
    (d / "node3.log").write_bytes(b"")
    (d / "node4.log").symlink_to("/etc/passwd")  # a link is never followed out of the run
    return runs, d.name


def test_a_job_page_from_its_run(tmp_path):
    runs, job = job_dir(tmp_path)
    page = views.job_page(runs, job)
    json.dumps(page, allow_nan=False)
    assert [page[k] for k in ("job", "state", "owner", "script", "args", "record_error")] == [
        job,
        "running",
        "alice@lap",
        "trainers/gpt.py",
        ["--model", "tiny"],
        None,
    ]
    assert page["attempts"] == [
        {
            "number": 1,
            "hosts": ["node1", "node2"],
            "started": 10.0,
            "ended": 20.0,
            "outcome": "node2 exited 1: [2Jboom",
            "resumed_from": None,
        },
        {
            "number": 2,
            "hosts": ["node1", "node3"],
            "started": 21.0,
            "ended": None,
            "outcome": "running",
            "resumed_from": None,
        },
    ]
    assert page["failures"] == [
        {"time": 19.0, "attempt": 1, "host": "node2", "kind": "exited", "detail": "line one | line [31mtwo"}
    ]
    assert page["curves"] == {"loss": [[5, 2.0], [6, 1.9]], "tokens_per_s": [[5, 50.0], [6, 55.0]]}
    assert page["figures"]["loss"] == 1.9 and page["newest"]["attempt"] == 2
    assert "plan" not in page
    assert views.plan_page(runs, job) == {"job": job, "plan": "attempt 2\n  node1: docker run [31m...\n"}
    assert page["logs"] == {"node1": ["[node1 rank0] hello", "]0;pwn<script>x()</script>"], "node3": []}


def test_a_job_page_without_a_readable_record_still_shows_the_run(tmp_path):
    runs, job = job_dir(tmp_path)
    (runs / job / "job.json").write_text("{not json")
    page = views.job_page(runs, job)
    assert page["attempts"] == [] and "not a job record" in page["record_error"]
    assert page["curves"]["loss"] == [[5, 2.0], [6, 1.9]]


# ---------------------------------------------------------------- the server


class StillRefresher:
    """In place of cache.Refresher: a fixed overview, no SSH."""

    def overview(self):
        return {"jobs": [], "hosts": [], "note": "<b>\x1b[31m"}


def serving(srv):
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    return t


@pytest.fixture
def running(tmp_path):
    runs, job = job_dir(tmp_path)
    srv = server.listen(
        "127.0.0.1", 0, StillRefresher(), cache.JobPages(runs), gate.token_for("127.0.0.1", None)
    )
    serving(srv)
    yield srv.server_address[1], job
    srv.shutdown()
    srv.server_close()


def ask(port, method, path, host=None, headers=None):
    """A request to 127.0.0.1:port (the only place these tests send anything), whatever the server
    listens on."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.putrequest(method, path, skip_host=host is not None)
    if host is not None:
        c.putheader("Host", host)
    for k, v in (headers or {}).items():
        c.putheader(k, v)
    c.endheaders()
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, r.headers, body


def test_the_page_and_its_files_with_strict_headers(running):
    port, _ = running
    status, headers, body = ask(port, "GET", "/")
    assert status == 200 and body.startswith(b"<!DOCTYPE html>")
    assert headers["Content-Type"].startswith("text/html")
    assert headers["Content-Security-Policy"].startswith("default-src 'self'; script-src 'self';")
    assert "'unsafe-inline'" not in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff" and headers["Cache-Control"] == "no-store"
    for path, kind in (("/app.js", "text/javascript"), ("/style.css", "text/css")):
        status, headers, body = ask(port, "GET", path)
        assert status == 200 and headers["Content-Type"].startswith(kind) and body
    assert b"innerHTML" not in ask(port, "GET", "/app.js")[2]  # text goes in as textContent only
    assert b"http" not in ask(port, "GET", "/")[2].replace(b"http-equiv", b"")  # nothing from elsewhere


def test_the_json_endpoints(running):
    port, job = running
    status, headers, body = ask(port, "GET", "/api/overview")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"jobs": [], "hosts": [], "note": "<b>\x1b[31m"}
    status, _, body = ask(port, "GET", f"/api/job/{job}")
    assert status == 200 and json.loads(body)["job"] == job
    status, _, body = ask(port, "GET", f"/api/plan/{job}")
    assert status == 200 and json.loads(body)["plan"].startswith("attempt 2")
    assert ask(port, "GET", "/api/plan/..%2Fx")[0] == 404
    status, _, body = ask(port, "GET", "/api/job/..%2F..%2Fetc%2Fpasswd")
    assert status == 404 and json.loads(body) == {"error": "'../../etc/passwd' is not a fabtrain job id"}
    assert ask(port, "GET", "/api/job/gpt-9")[0] == 404
    assert ask(port, "GET", "/etc/passwd")[0] == 404
    status, _, body = ask(port, "HEAD", "/api/overview")
    assert status == 200 and body == b""


def test_only_get_and_head(running):
    port, job = running
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        status, headers, body = ask(port, method, f"/api/job/{job}")
        assert (status, headers["Allow"], body) == (405, "GET, HEAD", b"")


def test_a_host_header_not_this_servers_is_refused(running):
    port, _ = running
    assert ask(port, "GET", "/", host=f"localhost:{port}")[0] == 200
    assert ask(port, "GET", "/", host=f"127.0.0.1:{port}")[0] == 200
    status, _, body = ask(port, "GET", "/api/overview", host=f"attacker.example:{port}")
    assert status == 421 and json.loads(body) == {
        "error": (
            f"Host 'attacker.example:{port}' is not a name of this dashboard: "
            "open it by a name it printed at its start, or start it with --allow-host NAME to answer this one"
        )
    }
    status, headers, body = ask(port, "GET", "/", host="attacker.example")
    assert status == 421 and headers["Content-Type"].startswith("text/plain") and b"--allow-host" in body
    assert ask(port, "GET", "/", host="")[0] == 421


@pytest.fixture
def this_machine(monkeypatch):
    """The machine's names as the socket module gives them, fixed (no name service is asked)."""
    found = {"box.lab.example": ["10.0.0.5", "fe80::5%eth0"], "box": ["10.0.0.5"]}
    real = socket.getaddrinfo

    def getaddrinfo(name, port, *args, **kwargs):
        if name in found:
            return [
                (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0))
                for a in found[name]
            ]
        try:
            ipaddress.ip_address(name)
        except ValueError:
            raise socket.gaierror(-2, "Name or service not known") from None
        return real(name, port, *args, **kwargs)  # an address (the tests' own 127.0.0.1): no lookup

    monkeypatch.setattr(gate.socket, "gethostname", lambda: "Box")
    monkeypatch.setattr(gate.socket, "getfqdn", lambda name="": "box.lab.example")
    monkeypatch.setattr(gate.socket, "getaddrinfo", getaddrinfo)


def test_allowed_hosts(this_machine):
    assert gate.allowed_hosts("10.1.2.3", 8765) == {"10.1.2.3", "10.1.2.3:8765"}
    assert gate.allowed_hosts("127.0.0.1", 8765) == {
        "127.0.0.1",
        "127.0.0.1:8765",
        "localhost",
        "localhost:8765",
        "[::1]",
        "[::1]:8765",
    }
    every = {"box", "box.lab.example", "10.0.0.5", "[fe80::5]", "localhost", "127.0.0.1", "[::1]"}
    assert gate.answered_names("0.0.0.0") == gate.answered_names("::") == every
    assert gate.allowed_hosts("0.0.0.0", 8765) == every | {f"{n}:8765" for n in every}
    assert gate.allowed_hosts("10.1.2.3", 80, ["Dash.Example", "proxy.example:443", "fd00::9"]) == {
        "10.1.2.3",
        "10.1.2.3:80",
        "dash.example",
        "dash.example:80",
        "proxy.example:443",
        "[fd00::9]",
        "[fd00::9]:80",
    }


def test_allow_host_repeated_or_comma_separated_and_only_names():
    assert gate.allow_list(["a.example", "b.example,10.0.0.9:8080", " c , d"]) == (
        "a.example",
        "b.example",
        "10.0.0.9:8080",
        "c",
        "d",
    )
    for bad in ("*", "a/b", "evil.example?x", "a@b"):
        with pytest.raises(UserError, match=r"--allow-host '.*' is not a host name or address; give the"):
            gate.allow_list([bad])


def test_a_token_on_every_address_but_loopback():
    assert gate.token_for("127.0.0.1", None) is None and gate.token_for("::1", None) is None
    made = {gate.token_for(a, None) for a in ("0.0.0.0", "::", "10.1.2.3", "192.168.1.4")}
    assert len(made) == 4 and all(t and len(t) >= 43 and gate.TOKEN_CHARS.fullmatch(t) for t in made)


def test_a_token_file(tmp_path):
    good = tmp_path / "token"
    good.write_text("  s3cret-token_of.24~chars  \nsecond line\n")
    assert gate.token_for("0.0.0.0", str(good)) == "s3cret-token_of.24~chars"
    assert gate.token_for("127.0.0.1", str(good)) == "s3cret-token_of.24~chars"  # asked for: given
    (tmp_path / "empty").write_text("\nsomething\n")
    (tmp_path / "short").write_text("abc\n")
    (tmp_path / "spaces").write_text("a token with spaces in it\n")
    os.mkfifo(tmp_path / "fifo")
    for name, why in (
        ("missing", "no such file; write a token of 16 or more"),
        ("empty", "is empty \\(its first line holds no token\\)"),
        ("short", "its first line is not a token of 16 or more .* \\(it has 3 characters\\)"),
        ("spaces", "its first line is not a token"),
        ("fifo", "is not a regular file"),
        (".", "is not a regular file"),
    ):
        path = tmp_path / name
        with pytest.raises(UserError, match=f"^--token-file {path}:? {why}") as refused:
            gate.token_for("0.0.0.0", str(path))
        assert refused.value.exit_code == 2


GOOD_TOKEN = "right-token-0123456789abcdef"


@pytest.fixture
def everywhere(tmp_path, this_machine):
    """The server on 0.0.0.0 (every address), asking for GOOD_TOKEN, answering one more name."""
    runs, job = job_dir(tmp_path)
    srv = server.listen("0.0.0.0", 0, StillRefresher(), cache.JobPages(runs), GOOD_TOKEN, ["dash.example"])
    serving(srv)
    yield srv, srv.server_address[1], job
    srv.shutdown()
    srv.server_close()


def test_on_every_address_a_foreign_host_is_refused_whatever_it_carries(everywhere):
    _, port, _ = everywhere
    cookie = {"Cookie": f"fabtrain_dashboard_{port}={GOOD_TOKEN}"}
    for host in (
        f"attacker.example:{port}",
        "rebind.attacker.example",
        "10.9.9.9",
        f"box.lab.example.evil:{port}",
    ):
        status, _, body = ask(port, "GET", "/api/overview", host=host, headers=cookie)
        assert status == 421 and "--allow-host NAME" in json.loads(body)["error"], host
    assert ask(port, "GET", f"/?token={GOOD_TOKEN}", host="attacker.example")[0] == 421
    for host in (
        f"box:{port}",
        f"BOX.lab.example:{port}",
        f"10.0.0.5:{port}",
        "[fe80::5]",
        f"localhost:{port}",
        f"[::1]:{port}",
        f"dash.example:{port}",
    ):
        assert ask(port, "GET", "/api/overview", host=host, headers=cookie)[0] == 200, host


def test_on_every_address_a_request_without_the_token_is_refused(everywhere):
    _, port, job = everywhere
    for path in ("/", "/app.js", "/api/overview", f"/api/job/{job}", "/api/runs", "/nothing"):
        status, headers, body = ask(port, "GET", path)
        assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="fabtrain dashboard"', path
        assert b"cookie" in body and b"?token=" in body and "Set-Cookie" not in headers
    status, headers, body = ask(port, "GET", "/")
    assert headers["Content-Type"] == "text/plain; charset=utf-8"
    assert body == (gate.NEEDS_TOKEN + "\n").encode()
    status, headers, body = ask(port, "GET", "/api/overview")
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"error": gate.NEEDS_TOKEN}
    assert ask(port, "HEAD", "/")[0:3:2] == (401, b"")
    for wrong in ("WRONG", "", GOOD_TOKEN[:-1], GOOD_TOKEN + "x", "%C3%A9" * 10):
        status, headers, body = ask(port, "GET", f"/?token={wrong}")
        assert (status, body) == (401, (gate.WRONG_TOKEN + "\n").encode()) and "Set-Cookie" not in headers
    assert ask(port, "GET", f"/?token={GOOD_TOKEN}&token=WRONG")[0] == 401
    for cookie in (
        f"fabtrain_dashboard_{port}=WRONG",
        f"fabtrain_dashboard_1={GOOD_TOKEN}",
        f"fabtrain_dashboard_{port}x={GOOD_TOKEN}",
        f"other={GOOD_TOKEN}",
        "\u00e9=\u00e9",
    ):
        assert ask(port, "GET", "/api/overview", headers={"Cookie": cookie})[0] == 401, cookie
    assert ask(port, "GET", "/api/overview", headers={"Authorization": "Bearer WRONG"})[0] == 401
    assert ask(port, "GET", "/api/overview", headers={"Authorization": f"Basic {GOOD_TOKEN}"})[0] == 401


def test_the_right_token_sets_a_cookie_and_leaves_the_url(everywhere):
    _, port, job = everywhere
    status, headers, body = ask(port, "GET", f"/?token={GOOD_TOKEN}")
    assert status == 303 and headers["Location"] == "/"
    assert headers["Set-Cookie"] == (
        f"fabtrain_dashboard_{port}={GOOD_TOKEN}; Path=/; HttpOnly; SameSite=Strict"
    )
    assert headers["Referrer-Policy"] == "no-referrer" and headers["Cache-Control"] == "no-store"
    assert ask(port, "HEAD", f"/?token={GOOD_TOKEN}")[0] == 303
    # the rest of the query stays; a path of two slashes cannot send the browser to another server
    moved = ask(port, "GET", f"/api/job/{job}?x=1&token={GOOD_TOKEN}&y=%2F")[1]["Location"]
    assert moved == f"/api/job/{job}?x=1&y=%2F"
    assert ask(port, "GET", f"//evil.example/?token={GOOD_TOKEN}")[1]["Location"] == "/evil.example/"
    assert ask(port, "GET", f"/\\evil.example/?token={GOOD_TOKEN}")[1]["Location"] == "/%5Cevil.example/"
    assert ask(port, "GET", f"/%0d%0aX:%20y?token={GOOD_TOKEN}")[1]["Location"] == "/%0d%0aX:%20y"


def test_the_cookie_lets_the_page_and_its_json_through(everywhere):
    _, port, job = everywhere
    _, headers, _ = ask(port, "GET", f"/?token={GOOD_TOKEN}")
    cookie = {"Cookie": headers["Set-Cookie"].split(";")[0]}
    status, headers, body = ask(port, "GET", "/", headers=cookie)
    assert status == 200 and body.startswith(b"<!DOCTYPE html>") and "Set-Cookie" not in headers
    assert ask(port, "GET", "/app.js", headers=cookie)[0] == 200
    status, _, body = ask(port, "GET", "/api/overview", headers=cookie)
    assert status == 200 and json.loads(body)["note"] == "<b>\x1b[31m"
    status, _, body = ask(port, "GET", f"/api/job/{job}", headers=cookie)
    assert status == 200 and json.loads(body)["job"] == job
    assert ask(port, "GET", f"/api/plan/{job}", headers=cookie)[0] == 200
    assert ask(port, "GET", "/api/runs", headers=cookie)[0] == 200
    assert ask(port, "GET", "/api/job/gpt-9", headers=cookie)[0] == 404
    # a browser holding a stale cookie of an earlier start beside this one; a script with the header
    both = {"Cookie": f"theme=dark; fabtrain_dashboard_{port}=OLD; fabtrain_dashboard_{port}={GOOD_TOKEN}"}
    assert ask(port, "GET", "/api/overview", headers=both)[0] == 200
    assert ask(port, "GET", "/api/overview", headers={"Authorization": f"Bearer {GOOD_TOKEN}"})[0] == 200
    assert ask(port, "POST", "/api/overview", headers=cookie)[0] == 405


def test_the_start_message_says_where_whether_a_token_and_the_url(everywhere, tmp_path):
    srv, port, _ = everywhere
    said = server.start_message(srv, "0.0.0.0", None)
    assert said.splitlines() == [
        f"dashboard: http://box.lab.example:{port}/?token={GOOD_TOKEN}",
        f"  listening on 0.0.0.0:{port} (every address of this machine); a token is asked for: open this URL "
        "once (a new token at every start); the browser keeps it in a cookie",
        "  answers the names 10.0.0.5, 127.0.0.1, [::1], [fe80::5], box, box.lab.example, dash.example, "
        "localhost (--allow-host NAME adds one)",
    ]
    said = server.start_message(srv, "0.0.0.0", "/etc/fab/token")
    assert said.startswith(f"dashboard: http://box.lab.example:{port}/\n") and GOOD_TOKEN not in said
    assert (
        f"open http://box.lab.example:{port}/?token=TOKEN once, TOKEN being the first line of /etc/fab/token"
    ) in said
    runs, _ = job_dir(tmp_path / "here")
    local = server.listen("127.0.0.1", 0, StillRefresher(), cache.JobPages(runs))
    try:
        port = local.server_address[1]
        assert server.start_message(local, "127.0.0.1", None).splitlines()[:2] == [
            f"dashboard: http://127.0.0.1:{port}/",
            f"  listening on 127.0.0.1:{port} (this machine only); no token asked (every account on this "
            "machine can read it; --token-file asks)",
        ]
    finally:
        local.server_close()


def test_bad_address_port_refresh_token_file_or_allow_host_are_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"--address 'localhost' is not an IP address; give one such as 127"):
        server.start(INV, tmp_path, "localhost", 8765)
    with pytest.raises(UserError, match=r"--port 70000 is not a TCP port"):
        server.start(INV, tmp_path, "127.0.0.1", 70000)
    with pytest.raises(UserError, match=r"--refresh 0 must be a number of seconds above 0"):
        server.start(INV, tmp_path, "127.0.0.1", 8765, every=0)
    with pytest.raises(UserError, match=r"--token-file .*/none: no such file"):
        server.start(INV, tmp_path, "0.0.0.0", 0, token_file=str(tmp_path / "none"))
    with pytest.raises(UserError, match=r"--allow-host '\*' is not a host name"):
        server.start(INV, tmp_path, "0.0.0.0", 0, allow=["ok.example,*"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=rf"cannot listen on 127.0.0.1:{port}: it is in use .*--port"):
            server.start(INV, tmp_path, "127.0.0.1", port)
