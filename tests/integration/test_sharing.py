"""Several jobs, and several people, on one cluster at once (claims.py): jobs on disjoint hosts or
on disjoint CPU slots of the same hosts run side by side with their own master ports; an overlap is
refused naming the holder; two jobs started at the same moment over the same hosts end with exactly
one running and nothing left of the other; `fab stop` ends your own jobs, `--job` one, `--all`
everyone's; a failure in one job never touches another."""

import json
import os
import re
import secrets
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from .conftest import FAB, ROOT, Run, fab, on_host

REPORT = "tests/integration/scripts/report.py"
COMMON = ("train", "--script", REPORT, "--skip-preflight", "--plain")


def newest_run(name: str) -> str:
    return max(p.name for p in (ROOT / "runs").glob(f"{name}-*"))


def wait_for_job(name: str, nodes: list[str], timeout: float = 120) -> str:
    """The id of the job started with --name NAME, once it has a running container on each node."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = list((ROOT / "runs").glob(f"{name}-*"))
        if runs:
            job = runs[0].name
            if all(
                on_host(n, f"docker ps -q --filter label=fabtrain.job={job}").stdout.strip() for n in nodes
            ):
                return job
        time.sleep(0.3)
    raise AssertionError(f"job {name} never ran on {nodes}")


def containers_of(job: str, node: str) -> list[str]:
    return on_host(node, f"docker ps -aq --filter label=fabtrain.job={job}").stdout.split()


def last_step(inventory_path, job: str) -> int | None:
    r = fab(inventory_path, "status", "--json", timeout=60)
    rows = {row["job"]: row for row in json.loads(r.stdout)["jobs"]}
    return rows.get(job, {}).get("step")


def traces(job_name: str, nodes: list[str]) -> list[str]:
    """Anything of a job left on the hosts: containers, claim files, runtime directories (secrets)."""
    found = []
    for n in nodes:
        out = on_host(
            n,
            f"docker ps -aq --filter name={job_name}; "
            f"ls /opt/fabtrain/output/.claims/*/ /opt/fabtrain/output/.runtime/ 2>/dev/null | "
            f"grep -F {job_name} || true",
        ).stdout.split()
        found += [f"{n}: {x}" for x in out]
    return found


def test_two_jobs_on_four_hosts_one_killed_and_one_stopped_never_touch_the_other(four_hosts_inventory_path):
    inv = four_hosts_inventory_path
    tag = secrets.token_hex(2)
    steps = ("--nproc", "1", "--args", "--steps 400 --step-time 0.25")
    a = Run(inv, *COMMON, *steps, "--include", "node1@node2", "--restarts", "1", "--name", f"share-a-{tag}")
    b = Run(
        inv,
        *COMMON,
        "--nproc",
        "1",
        "--args",
        "--steps 120 --step-time 0.25",
        "--include",
        "node3@node4",
        "--name",
        f"share-b-{tag}",
    )
    try:
        job_a = wait_for_job(f"share-a-{tag}", ["node1", "node2"])
        job_b = wait_for_job(f"share-b-{tag}", ["node3", "node4"])
        ids_b = {n: containers_of(job_b, n) for n in ("node3", "node4")}
        b.wait_for("step 5")
        # A's container on node2 killed: A restarts (attempt 2) on its own hosts; B is untouched.
        on_host("node2", f"docker kill $(docker ps -q --filter label=fabtrain.job={job_a})")
        a.wait_for("attempt 2", timeout=120)
        deadline = time.monotonic() + 120
        while "step 2" not in a.text.split("attempt 2", 1)[1]:
            assert time.monotonic() < deadline and a.proc.poll() is None, a.text[-2000:]
            time.sleep(0.2)
        step_before = last_step(inv, job_b)
        # A stopped by id: it ends without restarting; B keeps the same containers, its step rising.
        stop = fab(inv, "stop", "--job", job_a, "--grace", "2")
        assert stop.returncode == 0, stop.stderr
        assert f"stopped {job_a}" in stop.stdout and job_b not in stop.stdout
        assert a.finish(timeout=120) == 1 and "ended by 'fab stop'" in a.text, a.text[-2000:]
        assert containers_of(job_a, "node1") == [] and containers_of(job_a, "node2") == []
        assert {n: containers_of(job_b, n) for n in ("node3", "node4")} == ids_b
        # B's step, read again by fab status until it has risen (this machine's two CPUs are busy
        # with A's teardown meanwhile; a read may find no step line in the tail yet).
        deadline, step_after = time.monotonic() + 60, None
        while time.monotonic() < deadline and not (step_after and step_before and step_after > step_before):
            time.sleep(2)
            step_after = last_step(inv, job_b)
        assert step_before is not None and step_after is not None and step_after > step_before, (
            step_before,
            step_after,
        )
        assert "attempt 2" not in b.text and "exited with code" not in b.text
        assert b.finish(timeout=180) == 0, b.text[-2000:]
        assert f"job {job_b} finished on every host" in b.text
        assert json.loads((ROOT / "runs" / job_b / "job.json").read_text())["selected"] == ["node3", "node4"]
    finally:
        a.proc.kill()
        b.proc.kill()
        fab(inv, "stop", "--all", "--yes", "--grace", "0")


def test_cpu_jobs_share_hosts_by_slot_and_stop_ends_only_your_own(inventory_path):
    tag = secrets.token_hex(2)
    # alice and bob each take one CPU slot of the same two hosts; each gets its own master port.
    alice = Run(
        inventory_path,
        *COMMON,
        "--args",
        "--steps 400 --step-time 0.25",
        "--include",
        "node1:0@node2:0",
        "--name",
        f"alice-{tag}",
        env={**os.environ, "FABTRAIN_USER": "alice"},
    )
    # bob starts at once: his slot (1) is not alice's (0); the claims' lock orders the two starts.
    bob = Run(
        inventory_path,
        *COMMON,
        "--args",
        "--steps 400 --step-time 0.25",
        "--include",
        "node1:1@node2:1",
        "--name",
        f"bob-{tag}",
        env={**os.environ, "FABTRAIN_USER": "bob"},
    )
    done = False
    try:
        job_a = wait_for_job(f"alice-{tag}", ["node1", "node2"])
        job_b = wait_for_job(f"bob-{tag}", ["node1", "node2"])
        alice.wait_for("step 2")
        bob.wait_for("step 2")
        ports = {re.search(r"master=\S+:(\d+)", r.text).group(1) for r in (alice, bob)}
        assert len(ports) == 2, (alice.text[-1000:], bob.text[-1000:])
        assert "procs_per_node=1 world_size=2" in alice.text
        # A third job wanting a slot on both hosts is refused, naming both holders and who they are.
        third = fab(inventory_path, *COMMON, "--nproc", "1", "--name", f"carol-{tag}", timeout=120)
        assert third.returncode == 1 and "Traceback" not in third.stderr, third.stderr
        assert f"{job_a} (started by alice@" in third.stderr and f"{job_b} (started by bob@" in third.stderr
        assert "free there: none" in third.stderr and not list((ROOT / "runs").glob(f"carol-{tag}-*"))
        # fab status and fab top read the hosts at once (neither changes anything there).
        with ThreadPoolExecutor(2) as pool:
            looks = [
                pool.submit(fab, inventory_path, "status", "--json"),
                pool.submit(fab, inventory_path, "top", "--json", timeout=60),
            ]
            seen, shown = (look.result() for look in looks)
        status = json.loads(seen.stdout)
        rows = {r["job"]: r for r in status["jobs"]}
        assert rows[job_a]["hosts"]["node1"]["units"] == [0] and rows[job_b]["hosts"]["node2"]["units"] == [1]
        assert rows[job_a]["who"].startswith("alice@") and rows[job_a]["state"] == "running"
        # fab top --json: on each host, slot 0 is alice's job and slot 1 bob's, each container with
        # its job, CPU and memory; the jobs with their owners and alice's step.
        assert shown.returncode == 0, shown.stderr
        snap = json.loads(shown.stdout)
        assert [h["host"] for h in snap["hosts"]] == ["node1", "node2"] and snap["errors"] == []
        for host in snap["hosts"]:
            assert host["answered"] and host["kind"] == "slot" and host["vendor"] == "none", host
            holders = {s["unit"]: (s["job"], (s["who"] or "").partition("@")[0]) for s in host["slots"]}
            assert holders[0] == (job_a, "alice") and holders[1] == (job_b, "bob"), (host["host"], holders)
            ours = [c for c in host["containers"] if c["job"] in (job_a, job_b)]
            assert sorted(c["job"] for c in ours) == sorted([job_a, job_b]), host["containers"]
            assert all(c["cpu"] >= 0 and c["mem"] > 0 for c in ours), ours
            assert host["load"]["cpus"] == len(host["slots"]) and host["load"]["mem_total"] > 0
        tops = {j["job"]: j for j in snap["jobs"]}
        assert tops[job_a]["who"].startswith("alice@") and tops[job_b]["who"].startswith("bob@")
        assert tops[job_a]["hosts"] == {"node1": [0], "node2": [0]} and tops[job_a]["step"] >= 2
        # bob's `fab stop` ends bob's job and lists alice's as left alone.
        stop = fab(inventory_path, "stop", "--grace", "1", env={**os.environ, "FABTRAIN_USER": "bob"})
        assert stop.returncode == 0, stop.stderr
        assert f"stopped {job_b}" in stop.stdout and f"left alone: {job_a} of alice@" in stop.stdout
        assert bob.finish(timeout=120) == 1 and "ended by 'fab stop'" in bob.text
        assert containers_of(job_a, "node1") and containers_of(job_a, "node2")
        # --all without a terminal and without --yes stops nothing.
        refused = fab(
            inventory_path,
            "stop",
            "--all",
            env={**os.environ, "FABTRAIN_USER": "bob"},
            stdin=subprocess.DEVNULL,
        )
        assert refused.returncode == 2 and "add --yes" in refused.stderr and containers_of(job_a, "node1")
        everything = fab(
            inventory_path,
            "stop",
            "--all",
            "--yes",
            "--grace",
            "1",
            env={**os.environ, "FABTRAIN_USER": "bob"},
        )
        assert everything.returncode == 0 and f"stopped {job_a}" in everything.stdout
        assert alice.finish(timeout=120) == 1
        assert traces(job_a, ["node1", "node2"]) == [] and traces(job_b, ["node1", "node2"]) == []
        listed = subprocess.run(
            [FAB, "-r", str(ROOT), "runs", "--json"], cwd=ROOT, capture_output=True, text=True
        )
        runs = {r["job"]: r for r in json.loads(listed.stdout)["runs"]}
        assert runs[job_a]["state"] == runs[job_b]["state"] == "stopped"
        done = True  # both ended by the body's fab stop --all, nothing of them left (traces)
    finally:
        alice.proc.kill()
        bob.proc.kill()
        if not done:
            fab(inventory_path, "stop", "--all", "--yes", "--grace", "0")


def test_two_jobs_started_in_the_same_second_over_the_same_hosts_exactly_one_runs(inventory_path):
    tag = secrets.token_hex(2)
    names = [f"race-{i}-{tag}" for i in (0, 1)]
    # Both ask for slots 0 and 1 of both hosts (whatever their CPU count).
    argv = [("--args", "--sleep 3", "--include", "node1:0,1@node2:0,1", "--name", n) for n in names]
    runs = [Run(inventory_path, *COMMON, *a) for a in argv]
    try:
        codes = [r.finish(timeout=180) for r in runs]
        assert sorted(codes) == [0, 1], [r.text[-2000:] for r in runs]
        winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
        assert "finished on every host" in runs[winner].text
        assert f"{names[winner]}-" in runs[loser].text and "hold(s) 0,1; free there:" in runs[loser].text, (
            runs[loser].text[-2000:]
        )
        assert "Traceback" not in runs[loser].text and "REPORT" not in runs[loser].text
        # Nothing of the refused job: no container, claim or runtime directory (with its secrets), no run.
        assert traces(names[loser], ["node1", "node2"]) == []
        assert not list((ROOT / "runs").glob(f"{names[loser]}-*"))
    finally:
        for r in runs:
            r.proc.kill()
        fab(inventory_path, "stop", "--grace", "0")


def test_stopping_a_job_nobody_knows_is_refused_naming_it(inventory_path):
    """A mistyped id is not 'stopped': exit 2, the id named, where to look; nothing marked stopped."""
    typo = "gtp-20261126-000000-dead"
    r = fab(inventory_path, "stop", "--job", typo, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"no job {typo} on the hosts of {inventory_path}" in r.stderr
    assert "'fab runs' lists this machine's" in r.stderr and f"stopped {typo}" not in r.stdout
    assert on_host("node1", f"ls /opt/fabtrain/output/.runtime/.stopped/{typo}", check=False).returncode != 0
