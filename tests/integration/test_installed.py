"""fabtrain as an installed command: the package built from this checkout and installed into a
fresh virtualenv, then run from a user's project directory outside the checkout.

The virtualenv reaches the pinned dependencies through a .pth file naming the site-packages of the
interpreter running the tests (so nothing is downloaded; `pip check` then proves the package's
pins match them), and fabtrain itself is built and installed from a copy of the checkout, so no
build files land in it. No cluster is needed: the project's inventory names hosts on a closed
local port, which a dry run reports as not answering (its look at the hosts is read-only)."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import fabric
import pytest

ROOT = Path(__file__).resolve().parents[2]
# Never part of the package: version control, virtualenvs, caches, runs, the local cluster's files.
NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".cache",
    ".cluster*",
    ".ci",
    "runs",
    "tests",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
)


# Run by the installed interpreter: every third-party distribution that fabfile.py and the
# orchestrator's modules import must be one fabtrain's metadata requires (directly or through
# another requirement); prints those that are not. The dependencies' directory is argv[1].
UNDECLARED = r"""
import importlib, importlib.metadata as md, pkgutil, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
import fabfile, orchestrator
for found in pkgutil.walk_packages(orchestrator.__path__, "orchestrator."):
    importlib.import_module(found.name)
owners = md.packages_distributions()
used = {canonicalize_name(dist) for name, module in list(sys.modules.items())
        if "." not in name and (getattr(module, "__file__", None) or "").startswith(sys.argv[1])
        for dist in owners.get(name, [name])}
closure, todo = set(), ["fabtrain"]
while todo:
    for text in md.requires(todo.pop()) or []:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if (req.marker is None or req.marker.evaluate({"extra": ""})) and name not in closure:
            closure.add(name)
            todo.append(name)
print(" ".join(sorted(used - closure - set(sys.argv[2:]))))
"""
# Imported only because the tests' environment has them, each in a `try: import ... except
# ImportError` with a fallback; never needed: pathspec takes typing_extensions' `deprecated` when
# present, requests takes PySocks (urllib3.contrib.socks) for SOCKS proxies when present.
OPPORTUNISTIC = ("typing-extensions", "pysocks")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listing(root: Path) -> set[str]:
    """Every file and directory under root, relative; compiled caches left out (Python may write
    them beside any module it imports)."""
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(virtualenv, its site-packages): fabtrain installed from a copy of this checkout."""
    base = tmp_path_factory.mktemp("installed")
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    deps = Path(fabric.__file__).resolve().parent.parent  # pip, setuptools and the pinned runtime live there
    (purelib / "fabtrain-test-deps.pth").write_text(f"{deps}\n")
    r = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--disable-pip-version-check",
            str(source),
        ],
        capture_output=True,
        text=True,
        cwd=base,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return venv, purelib


@pytest.fixture
def project(tmp_path):
    """A user's project outside the checkout: main.py and an inventory of hosts that do not answer."""
    proj = tmp_path / "my-project"
    proj.mkdir()
    (proj / "main.py").write_text("print('hello from main.py')\n")
    (proj / "id_test").write_text("not a key: the hosts refuse the connection before it is read\n")
    (proj / "known_hosts").write_text("")
    port = closed_port()
    (proj / "inventory.yaml").write_text(f"""\
ssh:
  user: trainer
  port: {port}
  key: id_test
  known_hosts: known_hosts
  connect_timeout: 3
  config: none
job:
  image: fabtrain/trainer:latest
  code_dir: /opt/fabtrain/code
  output_dir: /opt/fabtrain/output
hosts:
  - {{name: node1, address: 127.0.0.1, interface: eth0, gpus: {{vendor: none, count: 0}}}}
  - {{name: node2, address: 127.0.0.2, interface: eth0, gpus: {{vendor: none, count: 0}}}}
""")
    assert ROOT not in proj.parents
    return proj


def fabtrain(venv: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FABTRAIN_INVENTORY", "VIRTUAL_ENV")
    }
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", HOME=str(cwd.parent / "home"), COLUMNS="200"
    )
    (cwd.parent / "home").mkdir(exist_ok=True)
    return subprocess.run(
        ["fabtrain", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_installed_package_uses_its_own_files_and_pinned_dependencies(installed, project):
    venv, purelib = installed
    assert (venv / "bin" / "fabtrain").is_file()
    for name in (
        "fabfile.py",
        "orchestrator/commandline/program.py",
        "orchestrator/config/resources.py",
        "orchestrator/preflight/smoke.py",
        "trainers/gpt.py",
        "trainers/smoke.py",
        "fabtrain_docker/entrypoint.py",
    ):
        assert (purelib / name).is_file(), name
    assert not (purelib / "docker" / "entrypoint.py").exists()  # docker/ is fabtrain_docker, never `docker`
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import fabfile, orchestrator, trainers; from orchestrator.config import resources; "
            "print(fabfile.__file__, orchestrator.__file__, resources.entrypoint(), sep='\\n')",
        ],
        cwd=project,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert where.returncode == 0, where.stderr
    fab_file, orch, entry = where.stdout.split()
    assert Path(fab_file).parent == purelib and Path(orch).parent.parent == purelib
    assert Path(entry) == purelib / "fabtrain_docker" / "entrypoint.py"
    assert Path(entry).read_bytes() == (ROOT / "docker" / "entrypoint.py").read_bytes()
    # The pins in pyproject.toml hold for the dependencies the tests run with (requirements.txt).
    check = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "check", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0 and "fabtrain" not in check.stdout, check.stdout + check.stderr
    # And nothing the package imports is left out of them (they reach this virtualenv only
    # through the .pth file, so a missing one would not show otherwise).
    deps = (purelib / "fabtrain-test-deps.pth").read_text().strip()
    undeclared = subprocess.run(
        [str(venv / "bin" / "python"), "-c", UNDECLARED, deps, *OPPORTUNISTIC],
        cwd=project,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert undeclared.returncode == 0, undeclared.stderr
    assert undeclared.stdout.split() == [], (
        f"imported but not in pyproject.toml's dependencies: {undeclared.stdout}"
    )


def test_fabtrain_runs_from_a_project_outside_the_checkout(installed, project):
    venv, purelib = installed
    site_before = listing(purelib)
    project_before = listing(project)

    r = fabtrain(venv, project, "--list")
    assert r.returncode == 0, r.stderr
    for name in ("train", "preflight", "runs", "stop", "cluster.up", "export.slurm"):
        assert f"  {name} " in r.stdout, name

    r = fabtrain(venv, project, "--help", "train")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Usage: fabtrain [--core-opts] train ") and "--dry-run" in r.stdout

    r = fabtrain(venv, project, "runs")  # no runs/ yet: an empty table, nothing created
    assert r.returncode == 0, r.stderr
    assert "runs in runs/" in r.stdout and not (project / "runs").exists()

    inventory = project / "inventory.yaml"
    r = fabtrain(
        venv,
        project,
        "train",
        "--dry-run",
        "--code",
        ".",
        "--script",
        "main.py",
        "--inventory",
        str(inventory),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    plan = r.stdout
    assert f"{project}/ " in plan, plan  # rsync's source: this project, resolved
    assert "main.py" in plan and "entrypoint.py" in plan
    assert "no answer" in plan  # the hosts' facts were looked for, read-only, and none answered
    assert "Traceback" not in r.stderr

    # ./inventory.yaml is found without --inventory; the hosts fail the ssh check, as a table.
    r = fabtrain(venv, project, "preflight", "--no-smoke")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "node1" in r.stdout and "node2" in r.stdout and "Traceback" not in r.stderr

    assert listing(purelib) == site_before, "fabtrain wrote into site-packages"
    assert listing(project) == project_before, "a dry run, --list, --help and runs write nothing"
