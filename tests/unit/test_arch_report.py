"""tests/arch_report.py, on a tiny project written in tmp_path: its sizes, cycles, coverage and times
are known exactly."""

import json
import textwrap

import pytest

from tests import arch_report as ar

# An import cycle of each kind. a <-> b only through a TYPE_CHECKING block; c -> d -> x -> c only
# through an import inside a function; e <-> f through a class body and g <-> h through the else
# branch of a TYPE_CHECKING block (both run when the modules load).
PACKAGE = {
    "__init__.py": "",
    "a.py": """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from orchestrator.b import B


        def make() -> "B":
            raise NotImplementedError
        """,
    "b.py": """\
        from orchestrator import a


        class B:
            pass
        """,
    "c.py": """\
        def later():
            from orchestrator import d
            return d
        """,
    "d.py": "import orchestrator.x\n",
    "x.py": "from orchestrator.c import later\n",
    "e.py": "from orchestrator.f import F\n",
    "f.py": """\
        class F:
            from orchestrator import e
        """,
    "g.py": """\
        import typing

        if typing.TYPE_CHECKING:
            pass
        else:
            import orchestrator.h
        """,
    "h.py": "from orchestrator import g, nothing_here\n",
    "sub/__init__.py": "import os\n",
    "sub/deep.py": "import orchestrator.sub\nimport json\n",
}


def body(lines: int) -> str:
    """A function of exactly `lines` lines, its `def` line included."""
    return "\n".join(["def f():"] + ["    x = 1"] * (lines - 1)) + "\n"


@pytest.fixture
def project(tmp_path):
    for name, text in PACKAGE.items():
        path = tmp_path / "orchestrator" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "trainers").mkdir()
    (tmp_path / "trainers" / "long.py").write_text(
        body(61).replace("def f", "def sixty_one")
        + "\n\n"
        + body(60).replace("def f", "def sixty")
        + "\n\n"
        + "class K:\n"
        + textwrap.indent(body(62).replace("def f():", "def m(self):"), "    ")
    )
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "entrypoint.py").write_text("def main():\n    def inner():\n        pass\n")
    (tmp_path / "docker" / "other.py").write_text("x = 1\n")  # not part of the project
    (tmp_path / "fabfile.py").write_text("import orchestrator\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.mypy]\nfiles = ["orchestrator", "fabfile.py"]\nexclude = ["sub/deep"]\n'
    )
    return tmp_path


def test_module_sizes(project):
    sizes = ar.module_sizes(project, ar.project_files(project))
    assert sizes == {
        "docker/entrypoint.py": 3,
        "fabfile.py": 1,
        "orchestrator/__init__.py": 0,
        "orchestrator/a.py": 8,
        "orchestrator/b.py": 5,
        "orchestrator/c.py": 3,
        "orchestrator/d.py": 1,
        "orchestrator/e.py": 1,
        "orchestrator/f.py": 2,
        "orchestrator/g.py": 6,
        "orchestrator/h.py": 1,
        "orchestrator/sub/__init__.py": 1,
        "orchestrator/sub/deep.py": 2,
        "orchestrator/x.py": 1,
        "trainers/long.py": 61 + 2 + 60 + 2 + 1 + 62,
    }
    assert ar.over(sizes, 5) == [
        ("trainers/long.py", 188),
        ("orchestrator/a.py", 8),
        ("orchestrator/g.py", 6),
    ]


def test_a_61_line_function_is_flagged_and_a_60_line_one_is_not(project):
    sizes = ar.function_sizes(project, ar.project_files(project))
    assert sizes["trainers/long.py:sixty_one"] == 61
    assert sizes["trainers/long.py:sixty"] == 60
    assert sizes["trainers/long.py:K.m"] == 62
    assert sizes["docker/entrypoint.py:main.inner"] == 2
    assert len(sizes) == 7
    assert ar.over(sizes, ar.FUNCTION_LIMIT) == [
        ("trainers/long.py:K.m", 62),
        ("trainers/long.py:sixty_one", 61),
    ]


def test_a_type_checking_cycle_is_in_the_all_imports_graph_only(project):
    runtime = ar.import_graph(project, runtime=True)
    every = ar.import_graph(project, runtime=False)
    assert runtime["orchestrator.a"] == set()
    assert every["orchestrator.a"] == {"orchestrator.b"}
    # nothing_here is no module: a name from the package, which loads the package itself.
    assert runtime["orchestrator.h"] == every["orchestrator.h"] == {"orchestrator.g", "orchestrator"}
    assert runtime["orchestrator.sub.deep"] == {"orchestrator.sub"}
    assert ar.cycles(runtime) == [["orchestrator.e", "orchestrator.f"], ["orchestrator.g", "orchestrator.h"]]
    assert ar.cycles(every) == [
        ["orchestrator.c", "orchestrator.d", "orchestrator.x"],
        ["orchestrator.a", "orchestrator.b"],
        ["orchestrator.e", "orchestrator.f"],
        ["orchestrator.g", "orchestrator.h"],
    ]


def test_the_cycles_are_the_strongly_connected_components():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d", "f"}, "f": set(), "g": {"g"}}
    assert ar.cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    chain = {str(i): {str(i + 1)} for i in range(5000)} | {"5000": {"0"}}  # deeper than the recursion limit
    assert [len(c) for c in ar.cycles(chain)] == [5001]


def test_the_cycle_table_parts_the_imports_run_at_load_from_the_others(project):
    runtime = ar.import_graph(project, runtime=True)
    rows = ar.cycle_rows(ar.import_graph(project, runtime=False), runtime)
    assert rows[:2] == [(3, "c, d, x", "d → x; x → c", "c → d"), (2, "a, b", "b → a", "a → b")]
    assert ar.cycle_rows(runtime, runtime)[0] == (2, "e, f", "e → f; f → e", "none")


def test_mypy_coverage(project):
    cov = ar.mypy_coverage(project, ar.project_files(project))
    assert cov.checked == ["orchestrator", "fabfile.py"]
    assert (cov.files, cov.covered_files) == (15, 12)
    assert (cov.lines, cov.covered_lines) == (223, 223 - 188 - 3 - 2)
    assert round(cov.percent, 2) == 13.45
    assert cov.not_covered == {
        "docker/entrypoint.py": 3,
        "orchestrator/sub/deep.py": 2,
        "trainers/long.py": 188,
    }


DURATIONS = """\
============================= slowest durations ==============================
2.50s call     tests/unit/test_x.py::test_slow
0.40s setup    tests/unit/test_x.py::test_slow
0.10s call     tests/unit/test_y.py::test_param[a b]
0.00s teardown tests/unit/test_y.py::test_param[a b]

(12 durations < 0.005s hidden.  Use -vv to show these durations.)
======================== 40 passed, 1 skipped in 12.34s (0:00:12) ========================
"""
JUNIT = """\
<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" \
errors="0" failures="0" skipped="0" tests="2" time="3.210"><testcase classname="tests.unit.test_x" \
name="test_slow" time="2.900" /><testcase classname="tests.unit.test_y" name="test_fast" time="0.100">\
<system-out>ok</system-out></testcase></testsuite></testsuites>
"""


def test_durations_from_pytest_output(tmp_path):
    (tmp_path / "d.txt").write_text(DURATIONS)
    d = ar.read_durations(tmp_path / "d.txt")
    assert d == ar.Durations(
        total=12.34,
        total_is_wall=True,
        tests={"tests/unit/test_x.py::test_slow": 2.9, "tests/unit/test_y.py::test_param[a b]": 0.1},
    )
    # As with --color=yes:
    colored = DURATIONS.replace("\n=", "\n\x1b[32m=").replace(" in 12.34s", "\x1b[0m in 12.34s")
    (tmp_path / "d.txt").write_text(colored)
    assert ar.read_durations(tmp_path / "d.txt").total == 12.34
    (tmp_path / "d.txt").write_text(DURATIONS.splitlines(keepends=True)[1])  # no summary line: the sum
    assert ar.read_durations(tmp_path / "d.txt").total == 2.5


def test_the_seconds_of_each_test_file_for_the_suites_workers(tmp_path):
    (tmp_path / "d.txt").write_text(DURATIONS.replace("0.10s call", "1.10s call"))
    ar.write_file_durations(ar.read_durations(tmp_path / "d.txt"), tmp_path / "durations.json")
    assert json.loads((tmp_path / "durations.json").read_text()) == {
        "tests/unit/test_x.py": 2.9,
        "tests/unit/test_y.py": 1.1,
    }


def test_durations_from_junit_xml(tmp_path):
    (tmp_path / "suite.xml").write_text(JUNIT)
    assert ar.read_durations(tmp_path / "suite.xml") == ar.Durations(
        total=3.21,
        total_is_wall=True,
        tests={"tests.unit.test_x::test_slow": 2.9, "tests.unit.test_y::test_fast": 0.1},
    )


def test_the_report(project, capsys):
    (project / "suite.xml").write_text(JUNIT)
    assert ar.main(["--root", str(project), "--durations", str(project / "suite.xml")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "15 Python files, 223 lines; 0 over 400 lines:" in out
    assert "7 functions and methods; 2 over 60 lines:" in out
    assert "| `trainers/long.py:sixty_one` | 61 |" in out
    assert (
        "Imports run when the modules load (module and class level, outside `if TYPE_CHECKING:`): "
        "9 module-to-module imports, 2 cycles."
    ) in out
    assert (
        "All imports (`TYPE_CHECKING` blocks and imports inside functions included): "
        "11 module-to-module imports, 4 cycles."
    ) in out
    assert (
        "[tool.mypy] files = orchestrator, fabfile.py: 30 of 223 lines (13.5 %), 12 of 15 files. Not checked:"
    ) in out
    assert "2 tests, 3.2 s (the run's own time); the 2 slowest:" in out
    assert out[-2:] == [
        "| `tests.unit.test_x::test_slow` | 2.90 |",
        "| `tests.unit.test_y::test_fast` | 0.10 |",
    ]


def test_a_missing_durations_file_says_how_to_make_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        ar.main(["--durations", str(tmp_path / "none.txt")])
    assert exit_.value.code == 2
    assert "none.txt: no such file; to make one, run `.venv/bin/pytest tests --durations=0 -vv" in (
        capsys.readouterr().err
    )
