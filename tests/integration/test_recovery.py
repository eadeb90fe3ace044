"""Jobs that outlive failures, on the local cluster: restarts from the newest snapshot, a spare
taking a frozen rank 0's place, fewer nodes, a spent budget, the hang watchdog, --resume."""

import glob
import json
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from orchestrator.testbed import cluster, faults

from .conftest import QUICK_LOSS, ROOT, Prometheus, fab, free_port, on_host, project_containers, with_ssh
from .test_lifecycle import running, start_fab, wait_for_containers

# A short GPT run: 2 epochs of 40 steps, a snapshot every 10 steps (4 ranks on 2 hosts); --exact: DDP's
# buckets fixed for the run's life, so a run resumed from memory ends bit for bit as this one does.
GPT_ARGS = "--snapshot-every 10 --max-steps-per-epoch 40 --sample-chars 0 --exact"
GPT = ["--model", "tiny", "--epochs", "2", "--args", GPT_ARGS]
# The same, each rank's state kept in memory (its host's keeper and a peer's) at every step: a
# failure loses at most one step (issue: lose at most one step).
GPT_MEMORY = ["--model", "tiny", "--epochs", "2", "--args", GPT_ARGS + " --memory-every 1"]
# The same with nothing kept in memory: the restart resumes from the disk snapshot (with memory on,
# a step held in memory newer than the snapshot is taken instead, as it should be).
GPT_DISK = ["--model", "tiny", "--epochs", "2", "--args", GPT_ARGS + " --memory-every 0"]


def job_id(text: str) -> str:
    return text.split("job ", 1)[1].split()[0]


def final_state(job: str, host: str = "node1") -> dict:
    """The job's newest snapshot, as fab train keeps it (runs/JOB/snapshots, checked by hash). The
    outputs fetched from the hosts hold no snapshots: they were copied once, verified."""
    assert not glob.glob(str(ROOT / "runs" / job / "outputs" / host / "snapshots" / "snapshot-*.pt"))
    kept = sorted(glob.glob(str(ROOT / "runs" / job / "snapshots" / "snapshot-*.pt")))
    assert 1 <= len(kept) <= 2, kept  # job.keep_snapshots (2)
    return torch.load(kept[-1], weights_only=True)


def eval_losses(out: str) -> list[str]:
    return [line.split("eval loss ")[1].split()[0] for line in out.splitlines() if "done | eval loss" in line]


def wait_for_line(proc_out: Path, needle: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_out.exists() and needle in proc_out.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} never appeared")


def run_in_background(inventory_path, log: Path, *args) -> subprocess.Popen:
    fh = log.open("w")
    return subprocess.Popen(
        [str(ROOT / ".venv/bin/fab"), *args, "--inventory", str(inventory_path)],
        cwd=ROOT,
        stdout=fh,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def reference(inventory_path):
    """The same GPT run, uninterrupted: what every recovered run must end with."""
    r = fab(inventory_path, "train", *GPT)
    assert r.returncode == 0, r.stderr[-2000:]
    return final_state(job_id(r.stdout)), eval_losses(r.stdout)


def assert_resumed_from_memory(out: str, replicas: bool = False, as_new_snapshot: bool = False) -> None:
    """Every restart of the run resumed from memory, at most one step lost (K = 1); with `replicas`,
    a replaced node's ranks took their state from their replicas on another host. With
    `as_new_snapshot`, a restart may instead take the disk snapshot when it is at least as new as
    the newest step every rank holds (a loaded machine whose failure fell just after a snapshot):
    still at most one step lost."""
    lines = re.findall(
        r"\[fabtrain\] resumed from memory at step (\d+) \(the newest every rank holds\), "
        r"(\d+) steps? lost(.*)",
        out,
    )
    disk = re.findall(
        r"\[fabtrain\] resumed from the disk snapshot at step (\d+) \(memory: every rank holds step (\d+)\), "
        r"(\d+) steps? lost",
        out,
    )
    assert lines or (as_new_snapshot and disk), out[-3000:]
    assert all(int(lost) <= 1 for _, lost, _ in lines), lines
    if as_new_snapshot:
        assert all(int(step) >= int(held) and int(lost) <= 1 for step, held, lost in disk), disk
    else:
        assert "resumed from /output/snapshots" not in out
    if replicas and lines and not disk:
        assert any("from their replicas on another host" in rest for _, _, rest in lines), lines


def assert_exactly_the_reference(job: str, reference, host: str = "node1") -> None:
    """The final parameters are the uninterrupted run's, bit for bit."""
    ref_state, _ = reference
    got = final_state(job, host)
    assert got["step"] == ref_state["step"] == 80
    differ = [k for k, v in ref_state["model"].items() if not torch.equal(got["model"][k], v)]
    assert not differ, differ


def assert_same_model(job: str, reference, out: str, host: str = "node1") -> None:
    ref_state, ref_losses = reference
    got = final_state(job, host)
    assert got["step"] == ref_state["step"] == 80
    # Not bit-identical: DDP rebuilds its gradient buckets on the first step after any start, so the
    # first resumed step sums gradients in another order (float rounding). Same eval losses to 4
    # decimals, weights within 1e-3.
    assert eval_losses(out)[-1:] == ref_losses[-1:]
    worst = max((got["model"][k] - v).abs().max().item() for k, v in ref_state["model"].items())
    assert worst < 1e-3, worst


# A web hook on a test host (node3, not used by the jobs here): every POST body, a line each.
HOOK_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with open("/tmp/hook.jsonl", "ab") as fh:
            fh.write(body + b"\\n")
        self.send_response(204)
        self.end_headers()
http.server.HTTPServer(("0.0.0.0", 8765), H).serve_forever()
"""


def test_killed_container_restarts_from_the_newest_snapshot(inventory_path, reference, tmp_path):
    """Also: the job's notifications reach a command here and a web hook on a test host, in order,
    each once; runs/JOB/events.jsonl holds every event of both attempts."""
    log, told = tmp_path / "out.txt", tmp_path / "told.jsonl"
    on_host(
        "node3",
        "rm -f /tmp/hook.jsonl; pkill -f 'python3 /tmp/hook_[s]erver'; "
        f"printf %s {shlex.quote(HOOK_SERVER)} > /tmp/hook_server.py",
        check=False,
    )
    on_host("node3", "python3 /tmp/hook_server.py", detach=True)
    hook = f"http://{cluster.node_infos(3)[2].address}:8765/hook"
    proc = run_in_background(
        inventory_path,
        log,
        "train",
        *GPT_DISK,
        "--restarts",
        "1",
        "--notify",
        f"cat >> {told}; echo >> {told}",
        "--notify-url",
        hook,
    )
    try:
        wait_for_line(log, "| step 20 |")
        on_host("node2", "docker kill $(docker ps -q --filter label=fabtrain.managed=1)")
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
        posted = on_host(
            "node3", "cat /tmp/hook.jsonl; pkill -f 'python3 /tmp/hook_[s]erver'", check=False
        ).stdout
    out = log.read_text()
    job = job_id(out)
    expected = ["started", "attempt_failed", "restarted", "finished"]
    by_command = [json.loads(line) for line in told.read_text().splitlines()]
    assert [n["event"] for n in by_command] == expected, by_command
    assert [json.loads(line)["event"] for line in posted.splitlines()] == expected, posted
    assert by_command[1]["detail"] == "node2 exited with code 137" and by_command[-1]["job"] == job
    events = [json.loads(line) for line in (ROOT / "runs" / job / "events.jsonl").read_text().splitlines()]
    assert [e["attempt"] for e in events if e["event"] == "attempt"] == [1, 2]
    assert events[-1]["event"] == "finished" and events[-1]["state"] == "finished"
    assert "attempt 1 failed (node2 exited with code 137); restart 1 of 1" in out
    assert re.search(
        r"attempt 2: starting 2 node\(s\), rank 0 on node1 \(port \d+\), from snapshot snapshot-0000000", out
    )
    assert "resumed from /output/snapshots/snapshot-0000000" in out
    # node1 kept its container (warm), node2's was started again; both launched their workers directly.
    assert out.count("generation=2 (warm: this container was kept; its workers started ahead)") == 1
    record = json.loads((ROOT / "runs" / job / "job.json").read_text())
    assert record["state"] == "finished" and [a["number"] for a in record["attempts"]] == [1, 2]
    assert record["attempts"][0]["outcome"] == "node2 exited with code 137"
    assert (
        f"# ---- job {job} attempt 2: node1=rank 0 slots 0,1, node2=rank 1 slots 0,1"
        in (ROOT / "runs" / job / "plan.txt").read_text()
    )
    assert_same_model(job, reference, out)
    # TensorBoard: one event file per attempt in rank 0's tb/, read as one run with every logged step
    # once (the second attempt's from its snapshot on), every epoch's eval loss as the log said it.
    tb = ROOT / "runs" / job / "tb"  # gathered from the hosts' outputs (rank 0's: node1's)
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2
    assert {p.name for p in tb.iterdir()} == {
        p.name for p in (ROOT / "runs" / job / "outputs" / "node1" / "tb").iterdir()
    }
    board = EventAccumulator(str(tb))
    board.Reload()
    assert [e.step for e in board.Scalars("train/loss")] == list(range(10, 81, 10))
    assert [e.step for e in board.Scalars("eval/loss")] == [40, 80]
    logged = [float(v) for v in eval_losses(out)[-2:]]  # 4 places; TensorBoard keeps float32
    assert [e.value for e in board.Scalars("eval/loss")] == pytest.approx(logged, abs=6e-5)
    assert project_containers("node1") == [] and project_containers("node2") == []


def job_containers(node: str) -> str:
    return on_host(node, "docker ps -q --filter label=fabtrain.managed=1").stdout.strip()


def test_a_killed_worker_restarts_warm_from_memory(inventory_path, reference, tmp_path):
    """One worker process killed on node2: both nodes keep their containers, only the workers
    start again (the next generation), from the newest step every rank holds in memory, or from a
    disk snapshot as new (at most one step lost), and the job ends with the uninterrupted run's
    model, bit for bit. Also: a real Prometheus server scrapes the job's /metrics
    (--metrics-port): every rank's fabtrain_step rises, fabtrain_host_failures_total rises at the
    killed worker; the hosts' telemetry is in telemetry.jsonl, summary.json and the figure."""
    log = tmp_path / "out.txt"
    port = free_port()
    prometheus = Prometheus(tmp_path, f"127.0.0.1:{port}")
    began = time.time()
    proc = run_in_background(
        inventory_path, log, "train", *GPT_MEMORY, "--restarts", "1", "--metrics-port", str(port)
    )
    try:
        wait_for_line(log, "| step 20 |")
        kept = {n: job_containers(n) for n in ("node1", "node2")}
        assert all(kept.values()), kept
        time.sleep(2)  # scraped before the failure
        killed = time.time()
        assert on_host("node2", faults.KILL_ONE_WORKER).stdout.strip().isdigit()
        # From memory; or from the disk snapshot when the kill fell just after one (every rank's
        # newest step in memory is then the snapshot's: as new, and it wins; still at most one step).
        wait_for_line(log, "[fabtrain] resumed from ", timeout=120)
        assert {n: job_containers(n) for n in ("node1", "node2")} == kept  # the same containers
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
        ended = time.time()
        steps = prometheus.range("fabtrain_step", began, ended)
        failures = prometheus.range("fabtrain_host_failures_total", began, ended)
    finally:
        proc.kill()
        prometheus.close()
    out = log.read_text()
    job = job_id(out)
    assert f"metrics for Prometheus at http://127.0.0.1:{port}/metrics" in out
    by_rank = {(s["metric"]["host"], s["metric"]["rank"]): [float(v) for _, v in s["values"]] for s in steps}
    assert set(by_rank) == {("node1", "0"), ("node1", "1"), ("node2", "2"), ("node2", "3")}, by_rank
    assert all(s["metric"]["job_id"] == job for s in steps)
    assert all(v[-1] > v[0] for v in by_rank.values()), by_rank
    [failed] = failures
    labels = {k: failed["metric"][k] for k in ("job_id", "host", "kind")}
    assert labels == {"job_id": job, "host": "node2", "kind": "exited"}, failed
    values = failed["values"]  # [[time, "value"], ...]
    first_seen, count = float(values[0][0]), float(values[-1][1])
    assert count == 1 and first_seen >= killed - 1, failed
    telemetry = (ROOT / "runs" / job / "telemetry.jsonl").read_text()
    samples = [json.loads(line) for line in telemetry.splitlines()]
    hosts = {s["host"] for s in samples}
    assert hosts == {"node1", "node2"}, hosts
    containers = [c for s in samples for c in s["sample"]["containers"]]
    assert containers and all(c["name"].startswith(f"fabtrain-{job}-r") and c["mem"] > 0 for c in containers)
    assert max(c["cpu"] for c in containers) > 0.1  # the ranks were busy
    summary = json.loads((ROOT / "runs" / job / "summary.json").read_text())
    assert set(summary["telemetry"]) == {"node1", "node2"} and summary["telemetry"]["node1"]["samples"] >= 2
    # fab metrics: the newest figures of the job's last attempt, per rank and per host.
    shown = subprocess.run(
        [str(ROOT / ".venv/bin/fab"), "metrics", "--job", job, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(shown.stdout)
    assert doc["state"] == "finished" and doc["attempt"] == 2, doc
    assert [(r["host"], r["rank"]) for r in doc["ranks"]] == [
        ("node1", 0),
        ("node1", 1),
        ("node2", 2),
        ("node2", 3),
    ]
    assert all(r["step"] > 20 and r["tokens_per_s"] > 0 for r in doc["ranks"]) and set(doc["hosts"]) == hosts
    # Launched without torchrun (a warm job): the node ends with its killed worker's code, at once.
    assert re.search(
        r"attempt 1 failed \(node2 exited with code 137 \(worker rank [23] exited with code 137", out
    ), out[-3000:]
    assert out.count("generation=2 (warm: this container was kept; its workers started ahead)") == 2
    plan = (ROOT / "runs" / job / "plan.txt").read_text()
    assert "attempt 2: node1=rank 0 slots 0,1, node2=rank 1 slots 0,1" in plan and "warm nodes" in plan
    assert_same_model(job, reference, out)
    assert_resumed_from_memory(out, as_new_snapshot=True)
    assert_exactly_the_reference(job, reference)
    assert project_containers("node1") == [] and project_containers("node2") == []


def test_interrupted_job_resumes_with_the_same_id(inventory_path, reference, tmp_path):
    log = tmp_path / "out.txt"
    proc = run_in_background(inventory_path, log, "train", *GPT)
    try:
        wait_for_line(log, "| step 30 |")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 130
    finally:
        proc.kill()
    first = log.read_text()
    job = job_id(first)
    assert f"Continue it with: fab train --resume {job}" in first
    assert running("node1") == [] and running("node2") == []
    r = fab(inventory_path, "train", "--resume", job)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming job {job} (1 attempt(s) so far, interrupted)" in r.stdout
    assert f"job {job} attempt 2: starting 2 node(s)" in r.stdout and "resumed from" in r.stdout
    assert_same_model(job, reference, r.stdout)
    again = fab(inventory_path, "train", "--resume", job)
    assert again.returncode == 2 and "already finished" in again.stderr


def train_and_freeze(inventory_path, tmp_path, node: str, after: str, *extra) -> str:
    """`fab train` of GPT with a restart, a whole test host frozen (docker pause) once `after` is
    printed; the command must still succeed. Its output."""
    log = tmp_path / "out.txt"
    inventory_path = with_ssh(inventory_path, tmp_path / "inventory.yaml", **QUICK_LOSS)
    proc = run_in_background(inventory_path, log, "train", *GPT, "--restarts", "1", *extra)
    try:
        wait_for_line(log, after)
        faults.freeze(node)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        faults.thaw(node)
        proc.kill()
        fab(inventory_path, "stop", "--grace", "0")
    return log.read_text()


def test_frozen_rank0_host_is_replaced_by_the_spare(spares_inventory_path, tmp_path):
    out = train_and_freeze(spares_inventory_path, tmp_path, "node1", "| step 30 |")
    job = job_id(out)
    assert "attempt 1 failed (node1 lost: no SSH keepalive answer for" in out
    assert "spare node3 takes the place of node1 (lost) as node rank 0" in out
    assert re.search(
        r"attempt 2: starting 2 node\(s\), rank 0 on node3 \(port \d+\), from snapshot snapshot-0000000", out
    )
    # node2's keeper held rank 0's and 1's replicas (memory on, K measured): memory, or the newest
    # snapshot where that is as new.
    assert re.search(r"\[node3 rank0\] resumed from (memory|/output/snapshots/snapshot-0000000)", out), out[
        -3000:
    ]
    assert "lost during the job: node1" in out
    # The snapshot came off node1 before it froze: it was copied here as it was written.
    assert sorted(p.name for p in (ROOT / "runs" / job / "snapshots").iterdir())
    assert final_state(job, "node3")["step"] == 80
    assert all(project_containers(n) == [] for n in ("node1", "node2", "node3"))


def wait_for_step_after(log: Path, marker: str, timeout: float = 120, steps: int = 1) -> None:
    """Until `steps` step lines (distinct steps) are printed after `marker` (training goes on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if marker in text and len(set(re.findall(r"\| step (\d+) \|", text[text.index(marker) :]))) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no step after {marker!r}")


def test_hot_spares_take_a_killed_containers_rank_then_a_frozen_hosts(
    two_spares_inventory_path, reference, tmp_path
):
    """--hot-spares with node3 and node4 waiting: node2's container killed -> node3's waiting
    container takes rank 1 (renamed, told its rank), node2 becomes a hot spare; then node3's whole
    host frozen -> node4 takes rank 1, node3 named lost. Each time the replaced node's ranks take
    their state from their replicas in node1's keeper, at most one step lost, and the job ends with
    the uninterrupted run's model bit for bit; each attempt's plan is in plan.txt."""
    inv = with_ssh(two_spares_inventory_path, tmp_path / "inventory.yaml", **QUICK_LOSS)
    log = tmp_path / "out.txt"
    proc = run_in_background(inv, log, "train", *GPT_MEMORY, "--restarts", "2", "--hot-spares")
    try:
        wait_for_line(log, "| step 20 |")
        for spare in ("node3", "node4"):  # waiting, hot, under the spare's name
            names = on_host(spare, "docker ps --format '{{.Names}}' --filter label=fabtrain.managed=1").stdout
            assert names.split() and all(n.endswith("-spare") for n in names.split()), (spare, names)
        on_host("node2", "docker kill $(docker ps -q --filter label=fabtrain.managed=1)")
        # Two step lines (10 steps each) trained on the spare first: its ranks' replicas have reached
        # node1's keeper (a host lost in its very first steps, before any replica arrived, resumes from
        # the disk snapshot: docs/recovery.md).
        wait_for_step_after(log, "hot spare: this container waited for a rank", steps=2)
        faults.freeze("node3")
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        faults.thaw("node3")
        proc.kill()
        fab(inv, "stop", "--grace", "0")
    out = log.read_text()
    job = job_id(out)
    assert (
        "spare node3 takes the place of node2 (its container is gone; a hot spare is ready) as node rank 1"
    ) in out
    assert "spare node4 takes the place of node3 (lost) as node rank 1" in out
    assert "attempt 2 failed (node3 lost: no SSH keepalive answer for" in out
    assert "lost during the job: node3" in out
    # Both spares ran their rank from the container that waited: no cold start.
    assert out.count("(hot spare: this container waited for a rank; its workers started ahead)") == 2
    plans = (ROOT / "runs" / job / "plan.txt").read_text()
    assert re.search(
        r"attempt 1: node1=rank 0 slots 0,1, node2=rank 1 slots 0,1; .*hot spares node3, node4", plans
    )
    assert re.search(
        r"attempt 2: node1=rank 0 slots 0,1, node3=rank 1 slots 0,1; .*hot spares node4, node2", plans
    )
    assert re.search(r"attempt 3: node1=rank 0 slots 0,1, node4=rank 1 slots 0,1;", plans)
    assert "docker rename fabtrain-" in plans
    assert_same_model(job, reference, out)
    # Both replaced nodes' ranks resumed from their replicas on node1, at most a step lost each time.
    assert_resumed_from_memory(out, replicas=True, as_new_snapshot=True)
    assert_exactly_the_reference(job, reference)
    assert all(project_containers(n) == [] for n in ("node1", "node2", "node3", "node4"))


def test_without_a_spare_the_job_finishes_on_fewer_nodes(inventory_path, tmp_path):
    out = train_and_freeze(inventory_path, tmp_path, "node2", "| step 20 |", "--min-nodes", "1")
    assert "no spare left: going on without node2 with 1 node(s) (--min-nodes 1)" in out
    assert "world 2 instead of 4: batch 16 x accum 1 -> 16 x 2 keeps the global batch of 64 sequences" in out
    assert "finished on every host after 2 attempts" in out
    assert final_state(job_id(out))["step"] == 80


def test_spent_budget_names_every_failure(inventory_path):
    r = fab(
        inventory_path,
        "train",
        "--script",
        "tests/integration/scripts/exit_on_node.py",
        "--args",
        "--node 1 --code 3 --after 0.5",
        "--restarts",
        "1",
        "--skip-preflight",
    )
    assert r.returncode == 1
    assert "every attempt failed (2):" in r.stderr
    # Both attempts launched by the entrypoint (a warm job): the node exits with the worker's own code.
    assert re.search(
        r"attempt 1 on node1, node2: node2 exited with code 3 \(worker rank [23] exited with "
        r"code 3\)",
        r.stderr,
    ), r.stderr
    last = r"failed: node2 \(node rank 1\) exited with code 3 \(worker rank [23] exited with code 3\)"
    assert re.search(last, r.stderr), r.stderr
    assert "attempt 1 on node1, node2:" in r.stderr and "attempt 2 on node1, node2:" in r.stderr
    assert "fab train --resume" in r.stderr


def test_hang_watchdog_dumps_every_ranks_stack_and_ends_the_job(inventory_path):
    start = time.monotonic()
    r = fab(
        inventory_path,
        "train",
        "--script",
        "tests/integration/scripts/hang.py",
        "--hang-timeout",
        "10",
        "--skip-preflight",
        timeout=180,
    )
    took = time.monotonic() - start
    assert r.returncode == 1, r.stderr[-2000:]
    assert took < 15 + 30, f"{took:.0f}s"
    out = r.stdout + r.stderr
    # Every node quiet, or node2 (the sleeping rank's) first: which watch fires first is timing.
    assert re.search(r"no progress from (any node|node2) for", out) and "(--hang-timeout 10)" in out
    # Every rank's stack, in the terminal and the logs, and one line per rank saying where it is.
    for rank in range(3):
        assert f"rank {rank} on node" in out and "all_reduce (distributed_c10d.py:" in out
    assert "rank 3 on node2: tests/integration/scripts/hang.py:14 in <module> `time.sleep(3600)`" in out
    assert "called from tests/integration/scripts/hang.py:15 `dist.all_reduce(t)`" in out
    job = job_id(r.stdout)
    log = (ROOT / "runs" / job / "node1.log").read_text()
    assert "--- rank 0 (local rank 0, pid" in log and "Current thread" in log
    assert project_containers("node1") == [] and project_containers("node2") == []


def test_fab_stop_ends_a_job_that_has_restarts_left(inventory_path):
    proc = start_fab(
        inventory_path,
        "train",
        "--script",
        "tests/integration/scripts/report.py",
        "--args",
        "--sleep 300",
        "--restarts",
        "3",
        "--skip-preflight",
    )
    try:
        wait_for_containers(["node1", "node2"])
        assert fab(inventory_path, "stop").returncode == 0
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "was ended by 'fab stop'" in err and "attempt 2" not in out
    assert project_containers("node1") == [] and project_containers("node2") == []
