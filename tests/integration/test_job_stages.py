"""The job lifecycle under odd failures, on the local cluster: fab stop between attempts, resume
options and --dry-run, hang detection by where the ranks are (a chatty hung job, a silent healthy
phase, a module), a frozen Docker engine blamed as such, and a lost host's runtime files cleared once it
answers again."""

import json
import os
import re
import subprocess
import time

from orchestrator.testbed import faults

from .conftest import FAB, QUICK_LOSS, ROOT, Run, fab, on_host, project_containers, with_ssh
from .test_lifecycle import wait_for_containers

EXIT = "tests/integration/scripts/exit_on_node.py"
PROGRESS = "tests/integration/scripts/progress.py"
REPORT = "tests/integration/scripts/report.py"


def job_of(text: str) -> str:
    return text.split("job ", 1)[1].split()[0]


def record(job: str) -> dict:
    return json.loads((ROOT / "runs" / job / "job.json").read_text())


def test_fab_stop_between_attempts_ends_the_job_and_resume_honours_every_option(inventory_path):
    run = Run(
        inventory_path,
        "train",
        "--script",
        EXIT,
        "--args",
        "--node 1 --code 3 --after 0.5",
        "--restarts",
        "3",
        "--skip-preflight",
    )
    run.wait_for("restart 1 of 3 in")  # attempt 1 failed; the job is between attempts
    stop = fab(inventory_path, "stop")
    assert stop.returncode == 0, stop.stderr
    assert run.finish() == 1
    job = job_of(run.text)
    rec = record(job)
    assert rec["state"] == "stopped", rec
    assert len(rec["attempts"]) <= 2 and "attempt 3" not in run.text
    assert "ended by 'fab stop'" in run.text
    assert project_containers("node1") == [] and project_containers("node2") == []
    for node in ("node1", "node2"):  # nothing of the job is left on the hosts
        assert on_host(node, f"test -e /opt/fabtrain/output/.runtime/{job}", check=False).returncode == 1

    # --resume --dry-run: the next attempt's plan with the changed options; nothing starts.
    attempts = len(rec["attempts"])
    dry = fab(
        inventory_path,
        "train",
        "--resume",
        job,
        "--dry-run",
        "--restarts",
        "0",
        "--hang-timeout",
        "30",
        "--args",
        "--node 0 --code 0",
    )
    assert dry.returncode == 0, dry.stderr
    assert (
        f"# ---- job {job} attempt {attempts + 1}: node1=rank 0 slots 0,1, node2=rank 1 slots 0,1"
        in dry.stdout
    )
    assert "--node 0 --code 0" in dry.stdout.replace("'", "") and "--node 1" not in dry.stdout
    assert "docker run" in dry.stdout and project_containers("node1") == []
    assert len(record(job)["attempts"]) == attempts
    # Options that would make it another job are refused, never dropped.
    for bad, why in (
        (["--module", "x.y"], "--module cannot change"),
        (["--epochs", "3"], "--epochs applies to"),
    ):
        r = fab(inventory_path, "train", "--resume", job, "--dry-run", *bad)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
    # --restarts 0 overrides the recorded 3: the resumed job fails once and ends.
    r = fab(
        inventory_path,
        "train",
        "--resume",
        job,
        "--restarts",
        "0",
        "--skip-preflight",
        "--args",
        "--node 1 --code 5 --after 0.5",
    )
    assert r.returncode == 1 and "no --restarts" in r.stderr, r.stderr
    rec = record(job)
    assert rec["restarts"] == 0 and len(rec["attempts"]) == attempts + 1


# The hang test's watchdog deadline, seconds (the ranks' stacks looked at every HANG / 5 s). Not
# less: on a 2-core machine running two workers, four ranks loading torch's C library stayed in one
# frame of `import torch` for 6 s, which a 6 s timeout rightly calls a hang of the whole job.
HANG = 10


def test_where_the_ranks_are_not_output_decides_a_hang(inventory_path):
    # Every rank waits in all_reduce (the last sleeps) while rank 0's logging thread prints every
    # 2 s, before any step was printed: caught from the ranks' stacks, the stuck ranks named.
    run = Run(
        inventory_path,
        "train",
        "--script",
        PROGRESS,
        "--args",
        "--mode chatty",
        "--hang-timeout",
        str(HANG),
        "--skip-preflight",
    )
    run.wait_for("stuck from ", timeout=180)
    run.wait_for("hang watchdog: stacks of every rank", timeout=60)
    seen = time.time()
    assert run.finish(timeout=120) == 1, run.text[-3000:]
    out = run.text
    # Four ranks print into one node's console at once: a line may hold the start of another.
    stuck = max(float(v) for v in re.findall(r"stuck from (\d+\.\d{3})", out))
    assert seen - stuck < HANG + 10, f"the hang was reported {seen - stuck:.1f}s after the ranks stopped"
    assert "hung: no progress" in out and "waiting for data" in out
    assert "rank 3 on node2: tests/integration/scripts/progress.py:" in out and "time.sleep(3600)" in out
    assert "failed: node2 (node rank 1) hung" in out  # the rank the others wait for
    # torch's flight recorder, read in the containers, names the same rank.
    verdict = (
        r"flight recorder: rank 3 on node2 never entered gloo:all_reduce #\d+ of process group \S+, "
        r"which rank\(s\) 0, 1, 2 wait in \(its newest: gloo:barrier #\d+\)"
    )
    assert re.search(verdict, out), out[-3000:]
    # The periodic looks stay out of the log: the stacks appear once per host, at the hang.
    assert out.count("hang watchdog: stacks of every rank on node1") == 1
    # A healthy job silent for 29 s: 15 s tokenizing (its main thread moves), then 14 s sleeping
    # with its heartbeat touched. Neither is a hang at --hang-timeout 10 (each phase 1.5 times it).
    r = fab(
        inventory_path,
        "train",
        "--script",
        PROGRESS,
        "--args",
        "--mode quiet-phase --compute 15 --quiet 14",
        "--hang-timeout",
        str(HANG),
        "--skip-preflight",
        timeout=240,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "rank 0 step 5" in r.stdout and "hang watchdog" not in r.stdout + r.stderr


def test_a_hung_module_names_its_ranks_and_frames(inventory_path):
    r = fab(
        inventory_path,
        "train",
        "--module",
        "tests.integration.scripts.hang",
        "--hang-timeout",
        "10",
        "--skip-preflight",
        timeout=240,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "rank 3 on node2: tests/integration/scripts/hang.py:14 in <module> `time.sleep(3600)`" in out
    assert "called from tests/integration/scripts/hang.py:15 `dist.all_reduce(t)`" in out
    # Which watch fires first is a matter of timing: node2 quiet for the timeout, or every node; both
    # blame node2, whose rank never entered the collective. The silence is measured when the watch
    # has looked again (SSH round trips): at least the timeout, more on a loaded machine.
    verdict = re.search(r"^.*failed: .* hung: .*$", r.stderr, re.MULTILINE)
    assert verdict, r.stderr[-2000:]
    blame = r"failed: node2 \(node rank 1\) hung: no progress from (any node|node2) for (\d+)s"
    said = re.search(blame, verdict[0])
    assert said and 10 <= int(said[2]) < 10 + 10, verdict[0][:500]


def test_a_frozen_engine_is_named_and_a_node_that_exited_0_is_never_blamed(inventory_path):
    # The ranks end 3 s after they report: long after node2's engine was frozen (at its container's start).
    run = Run(inventory_path, "train", "--script", REPORT, "--args", "--sleep 3", "--skip-preflight")
    try:
        wait_for_containers(["node1", "node2"])
        on_host("node2", "pkill -STOP -x dockerd; pkill -STOP -x containerd")
        start = time.monotonic()
        code = run.finish(timeout=150)
        took = time.monotonic() - start
    finally:
        on_host("node2", "pkill -CONT -x containerd; pkill -CONT -x dockerd", check=False)
    out = run.text
    assert code == 0, out[-3000:]
    assert "node2: its ranks exited with code 0, but its Docker engine has not confirmed it" in out
    assert "Docker engine stuck on node2" in out and "hang watchdog" not in out
    assert took < 10 + 60, took
    job = job_of(out)
    assert on_host("node2", f"test -e /opt/fabtrain/output/.runtime/{job}", check=False).returncode == 1
    assert fab(inventory_path, "stop").returncode == 0
    assert project_containers("node2") == []


def test_a_lost_hosts_secrets_are_removed_once_it_answers_again(inventory_path, tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cr3t\n")
    # QUICK_LOSS: the frozen host is lost after 6 s without an answer (3 x 2 s), not 15.
    inv2 = with_ssh(inventory_path, tmp_path / "secret.yaml", **QUICK_LOSS)
    inv2.write_text(inv2.read_text().replace("job:\n", f"job:\n  secret_files:\n    API_TOKEN: {secret}\n"))
    run = Run(inv2, "train", "--script", REPORT, "--args", "--sleep 300", "--skip-preflight")
    try:
        wait_for_containers(["node1", "node2"])
        faults.freeze("node2")
        assert run.finish(timeout=120) == 1
    finally:
        faults.thaw("node2")
    job = job_of(run.text)
    assert "no SSH keepalive answer" in run.text
    left = f"/opt/fabtrain/output/.runtime/{job}/secrets.env"
    assert on_host("node2", f"test -e {left}", check=False).returncode == 0  # lost: nobody could remove it
    assert on_host("node1", f"test -e {left}", check=False).returncode == 1
    r = subprocess.run(
        [FAB, "stop", "--inventory", str(inv2)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "FABTRAIN_LEASE_STALE": "2"},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"node2: removed the left-over runtime files (secrets included) of {job}" in r.stdout
    assert on_host("node2", f"test -e {left}", check=False).returncode == 1
