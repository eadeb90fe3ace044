"""The registry (backends/registry.py): one name for each backend, a Runner, a Renderer or both; the
fab train options a backend does not declare refused (exit 2) before anything is read or reached;
Kubernetes renders and runs nothing."""

import dataclasses
import io
import sys
from pathlib import Path

import pytest
from fabric.main import make_program as make_fab
from rich.console import Console

from orchestrator.backends import base, registry
from orchestrator.backends.kubernetes.backend import RENDER_ONLY, KubernetesBackend
from orchestrator.backends.slurm.backend import SlurmBackend
from orchestrator.backends.ssh.backend import SshBackend
from orchestrator.commandline import requests
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = {"gpt": "trainers/gpt.py"}
SLURM_WHY = (
    "Slurm picks the nodes, queues the job, restarts it by requeue and has its own checks; set "
    "nodes, partition and time in the inventory's slurm: section (Slurm's --mail-type and "
    "--mail-user tell a job's end)"
)
# What every backend takes, whatever it declares: the job's own options and these.
EVERYWHERE = {"job", "inventory", "on", "dry_run", "resume", "plain"}


class Measured:
    """A runner registered by a test, declaring two options: what it refuses follows from them."""

    name = "measured"
    where = " here"
    accepts = (base.Option("restarts", int, 0, "attempts after a failure"), *base.train_options("queue"))
    declines = "it has no hosts to measure"


def launch(tmp_path, inv_text="hosts:\n  - {name: a, address: 10.0.0.1, interface: eth0}\n"):
    inv = parse(inv_text, tmp_path / "inventory.yaml")
    spec = jobspec.JobSpec(job_id="gpt-1", script="trainers/gpt.py")
    return base.Launch(
        inv, spec, Policy(restarts=1), None, tmp_path / "runs", Console(file=io.StringIO(), width=200)
    )


def test_each_name_is_one_backend_of_its_kinds():
    ssh, slurm, kubernetes = (registry.get(n) for n in ("ssh", "slurm", "kubernetes"))
    assert isinstance(ssh, SshBackend) and isinstance(slurm, SlurmBackend)
    assert isinstance(kubernetes, KubernetesBackend)
    assert registry.runs_jobs(ssh) and registry.runs_jobs(slurm) and not registry.runs_jobs(kubernetes)
    assert isinstance(registry.choose(None), SshBackend)
    assert isinstance(registry.runner("slurm"), SlurmBackend)
    # What fab export.NAME writes with: the backend when it renders, else its runner's plan.
    assert isinstance(registry.renderer("slurm"), SlurmBackend)
    assert isinstance(registry.renderer("kubernetes"), KubernetesBackend)
    plan = registry.renderer("ssh")
    assert isinstance(plan, registry.Plan) and isinstance(plan.runner, SshBackend) and plan.name == "ssh"
    with pytest.raises(UserError) as e:
        registry.get("k8s")
    assert str(e.value) == "--on 'k8s': give ssh or slurm or kubernetes" and e.value.exit_code == 2


def test_kubernetes_is_not_a_runner():
    kubernetes = registry.get("kubernetes")
    assert not any(hasattr(kubernetes, m) for m in ("run", "attach", "stop", "status", "dry_run", "serves"))
    for call in (lambda: registry.runner("kubernetes"), lambda: registry.as_runner(kubernetes)):
        with pytest.raises(UserError) as e:
            call()
        assert str(e.value) == RENDER_ONLY and e.value.exit_code == 2
    assert RENDER_ONLY == (
        "--on kubernetes: fabtrain does not run jobs there; it writes manifests to hand "
        "to kubectl: use fab export.k8s, or fab train --on kubernetes --dry-run"
    )


def test_fab_status_and_stop_ask_runners_only(monkeypatch):
    asked = []

    class Asked(Measured):
        def run(self, launch):
            raise AssertionError("not run here")

        def serves(self, inv):
            asked.append(inv)
            return True

    module = type(sys)("measured_backend")
    module.Asked = Asked
    monkeypatch.setitem(sys.modules, "measured_backend", module)
    monkeypatch.setattr(
        registry,
        "BACKENDS",
        {
            "measured": "measured_backend:Asked",
            "kubernetes": "orchestrator.backends.kubernetes.backend:KubernetesBackend",
        },
    )
    found = registry.serving("INV")
    assert [type(b) for b in found] == [Asked] and asked == ["INV"]


def test_every_train_option_is_declared_once_typed_as_fab_train_takes_it():
    fields = {f.name: f for f in dataclasses.fields(requests.TrainRequest)}
    names = [o.name for o in base.TRAIN_OPTIONS]
    assert len(names) == len(set(names)) and set(names) == set(fields) - EVERYWHERE
    for option in base.TRAIN_OPTIONS:
        assert (fields[option.name].default is False) == (option.type is bool), option.name
        assert option.flag.startswith("--") and "_" not in option.flag and option.help
    assert base.train_options("queue", "restarts") == (base.TRAIN_OPTIONS[1], base.TRAIN_OPTIONS[16])
    with pytest.raises(KeyError, match="not fab train options: queued"):
        base.train_options("queued")
    assert SshBackend.accepts == base.TRAIN_OPTIONS and SlurmBackend.accepts == ()


def refusal(backend, **given) -> UserError:
    with pytest.raises(UserError) as e:
        registry.refuse(backend, given)
    return e.value


def test_a_refusal_follows_from_what_a_backend_declares():
    e = refusal(Measured(), restarts=2, queue=True, health=True, num_nodes=2, plain=True)
    assert (
        str(e)
        == (
            "--num-nodes, --health: not with --on measured: it has no hosts to measure (it takes "
            "--restarts, --queue)"
        )
        and e.exit_code == 2
    )
    registry.refuse(Measured(), {"restarts": 2, "queue": True, "smoke": False, "gpus": None, "resume": "x"})
    registry.refuse(SshBackend(), {o.name: "given" for o in base.TRAIN_OPTIONS})
    e = refusal(SlurmBackend(), queue=True, detach=True, notify="mail me")
    assert str(e) == f"--notify, --detach, --queue: not with --on slurm: {SLURM_WHY}" and e.exit_code == 2
    e = refusal(KubernetesBackend(), health=True, restarts=3)
    assert (
        str(e)
        == (
            "--health: not with --on kubernetes: fabtrain does not run jobs there; it writes "
            "manifests to hand to kubectl: use fab export.k8s, or fab train --on kubernetes "
            "--dry-run (it takes --restarts, --include, --exclude)"
        )
        and e.exit_code == 2
    )

    class Undeclared:  # registered without `accepts`: takes none of them
        name = "bare"

    assert str(refusal(Undeclared(), cpuset=True)) == "--cpuset: not with --on bare"


def test_fab_train_refuses_an_undeclared_option_before_reading_anything(tmp_path, monkeypatch, capsys):
    """Through the command line: exit 2, one line, no inventory read (there is none) and no host asked."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        requests.train(
            requests.TrainRequest(on="slurm", queue=True, inventory=str(tmp_path / "none.yaml")),
            tmp_path / "runs",
            Console(file=io.StringIO()),
            TRAINERS,
        )
    assert str(e.value) == f"--queue: not with --on slurm: {SLURM_WHY}" and e.value.exit_code == 2
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_:
        make_fab().run(
            ["fab", "train", "--on", "slurm", "--hot-spares", "--inventory", str(tmp_path / "none")]
        )
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"--hot-spares: not with --on slurm: {SLURM_WHY}" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_a_renderers_settings_are_typed_and_declared(tmp_path):
    slurm = registry.renderer("slurm")
    job = launch(tmp_path)
    rendered = registry.render(slurm, job, partition="gpu")
    assert list(rendered.files) == ["gpt-1.sbatch"] and rendered.job_id == "gpt-1"
    assert "#SBATCH --partition=gpu" in rendered.files["gpt-1.sbatch"]
    assert "srun --container-image" not in rendered.files["gpt-1.sbatch"]  # pyxis at its default, False
    with pytest.raises(UserError) as e:
        registry.render(slurm, job, pyxis="yes")
    assert str(e.value) == "--pyxis 'yes': give a bool" and e.value.exit_code == 2
    with pytest.raises(UserError) as e:
        registry.render(slurm, job, nodes=4)
    assert str(e.value) == "--nodes: not with slurm's files" and e.value.exit_code == 2


def test_a_runners_plan_is_its_dry_run_as_one_file(tmp_path):
    class Planned(Measured):
        def run(self, launch):
            raise AssertionError("not run here")

        def dry_run(self, launch):
            return f"[a] start {launch.spec.job_id}\n[a] watch"

    job = launch(tmp_path)
    rendered = registry.render(registry.Plan(Planned()), job)
    assert rendered.files == {"plan.txt": "[a] start gpt-1\n[a] watch"} and rendered.warnings == ()
    assert registry.dry_run(Planned(), job) == rendered.text() == "[a] start gpt-1\n[a] watch"
