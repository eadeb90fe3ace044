"""The exported sbatch script on a real Slurm: the test hosts run munged and slurmd (slurmctld on
node1), started by slurmbed.slurm_up next to their sshd and Docker engine."""

import json
import re
import signal
import subprocess
import time

import pytest

from orchestrator.testbed import cluster as cluster_mod
from orchestrator.testbed import slurmbed

from .conftest import ADDRESS, CONTAINER, ROOT, Run, command, fab, on_host, project_containers

GPT = [
    "--model",
    "tiny",
    "--epochs",
    "2",
    "--args",
    "--max-steps-per-epoch 30 --log-every 5 --sample-chars 0",
]


@pytest.fixture(scope="module")
def slurm(inventory_path):
    slurmbed.slurm_up(cluster_mod.engine_client(), cluster_mod.node_infos(2), cluster_mod.STATE_DIR)
    r = fab(inventory_path, "sync")
    assert r.returncode == 0, r.stderr
    return inventory_path


def submit(inventory_path, tmp_path, *args) -> tuple[str, str, float]:
    """Export the job, copy the script to node1 and sbatch it there: (slurm job id, fabtrain job
    id, the time of submission)."""
    script = tmp_path / "job.sbatch"
    r = fab(inventory_path, "export.slurm", *args, "--out", str(script))
    assert r.returncode == 0, r.stderr
    job = re.search(r"\(job (\S+)\)", r.stdout).group(1)
    subprocess.run(
        ["docker", "exec", "-i", CONTAINER["node1"], "sh", "-c", "cat > /root/job.sbatch"],
        input=script.read_bytes(),
        check=True,
    )
    submitted = time.monotonic()
    out = on_host("node1", "cd /root && sbatch --parsable job.sbatch").stdout.strip()
    return out.split(";")[0], job, submitted


def job_state(slurm_id: str) -> dict[str, str]:
    out = on_host("node1", f"scontrol show job --oneliner {slurm_id}").stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_done(slurm_id: str, timeout: float = 300) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(slurm_id)
        if state.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None):
            return state
        time.sleep(1)
    raise AssertionError(f"slurm job {slurm_id} still {job_state(slurm_id).get('JobState')} after {timeout}s")


def output(job: str, slurm_id: str) -> str:
    return on_host("node1", f"cat /root/{job}-{slurm_id}.out", check=False).stdout


def wait_for(job: str, slurm_id: str, needle: str, timeout: float = 180) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in output(job, slurm_id):
            return time.monotonic()
        time.sleep(0.5)
    raise AssertionError(f"{needle!r} never appeared in the job's output:\n{output(job, slurm_id)[-3000:]}")


def sacct_state(slurm_id: str) -> str:
    """The job's state in sacct (from the job completion log: no accounting database here)."""
    out = on_host(
        "node1", f"sacct --completion --noheader --parsable2 -j {slurm_id} --format JobID,State"
    ).stdout
    return dict(line.split("|") for line in out.split())[slurm_id]


@pytest.fixture(autouse=True)
def slurm_idle(slurm):
    """Each test starts and leaves the Slurm cluster idle: a test that fails midway must not leave a
    job holding the nodes (and their claims) for the tests after it."""

    def settle():
        on_host("node1", "scancel --user root", check=False)
        deadline = time.monotonic() + 90
        while on_host("node1", "squeue --noheader", check=False).stdout.strip() or on_host(
            "node1", "sinfo --noheader --format %T", check=False
        ).stdout.split() != ["idle"]:
            if time.monotonic() > deadline:
                break
            on_host("node1", "scontrol update nodename=node[1-2] state=resume", check=False)
            time.sleep(1)
        for node in ("node1", "node2"):
            on_host(
                node, "docker ps -aq --filter label=fabtrain.managed=1 | xargs -r docker rm -f", check=False
            )
        # After a node was set DOWN under a running step (the requeue tests), this Slurm (22.05) can
        # keep that step's resources counted: the next job stays PENDING (Resources) on IDLE+PLANNED
        # nodes for minutes. Rebuilding the controller's view from its jobs clears it at once.
        on_host("node1", "scontrol reconfigure", check=False)

    settle()
    yield
    settle()


def test_exported_script_trains_across_two_slurm_nodes(slurm, tmp_path):
    slurm_id, job, submitted = submit(slurm, tmp_path, *GPT)
    first_step = wait_for(job, slurm_id, "| step ")
    state = wait_done(slurm_id)
    text = output(job, slurm_id)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", text[-3000:]
    print(f"sbatch -> first training step: {first_step - submitted:.1f}s")
    # srun --label: both nodes' containers reported, 2 nodes x 2 processes = world 4.
    assert re.search(
        rf"^0: \[fabtrain\] nodes=2 node_rank=0 master={re.escape(ADDRESS['node1'])}:29500 .*world_size=4",
        text,
        re.M,
    )
    assert re.search(r"^1: \[fabtrain\] nodes=2 node_rank=1 ", text, re.M)
    evals = [float(m) for m in re.findall(r"eval loss (\d+\.\d+)", text)]
    assert len(evals) == 2 and evals[1] < evals[0], text[-3000:]
    assert project_containers("node1") == [] and project_containers("node2") == []
    assert sacct_state(slurm_id) == "COMPLETED"


def test_a_killed_node_task_ends_the_slurm_job(slurm, tmp_path):
    slurm_id, job, _ = submit(slurm, tmp_path, "--model", "tiny", "--epochs", "50", "--args", "--log-every 1")
    wait_for(job, slurm_id, "| step ")
    on_host("node2", f"docker kill fabtrain-{job}-r1")
    killed = time.monotonic()
    state = wait_done(slurm_id, timeout=180)
    took = time.monotonic() - killed
    text = output(job, slurm_id)
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0", (state, text[-3000:])
    assert sacct_state(slurm_id) == "FAILED"
    print(f"container killed -> slurm job FAILED: {took:.1f}s")
    assert project_containers("node1") == [] and project_containers("node2") == []


def test_job_requeued_after_a_node_failure_resumes_from_its_snapshot(slurm, tmp_path):
    """node2 marked DOWN mid-run (Slurm's node failure): the job is requeued, runs again with the
    same output directory and every rank resumes from rank 0's newest snapshot (node2's disk never
    had it: rank 0 sends it), then finishes."""
    slurm_id, job, _ = submit(
        slurm,
        tmp_path,
        "--model",
        "tiny",
        "--epochs",
        "2",
        "--args",
        "--max-steps-per-epoch 40 --snapshot-every 10 --log-every 1 --sample-chars 0",
    )
    wait_for(job, slurm_id, "| step 25 |")
    on_host("node1", "scontrol update nodename=node2 state=down reason=fabtrain-test")
    deadline = time.monotonic() + 60
    while (state := job_state(slurm_id)).get("Restarts") != "1" or state.get("JobState") != "PENDING":
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    on_host("node1", "scontrol update nodename=node2 state=resume", check=False)  # may be back already
    # Slurm holds a requeued job for 2 minutes once it is pending again; start it now, once node2 is
    # idle again (started while node2 was still coming back, its steps waited for "busy" nodes).
    deadline = time.monotonic() + 60
    while (node2 := on_host("node1", "sinfo --noheader --nodes node2 --format %T").stdout.strip()) != "idle":
        assert time.monotonic() < deadline, f"node2 is {node2}, not idle, 60s after resume"
        time.sleep(0.5)
    on_host("node1", f"scontrol update jobid={slurm_id} StartTime=now")
    state = wait_done(slurm_id)
    text = output(job, slurm_id)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, text[-3000:])
    assert f"slurm job {slurm_id} (restart 1)" in text
    after = text.split("(restart 1)", 1)[1]
    assert re.search(
        r"^0: \[node1 rank0\] resumed from /output/snapshots/snapshot-0000000[23]0\.pt", after, re.M
    )
    assert re.search(r"^1: \[node2 rank2\] resumed from .*\(rank 0's copy\)", after, re.M), after[:3000]
    assert "| step 1 |" not in after and "epoch 1 done | eval loss" in after
    assert project_containers("node1") == [] and project_containers("node2") == []


# ---------------------------------------------------------------- fab train --on slurm


@pytest.fixture(scope="module")
def slurm_inventory(slurm):
    """The test hosts' inventory with a slurm: section (login node: node1, Slurm's controller)."""
    path = slurm.parent / "slurm.yaml"
    path.write_text(cluster_mod.render_inventory(cluster_mod.node_infos(2), slurm=True))
    return path


@pytest.fixture(scope="module")
def shared_inventory(slurm):
    """As slurm_inventory, with job.output_dir (and so slurm.workdir) in /shared: one directory
    bind-mounted into both test hosts, as a shared filesystem is on a Slurm cluster."""
    path = slurm.parent / "slurm-shared.yaml"
    text = cluster_mod.render_inventory(cluster_mod.node_infos(2), slurm=True)
    path.write_text(text.replace("job:\n", "job:\n  output_dir: /shared/output\n", 1))
    return path


def record(job: str) -> dict:
    return json.loads((ROOT / "runs" / job / "job.json").read_text())


def job_of(text: str) -> str:
    return re.search(r"submitted job (\S+) as slurm job (\d+)", text).group(1)


def test_fab_train_on_slurm_streams_both_nodes_and_exits_with_the_jobs_result(slurm_inventory):
    r = fab(slurm_inventory, "train", "--on", "slurm", "--plain", *GPT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    job = job_of(r.stdout)
    slurm_id = record(job)["backend"]["slurm_id"]
    # Every node's lines, with the same prefixes as an SSH job, in the terminal and in runs/JOB/NODE.log.
    assert re.search(r"^node1 r0 \| \[node1 rank0\] epoch 1 \| step \d+ \| loss", r.stdout, re.M), r.stdout[
        -3000:
    ]
    assert re.search(r"^node2 r1 \| \[node2 rank2\] epoch 1 \| step \d+ \| loss", r.stdout, re.M)
    assert f"[fabtrain] slurm job {slurm_id}: RUNNING on node[1-2]" in r.stdout
    run = ROOT / "runs" / job
    assert "[node2 rank3] epoch 1 done" not in (run / "node1.log").read_text()
    assert (
        "eval loss" in (run / "node1.log").read_text() and "[node2 rank2]" in (run / "node2.log").read_text()
    )
    assert f"slurm job {slurm_id} (restart 0)" in (run / "slurm.log").read_text()
    # The curve, drawn from rank 0's metrics fetched through the login node, and the record.
    assert (run / "loss.png").stat().st_size > 10_000 and (run / "outputs/node1/metrics.jsonl").is_file()
    rec = record(job)
    assert rec["state"] == "finished" and [a["hosts"] for a in rec["attempts"]] == [["node1", "node2"]]
    runs = json.loads(
        subprocess.run([*command(ROOT), "runs", "--json"], cwd=ROOT, capture_output=True, text=True).stdout
    )["runs"]
    assert any(x["job"] == job and x["state"] == "finished" and x["on"] == "slurm" for x in runs)
    assert sacct_state(slurm_id) == "COMPLETED"
    assert project_containers("node1") == [] and project_containers("node2") == []


def long_job(inventory) -> tuple[Run, str, str]:
    """A 50-epoch fab train --on slurm in the background, once it trains: (run, job, slurm id)."""
    run = Run(
        inventory,
        "train",
        "--on",
        "slurm",
        "--plain",
        "--model",
        "tiny",
        "--epochs",
        "50",
        "--args",
        "--log-every 1 --sample-chars 0",
    )
    run.wait_for("| step ", timeout=180)
    job = job_of(run.text)
    return run, job, record(job)["backend"]["slurm_id"]


def test_fab_stop_job_cancels_a_slurm_job_and_its_containers(slurm_inventory):
    run, job, slurm_id = long_job(slurm_inventory)
    # Resuming it while Slurm runs it is refused, naming it; nothing is submitted (fab status: one job).
    again = fab(slurm_inventory, "train", "--on", "slurm", "--plain", "--resume", job)
    assert again.returncode == 2 and (
        f"--resume {job}: that job is still on Slurm (slurm job {slurm_id} RUNNING)" in again.stderr
    ), again.stdout + again.stderr
    assert record(job)["backend"]["slurm_id"] == slurm_id and record(job)["state"] == "running"
    status = json.loads(fab(slurm_inventory, "status", "--json").stdout)
    assert [(s["job"], s["state"], s["nodes"]) for s in status["slurm"]] == [(job, "RUNNING", "node[1-2]")]
    # fab logs follows it from the start, each node's lines prefixed; Ctrl+C only detaches.
    logs = Run(slurm_inventory, "logs", "--job", job, "--plain")
    logs.wait_for("node2 r1 | [node2 rank2] epoch 0 | step ", timeout=60)
    assert "node1 r0 | [fabtrain] nodes=2 node_rank=0" in logs.text
    logs.proc.send_signal(signal.SIGINT)
    assert logs.finish(timeout=30) == 0 and "detached; the job goes on" in logs.text
    assert record(job)["state"] == "running" and job_state(slurm_id)["JobState"] == "RUNNING"
    stopped = fab(slurm_inventory, "stop", "--job", job)
    assert stopped.returncode == 0 and f"stopped {job} (slurm job {slurm_id}: CANCELLED)" in stopped.stdout, (
        stopped.stdout + stopped.stderr
    )
    code = run.finish(timeout=120)
    assert code != 0 and f"slurm job {slurm_id} ended CANCELLED" in run.text, run.text[-2000:]
    assert sacct_state(slurm_id) == "CANCELLED"
    assert project_containers("node1") == [] and project_containers("node2") == []
    assert record(job)["state"] == "stopped"
    assert json.loads(fab(slurm_inventory, "status", "--json").stdout)["slurm"] == []


def test_fab_train_on_slurm_with_a_shared_output_dir_is_requeued_and_resumes(shared_inventory):
    """output_dir shared by both nodes (each keeps its own runtime files there); node2 set DOWN
    mid-run: Slurm requeues the job, the stream shows attempt 2, every rank resumes from the newest
    snapshot in the shared directory, and the job finishes."""
    run = Run(
        shared_inventory,
        "train",
        "--on",
        "slurm",
        "--plain",
        "--model",
        "tiny",
        "--epochs",
        "2",
        "--args",
        "--max-steps-per-epoch 40 --snapshot-every 10 --log-every 1 --sample-chars 0",
    )
    run.wait_for("| step 25 |", timeout=180)
    job = job_of(run.text)
    slurm_id = record(job)["backend"]["slurm_id"]
    # Both nodes' runtime directories side by side in the one shared directory.
    assert on_host("node2", f"ls /shared/output/.runtime/{job}").stdout.split() == [
        f"{slurm_id}.0.0",
        f"{slurm_id}.0.1",
    ]
    on_host("node1", "scontrol update nodename=node2 state=down reason=fabtrain-test")
    run.wait_for(f"attempt 2: Slurm requeued job {slurm_id} (restart 1)", timeout=60)
    deadline = time.monotonic() + 60
    while job_state(slurm_id).get("JobState") != "PENDING":  # requeued once the old attempt has left
        assert time.monotonic() < deadline, job_state(slurm_id)
        time.sleep(0.5)
    on_host("node1", "scontrol update nodename=node2 state=resume", check=False)
    deadline = time.monotonic() + 60
    while on_host("node1", "sinfo --noheader --nodes node2 --format %T").stdout.strip() != "idle":
        assert time.monotonic() < deadline, "node2 not idle 60s after resume"
        time.sleep(0.5)
    # Each requeue (one more while node2 comes back is seen) holds the job for 2 minutes: skip them.
    seen = []
    deadline = time.monotonic() + 240
    while run.proc.poll() is None and time.monotonic() < deadline:
        state = job_state(slurm_id)
        seen.append((state.get("JobState"), state.get("Reason"), state.get("Restarts")))
        if state.get("JobState") == "PENDING" and state.get("Reason") == "BeginTime":
            on_host("node1", f"scontrol update jobid={slurm_id} StartTime=now", check=False)
        time.sleep(2)
    assert run.finish(timeout=5) == 0, f"{sorted(set(seen), key=seen.index)}\n{run.text[-3000:]}"
    after = run.text.split("(restart 1)", 1)[1]
    assert re.search(
        r"^node1 r0 \| \[node1 rank0\] resumed from /output/snapshots/snapshot-0000000[23]0\.pt", after, re.M
    ), after[:3000]
    assert re.search(
        r"^node2 r1 \| \[node2 rank2\] resumed from /output/snapshots/snapshot-0000000[23]0\.pt", after, re.M
    )
    assert "| step 1 |" not in after and "epoch 1 done | eval loss" in after
    rec = record(job)
    # Slurm may requeue more than once while node2 comes back; each requeue is an attempt.
    outcomes = [a["outcome"] for a in rec["attempts"]]
    assert len(outcomes) >= 2 and set(outcomes[:-1]) == {"requeued"} and outcomes[-1] == "finished", outcomes
    assert rec["state"] == "finished"
    assert sacct_state(slurm_id) == "COMPLETED"
    assert project_containers("node1") == [] and project_containers("node2") == []
    # The finished job trained further: the same id and shared output directory, a new Slurm job.
    more = fab(shared_inventory, "train", "--on", "slurm", "--plain", "--resume", job, "--epochs", "3")
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr
    assert (
        f"resuming job {job} on Slurm ({len(outcomes)} attempt(s) so far, finished); now args '--model tiny "
        "--epochs 3" in more.stdout
    )
    assert re.search(
        r"^node2 r1 \| \[node2 rank2\] resumed from /output/snapshots/snapshot-\d+\.pt", more.stdout, re.M
    )
    assert "epoch 2 done | eval loss" in more.stdout and "epoch 1 done" not in more.stdout
    rec = record(job)
    assert len(rec["attempts"]) == len(outcomes) + 1 and rec["state"] == "finished"
    assert rec["backend"]["earlier"] == [slurm_id]
    assert rec["attempts"][-1]["hosts"] == ["node1", "node2"] and len(rec["resumes"]) == 1


def test_ctrl_c_on_fab_train_on_slurm_cancels_the_job(slurm_inventory):
    run, job, slurm_id = long_job(slurm_inventory)
    run.proc.send_signal(signal.SIGINT)
    code = run.finish(timeout=120)
    assert code != 0 and f"Ctrl+C: cancelling slurm job {slurm_id} (scancel)" in run.text, run.text[-2000:]
    assert f"slurm job {slurm_id} ended CANCELLED" in run.text
    assert sacct_state(slurm_id) == "CANCELLED" and record(job)["state"] == "interrupted"
    deadline = time.monotonic() + 60  # the tasks' traps stop the containers as the job leaves its nodes
    while project_containers("node1") or project_containers("node2"):
        assert time.monotonic() < deadline, "containers left 60s after the job was cancelled"
        time.sleep(0.5)
