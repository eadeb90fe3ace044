import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# A suite started in the background by a shell without job control (`pytest ... &` in a script, or
# under nohup) inherits SIGINT ignored, and so would every fab it starts: the tests that press Ctrl+C
# on `fab logs` or `fab forward` would then fail for how the suite was started. A handler
# here makes the children start with SIGINT's default (an exec resets a handled signal, not an
# ignored one).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from tests import suite  # noqa: E402  (after the path: this checkout's tests and orchestrator)

# On a pytest-xdist worker, this worker's own local cluster: gw0 the first (the one `fab cluster.up`
# makes), gw1 a second. Set at import, before anything imports orchestrator.testbed.cluster (which
# reads it once; tests.suite does not): tests/integration/conftest.py is imported before
# pytest_configure when a path under tests/integration is named on the command line.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["FABTRAIN_TESTBED"] = str(suite.worker_index() + 1)

# The suite runs in layers, cheapest first, on one process or on pytest-xdist workers (tests/suite.py
# says how). FAILED_ENV names the run's file of the layers that had a failure: made by the process
# that starts the run, read by its workers (they inherit the environment).
FAILED_ENV = "FABTRAIN_SUITE_FAILED"
FAILED = pytest.StashKey[suite.FailedLayers]()


def pytest_addoption(parser):
    parser.addoption(
        "--all-layers",
        action="store_true",
        default=False,
        help="run every layer (lint, unit, trainers, integration) even after one failed",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes tens of seconds (still part of every run)")
    if not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="fabtrain-suite-failed-")
        os.close(fd)
        os.environ[FAILED_ENV] = path
    config.stash[FAILED] = suite.FailedLayers(Path(os.environ[FAILED_ENV]))
    config.stash[suite.PRESTART] = None


def pytest_unconfigure(config):
    started = config.stash.get(suite.PRESTART, None)
    if started is not None and started.poll() is None:
        started.terminate()
        started.wait(30)
    if not hasattr(config, "workerinput") and FAILED in config.stash:
        config.stash[FAILED].path.unlink(missing_ok=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Layer order; within a layer, the order collection (and other hooks) gave."""
    items.sort(key=lambda item: suite.layer_of(item.path))


def pytest_collection_finish(session):
    session.config.stash[suite.PRESTART] = suite.prestart_cluster(session)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.failed:
        suite.FailedLayers(Path(os.environ[FAILED_ENV])).add(suite.layer_of(suite.file_of(report.nodeid)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """A test of a layer after one that failed is not run: the run stops there."""
    here = suite.layer_of(item.path)
    failed = {i for i in item.config.stash[FAILED].read() if i < here}
    if not failed or item.config.getoption("--all-layers"):
        return None
    if not item.session.shouldfail:
        later = {suite.layer_of(i.path) for i in item.session.items} - set(range(here))
        item.session.shouldfail = suite.stop_line(failed, later)
    return True


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return suite.make_scheduler(config, log, config.stash[FAILED])
