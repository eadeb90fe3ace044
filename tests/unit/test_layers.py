"""The layers of orchestrator/ (docs/architecture.md) hold: each package imports only its own layer
and the ones below it, no two modules import each other (directly or round a loop) when loaded,
and the pure core loads nothing that does I/O."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "orchestrator"

# Bottom to top. A package may import its own layer and any layer with a lower number. testbed (the
# local test cluster) sits beside the stack: it ships images to its hosts.
LAYERS = {
    "core": 0,
    "config": 1,
    "hostcmds": 2,
    "transport": 3,
    "hosts": 4,
    "progress": 4,
    "images": 4,
    "snapshots": 4,
    "telemetry": 4,
    "preflight": 5,
    "backends": 6,
    "commandline": 7,
    "testbed": 7,
    "dashboard": 8,
}
# What the pure core must never load: the network, processes, terminals, files of other formats.
NOT_IN_CORE = ("paramiko", "fabric", "invoke", "docker", "subprocess", "socket", "rich", "yaml")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def target(module: str, name: str) -> str:
    """`from module import name`: the module that is loaded (name itself when it is a submodule)."""
    full = f"{module}.{name}"
    rel = Path(*full.split("."))
    return full if (ROOT / rel.with_suffix(".py")).exists() or (ROOT / rel).is_dir() else module


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The orchestrator modules a file imports; TYPE_CHECKING blocks left out (never run)."""
    tree = ast.parse(path.read_text())
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and top_level_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orchestrator"):
                found.update(target(node.module, a.name) for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("orchestrator"))
            visit(list(ast.iter_child_nodes(node)))

    visit(tree.body)
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_is_a_known_layer():
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS), (
        "a new package under orchestrator/ needs its place in LAYERS (and docs/architecture.md)"
    )
    loose = [p.name for p in PKG.glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"modules belong in a layer's package: {loose}"


def test_no_package_imports_a_layer_above_it():
    upward = []
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        if not layer(me):
            continue
        for other in imports(path, top_level_only=False):
            if layer(other) and LAYERS[layer(other)] > LAYERS[layer(me)]:
                upward.append(f"{me} imports {other}")
    assert upward == []


def test_no_import_cycle_when_modules_load():
    graph = {module_name(p): imports(p, top_level_only=True) for p in PKG.rglob("*.py")}
    state: dict[str, int] = {}
    cycles = []

    def walk(m, path):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if n == m or n not in graph:
                continue
            if state.get(n) == 1:
                cycles.append(path[path.index(n) :] + [n] if n in path else [m, n])
            elif n not in state:
                walk(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    assert cycles == []


def test_the_core_loads_no_io_and_no_other_layer():
    core = sorted(module_name(p) for p in (PKG / "core").glob("*.py"))
    code = f"import sys\nfor m in {core!r}: __import__(m)\nprint('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert [m for m in loaded if m.split(".")[0] in NOT_IN_CORE] == []
    assert [m for m in loaded if m.startswith("orchestrator.") and layer(m) != "core"] == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check itself: a core module importing the transport is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from orchestrator.transport import remote\n\ndef f():\n    from orchestrator.backends.ssh import "
        "job\n"
    )
    assert imports(bad, top_level_only=False) == {
        "orchestrator.transport.remote",
        "orchestrator.backends.ssh.job",
    }
    assert imports(bad, top_level_only=True) == {"orchestrator.transport.remote"}


def test_every_package_is_installed():
    """pyproject.toml lists the packages by hand (fabtrain_docker cannot be found by a find)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(p.parent) for p in ROOT.glob("orchestrator/**/__init__.py")}
    assert found | {"trainers", "fabtrain_docker"} == listed  # trainers/: modules, no __init__.py
