"""The suite's own scheduling on pytest-xdist workers (tests/suite.py), against stand-in workers that
record what they are sent: whole files, the heaviest first, one layer at a time, and nothing of a
later layer once an earlier one failed."""

from types import SimpleNamespace

from tests import suite

LINT = "tests/unit/test_lint.py"
UNIT_A, UNIT_B = "tests/unit/test_a.py", "tests/unit/test_b.py"
INTEG_A, INTEG_B = "tests/integration/test_a.py", "tests/integration/test_b.py"


class Worker:
    """What the scheduler sees of an xdist worker: the indexes it is sent, and a shutdown."""

    def __init__(self, name):
        self.name, self.sent, self.shutting_down = name, [], False
        self.gateway = SimpleNamespace(id=name)

    def send_runtest_some(self, indexes):
        self.sent += indexes

    def shutdown(self):
        self.shutting_down = True

    def __repr__(self):
        return self.name


class Config:
    def __init__(self, all_layers=False):
        self.all_layers, self.lines = all_layers, []
        self.pluginmanager = self

    def getvalue(self, name):
        return ["2*popen"] if name == "tx" else None

    def getoption(self, name):
        assert name == "--all-layers"
        return self.all_layers

    def get_plugin(self, name):
        return self

    def write_line(self, text, **markup):
        self.lines.append(text)


def started(tmp_path, collection, weights=None, all_layers=False):
    failed = suite.FailedLayers(tmp_path / "failed")
    config = Config(all_layers)
    sched = suite.make_scheduler(config, None, failed)
    sched.weight = weights or {}
    workers = [Worker("gw0"), Worker("gw1")]
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, collection)
    sched.schedule()
    return sched, workers, failed, config


def sent(sched, w):
    return [sched.collection[i] for i in w.sent]


def complete(sched, w, nodeid):
    sched.mark_test_complete(w, sched.collection.index(nodeid))


COLLECTION = [
    f"{LINT}::test_ruff",
    f"{LINT}::test_mypy",
    f"{UNIT_A}::test_1",
    f"{UNIT_B}::test_1",
    f"{UNIT_B}::test_2",
    f"{INTEG_A}::test_1",
    f"{INTEG_B}::test_1",
]


def test_whole_files_one_layer_at_a_time_the_heaviest_first(tmp_path):
    sched, (w0, w1), _, _ = started(tmp_path, COLLECTION, {INTEG_B: 300.0, INTEG_A: 20.0})
    # The lint file to one worker; the other waits: the unit layer starts once lint has ended.
    assert sent(sched, w0) == [f"{LINT}::test_ruff", f"{LINT}::test_mypy"] and w1.sent == []
    complete(sched, w0, f"{LINT}::test_ruff")
    # One lint test left, on gw0 (xdist runs it once it knows what follows): the next layer goes on.
    assert sent(sched, w0)[2:] == [f"{UNIT_B}::test_1", f"{UNIT_B}::test_2"]  # 2 tests: the heavier
    assert sent(sched, w1) == [f"{UNIT_A}::test_1"]
    for w, nodeid in ((w0, f"{LINT}::test_mypy"), (w1, f"{UNIT_A}::test_1"), (w0, f"{UNIT_B}::test_1")):
        complete(sched, w, nodeid)
    # Each worker has at most one unit test left: the integration layer starts, its heaviest file
    # first (to the first worker asked).
    assert sent(sched, w0)[4:] == [f"{INTEG_B}::test_1"]
    assert sent(sched, w1)[1:] == [f"{INTEG_A}::test_1"]
    assert not sched.workqueue and not w0.shutting_down
    complete(sched, w0, f"{UNIT_B}::test_2")  # nothing left to send: each worker ends after its own
    assert w0.shutting_down and w1.shutting_down


def test_no_later_layer_starts_once_a_test_of_an_earlier_one_failed(tmp_path):
    sched, (w0, w1), failed, config = started(tmp_path, COLLECTION[:5])
    failed.add(suite.LAYERS.index("lint"))  # test_ruff failed (the controller's report hook)
    complete(sched, w0, f"{LINT}::test_ruff")
    assert len(w0.sent) == 2 and w1.sent == []  # nothing of the unit layer was sent
    assert w0.shutting_down and w1.shutting_down and not sched.workqueue
    assert config.lines == [
        "layer lint failed: the later layers (unit) were not run (--all-layers runs them anyway)"
    ]


def test_all_layers_runs_the_later_layers_after_a_failure(tmp_path):
    sched, (w0, w1), failed, _ = started(tmp_path, COLLECTION[:5], all_layers=True)
    failed.add(suite.LAYERS.index("lint"))
    complete(sched, w0, f"{LINT}::test_ruff")
    assert len(w0.sent) + len(w1.sent) == 5


def test_a_file_that_failed_is_known_to_every_process_of_the_run(tmp_path):
    failed = suite.FailedLayers(tmp_path / "failed")
    assert failed.read() == set()
    failed.add(1)
    failed.add(1)
    assert suite.FailedLayers(tmp_path / "failed").read() == {1}


def test_layers_of_files():
    assert [suite.layer_of(f) for f in (LINT, UNIT_A, "tests/trainers/test_gpt.py", INTEG_A)] == [0, 1, 2, 3]


def test_no_worker_is_left_holding_a_single_test_while_files_are_queued(tmp_path):
    # xdist runs a worker's last pending test only once it is sent another or shut down: with one
    # one-test file each and a third queued, both workers waited for ever.
    files = [f"tests/unit/test_{x}.py::test_1" for x in "abc"]
    sched, (w0, w1), _, _ = started(tmp_path, files)
    assert sent(sched, w0) == files[:2] and sent(sched, w1) == files[2:]
    assert not sched.workqueue and w1.shutting_down  # its one test runs now; gw0 runs a, then b
    complete(sched, w0, files[0])
    assert w0.shutting_down
