"""Telemetry while an attempt is watched: every job.telemetry_every seconds, each host's plan step
`telemetry` (one SSH command on the session the job already holds, with the step's deadline) is
run, its output read by samples.parse_sample and kept to the GPUs the job holds there,
and reported as a `telemetry` event (runs/JOB/telemetry.jsonl, /metrics, --json).

At most one sample is in flight per host: a host whose command has not come back is skipped, not
piled up, and named once (`sampling goes on with the others`). A GPU the job holds whose
utilisation stays at most IDLE_UTIL for job.idle_gpu_after seconds is named once; with
job.stop_idle, `on_idle` is called (the job is stopped as by fab stop).

The sampler sits below the backends: it reads an SSH attempt's plan (backends/ssh/attempt.AttemptPlan)
through `Sampled`, the few fields it needs, so that it names no backend's type.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from orchestrator.hosts import claims
from orchestrator.telemetry.samples import parse_sample
from orchestrator.transport.remote import describe

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.transport.remote import Session

IDLE_UTIL = 0.01  # a GPU at most this busy (0 to 1) is idle
MAX_WORKERS = 16  # hosts sampled at once


class SampleStep(Protocol):
    """A plan step that samples one host (the `telemetry` steps of backends/ssh/planstep.Step)."""

    @property
    def where(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def command(self) -> str: ...
    @property
    def deadline(self) -> float: ...
    @property
    def what(self) -> str: ...


class Sampled(Protocol):
    """What the sampler reads of an attempt's plan (backends/ssh/attempt.AttemptPlan)."""

    @property
    def inv(self) -> Inventory: ...
    @property
    def hosts(self) -> Sequence[Host]: ...
    @property
    def steps(self) -> Sequence[SampleStep]: ...
    @property
    def units(self) -> Mapping[str, tuple[int, ...]]: ...


class Idle:
    """Which GPUs have stayed idle for `after` seconds, each named once (pure: the caller's clock)."""

    def __init__(self, after: float) -> None:
        self.after = after
        self.since: dict[tuple[str, int], float] = {}  # (host, GPU) -> when it was first seen idle
        self.named: set[tuple[str, int]] = set()

    def see(self, host: str, gpus: list[dict], now: float) -> list[tuple[int, float]]:
        """(GPU index, seconds idle) of each of the host's GPUs that has just passed `after`."""
        newly = []
        for g in gpus:
            key = (host, g["index"])
            if g.get("util") is None or g["util"] > IDLE_UTIL:
                self.since.pop(key, None)
                self.named.discard(key)
                continue
            start = self.since.setdefault(key, now)
            if self.after and now - start >= self.after and key not in self.named:
                self.named.add(key)
                newly.append((g["index"], now - start))
        return newly


def held(sample: dict, host: Host, units: tuple[int, ...] | None) -> dict:
    """The sample with only the GPUs the job holds on the host (all when it says nothing)."""
    if units is None or claims.kind(host) != "GPU":
        return sample
    return {**sample, "gpus": [g for g in sample.get("gpus", ()) if g.get("index") in units]}


class Sampler:
    """Samples an attempt's hosts in the background (see the module's docstring) until `stop`."""

    def __init__(
        self,
        session: Session,
        attempt: Sampled,
        emit: Callable[..., None],
        note: Callable[[str, str], None],
        on_idle: Callable[[str], None] | None = None,
        watched: Callable[[str], bool] = lambda host: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session, self.attempt, self.emit, self.note = session, attempt, emit, note
        self.watched = watched  # False: the host's node has ended, or the host is lost: not asked again
        self.on_idle, self.clock = on_idle, clock
        job = attempt.inv.job
        self.every = job.telemetry_every
        self.idle = Idle(job.idle_gpu_after)
        self.stop_idle = job.stop_idle
        self.steps = {s.where: s for s in attempt.steps if s.key == "telemetry"}
        self.hosts = [h for h in attempt.hosts if h.name in self.steps]
        self.busy: set[str] = set()
        self.silent: set[str] = set()  # hosts named as not answering (named again once they do)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        if not self.every or not self.hosts:
            return
        self.pool = ThreadPoolExecutor(
            max_workers=min(MAX_WORKERS, len(self.hosts)), thread_name_prefix="telemetry"
        )
        self.thread = threading.Thread(target=self.run, daemon=True, name="telemetry")
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def run(self) -> None:
        while True:
            for h in self.hosts:
                with self.lock:
                    if h.name in self.busy or not self.watched(h.name):
                        continue
                    self.busy.add(h.name)
                try:
                    assert self.pool is not None
                    self.pool.submit(self.sample, h)
                except RuntimeError:  # the pool was shut down: the watch is over
                    return
            if self.stopped.wait(self.every):
                return

    def sample(self, h: Host) -> None:
        step = self.steps[h.name]
        try:
            if self.stopped.is_set() or not self.watched(h.name):
                return
            r = self.session.run(h, step.command, timeout=step.deadline, what=step.what)
        except Exception as exc:  # noqa: BLE001 - a host that does not answer is named, not fatal
            if not self.stopped.is_set() and h.name not in self.silent:
                self.silent.add(h.name)
                self.note(f"telemetry: {describe(h, exc)}; sampling goes on with the other hosts", "warning")
            return
        finally:
            with self.lock:
                self.busy.discard(h.name)
        if self.stopped.is_set():
            return
        self.silent.discard(h.name)
        sample = held(parse_sample(r.stdout), h, self.attempt.units.get(h.name))
        self.emit("telemetry", host=h.name, sample=sample)
        for index, seconds in self.idle.see(h.name, sample.get("gpus", []), self.clock()):
            self.note(
                f"{h.name} GPU {index}: idle (utilisation at most {IDLE_UTIL:.0%}) for {seconds:.0f}s "
                "while the job holds it"
                + (
                    "; stopping the job (--stop-idle)"
                    if self.stop_idle
                    else "; --stop-idle would stop the job"
                ),
                "warning",
            )
            if self.stop_idle and self.on_idle is not None:
                self.on_idle(f"{h.name} GPU {index} idle for {seconds:.0f}s")
