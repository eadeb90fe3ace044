"""A detached job's brain out of the blast radius, on the local cluster: its controller's host
frozen (docker pause) while it also runs rank 0, and its controller's container killed. The standby
takes the job over from its mirror of the record and snapshots; the job finishes once; another
clone follows it; the old controller, thawed, stops itself; nothing of the job is left."""

import json
import re
import subprocess
import time

from orchestrator.testbed import faults

from .conftest import ROOT, fab, on_host, project_containers, with_ssh
from .test_controller import status_doc

CONTROLLERS = "/opt/fabtrain/output/.controllers"
# Epochs of 40 steps, a snapshot every 10: 12 of them are long enough to be killed mid-run and
# followed, 4 to be frozen after the first snapshot is mirrored and resumed on another host (rank 0
# frozen, the job cannot end before the standby takes it over).
STEPS = "--snapshot-every 10 --max-steps-per-epoch 40 --sample-chars 0"
NODES = ("node1", "node2", "node3")


def detach(inventory_path, *more, epochs: int = 12) -> tuple[str, str]:
    r = fab(
        inventory_path,
        "train",
        "--model",
        "tiny",
        "--epochs",
        str(epochs),
        "--args",
        STEPS,
        *more,
        "--detach",
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    job = re.search(r"job (\S+) detached: its controller runs on", r.stdout).group(1)
    return job, r.stdout


def wait_on(node: str, test: str, timeout: float, what: str) -> float:
    """Until `test` (a shell test) holds on `node`: the seconds it took."""
    start = time.monotonic()
    while on_host(node, test, check=False).returncode != 0:
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout}s"
        time.sleep(0.5)
    return time.monotonic() - start


def step_of(inventory_path, job: str) -> int:
    rows = {j["job"]: j for j in status_doc(inventory_path)["jobs"]}
    return (rows.get(job) or {}).get("step") or 0


def nothing_left(job: str) -> None:
    for node in NODES:
        assert project_containers(node) == [], node
        left = on_host(
            node,
            f"docker ps -aq --filter label=fabtrain.controller={job}; "
            f"ls {CONTROLLERS} 2>/dev/null | grep -x {job}; "
            f"grep -c {job} ~/.ssh/authorized_keys",
            check=False,
        )
        assert left.stdout.split() == ["0"], (node, left.stdout)


def test_a_frozen_controller_host_that_ran_rank_0_loses_nothing(spares_inventory_path, tmp_path):
    """2 hosts + 1 spare, the controller forced onto node1 (rank 0's host): frozen mid-run, the
    standby on node3 takes over, node3 takes rank 0 from the newest snapshot, the job finishes; a
    second clone fetches its logs, events and final snapshot; thawed, the old controller stops itself."""
    # Each connection to the frozen host waits connect_timeout for an answer (the new controller's end
    # makes 4 in a row, fab logs here several): 3 s here instead of the default 10 s.
    inv = with_ssh(spares_inventory_path, tmp_path / "inventory.yaml", connect_timeout=3)
    inv.write_text(inv.read_text() + "controller: {host: node1}\n")
    job, said = detach(inv, "--restarts", "2", epochs=4)
    assert "controller on node1 (the inventory's controller: host); its standby on node3" in said, said
    assert "Risk: node1 also runs rank 0 of the job" in said, said
    frozen = False
    try:
        # A snapshot mirrored on node3 before the freeze: the newest state lives on two hosts.
        wait_on(
            "node3",
            f"ls {CONTROLLERS}/{job}/mirror/runs/{job}/snapshots | grep -q snapshot-",
            240,
            "a snapshot in the standby's mirror",
        )
        faults.freeze("node1")
        frozen = True
        took = wait_on("node3", f"test -e {CONTROLLERS}/{job}/taken", 60, "the standby taking over")
        print(f"controller host frozen -> a new controller on node3: {took:.1f}s")
        assert took <= 30, took
        ended = wait_on("node3", f"test -e {CONTROLLERS}/{job}/done.json", 400, "the job's end")
        print(f"... and the job's end {ended:.1f}s later")
        # Another laptop: a clone with no record of the job follows it from the hosts.
        laptop = tmp_path / "laptop"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(laptop)], check=True)
        other = fab(inv, "logs", "--job", job, "--plain", cwd=laptop, timeout=300)
        assert other.returncode == 0, (other.stdout + other.stderr)[-3000:]
        assert f"job {job} ended" in other.stdout and "copied from its controller on node3" in other.stdout
        copied = laptop / "runs" / job
        assert not (copied / "job.json").exists()  # a host's record is never taken as one here
        events = [json.loads(line) for line in (copied / "events.jsonl").read_text().splitlines()]
        kinds = [e["event"] for e in events]
        assert "controller_lost" in kinds and "controller_started" in kinds and kinds[-1] == "finished"
        lost = next(e for e in events if e["event"] == "controller_lost")
        assert lost["host"] == "node1" and "does not answer" in lost["why"]
        started = next(e for e in events if e["event"] == "controller_started")
        assert started["host"] == "node3" and started["from_host"] == "node1"
        assert sorted(p.name for p in (copied / "snapshots").glob("snapshot-*.pt"))
        assert (copied / "node3.log").is_file() and (copied / "node1.log").is_file()
        # This machine, which started it: its logs fetch the run, node1 still frozen.
        logs = fab(inv, "logs", "--job", job, "--plain", timeout=300)
        said = (logs.stdout + logs.stderr)[-3000:]
        assert logs.returncode == 0 and f"job {job} finished" in logs.stdout, said
        record = json.loads((ROOT / "runs" / job / "job.json").read_text())
        assert record["state"] == "finished" and record["controller"]["ended_on"] == "node3"
        attempts = record["attempts"]
        assert len(attempts) >= 2 and attempts[-1]["hosts"][0] == "node3", attempts
        assert attempts[-1]["resumed_from"], attempts
        node3 = (ROOT / "runs" / job / "node3.log").read_text()
        # From memory (node2's keeper held rank 0's and 1's replicas), or the newest snapshot if as new.
        assert re.search(r"resumed from (memory|/output/snapshots/snapshot-)", node3), node3[-3000:]
        faults.thaw("node1")
        frozen = False
        # Thawed: the old controller learns it was taken over and stops itself.
        gone = wait_on(
            "node1",
            f'test -z "$(docker ps -q --filter label=fabtrain.controller={job})"',
            60,
            "the old controller stopping",
        )
        print(f"thawed -> the old controller gone in {gone:.1f}s")
        status = fab(inv, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        fab(inv, "stop", "--job", job, "--grace", "0")  # rank 0's container of attempt 1, frozen with node1
        nothing_left(job)
    finally:
        if frozen:
            faults.thaw("node1")
        fab(inv, "stop", "--job", job, "--grace", "0")


def test_a_killed_controller_is_back_within_15s_and_training_never_stops(inventory_path):
    """2 hosts, no spare: the controller on node2 (the last host), its standby on node1. Its
    container killed mid-run: the standby follows the running attempt within 15 s; the job trains
    on and finishes once, in one attempt."""
    job, said = detach(inventory_path)
    assert "controller on node2 (the last host" in said and "its standby on node1" in said, said
    try:
        deadline = time.monotonic() + 180
        while step_of(inventory_path, job) < 20:
            assert time.monotonic() < deadline, f"job {job} never reached step 20"
            time.sleep(1)
        on_host("node2", f"docker kill fabtrain-ctl-{job}")
        took = wait_on("node1", f"test -e {CONTROLLERS}/{job}/taken", 30, "the standby taking over")
        print(f"controller killed -> a new controller on node1: {took:.1f}s")
        assert took <= 15, took
        logs = fab(inventory_path, "logs", "--job", job, "--plain", timeout=400)
        said = (logs.stdout + logs.stderr)[-3000:]
        assert logs.returncode == 0 and f"job {job} finished" in logs.stdout, said
        run = ROOT / "runs" / job
        record = json.loads((run / "job.json").read_text())
        assert record["state"] == "finished" and len(record["attempts"]) == 1, record["attempts"]
        kinds = [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]
        assert kinds.count("finished") == 1 and "controller_started" in kinds
        assert kinds.count("attempt") == 1  # no container started twice
        nothing_left(job)
    finally:
        fab(inventory_path, "stop", "--job", job, "--grace", "0")
