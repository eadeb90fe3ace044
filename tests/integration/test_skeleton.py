"""The walking skeleton on the local cluster: sync, preflight, train, stop."""

import hashlib
import json
import re
import subprocess
import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from .conftest import FAB, ROOT, fab, on_host, project_containers


def test_sync_reaches_every_host(inventory_path, inv):
    r = fab(inventory_path, "sync")  # the built-in trainers: this project's trainers/ only
    assert r.returncode == 0, r.stderr
    dest = r.stdout.split("synced to ", 1)[1].split()[0]
    assert dest.startswith(f"{inv.job.code_dir}/") and len(dest.rsplit("/", 1)[1]) == 16
    want = hashlib.sha256((ROOT / "trainers" / "gpt.py").read_bytes()).hexdigest()
    for h in inv.hosts:
        got = on_host(h.name, f"sha256sum {dest}/trainers/gpt.py").stdout.split()[0]
        assert got == want, h.name
        # Neither the rest of the project nor local state is copied to the hosts.
        for other in ("orchestrator", ".cluster", "tests"):
            assert on_host(h.name, f"test -e {dest}/{other}", check=False).returncode == 1, other


def test_a_busy_master_port_is_passed_over_by_preflight_and_train_alike(inventory_path, inv):
    port = inv.job.master_port
    on_host(
        "node1",
        "exec python3 -c 'import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
        f'socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", {port})); '
        f"s.listen(); time.sleep(120)' port-holder",
        detach=True,
    )
    try:
        for _ in range(100):
            if on_host("node1", f"ss -Htln 'sport = :{port}'").stdout.strip():
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the port holder did not start")
        # Another job (or program) holds job.master_port: preflight checks the port a job would take,
        # the next free one, and the smoke test's all_reduce runs on it.
        r = fab(inventory_path, "preflight", "--json")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr
        checks = {(c["host"], c["check"]): c for c in json.loads(r.stdout)["checks"]}
        assert checks[("node1", "port")]["status"] == "ok"
        assert checks[("node1", "port")]["detail"] == f"master port {port + 1} free"
        # fab train takes the same port, read on rank 0's host and shown in its plan.
        t = fab(inventory_path, "train", "--epochs", "1", "--dry-run")
        assert t.returncode == 0, t.stderr
        assert f"[node1] ss -Htln  -> {port + 1} free" in t.stdout
        assert f"MASTER_PORT={port + 1}" in t.stdout and f"MASTER_PORT={port} " not in t.stdout
        assert project_containers("node1") == [] and project_containers("node2") == []
    finally:
        on_host("node1", "pkill -f port-holder", check=False)


def test_train_streams_both_hosts_and_exits_zero(inventory_path, inv):
    r = fab(inventory_path, "train", "--model", "tiny", "--epochs", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("node1 r0 | [node1 rank0] epoch 1 | step") for line in lines)
    assert any(line.startswith("node2 r1 | [node2 rank2] epoch 1 | step") for line in lines)
    evals = [float(line.rsplit("eval loss ", 1)[1].split()[0]) for line in lines if "eval loss" in line]
    assert len(evals) == 2 and evals[1] < evals[0] < 3.0
    run_dir = ROOT / r.stdout.split("logs and outputs in ")[-1].split()[0]
    assert "world_size=4" in (run_dir / "node2.log").read_text()
    assert (run_dir / "outputs" / "node1" / "metrics.jsonl").exists()
    assert (run_dir / "plan.txt").read_text().count("docker run") == 2
    # Curves and a summary, drawn here from the fetched metrics and every rank's step lines.
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["hosts"] == ["node1", "node2"] and summary["state"] == "finished"
    assert round(summary["final_eval_loss"], 4) == evals[1]
    assert sorted(summary["ranks"]) == ["node1 rank0", "node1 rank1", "node2 rank2", "node2 rank3"]
    assert (
        sorted(summary["per_host"]) == ["node1", "node2"]
        and summary["ranks"]["node2 rank3"]["step_ms_median"] > 0
    )
    assert "step times (ms per optimizer step: median / p95)" in r.stdout
    # TensorBoard: rank 0's event files, fetched with node1's outputs (read as TensorBoard reads
    # them): the train loss of every logged step of both epochs and each epoch's eval loss.
    board = EventAccumulator(str(run_dir / "tb"))  # gathered from node1's outputs
    board.Reload()
    metrics = [json.loads(line) for line in (run_dir / "outputs" / "node1" / "metrics.jsonl").open()]
    train = [(m["step"], m["epoch"]) for m in metrics if m["kind"] == "train"]
    assert [e.step for e in board.Scalars("train/loss")] == [step for step, _ in train]
    assert {epoch for _, epoch in train} == {0, 1}
    assert [e.step for e in board.Scalars("eval/loss")] == [m["step"] for m in metrics if m["kind"] == "eval"]
    tb_evals = [e.value for e in board.Scalars("eval/loss")]  # float32; the log's have 4 places
    assert len(tb_evals) == 2 and all(abs(a - b) < 6e-5 for a, b in zip(tb_evals, evals, strict=True))
    assert not (run_dir / "outputs" / "node2" / "tb").exists()  # global rank 0 only
    assert project_containers("node1") == [] and project_containers("node2") == []


def test_train_json_writes_json_lines_only_to_stdout(inventory_path):
    """--json: every stdout line an event; the end-of-run table and the last line go to stderr."""
    r = fab(
        inventory_path,
        "train",
        "--json",
        "--model",
        "tiny",
        "--epochs",
        "1",
        "--nproc",
        "1",
        "--skip-preflight",
        "--args",
        "--max-steps-per-epoch 6 --log-every 2 --sample-chars 0",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert all(isinstance(e, dict) and "event" in e for e in events)
    assert any(e["event"] == "progress" for e in events), [e["event"] for e in events]
    assert "step times (ms per optimizer step: median / p95)" in r.stderr
    assert "finished on every host" in r.stderr


def test_a_cpu_starved_host_is_named_as_the_straggler(inventory_path):
    """node2's training container limited to 0.3 CPU as soon as it starts (docker update --cpus on
    node2's engine): its ranks are named while the job runs and at the end, node1's never."""
    proc = subprocess.Popen(
        [
            FAB,
            "train",
            "--model",
            "tiny",
            "--epochs",
            "1",
            "--skip-preflight",
            "--args",
            "--max-steps-per-epoch 48 --log-every 4 --sample-chars 0",
            "--inventory",
            str(inventory_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (
            names := on_host("node2", "docker ps -q --filter label=fabtrain.managed=1").stdout.split()
        ):
            assert time.monotonic() < deadline and proc.poll() is None, "node2's container never started"
            time.sleep(0.2)
        on_host("node2", f"docker update --cpus 0.3 {names[0]}")
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    live = [line for line in r.stdout.splitlines() if line.startswith("[fabtrain] straggler: ")]
    assert live and all(line.startswith("[fabtrain] straggler: node2 rank") for line in live), r.stdout[
        -3000:
    ]
    run_dir = ROOT / r.stdout.split("logs and outputs in ")[-1].split()[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {s["host"] for s in summary["stragglers"]} == {"node2"}, summary
    assert all(s["times_median"] > 1 + summary["straggler_margin"] for s in summary["stragglers"])
    assert (
        summary["per_host"]["node2"]["compute_ms_median"] > summary["per_host"]["node1"]["compute_ms_median"]
    )
    # The end of the run names them too (after the table).
    assert re.search(r"^straggler: node2 rank[23] takes [\d.]+ ms of compute per step", r.stdout, re.M)


def test_failed_node_is_named_and_job_exits_nonzero(inventory_path):
    r = fab(
        inventory_path,
        "train",
        "--script",
        "tests/integration/scripts/exit_on_node.py",
        "--args",
        "--node 1 --code 7",
    )
    assert r.returncode == 1
    # Both of node2's workers exit 7; torchrun reports whichever it saw first as the root cause.
    assert re.search(
        r"failed: node2 \(node rank 1\) exited with code 1 \(worker rank [23] exited with code 7\)", r.stderr
    ), r.stderr
    assert "exitcode  : 7" in r.stderr  # the last lines of that host's log
    run_dir = ROOT / r.stderr.split("full logs: ")[1].split()[0]
    assert "node 1 giving up with code 7" in (run_dir / "node2.log").read_text()
    assert project_containers("node1") == [] and project_containers("node2") == []


def test_stop_removes_every_project_container_and_is_idempotent(inventory_path, inv):
    for h in inv.hosts:
        for job in ("a", "b"):
            on_host(
                h.name,
                f"docker run -d --label fabtrain.managed=1 --label fabtrain.job={job} "
                f"--entrypoint sleep {inv.job.image} 300",
            )
        # Not ours: must survive.
        on_host(h.name, f"docker run -d --name bystander --entrypoint sleep {inv.job.image} 300")
    try:
        r = fab(inventory_path, "stop", "--grace", "1")
        assert r.returncode == 0, r.stderr
        assert "node1: removed 2 container(s)" in r.stdout
        for h in inv.hosts:
            assert project_containers(h.name) == []
            assert on_host(h.name, "docker ps -q --filter name=bystander").stdout.strip()
        again = fab(inventory_path, "stop")
        assert again.returncode == 0 and "node2: removed 0 container(s)" in again.stdout
    finally:
        for h in inv.hosts:
            on_host(h.name, "docker rm -f bystander", check=False)


def test_tensor_parallel_trainer_across_hosts(inventory_path):
    r = fab(inventory_path, "train", "--trainer", "mlp-tp", "--epochs", "1", "--args", "--tp 2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    meshes = [line for line in r.stdout.splitlines() if "| mesh [[0, 1], [2, 3]]" in line]
    assert len(meshes) == 4  # every rank prints its place in the (dp, tp) mesh
    assert any(line.startswith("node2 r1 | [node2 rank3] dp_rank 1 tp_rank 1") for line in meshes)
    losses = [float(m.group(1)) for m in re.finditer(r"\] step \d+ \| loss ([\d.]+)", r.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    # Its TensorBoard loss, by the steps its log lines name (rank 0's, fetched with node1's outputs).
    run_dir = ROOT / r.stdout.split("logs and outputs in ")[-1].split()[0]
    board = EventAccumulator(str(run_dir / "outputs" / "node1" / "tb"))
    board.Reload()
    steps = [int(m.group(1)) for m in re.finditer(r"node1 rank0\] step (\d+) \| loss", r.stdout)]
    assert [e.step for e in board.Scalars("train/loss")] == steps == [*range(0, 50, 10), 49]


def test_cluster_up_gives_back_what_a_killed_test_left_stopped(spares_inventory_path):
    """A test killed mid-way can leave a host's sshd gone or its engine frozen: the next cluster.up
    (each test run's first) gives both back instead of waiting on them, and the hosts answer."""
    from orchestrator.testbed import cluster

    on_host("node3", 'kill "$(cat /run/sshd.pid)"')
    on_host("node2", "pkill -STOP -x dockerd; pkill -STOP -x containerd")
    try:
        cluster.up(2, spares=2, log=lambda _: None)
        # Given back by up, not by this test: node2's engine answers, node3's sshd takes logins.
        assert on_host("node2", "timeout 5 docker info >/dev/null", check=False).returncode == 0
        r = fab(spares_inventory_path, "status", timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "hosts: 3 answering" in r.stdout, r.stdout
    finally:
        on_host("node2", "pkill -CONT -x containerd; pkill -CONT -x dockerd")
        on_host("node3", "pgrep -x sshd >/dev/null || /usr/sbin/sshd -E /var/log/sshd.log")
