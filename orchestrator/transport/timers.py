"""Every pending command deadline (Command's, in remote.py), kept by one thread instead of a timer
thread per command."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable


class Deadlines:
    """Every pending command deadline, kept by one thread instead of a timer thread per command
    (a fan-out to 64 hosts started 64 more threads). A deadline that passes runs its action on a
    thread of its own, so one slow close (a frozen host's channel) cannot hold up the others;
    the common case, a command done in time, costs no thread at all."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, spawn: Callable | None = None) -> None:
        self.clock = clock
        self._spawn = spawn or (
            lambda action: threading.Thread(target=action, daemon=True, name="deadline").start()
        )
        self._heap: list[list] = []  # [when, sequence, action or None once cancelled]
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, seconds: float, action: Callable[[], None]) -> list:
        """Run `action` once `seconds` have passed, unless cancelled; the handle for cancel()."""
        entry = [self.clock() + seconds, next(self._seq), action]
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="deadlines")
                self._thread.start()
            self._cond.notify()
        return entry

    def cancel(self, entry: list) -> None:
        with self._cond:
            entry[2] = None  # dropped when it reaches the top of the heap

    def due(self) -> list[Callable[[], None]]:
        """The actions whose time has come, in deadline order, taken off the heap."""
        out = []
        with self._cond:
            now = self.clock()
            while self._heap and (self._heap[0][2] is None or self._heap[0][0] <= now):
                action = heapq.heappop(self._heap)[2]
                if action is not None:
                    out.append(action)
        return out

    def _run(self) -> None:
        while True:
            for action in self.due():
                self._spawn(action)
            with self._cond:
                wait = self._heap[0][0] - self.clock() if self._heap else None
                if wait is None or wait > 0:
                    self._cond.wait(wait)


DEADLINES = Deadlines()
