"""Several jobs on one cluster: two jobs on disjoint hosts at once (--include), an overlapping
third refused naming the holder, `fab stop --job` ending one and leaving the other untouched."""
import json
import secrets

from .conftest import ROOT, Run, fab, project_containers
from .test_lifecycle import wait_for_containers

REPORT = "tests/integration/scripts/report.py"


def newest_run(name: str) -> str:
    return max(p.name for p in (ROOT / "runs").glob(f"{name}-*"))


def test_two_jobs_on_disjoint_hosts_and_stop_job_ends_only_its_own(inventory_path):
    tag = secrets.token_hex(2)
    common = ("train", "--script", REPORT, "--nproc", "1", "--skip-preflight", "--plain")
    a = Run(inventory_path, *common, "--args", "--sleep 60", "--include", "node1", "--name", f"share-a-{tag}")
    b = Run(inventory_path, *common, "--args", "--sleep 12", "--include", "node2", "--name", f"share-b-{tag}")
    try:
        wait_for_containers(["node1", "node2"])
        job_a, job_b = newest_run(f"share-a-{tag}"), newest_run(f"share-b-{tag}")
        assert json.loads((ROOT / "runs" / job_b / "job.json").read_text())["selected"] == ["node2"]
        # A third job over both hosts is refused, naming the jobs that hold them; it leaves nothing.
        r = fab(inventory_path, *common, "--include", "node1@node2", "--name", f"share-c-{tag}", timeout=120)
        assert r.returncode == 1 and "a job is already running on these hosts" in r.stderr, r.stderr
        assert job_a in r.stderr and job_b in r.stderr and "Traceback" not in r.stderr
        ids_b = project_containers("node2")
        # Job A stopped by id: job B keeps running, the same container, and finishes on its own.
        stop = fab(inventory_path, "stop", "--job", job_a, "--grace", "2")
        assert stop.returncode == 0, stop.stderr
        assert a.finish(timeout=120) == 1 and "ended by 'fab stop'" in a.text, a.text[-2000:]
        assert project_containers("node1") == [] and project_containers("node2") == ids_b
        assert b.finish(timeout=120) == 0, b.text[-2000:]
        assert f"job {job_b} finished on every host" in b.text and '"world": 1' in b.text
    finally:
        a.proc.kill()
        b.proc.kill()
        fab(inventory_path, "stop", "--grace", "0")
