"""Jobs that outlive the terminal, on the local cluster: a job whose `fab train` was killed is taken
over by `fab attach` and goes on (watchdog, restarts, fetch)."""

import json
import re
import time

from .conftest import ROOT, Run, fab, on_host, project_containers
from .test_recovery import GPT, final_state, job_id, run_in_background, wait_for_line

# 10 epochs of the tiny corpus (43 steps each, about 30 s here): long enough to be killed, waited for
# (the lease: fab attach takes over about 16 s after step 20, near step 200) and taken over mid-run.
EPOCHS = 10
LONGER = ["--model", "tiny", "--epochs", str(EPOCHS), "--args", "--snapshot-every 10 --sample-chars 0"]


def test_fab_attach_takes_over_a_job_whose_fab_train_was_killed(inventory_path, tmp_path):
    log = tmp_path / "train.txt"
    proc = run_in_background(inventory_path, log, "train", *LONGER, "--restarts", "1")
    attach = None
    try:
        wait_for_line(log, "| step 20 |")
        proc.kill()  # SIGKILL: no teardown, no fetch; the containers go on with nobody watching
        proc.wait(10)
        job = job_id(log.read_text())
        assert len(project_containers("node1")) == len(project_containers("node2")) == 1
        # Its lease is still fresh: whoever renewed it may be alive, so it is left alone.
        early = fab(inventory_path, "attach", job)
        assert early.returncode == 2 and "is looked after right now" in early.stderr, early.stderr
        wait = float(re.search(r"try again in (\d+)s", early.stderr).group(1))
        time.sleep(wait + 1)
        attach = Run(inventory_path, "attach", job, "--plain")
        attach.wait_for(f"took over job {job}: attempt 1 on node1 (rank 0), node2 (rank 1)")
        attach.wait_for("| step 30 |")  # followed from the start of its output
        assert len(project_containers("node1")) == len(project_containers("node2")) == 1  # no second copy
        on_host("node2", "docker kill $(docker ps -q --filter label=fabtrain.managed=1)")
        assert attach.finish(timeout=300) == 0, attach.text[-3000:]
    finally:
        proc.kill()
        if attach is not None:
            attach.proc.kill()
    out = attach.text
    assert "attempt 1 failed (node2 exited with code 137); restart 1 of 1" in out
    assert re.search(r"attempt 2: starting 2 node\(s\), rank 0 on node1 .*from snapshot snapshot-", out)
    assert f"job {job} finished on every host after 2 attempts" in out
    record = json.loads((ROOT / "runs" / job / "job.json").read_text())
    assert record["state"] == "finished" and [a["number"] for a in record["attempts"]] == [1, 2]
    assert final_state(job)["step"] == EPOCHS * 43
    assert (ROOT / "runs" / job / "outputs" / "node2").is_dir()  # the fetch of the end ran
    assert project_containers("node1") == [] and project_containers("node2") == []


def status_doc(inventory_path) -> dict:
    r = fab(inventory_path, "status", "--json")
    return json.loads(r.stdout)


def test_detached_job_restarts_and_finishes_with_nobody_watching(inventory_path):
    start = time.monotonic()
    r = fab(inventory_path, "train", *GPT, "--restarts", "1", "--detach")
    took = time.monotonic() - start
    assert r.returncode == 0, r.stderr[-3000:]
    job = re.search(r"job (\S+) detached: its controller runs on node2 \(fabtrain-ctl-", r.stdout).group(1)
    print(f"fab train --detach returned in {took:.1f}s")
    try:
        deadline = time.monotonic() + 180
        while True:  # the submitting fab has exited: the job runs on, seen in fab status
            rows = {j["job"]: j for j in status_doc(inventory_path)["jobs"]}
            if ((rows.get(job) or {}).get("step") or 0) >= 15:
                break
            assert time.monotonic() < deadline, f"job {job} never reached step 15: {rows}"
            time.sleep(1)
        # Killed at once: the job's 80 steps take about 8 s here, a status call one.
        on_host("node2", "docker kill $(docker ps -q --filter label=fabtrain.managed=1)")
        seen = fab(inventory_path, "status")
        said = f"{job}: detached, its controller runs on node2, its standby on node1"
        assert said in seen.stdout, seen.stdout
        logs = fab(inventory_path, "logs", "--job", job, "--plain", timeout=400)
    finally:
        fab(inventory_path, "stop", "--job", job, "--grace", "0")
    assert logs.returncode == 0, (logs.stdout + logs.stderr)[-3000:]
    assert (
        f"job {job} finished; logs and outputs in" in logs.stdout
        and "(fetched from its controller on node2)" in logs.stdout
    )
    run = ROOT / "runs" / job
    record = json.loads((run / "job.json").read_text())
    assert record["state"] == "finished" and [a["number"] for a in record["attempts"]] == [1, 2]
    assert record["attempts"][0]["outcome"] == "node2 exited with code 137"
    assert record["controller"]["host"] == "node2" and record["controller"]["fetched"]
    assert record["controller"]["standby"]["host"] == "node1" and record["controller"]["ended_on"] == "node2"
    node1 = (run / "node1.log").read_text()
    # From memory (node1's keeper held node2's ranks' replicas), or the newest snapshot if as new.
    assert "| step 10 |" in node1 and re.search(
        r"resumed from (memory|/output/snapshots/snapshot-0000000)", node1
    ), node1[-3000:]
    assert (run / "loss.png").is_file() and final_state(job)["step"] == 80
    events = [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert events.count("attempt") == 2 and events[-1] == "finished"
    # Nothing of the job or its controller is left on any host: containers, directories, its key.
    for node in ("node1", "node2"):
        assert project_containers(node) == []
        left = on_host(
            node,
            "docker ps -aq --filter label=fabtrain.controller; ls /opt/fabtrain/output/.controllers; "
            "ls /opt/fabtrain/output/.runtime | grep -vx images; "
            f"grep -c {job} ~/.ssh/authorized_keys",
            check=False,
        )
        assert left.stdout.split() == ["0"], left.stdout


REPORT = "tests/integration/scripts/report.py"


def queued(jobs: list[dict]) -> dict[str, dict]:
    """The rows of `fab status --json`'s jobs that wait in a queue, by job."""
    return {r["job"]: r for r in jobs if r["queue"]}


def queued_rows(inventory_path) -> dict[str, dict]:
    return queued(status_doc(inventory_path)["jobs"])


def test_queue_first_come_first_served_and_a_queued_job_stopped(inventory_path):
    """A holds both hosts (every slot); B and C, two other people, queue in that order; A ends, B
    starts by itself while C waits; fab stop --job C removes C; B finishes."""
    common = ("train", "--script", REPORT, "--skip-preflight", "--plain")
    a = Run(inventory_path, *common, "--args", "--sleep 600", "--name", "qa")
    b = c = None
    done = False
    try:
        a.wait_for("attempt 1: starting 2 node(s)")
        refused = fab(inventory_path, *common, "--name", "qx")
        assert refused.returncode != 0 and "add --queue" in refused.stderr, refused.stderr[-2000:]
        b = Run(
            inventory_path,
            *common,
            "--args",
            "--sleep 2",
            "--name",
            "qb",
            "--queue",
            env={"FABTRAIN_USER": "bob"},
        )
        b.wait_for("queued: position 1 (")
        c = Run(
            inventory_path,
            *common,
            "--args",
            "--sleep 5",
            "--name",
            "qc",
            "--queue",
            env={"FABTRAIN_USER": "carol"},
        )
        c.wait_for("queued: position 2 (")
        listed = status_doc(inventory_path)["jobs"]  # one look for the queue's rows and qa's id
        rows = queued(listed)
        by_name = {r["job"].split("-")[0]: r for r in rows.values()}
        assert by_name["qb"]["queue"]["position"] == 1 and by_name["qc"]["queue"]["position"] == 2, rows
        assert by_name["qb"]["who"].startswith("bob@") and by_name["qc"]["who"].startswith("carol@")
        assert by_name["qb"]["state"] == "queued (1)" and by_name["qb"]["since"]
        assert "node1: held by qa-" in "; ".join(by_name["qb"]["queue"]["waits"])
        assert "node1: behind qb-" in "; ".join(by_name["qc"]["queue"]["waits"])
        table = fab(inventory_path, "status").stdout
        assert "queued (2)" in table and "behind qb-" in table
        qa = next(j["job"] for j in listed if j["job"].startswith("qa-"))
        stopped = fab(inventory_path, "stop", "--job", qa, "--grace", "0", "--json")
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        doc = json.loads(stopped.stdout)  # --json: what was stopped, where, what was left alone
        assert doc["stopped"] == [qa] and doc["failed_hosts"] == [] and doc["left_alone"] == []
        assert sum(doc["containers_removed"].values()) >= 1, doc
        b.wait_for("left the queue after", timeout=60)
        b.wait_for("attempt 1: starting 2 node(s)")
        c_job = by_name["qc"]["job"]
        assert c_job in queued_rows(inventory_path)  # C still waits: behind B's claim now
        stop = fab(inventory_path, "stop", "--job", c_job, "--grace", "0")
        assert stop.returncode == 0 and f"stopped {c_job}" in stop.stdout
        assert c.finish(60) != 0 and "ended by 'fab stop' while it waited in the queue" in c.text, c.text[
            -2000:
        ]
        assert b.finish(120) == 0, b.text[-3000:]
        assert queued_rows(inventory_path) == {}
        assert not on_host("node1", "ls /opt/fabtrain/output/.claims/*/queue/").stdout.split()
        done = a.proc.poll() is not None  # a's fab has ended too (stopped above): no job of the test is left
    finally:
        for r in (a, b, c):
            if r is not None:
                r.proc.kill()
        if not done:  # every job ended in the body; otherwise nothing of them may stay for the next test
            fab(inventory_path, "stop", "--all", "--yes", "--grace", "0")


def test_two_jobs_queued_at_the_same_moment_get_distinct_positions(inventory_path):
    common = ("train", "--script", REPORT, "--skip-preflight", "--plain")
    a = Run(inventory_path, *common, "--args", "--sleep 600", "--name", "qa")
    runs = []
    try:
        a.wait_for("attempt 1: starting 2 node(s)")
        runs = [
            Run(inventory_path, *common, "--args", "--sleep 1", "--name", f"q{i}", "--queue") for i in (1, 2)
        ]
        for r in runs:
            r.wait_for("queued: position")
        time.sleep(6)  # each has renewed its place once and seen the other's
        positions = sorted(r["queue"]["position"] for r in queued_rows(inventory_path).values())
        assert positions == [1, 2]
    finally:
        for r in (a, *runs):
            r.proc.kill()
        fab(inventory_path, "stop", "--all", "--yes", "--grace", "0")
