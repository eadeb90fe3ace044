"""fab train, status, logs and stop as the command line runs them (commandline/requests.py and
control.py), against a backend that is one folder (tests/unit/localbackend: each node a local
process) and one registration: nothing else in the orchestrator knows it. What holds here holds for
any backend."""

import io
import json
import threading
import time

import pytest
from rich.console import Console

from orchestrator.backends import registry
from orchestrator.commandline import cli, control, requests
from orchestrator.core.errors import UserError
from orchestrator.core.recovery import JobRecord

NODE = """\
import os, sys, time
rank = os.environ["NODE_RANK"]
print("node", rank, "of", os.environ["NNODES"], "master", os.environ["MASTER_ADDR"], flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]) if rank == "1" else 0)
"""
TRAINERS = {"gpt": "trainers/gpt.py"}
REGISTERED = dict(registry.BACKENDS)  # before a test leaves only its own


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The one registration; alone, so that status and stop ask nothing else (no SSH).
    monkeypatch.setattr(registry, "BACKENDS", {"local": "tests.unit.localbackend:LocalBackend"})
    monkeypatch.setattr(registry, "DEFAULT", "local")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "node.py").write_text(NODE)
    (tmp_path / "inv.yaml").write_text(
        "hosts:\n  - {name: a, address: 127.0.0.1, interface: lo}\n"
        "  - {name: b, address: 127.0.0.2, interface: lo}\n"
    )
    return tmp_path


def request(here, sleep="0", code="0", **options):
    job = {"script": "node.py", "code": str(here / "code"), "args": f"{sleep} {code}"}
    return requests.TrainRequest(
        job=job, inventory=str(here / "inv.yaml"), plain=True, **{"on": "local", **options}
    )


def console():
    return Console(file=io.StringIO(), width=200)


def job_of(here):
    return next(p.name for p in (here / "runs").iterdir() if (p / "job.json").exists())


def test_a_job_runs_every_node_and_its_record_names_its_backend(here, monkeypatch):
    out = console()
    assert requests.train(request(here), here / "runs", out, TRAINERS) is None
    job = job_of(here)
    assert "node 0 of 2 master 127.0.0.1" in (here / "runs" / job / "a.log").read_text()
    assert "node 1 of 2 master 127.0.0.1" in (here / "runs" / job / "b.log").read_text()
    assert JobRecord.load(here / "runs", job).on == "local"
    assert f"job {job} finished on every node" in out.file.getvalue()
    # The same job again: the record's backend is the one that resumes it, and no other.
    monkeypatch.setitem(registry.BACKENDS, "ssh", "orchestrator.backends.ssh.backend:SshBackend")
    with pytest.raises(UserError, match=f"job {job} ran on local; resume it with --on local"):
        requests.train(request(here, resume=job, on="ssh"), here / "runs", console(), TRAINERS)
    again = console()
    requests.train(request(here, resume=job), here / "runs", again, TRAINERS)
    assert f"resuming job {job} locally (1 attempt(s) so far, finished)" in again.file.getvalue()
    assert len(JobRecord.load(here / "runs", job).attempts) == 2


def test_a_failed_node_fails_the_job_naming_it(here):
    with pytest.raises(UserError, match=r"b exited with code 3"):
        requests.train(request(here, code="3"), here / "runs", console(), TRAINERS)
    assert JobRecord.load(here / "runs", job_of(here)).state == "failed"


def test_dry_run_and_refused_options_come_from_the_backend(here):
    text = requests.train(request(here, dry_run=True), here / "runs", console(), TRAINERS)
    assert text.splitlines() == ["[a] node.py 0 0", "[b] node.py 0 0"]
    assert not (here / "runs").exists() or not list((here / "runs").iterdir())
    with pytest.raises(UserError, match=r"--health: not with --on local"):
        requests.train(request(here, health=True), here / "runs", console(), TRAINERS)


def test_status_logs_and_stop_reach_a_running_job_through_its_backend(here):
    ended: list = []

    def train():
        try:
            requests.train(request(here, sleep="60"), here / "runs", console(), TRAINERS)
        except UserError as exc:
            ended.append(exc)

    t = threading.Thread(target=train)
    t.start()
    deadline = time.monotonic() + 30
    while not (rows := control.status(str(here / "inv.yaml"), here / "runs").doc.get("local")):
        assert time.monotonic() < deadline, "the job never showed in fab status"
        time.sleep(0.1)
    job = rows[0]["job"]
    assert {r["host"] for r in rows} == {"a", "b"}
    # Each node has said its first line (a loaded machine starts them late) before it is stopped.
    while not all(
        "of 2" in (p.read_text() if p.exists() else "")
        for p in (here / "runs" / job / f"{h}.log" for h in "ab")
    ):
        assert time.monotonic() < deadline, "a node never printed its first line"
        time.sleep(0.1)
    status = control.status(str(here / "inv.yaml"), here / "runs")
    assert json.loads(json.dumps(status.doc))["errors"] == [] and f"{job} runs on a" in status.lines
    out = control.stop(str(here / "inv.yaml"), job, False, False, None, here / "runs")
    assert out.lines == [f"stopped {job} on a", f"stopped {job} on b"] and not out.failed
    t.join(timeout=30)
    assert not t.is_alive() and ended and "exited with code -15" in str(ended[0])
    assert control.status(str(here / "inv.yaml"), here / "runs").doc["local"] == []
    logs = console()
    finished = control.logs(str(here / "inv.yaml"), job, here / "runs", logs, plain=True)
    assert "a | node 0 of 2" in logs.file.getvalue() and "ended failed" in str(finished.error)


def test_kubernetes_is_a_backend_that_only_renders_its_manifests(here, monkeypatch):
    """One registration: --dry-run prints the manifests fab export.k8s writes; whatever would run, follow
    or stop a job there refuses, in one line (it is a Renderer, no Runner); fab status and fab stop never
    ask it."""
    from dataclasses import replace

    from orchestrator.backends.base import Launch
    from orchestrator.backends.kubernetes.backend import RENDER_ONLY, KubernetesBackend
    from orchestrator.config import inventory
    from orchestrator.core.policy import Policy

    monkeypatch.setitem(registry.BACKENDS, "kubernetes", REGISTERED["kubernetes"])
    kubernetes = registry.get("kubernetes")
    assert isinstance(kubernetes, KubernetesBackend) and not registry.runs_jobs(kubernetes)
    text = requests.train(
        request(here, on="kubernetes", dry_run=True, restarts=2), here / "runs", console(), TRAINERS
    )
    job = text.split()[1]
    inv = inventory.load(str(here / "inv.yaml"))
    spec = replace(cli.new_spec(request(here).job, TRAINERS), job_id=job)
    job_launch = Launch(inv, spec, Policy(restarts=2), None, here / "runs", console())
    rendered = KubernetesBackend().render(job_launch, {})
    files, warnings = rendered.files, rendered.warnings
    assert list(files) == ["trainjob.yaml", "pytorchjob.yaml", "indexed-job.yaml"] and warnings == ()
    assert text == (
        f"job {job} as Kubernetes manifests (fab export.k8s writes these files; kubectl apply -f "
        "one of them):\n" + "".join(f"\n--- {f} ---\n{t}\n" for f, t in files.items())[:-1]
    )
    assert "backoffLimit: 2" in files["indexed-job.yaml"]
    with pytest.raises(UserError) as e:
        requests.train(request(here, on="kubernetes"), here / "runs", console(), TRAINERS)
    assert str(e.value) == RENDER_ONLY and e.value.exit_code == 2 and "\n" not in RENDER_ONLY
    with pytest.raises(UserError, match="--health: not with --on kubernetes"):
        requests.train(request(here, on="kubernetes", health=True), here / "runs", console(), TRAINERS)
    # Following, stopping or listing a job goes through registry.runner, which it is not.
    with pytest.raises(UserError, match="fabtrain does not run jobs there") as e:
        registry.runner("kubernetes")
    assert str(e.value) == RENDER_ONLY and e.value.exit_code == 2
    assert control.status(str(here / "inv.yaml"), here / "runs").doc == {"local": [], "errors": []}
    assert control.stop(str(here / "inv.yaml"), None, False, False, None, here / "runs").problems == []
