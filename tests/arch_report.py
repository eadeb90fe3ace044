"""The shape of the code in numbers, as Markdown tables (docs/architecture.md keeps a copy):

- module sizes: lines of every Python file of the project (orchestrator/, trainers/,
  docker/entrypoint.py and fabtrain_memory.py, fabfile.py), the ones over 400 lines listed;
- function sizes: every function and method (`def` line to its last line), the ones over 60 lines;
- import cycles among the orchestrator's modules, twice: the imports run when the modules load
  (module and class level, outside `if TYPE_CHECKING:`), then every import (TYPE_CHECKING blocks
  and imports inside functions too). A cycle of the first kind can break loading; one of the second
  kind only ties the modules together;
- mypy coverage: the share of the project's lines in the files [tool.mypy] `files` names;
- the suite's time, from a file pytest wrote: `--durations=0` output or `--junitxml` XML.

    .venv/bin/python tests/arch_report.py [--durations FILE] [--mypy]

Only the standard library; --mypy also runs mypy (pyproject's configuration) and prints its verdict.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LIMIT = 400  # lines
FUNCTION_LIMIT = 60  # lines
SLOWEST = 15
PACKAGE = "orchestrator"  # the import graph is drawn among this package's modules
# -vv: pytest hides the durations under 5 ms without it.
DURATIONS_HELP = (
    "run `.venv/bin/pytest tests --durations=0 -vv > durations.txt` "
    "(or `--junitxml=suite.xml`), "
    "then `.venv/bin/python tests/arch_report.py --durations durations.txt`"
)


def project_files(root: Path) -> list[Path]:
    """The project's Python files (tests excluded), sorted."""
    found = [p for folder in ("orchestrator", "trainers") for p in (root / folder).rglob("*.py")]
    # The runtime files, shipped to every host: the entrypoint and the fabtrain_* modules beside it.
    found += [
        p
        for p in (root / "docker").glob("*.py")
        if p.name == "entrypoint.py" or p.name.startswith("fabtrain_")
    ]
    if (root / "fabfile.py").is_file():
        found.append(root / "fabfile.py")
    return sorted(found)


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def module_sizes(root: Path, files: list[Path]) -> dict[str, int]:
    """Lines per file, by path relative to root."""
    return {p.relative_to(root).as_posix(): line_count(p) for p in files}


def over(sizes: dict[str, int], limit: int) -> list[tuple[str, int]]:
    """The entries above limit, largest first."""
    return sorted(((k, v) for k, v in sizes.items() if v > limit), key=lambda kv: (-kv[1], kv[0]))


def function_sizes(root: Path, files: list[Path]) -> dict[str, int]:
    """Lines of every function and method, as 'path:Class.method' (nested ones 'path:outer.inner')."""
    sizes: dict[str, int] = {}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        sizes.update(_functions(tree, path.relative_to(root).as_posix() + ":"))
    return sizes


def _functions(node: ast.AST, prefix: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + child.name
            assert child.end_lineno is not None  # ast.parse sets it
            sizes[name] = child.end_lineno - child.lineno + 1
            sizes.update(_functions(child, name + "."))
        elif isinstance(child, ast.ClassDef):
            sizes.update(_functions(child, prefix + child.name + "."))
        else:
            sizes.update(_functions(child, prefix))
    return sizes


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(root: Path, module: str, name: str) -> str:
    """`from module import name`: the module loaded for it (name itself when it is a submodule)."""
    full = Path(root, *f"{module}.{name}".split("."))
    return f"{module}.{name}" if full.with_suffix(".py").is_file() or full.is_dir() else module


def is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(root: Path, path: Path, runtime: bool, package: str = PACKAGE) -> set[str]:
    """The package's modules a file imports. runtime: only the imports run when it loads (a
    TYPE_CHECKING block's else branch does run; a class body runs, a function body does not). An
    import counts for the module it names, not for the packages Python loads on the way there."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if runtime and isinstance(child, ast.If) and is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            if runtime and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == package)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == package
        ):
            found.update(imported(root, node.module, a.name) for a in node.names)
        visit(node)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph(root: Path, runtime: bool, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (only modules that exist, no self-imports)."""
    paths = {module_name(root, p): p for p in sorted((root / package).rglob("*.py"))}
    return {
        m: {n for n in imports(root, p, runtime, package) if n in paths and n != m} for m, p in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components (Tarjan) of more than one module: each sorted, the largest
    first. Iterative, so a long chain of imports cannot reach Python's recursion limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


@dataclass(frozen=True)
class Coverage:
    checked: list[str]  # the configuration's `files` entries
    lines: int  # the project's lines
    covered_lines: int
    files: int
    covered_files: int
    not_covered: dict[str, int]  # path -> lines

    @property
    def percent(self) -> float:
        return 100.0 * self.covered_lines / self.lines if self.lines else 0.0


def mypy_files(root: Path) -> tuple[list[str], set[Path]]:
    """[tool.mypy] `files` in pyproject.toml, and the Python files they name (`exclude` applied)."""
    config = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("mypy", {})
    entries = config.get("files", [])
    entries = [e.strip() for e in entries.split(",")] if isinstance(entries, str) else list(entries)
    exclude = config.get("exclude", [])
    patterns = [re.compile(e) for e in ([exclude] if isinstance(exclude, str) else exclude)]
    files: set[Path] = set()
    for entry in entries:
        path = root / entry
        files.update(path.rglob("*.py") if path.is_dir() else [path] if path.is_file() else [])
    kept = {p for p in files if not any(x.search(p.relative_to(root).as_posix()) for x in patterns)}
    return entries, kept


def mypy_coverage(root: Path, files: list[Path]) -> Coverage:
    entries, checked = mypy_files(root)
    sizes = module_sizes(root, files)
    covered = {p.relative_to(root).as_posix() for p in checked}
    missing = {k: v for k, v in sizes.items() if k not in covered}
    return Coverage(
        checked=entries,
        lines=sum(sizes.values()),
        covered_lines=sum(v for k, v in sizes.items() if k in covered),
        files=len(sizes),
        covered_files=len(sizes) - len(missing),
        not_covered=missing,
    )


@dataclass(frozen=True)
class Durations:
    total: float  # seconds: the run's own figure where the file has one, else the sum of the tests
    total_is_wall: bool  # the run's own figure (pytest's last line, junit's testsuite time)
    tests: dict[str, float]  # test id -> seconds (setup, call and teardown together)


DURATION_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SUMMARY_LINE = re.compile(r"=+ .*\bin (\d+(?:\.\d+)?)s\b.*=+\s*$")


def read_durations(path: Path) -> Durations:
    """pytest's `--durations=0` output (the phases of a test added up) or a `--junitxml` file."""
    text = ANSI.sub("", path.read_text(errors="replace"))  # a run with --color=yes
    tests: dict[str, float] = {}
    if text.lstrip().startswith("<"):
        root = ET.fromstring(text)
        suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
        wall = [float(s.get("time", 0)) for s in suites]
        for case in root.iter("testcase"):
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            tests[test] = tests.get(test, 0.0) + float(case.get("time", 0))
        total_is_wall = bool(wall)
        total = sum(wall) if wall else sum(tests.values())
    else:
        wall = []
        for line in text.splitlines():
            if m := DURATION_LINE.match(line):
                tests[m[3]] = tests.get(m[3], 0.0) + float(m[1])
            elif m := SUMMARY_LINE.match(line):
                wall.append(float(m[1]))
        total_is_wall = bool(wall)
        total = wall[-1] if wall else sum(tests.values())
    return Durations(
        total=round(total, 3), total_is_wall=total_is_wall, tests={k: round(v, 3) for k, v in tests.items()}
    )


def table(head: tuple[str, ...], rows: list[tuple[object, ...]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def code(text: str) -> str:
    return f"`{text}`"


def cycle_rows(graph: dict[str, set[str]], runtime: dict[str, set[str]]) -> list[tuple[object, ...]]:
    """One row per cycle of graph: its size, its modules, the imports inside it that run when the
    modules load and those that do not."""
    rows: list[tuple[object, ...]] = []
    for component in cycles(graph):
        inside = set(component)
        edges = [(m, n) for m in component for n in sorted(graph[m] & inside)]
        at_load = [f"{short(m)} → {short(n)}" for m, n in edges if n in runtime.get(m, set())]
        later = [f"{short(m)} → {short(n)}" for m, n in edges if n not in runtime.get(m, set())]
        rows.append(
            (
                len(component),
                ", ".join(map(short, component)),
                "; ".join(at_load) or "none",
                "; ".join(later) or "none",
            )
        )
    return rows


def short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def report(root: Path = ROOT, durations: Path | None = None, mypy_verdict: str | None = None) -> str:
    files = project_files(root)
    out: list[str] = []

    sizes = module_sizes(root, files)
    big = over(sizes, MODULE_LIMIT)
    total = sum(sizes.values())
    out += [
        "### Modules",
        "",
        f"{len(sizes)} Python files, {total} lines; {len(big)} over {MODULE_LIMIT} lines:",
        "",
    ]
    out += table(("module", "lines"), [(code(k), v) for k, v in big]) + [""]

    functions = function_sizes(root, files)
    long = over(functions, FUNCTION_LIMIT)
    out += [
        "### Functions",
        "",
        f"{len(functions)} functions and methods; {len(long)} over {FUNCTION_LIMIT} lines:",
        "",
    ]
    out += table(("function", "lines"), [(code(k), v) for k, v in long]) + [""]

    runtime, every = import_graph(root, runtime=True), import_graph(root, runtime=False)
    out += [
        f"### Import cycles among {PACKAGE}/ modules",
        "",
        f"Strongly connected components of more than one module ({len(runtime)} modules; "
        f"names relative to `{PACKAGE}`).",
        "",
    ]
    for title, graph in (
        ("Imports run when the modules load (module and class level, outside `if TYPE_CHECKING:`)", runtime),
        ("All imports (`TYPE_CHECKING` blocks and imports inside functions included)", every),
    ):
        rows = cycle_rows(graph, runtime)
        edges = sum(len(v) for v in graph.values())
        plural = "" if len(rows) == 1 else "s"
        out += [f"{title}: {edges} module-to-module imports, {len(rows)} cycle{plural}.", ""]
        if rows:
            out += table(("modules", "cycle", "imports run at load", "imports not run at load"), rows) + [""]

    cov = mypy_coverage(root, files)
    out += [
        "### mypy coverage",
        "",
        f"[tool.mypy] files = {', '.join(cov.checked) or '(none)'}: {cov.covered_lines} of {cov.lines} "
        f"lines ({cov.percent:.1f} %), {cov.covered_files} of {cov.files} files. Not checked:",
        "",
    ]
    out += table(("file", "lines"), [(code(k), v) for k, v in sorted(cov.not_covered.items())]) + [""]
    if mypy_verdict is not None:
        out += [f"mypy on those files: {mypy_verdict}", ""]

    out += ["### Suite time", ""]
    if durations is None:
        out += [f"Not measured here. To measure it: {DURATIONS_HELP}."]
    else:
        d = read_durations(durations)
        slowest = sorted(d.tests.items(), key=lambda kv: (-kv[1], kv[0]))[:SLOWEST]
        kind = "the run's own time" if d.total_is_wall else "the sum of the tests' times"
        out += [f"{len(d.tests)} tests, {d.total:.1f} s ({kind}); the {len(slowest)} slowest:", ""]
        out += table(("test", "seconds"), [(code(k), f"{v:.2f}") for k, v in slowest])
    return "\n".join(out) + "\n"


def run_mypy(root: Path) -> str:
    """mypy's verdict (its last line) on the files pyproject.toml names."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "mypy"], cwd=root, capture_output=True, text=True, timeout=1800
        )
    except subprocess.TimeoutExpired:
        return "mypy ran past 30 minutes"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[-1] if lines else f"mypy printed nothing (exit {done.returncode})"


def write_file_durations(d: Durations, path: Path) -> None:
    """The seconds of each test file (its tests' phases added up), a second or more, as JSON."""
    files: dict[str, float] = {}
    for test, seconds in d.tests.items():
        name = test.split("::", 1)[0]
        files[name] = files.get(name, 0.0) + seconds
    kept = {k: round(v, 1) for k, v in sorted(files.items()) if v >= 1.0}
    path.write_text(json.dumps(kept, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--durations",
        type=Path,
        metavar="FILE",
        help="pytest --durations=0 output or a --junitxml file, for the suite's time",
    )
    parser.add_argument(
        "--write-file-durations",
        action="store_true",
        help="with --durations: write the seconds of each test file to tests/durations.json (the order "
        "in which the suite's workers take the files of a layer: tests/suite.py)",
    )
    parser.add_argument("--mypy", action="store_true", help="also run mypy and print its verdict")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.durations is not None and not args.durations.is_file():
        parser.error(f"--durations {args.durations}: no such file; to make one, {DURATIONS_HELP}")
    if args.write_file_durations:
        if args.durations is None:
            parser.error("--write-file-durations needs --durations FILE")
        write_file_durations(read_durations(args.durations), args.root / "tests" / "durations.json")
    verdict = None
    if args.mypy:
        verdict = run_mypy(args.root) if importlib.util.find_spec("mypy") else "mypy is not installed here"
    print(report(args.root, args.durations, verdict), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
