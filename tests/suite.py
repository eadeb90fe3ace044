"""How the whole suite runs: in layers, cheapest first, on one process or on pytest-xdist workers,
with the local cluster started while the earlier layers run.

Layers: lint (ruff and mypy), the unit tests, the trainers' tests (torch on the CPU), the
integration tests (a local Docker cluster). When a layer has a failure, no test of a later layer
starts (the failed layer itself runs to its end), so a lint or unit failure fails CI before any
cluster test; --all-layers runs every layer regardless. A run of one file or folder is one layer.

With `-n 2` (README's command 2) each worker takes whole test files (a module's fixtures set up
once), the heaviest first, one layer at a time (LayeredScheduling), and runs the integration tests
on a cluster of its own (FABTRAIN_TESTBED: worker gw0 the first cluster, gw1 a second one). Each
process with integration tests to run starts its cluster in the background as soon as it has
collected (prestart_cluster), while the earlier layers run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("lint", "unit", "trainers", "integration")
LINT_FILE = ROOT / "tests" / "unit" / "test_lint.py"
# Seconds each test file took in a full run (`tests/arch_report.py --durations LOG
# --write-file-durations` writes it): the workers take the heaviest files of a layer first, so the
# last ones to start are short. A file not listed counts SECONDS_PER_TEST per test.
DURATIONS = ROOT / "tests" / "durations.json"
SECONDS_PER_TEST = 10.0


def layer_of(path: Path | str) -> int:
    """The index in LAYERS of the test file at `path` (anything else under tests/ is a unit test)."""
    path = (ROOT / path).resolve()
    if path == LINT_FILE:
        return LAYERS.index("lint")
    for name in ("trainers", "integration"):
        if (ROOT / "tests" / name) in path.parents:
            return LAYERS.index(name)
    return LAYERS.index("unit")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def stop_line(failed: set[int], later: set[int]) -> str:
    return (
        f"layer {', '.join(LAYERS[i] for i in sorted(failed))} failed: the later layers "
        f"({', '.join(LAYERS[i] for i in sorted(later))}) were not run (--all-layers runs them anyway)"
    )


# ------------------------------------------------------------------ the layers across workers


class FailedLayers:
    """The layers that had a failure, seen by every process of the run: the controller writes each
    failed report's layer to a file of the run (`path`), which a worker reads before each test (a
    worker learns of another's failure at once, not when its queue is empty)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, layer: int) -> None:
        with open(self.path, "a") as f:
            f.write(f"{layer}\n")

    def read(self) -> set[int]:
        try:
            return {int(x) for x in self.path.read_text().split()}
        except (OSError, ValueError):
            return set()


def weights() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def make_scheduler(config: pytest.Config, log, failed: FailedLayers):
    """pytest-xdist's scheduler for this suite (LayeredScheduling); imported only under xdist."""
    from xdist.scheduler import LoadScopeScheduling

    class LayeredScheduling(LoadScopeScheduling):
        """Whole files to each worker, the heaviest of a layer first; a layer's first file is sent
        once every test of the layers before it has ended (but the last one on each worker, which
        xdist runs only when it is sent the next: see release) and none once one of them failed."""

        def __init__(self) -> None:
            super().__init__(config, log)
            self.weight = weights()

        def _split_scope(self, nodeid: str) -> str:
            return file_of(nodeid)

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is None:
                if not self._check_nodes_have_same_collection():
                    return
                self.collection = list(next(iter(self.registered_collections.values())))
                units: dict[str, dict[str, bool]] = {}
                for nodeid in self.collection:
                    units.setdefault(file_of(nodeid), {})[nodeid] = False
                order = sorted(
                    units, key=lambda f: (layer_of(f), -self.weight.get(f, SECONDS_PER_TEST * len(units[f])))
                )
                self.workqueue = OrderedDict((f, units[f]) for f in order)
            for node in self.nodes:
                self._reschedule(node)

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            nodeid = self.registered_collections[node][item_index]
            self.assigned_work[node][file_of(nodeid)][nodeid] = True
            for n in self.nodes:  # a layer that ended here lets every waiting worker go on
                self._reschedule(n)

        def _reschedule(self, node) -> None:
            # A worker runs its last pending test only once it is sent another or shut down, so
            # it is sent files until it holds two tests or the queue is empty (one test each, and
            # both workers would wait for ever), unless the next file's layer may not start yet.
            while not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
                if not self.workqueue:
                    node.shutdown()
                    return
                if not self.may_start(layer_of(next(iter(self.workqueue)))):
                    return
                self._assign_work_unit(node)

        def may_start(self, layer: int) -> bool:
            """Whether a file of `layer` may be sent now: once every worker has at most one test of
            the layers before it left (the one xdist runs once it knows what follows it), and never
            after one of them failed (then the run stops)."""
            unfinished = self.unfinished_before(layer)
            if not unfinished:
                return True
            if any(n > 1 for n in unfinished.values()):
                return False
            earlier = {i for i in failed.read() if i < layer}
            if earlier and not config.getoption("--all-layers"):
                self.stop(earlier)
                return False
            return True

        def unfinished_before(self, layer: int) -> dict:
            """Worker -> how many of its tests of the layers before `layer` have not ended, for the
            workers that have any."""
            left = {
                node: sum(
                    not done for f, unit in work.items() if layer_of(f) < layer for done in unit.values()
                )
                for node, work in self.assigned_work.items()
            }
            return {node: n for node, n in left.items() if n}

        def stop(self, failed_layers: set[int]) -> None:
            later = {layer_of(f) for f in self.workqueue}
            self.workqueue.clear()
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(stop_line(failed_layers, later), red=True, bold=True)
            for n in self.nodes:
                n.shutdown()

    return LayeredScheduling()


# ------------------------------------------------------------------ the cluster, started early


PRESTART = pytest.StashKey["subprocess.Popen | None"]()  # this process's prestart_cluster


def worker_index() -> int:
    """0 in a run without xdist and on worker gw0, 1 on gw1, ... (xdist names the worker in the
    environment before any conftest loads)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") else 0


def prestart_cluster(session: pytest.Session) -> subprocess.Popen | None:
    """This process's cluster brought up in the background (a process of its own), when the run has
    integration tests for it (on worker gwN: more than N integration files) and a Docker engine: the
    integration tests' first fixture then finds it up (cluster.up again: it reuses the hosts)."""
    if session.config.option.collectonly:
        return None
    integration = LAYERS.index("integration")
    files = {file_of(i.nodeid) for i in session.items if layer_of(file_of(i.nodeid)) == integration}
    if len(files) <= worker_index():
        return None
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return None
    (ROOT / ".cache").mkdir(exist_ok=True)
    testbed = os.environ.get("FABTRAIN_TESTBED") or "1"
    with open(ROOT / ".cache" / f"cluster-up-{testbed}.log", "w") as log:  # the child keeps its own
        return subprocess.Popen(
            [sys.executable, "-c", "from orchestrator.testbed import cluster; cluster.up(2, spares=2)"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
