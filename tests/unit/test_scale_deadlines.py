"""Command deadlines kept by one thread (timers.Deadlines) instead of one timer thread each, and
the open-files limit raised for hundreds of hosts."""

import threading

from orchestrator.transport.timers import Deadlines


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_due_actions_come_in_deadline_order_and_cancelled_ones_never():
    clock, fired = Clock(), []
    d = Deadlines(clock=clock, spawn=lambda action: action())
    d._thread = object()  # no background thread: the test calls due() itself
    a = d.add(5, lambda: fired.append("a"))
    d.add(1, lambda: fired.append("b"))
    d.add(3, lambda: fired.append("c"))
    d.cancel(a)
    assert d.due() == []
    clock.now += 3
    for action in d.due():
        action()
    assert fired == ["b", "c"]
    clock.now += 10
    assert d.due() == [] and d._heap == []  # the cancelled one is gone without running


def test_many_commands_share_one_thread_and_an_expiry_runs_on_its_own():
    d = Deadlines()
    before = set(threading.enumerate())
    handles = [d.add(60, lambda: None) for _ in range(64)]
    assert set(threading.enumerate()) - before == {d._thread}
    for h in handles:
        d.cancel(h)
    fired, where = threading.Event(), []

    def action():
        where.append(threading.current_thread().name)
        fired.set()

    d.add(0.05, action)
    assert fired.wait(30)  # a hang guard: when it fires is the benchmarks' to say
    assert where == ["deadline"]


def test_a_slow_action_does_not_delay_the_next_deadline():
    d = Deadlines()
    release, second = threading.Event(), threading.Event()
    d.add(0.01, lambda: release.wait(60))  # a close that hangs (a frozen host)
    d.add(0.05, second.set)
    assert second.wait(30)  # long before the hung one ends
    release.set()


class FakeResource:
    RLIMIT_NOFILE, RLIM_INFINITY = 7, -1

    def __init__(self, soft, hard):
        self.limits, self.set = (soft, hard), []

    def getrlimit(self, which):
        return self.limits

    def setrlimit(self, which, limits):
        self.set.append(limits)
        self.limits = limits


def test_the_open_files_limit_is_raised_for_hundreds_of_hosts_never_lowered_nor_past_hard():
    from orchestrator.transport.connect import fds_needed, raise_fd_limit

    r = FakeResource(1024, 524288)
    assert raise_fd_limit(fds_needed(512), r) == 1792 and r.set == [(1792, 524288)]
    r = FakeResource(1024, 1500)
    assert raise_fd_limit(fds_needed(512), r) == 1500
    r = FakeResource(4096, 524288)
    assert raise_fd_limit(fds_needed(64), r) == 4096 and r.set == []
