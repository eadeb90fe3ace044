import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The suite runs in layers, cheapest first: lint (ruff and mypy), the unit tests, the trainers'
# tests (torch on the CPU), the integration tests (a local Docker cluster). When a layer has a
# failure, the run stops before the next layer starts (the failed layer itself runs to its end),
# so a lint or unit failure fails CI before the local cluster is even started. --all-layers runs
# every layer regardless. A run of one file or folder is a single layer and runs as before.
LAYERS = ("lint", "unit", "trainers", "integration")
LINT_FILE = ROOT / "tests" / "unit" / "test_lint.py"


def layer_of(path: Path) -> int:
    """The index in LAYERS of the test file at `path` (anything else under tests/ is a unit test)."""
    path = Path(path).resolve()
    if path == LINT_FILE:
        return LAYERS.index("lint")
    for name in ("trainers", "integration"):
        if (ROOT / "tests" / name) in path.parents:
            return LAYERS.index(name)
    return LAYERS.index("unit")


def pytest_addoption(parser):
    parser.addoption(
        "--all-layers",
        action="store_true",
        default=False,
        help="run every layer (lint, unit, trainers, integration) even after one failed",
    )


FAILED = pytest.StashKey[set[int]]()  # indexes in LAYERS of the layers that had a failure


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes tens of seconds (still part of every run)")
    config.stash[FAILED] = set()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Layer order; within a layer, the order collection (and other hooks) gave."""
    items.sort(key=lambda item: layer_of(item.path))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield  # outermost: the report as the other plugins (xfail's among them) leave it
    if report.failed:
        item.config.stash[FAILED].add(layer_of(item.path))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    result = yield
    if nextitem is not None and not item.config.getoption("--all-layers"):
        here, after = layer_of(item.path), layer_of(nextitem.path)
        failed = sorted(i for i in item.config.stash[FAILED] if i <= here)
        if after > here and failed and not item.session.shouldfail:
            later = sorted({layer_of(i.path) for i in item.session.items} - set(range(here + 1)))
            item.session.shouldfail = (
                f"layer {', '.join(LAYERS[i] for i in failed)} failed: the later layers "
                f"({', '.join(LAYERS[i] for i in later)}) were not run (--all-layers runs them anyway)"
            )
    return result
