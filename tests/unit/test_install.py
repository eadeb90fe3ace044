"""README's command 1 needs only the runtime: a fresh virtualenv made from requirements.lock alone
(with --require-hashes, as docker/bootstrap.sh installs it) plus this checkout runs `fab --list`
and a dry run of `fab train`, imports every orchestrator module and fabfile.py, and has no torch
and none of the tests' or linters' packages (those are requirements-test.lock's, installed by
`bootstrap.sh --tests`).

The distributions come the way bootstrap gets them: pip with this machine's configuration (PyPI, and
pip's cache of what bootstrap downloaded). The checkout is installed from a copy, so that no build
files land in it. The dry run's hosts are on a closed loopback port: they do not answer."""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Never part of the package: version control, virtualenvs, caches, runs, the local cluster's files.
NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".cache",
    ".cluster*",
    "runs",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".fabtrain",
)
# Test and lint packages that must not reach the runtime's virtualenv (requirements-test.lock's).
TEST_ONLY = ("torch", "pytest", "mypy", "ruff", "selenium", "kubernetes", "pydantic", "tensorboard", "mkdocs")

# Run by the new virtualenv's interpreter, outside the checkout: every orchestrator module and
# fabfile.py import from site-packages; prints where fabfile came from, then the test-only modules
# that any of them loaded.
IMPORT_ALL = r"""
import importlib, pkgutil, sys
import fabfile, orchestrator, trainers
for found in pkgutil.walk_packages(orchestrator.__path__, "orchestrator."):
    importlib.import_module(found.name)
print(fabfile.__file__)
print(" ".join(name for name in sys.argv[1:] if name in sys.modules))
"""


def locked_names(lock: Path) -> set[str]:
    return {
        re.sub(r"[-_.]+", "-", m.group(1)).lower()
        for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", lock.read_text(), re.M)
    }


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv: list, cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_runtime_lock_alone_runs_command_1(tmp_path):
    lock = ROOT / "requirements.lock"
    assert not locked_names(lock) & set(TEST_ONLY), "requirements.lock pins test-only packages"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "FABTRAIN_INVENTORY")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    venv = tmp_path / "venv"
    python, pip = venv / "bin" / "python", [venv / "bin" / "python", "-m", "pip"]
    r = run([sys.executable, "-m", "venv", venv], tmp_path, env)
    assert r.returncode == 0, r.stderr

    # bootstrap.sh's two steps: the lock by hash, then the checkout without dependencies.
    r = run([*pip, "install", "-q", "--no-compile", "--require-hashes", "-r", lock], tmp_path, env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = run(
        [*pip, "install", "-q", "--no-compile", "--no-deps", "--no-build-isolation", source], tmp_path, env
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = run([*pip, "list", "--format=freeze"], tmp_path, env)
    installed = {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower() for line in r.stdout.split()}
    expected = locked_names(lock) | {"fabtrain", "pip"}
    assert installed == expected, f"not locked: {installed - expected}; missing: {expected - installed}"

    # Outside the checkout: the installed package, every module of it, and no test package.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run([python, "-c", IMPORT_ALL, *TEST_ONLY], elsewhere, env)
    assert r.returncode == 0, r.stderr[-3000:]
    fabfile_path, loaded = (r.stdout.splitlines() + ["", ""])[:2]
    assert Path(fabfile_path).parent.name == "site-packages", fabfile_path
    assert loaded == "", f"importing the orchestrator loaded test-only packages: {loaded}"
    for name in ("torch", "pytest"):
        r = run([python, "-c", f"import {name}"], elsewhere, env)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, f"{name} is importable"

    # Command 1's program in the checkout: its tasks, and `fab train` as far as it goes without hosts.
    fab = venv / "bin" / "fab"
    r = run([fab, "--list"], source, env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for task in ("train", "preflight", "stop", "cluster.up"):
        assert re.search(rf"^  {re.escape(task)} ", r.stdout, re.M), (task, r.stdout)
    (tmp_path / "home").mkdir()
    (tmp_path / "id_test").write_text("not a key: the hosts refuse the connection before it is read\n")
    (tmp_path / "known_hosts").write_text("")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(f"""\
ssh: {{user: trainer, port: {closed_port()}, key: id_test, known_hosts: known_hosts, connect_timeout: 3,
       config: none}}
job: {{image: fabtrain/trainer:latest, code_dir: /opt/fabtrain/code, output_dir: /opt/fabtrain/output}}
hosts:
  - {{name: node1, address: 127.0.0.1, interface: eth0, gpus: {{vendor: none, count: 0}}}}
""")
    r = run(
        [fab, "train", "--dry-run", "--inventory", inventory],
        source,
        {**env, "HOME": str(tmp_path / "home")},
        timeout=120,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert "no answer" in r.stdout and "## start" in r.stdout, r.stdout[-3000:]
