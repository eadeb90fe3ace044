"""The habits hold: ruff (pyproject.toml's rules and its formatting, 110 columns) and mypy pass on
the whole tree, so .ci/run (which runs this suite) fails on a lint or type error like on any other."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*argv: str) -> subprocess.CompletedProcess:
    argv_ = [str(BIN / argv[0]), *argv[1:]]
    return subprocess.run(argv_, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    r = run("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_ruff_format_changes_nothing():
    r = run("ruff", "format", "--check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_mypy_finds_nothing():
    r = run("mypy", "--no-incremental")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
