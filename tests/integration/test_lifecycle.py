"""Lifecycle on the local cluster: fail fast, lost hosts, Ctrl+C, one job at a time, security."""

import json
import os
import signal
import subprocess
import time

import pytest

from orchestrator.testbed import faults

from .conftest import ADDRESS, FAB, ROOT, fab, on_host, project_containers

N1 = ADDRESS["node1"]

REPORT = "tests/integration/scripts/report.py"


def start_fab(inventory_path, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [FAB, *args, "--inventory", str(inventory_path)],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_for_containers(nodes, count=1, timeout=90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(
            len(on_host(n, "docker ps -q --filter label=fabtrain.managed=1").stdout.split()) >= count
            for n in nodes
        ):
            return
        time.sleep(0.3)
    raise AssertionError(f"job containers did not start on {nodes}")


def running(node) -> list[str]:
    return on_host(node, "docker ps -q --filter label=fabtrain.managed=1").stdout.split()


def test_killed_container_brings_the_job_down_fast(inventory_path):
    proc = start_fab(inventory_path, "train", "--script", REPORT, "--args", "--sleep 300")
    try:
        wait_for_containers(["node1", "node2"])
        time.sleep(3)  # let torchrun start inside
        killed = time.monotonic()
        on_host("node2", "docker kill $(docker ps -q --filter label=fabtrain.managed=1)")
        out, err = proc.communicate(timeout=60)
        while running("node1") and time.monotonic() - killed < 10:
            time.sleep(0.1)
        down = time.monotonic() - killed
        assert proc.returncode == 1
        assert "failed: node2 (node rank 1) exited with code 137" in err
        assert "the other nodes were stopped in" in err
        assert running("node1") == [] and down < 10, f"{down:.1f}s"
    finally:
        proc.kill()
        fab(inventory_path, "stop", "--grace", "0")


def test_paused_host_brings_the_job_down_within_bound(inventory_path):
    proc = start_fab(inventory_path, "train", "--script", REPORT, "--args", "--sleep 300")
    try:
        wait_for_containers(["node1", "node2"])
        time.sleep(2)
        faults.freeze("node2")
        paused = time.monotonic()
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - paused
        assert proc.returncode == 1
        assert "failed: node2 (node rank 1) lost: no SSH keepalive answer for" in err
        assert running("node1") == []
        assert took < 60, f"{took:.1f}s"
    finally:
        faults.thaw("node2")
        proc.kill()
        fab(inventory_path, "stop", "--grace", "0")
    assert project_containers("node1") == [] and project_containers("node2") == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_every_container(inventory_path, sig, code):
    proc = start_fab(inventory_path, "train", "--script", REPORT, "--args", "--sleep 300")
    try:
        wait_for_containers(["node1", "node2"])
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == code, err
        assert f"interrupted ({signal.Signals(sig).name}); every container was stopped" in err
        assert project_containers("node1") == [] and project_containers("node2") == []
    finally:
        proc.kill()


def test_second_train_is_refused_and_first_keeps_running(inventory_path):
    proc = start_fab(inventory_path, "train", "--script", REPORT, "--args", "--sleep 300")
    try:
        wait_for_containers(["node1", "node2"])
        # The first job holds slots 0 and 1 of each host (2 processes); the second asks for slot 0.
        second = fab(inventory_path, "train", "--epochs", "1", "--include", "node1:0@node2:0")
        assert second.returncode == 1, second.stderr
        assert "node1: this job needs slots 0, but report-" in second.stderr
        assert "hold(s) 0,1; free there:" in second.stderr and "'fab stop --job JOB'" in second.stderr
        assert "Traceback" not in second.stderr
        assert running("node1") and running("node2")
        status = fab(inventory_path, "status")
        assert "report-" in status.stdout and "running" in status.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


HOSTILE = ["'; touch /tmp/pwned #", "$(touch /tmp/pwned2)", "`id`", "a b  c", "line1\nline2", '"dq"', "--lr"]


def test_hostile_arguments_and_env_arrive_verbatim(inventory_path, tmp_path):
    """Also: every rank has the job's W&B variables, the inventory's own value in place of fabtrain's."""
    inv_text = inventory_path.read_text().replace(
        "job:\n",
        "job:\n  env:\n    HOSTILE: " + json.dumps("$(touch /tmp/pwned3); 'x' \"y\" `id`") + "\n"
        "    WANDB_RUN_GROUP: sweep-7\n",
    )
    inv2 = tmp_path / "hostile.yaml"
    inv2.write_text(inv_text)
    import shlex

    wandb = ["WANDB_RUN_GROUP", "WANDB_RUN_ID", "WANDB_RESUME"]
    r = fab(
        inv2,
        "train",
        "--script",
        REPORT,
        "--args",
        shlex.join(["--env", "HOSTILE", *(a for k in wandb for a in ("--env", k)), *HOSTILE]),
    )
    assert r.returncode == 0, r.stderr
    job = r.stdout.split("logs and outputs in ")[-1].split()[0].rstrip("/").rsplit("/", 1)[-1]
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in r.stdout.splitlines() if "REPORT " in line]
    assert len(reports) == 4
    for rep in reports:
        assert rep["args"] == HOSTILE
        assert rep["env"]["HOSTILE"] == "$(touch /tmp/pwned3); 'x' \"y\" `id`"
        assert [rep["env"][k] for k in wandb] == ["sweep-7", job, "allow"]
        assert rep["world"] == 4 and rep["sum"] == 10.0
    for node in ("node1", "node2"):
        assert on_host(node, "ls /tmp/pwned* 2>/dev/null; true").stdout == ""
    assert not any(os.path.exists(f"/tmp/pwned{s}") for s in ("", "2", "3"))


def test_secret_never_on_a_command_line_log_or_inspect(inventory_path, tmp_path):
    """Also: the inventory's container options (job-wide cap_add, node2's own ulimits and
    security_opt) reach the containers as Docker records them."""
    token = "s3cr3t-" + os.urandom(8).hex()
    secret = tmp_path / "token"
    secret.write_text(token + "\n")
    inv2 = tmp_path / "secret.yaml"
    text = inventory_path.read_text().replace(
        "job:\n", f"job:\n  secret_files:\n    API_TOKEN: {secret}\n  cap_add: [SYS_PTRACE]\n"
    )
    inv2.write_text(
        text.replace(
            "  - name: node2\n",
            '  - name: node2\n    ulimits: {nofile: "4096:8192"}\n    security_opt: [no-new-privileges]\n',
        )
    )
    proc = start_fab(inv2, "train", "--script", REPORT, "--args", "--hash-env API_TOKEN --sleep 8")
    try:
        wait_for_containers(["node1", "node2"])
        time.sleep(3)
        local_ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
        assert token not in local_ps
        for node in ("node1", "node2"):
            cmdlines = on_host(node, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
            assert "torch.distributed.run" in cmdlines and token not in cmdlines
            inspect = on_host(
                node, "docker inspect $(docker ps -aq --filter label=fabtrain.managed=1)"
            ).stdout
            assert "FABTRAIN_JOB" in inspect and token not in inspect
            job = on_host(
                node, "docker ps --filter label=fabtrain.managed=1 --format '{{.Label \"fabtrain.job\"}}'"
            ).stdout.strip()
            assert (
                on_host(node, f"stat -c %a /opt/fabtrain/output/.runtime/{job}/secrets.env").stdout.strip()
                == "600"
            )
            config = json.loads(
                on_host(
                    node,
                    "docker inspect --format '{{json .HostConfig}}' "
                    "$(docker ps -q --filter label=fabtrain.managed=1)",
                ).stdout
            )
            assert config["CapAdd"] == ["SYS_PTRACE"]
            if node == "node2":
                assert config["Ulimits"] == [{"Name": "nofile", "Soft": 4096, "Hard": 8192}]
                assert "no-new-privileges" in config["SecurityOpt"]
            else:  # (the engine may add its own, e.g. label=disable)
                assert not config["Ulimits"] and "no-new-privileges" not in (config["SecurityOpt"] or [])
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    import hashlib

    want = hashlib.sha256(token.encode()).hexdigest()
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in out.splitlines() if "REPORT " in line]
    assert reports and all(rep["hash"]["API_TOKEN"] == want for rep in reports)
    run_dir = ROOT / out.split("logs and outputs in ")[-1].split()[0]
    for log in run_dir.rglob("*"):
        if log.is_file():
            assert token not in log.read_text(errors="replace")
    for node in ("node1", "node2"):  # the secrets file and our entrypoint are gone after the job
        assert on_host(node, f"ls /opt/fabtrain/output/.runtime/{job}", check=False).returncode != 0


def test_unknown_and_changed_host_keys_are_refused(inventory_path, tmp_path):
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    inv2 = tmp_path / "unknown.yaml"
    text = inventory_path.read_text()
    kh_line = next(line for line in text.splitlines() if "known_hosts:" in line)
    inv2.write_text(text.replace(kh_line, f"  known_hosts: {empty}"))
    r = fab(inv2, "preflight")
    assert r.returncode == 1
    assert f"node1 ({N1}): host key unknown (ssh-ed25519 SHA256:" in r.stdout
    assert f"ssh-keyscan -p 22 {N1} >>" in r.stdout
    # A wrong key recorded for node1 (node2's key): refused as changed.
    real = open(kh_line.split(":", 1)[1].strip()).read().splitlines()
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text(f"{N1} " + real[1].split(" ", 1)[1] + "\n")
    inv3 = tmp_path / "changed.yaml"
    inv3.write_text(text.replace(kh_line, f"  known_hosts: {wrong}"))
    r = fab(inv3, "preflight", "--json")
    assert r.returncode == 1
    checks = json.loads(r.stdout)["checks"]
    node1 = [c for c in checks if c["host"] == "node1" and c["check"] == "ssh"][0]
    assert node1["status"] == "fail" and "host key CHANGED" in node1["detail"]


def test_lost_terminal_leaves_a_visible_job_that_fab_logs_reattaches_to(inventory_path):
    proc = start_fab(inventory_path, "train", "--script", REPORT, "--args", "--sleep 20")
    try:
        wait_for_containers(["node1", "node2"])
        proc.kill()  # the terminal is gone: no signal handler runs
        proc.wait()
        assert running("node1") and running("node2")  # the job goes on, by design
        status = json.loads(fab(inventory_path, "status", "--json").stdout)["jobs"]
        assert len(status) == 1 and status[0]["job"].startswith("report-") and status[0]["state"] == "running"
        assert {h: x["rank"] for h, x in status[0]["hosts"].items()} == {"node1": 0, "node2": 1}
        # Ctrl+C in fab logs detaches: the job keeps running.
        attached = start_fab(inventory_path, "logs")
        for line in attached.stdout:  # attached once node1's output arrives
            if "node1 r0 | " in line:
                break
        attached.send_signal(signal.SIGINT)
        out, _ = attached.communicate(timeout=30)
        assert attached.returncode == 0 and "detached; the job goes on" in out
        assert running("node1") and running("node2")
        as_json = start_fab(inventory_path, "logs", "--json")  # beside it: events, not log lines
        logs = fab(inventory_path, "logs", timeout=120)
        assert logs.returncode == 0, logs.stderr
        assert logs.stdout.count("REPORT ") == 4  # from the start, every rank
        assert "node2 r1 | " in logs.stdout
        out, _ = as_json.communicate(timeout=60)
        assert as_json.returncode == 0 and "REPORT " not in out, out[-2000:]
        assert all(json.loads(line)["job"].startswith("report-") for line in out.splitlines()), out[-2000:]
    finally:
        fab(inventory_path, "stop", "--grace", "0")
