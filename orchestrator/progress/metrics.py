"""The job's metrics for Prometheus: `/metrics` served by prometheus_client from the process that
runs the job's lifecycle, while it runs (fab train --metrics-port, job.metrics_port).

`Metrics` is one more listener of the job's events (events.py): progress (step, loss, tokens/s,
step and compute times per rank), host failures, attempts, and the hosts' telemetry samples. What
it serves is read at each scrape from what it last heard (a custom collector), so a value never
lags a scrape by more than an event.

Names and labels follow Prometheus's conventions (prometheus.io/docs/practices/naming): every series
names its job in `job_id` (`job` is the label Prometheus itself gives a scrape target), units are
base units in the name (`_seconds`, `_bytes`), counters end in `_total`, and a time is a Unix
timestamp gauge (`fabtrain_last_progress_timestamp_seconds`: `time() - ...` is how long ago).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from orchestrator.config.fields import listen_address
from orchestrator.core.events import Reporter


class Metrics(Reporter):
    """What the job's events said last, served as Prometheus metrics (see the module's docstring).
    `serve` starts the HTTP server; `close` stops it."""

    def __init__(self, job_id: str, owner: str, clock: Callable[[], float] = time.time) -> None:
        from prometheus_client.registry import CollectorRegistry

        self.job, self.owner, self.clock = job_id, owner, clock
        self.lock = threading.Lock()
        self.attempt = 0
        self.running = 0
        self.ranks: dict[tuple[str, int], dict] = {}  # (host, rank) -> its newest step line
        self.moved: dict[str, float] = {}  # host -> when its step last rose (Unix s)
        self.steps: dict[str, int] = {}  # host -> its newest step
        self.failures: dict[tuple[str, str], int] = {}  # (host, kind) -> count
        self.samples: dict[str, dict] = {}  # host -> its newest telemetry sample
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)
        self.server: Any = None

    # ------------------------------------------------------------ events in

    def emit(self, event: str, **f) -> None:
        with self.lock:
            if event == "attempt":
                self.attempt, self.running = int(f["attempt"]), 1
                now = self.clock()
                self.ranks.clear()
                self.samples.clear()
                self.steps.clear()
                self.moved = {str(h): now for h in f["hosts"]}
            elif event == "progress":
                host = str(f["host"])
                if f["step"] != self.steps.get(host):
                    self.steps[host], self.moved[host] = f["step"], self.clock()
                for r in f.get("ranks") or ():
                    self.ranks[(host, r["rank"])] = r
            elif event == "host_failed":
                key = (str(f["host"]), str(f["kind"]))
                self.failures[key] = self.failures.get(key, 0) + 1
            elif event == "telemetry":
                self.samples[str(f["host"])] = f["sample"]
            elif event in ("attempt_end", "finished"):
                self.running = 0

    # ------------------------------------------------------------ metrics out (at each scrape)

    def describe(self) -> list:
        return []  # the families depend on what was heard; collect() says them all

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name: str, doc: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"fabtrain_{name}", doc, labels=("job_id", *labels))

        def counter(name: str, doc: str, labels: tuple[str, ...]) -> CounterMetricFamily:
            # prometheus_client serves its samples as NAME_total
            return CounterMetricFamily(f"fabtrain_{name}", doc, labels=("job_id", *labels))

        with self.lock:
            job = self.job
            info = gauge("job_info", "The job and who started it (always 1).", ("owner",))
            info.add_metric([job, self.owner], 1)
            attempt = gauge("attempt", "The attempt under way (1: the first start).", ())
            attempt.add_metric([job], self.attempt)
            running = gauge("running", "1 while an attempt's nodes run, else 0.", ())
            running.add_metric([job], self.running)
            yield from (info, attempt, running)

            per_rank = (
                ("step", "step", "The newest step a rank reported."),
                ("loss", "loss", "The training loss at the rank's newest step."),
                ("tokens_per_second", "tokens_per_s", "Tokens a second, the rank's last interval."),
                ("step_seconds", "step_ms", "Seconds a step took, the rank's last interval."),
                ("compute_seconds", "compute_ms", "Seconds of compute a step (no waiting)."),
            )
            for name, key, doc in per_rank:
                family = gauge(name, doc, ("host", "rank"))
                for (host, rank), r in sorted(self.ranks.items()):
                    value = r.get(key)
                    if value is not None:
                        value = value / 1000 if key.endswith("_ms") else value
                        family.add_metric([job, host, str(rank)], value)
                yield family

            moved = gauge(
                "last_progress_timestamp_seconds",
                "When the host's step last rose (or its attempt started), Unix time.",
                ("host",),
            )
            for host, t in sorted(self.moved.items()):
                moved.add_metric([job, host], round(t, 3))
            yield moved

            failures = counter("host_failures", "Hosts that failed an attempt, by how.", ("host", "kind"))
            for (host, kind), n in sorted(self.failures.items()):
                failures.add_metric([job, host, kind], n)
            yield failures
            yield from self._telemetry(gauge, counter)

    def _telemetry(self, gauge: Callable[..., Any], counter: Callable[..., Any]) -> Iterator[Any]:
        """The hosts' newest telemetry samples (telemetry/samples.parse_sample's shape)."""
        job = self.job
        per_gpu = (
            ("gpu_utilization_ratio", "util", "GPU utilisation, 0 to 1."),
            ("gpu_memory_used_bytes", "mem_used", "GPU memory in use."),
            ("gpu_memory_total_bytes", "mem_total", "GPU memory in all."),
            ("gpu_power_watts", "power_w", "GPU power draw."),
            ("gpu_temperature_celsius", "temp_c", "GPU temperature."),
            # A count that only rises until the driver reloads: a counter (rate() sees the reset).
            ("gpu_ecc_uncorrected_errors", "ecc_uncorrected", "Uncorrected ECC errors (volatile)."),
        )
        for name, key, doc in per_gpu:
            family = (counter if key == "ecc_uncorrected" else gauge)(name, doc, ("host", "gpu"))
            for host, sample in sorted(self.samples.items()):
                for g in sample.get("gpus", ()):
                    if g.get(key) is not None:
                        family.add_metric([job, host, str(g["index"])], g[key])
            yield family
        per_container = (
            ("container_cpu_cores", "cpu", "CPU cores the job's container uses (1: one core)."),
            ("container_memory_bytes", "mem", "Memory the job's container uses."),
        )
        for name, key, doc in per_container:
            family = gauge(name, doc, ("host", "container"))
            for host, sample in sorted(self.samples.items()):
                for c in sample.get("containers", ()):
                    if c.get(key) is not None:
                        family.add_metric([job, host, c["name"]], c[key])
            yield family
        load = gauge("host_load1", "The host's 1-minute load average.", ("host",))
        for host, sample in sorted(self.samples.items()):
            if (sample.get("host") or {}).get("load1") is not None:
                load.add_metric([job, host], sample["host"]["load1"])
        yield load

    # ------------------------------------------------------------ the server

    def serve(self, where: str) -> str:
        """Serve /metrics at `where` ([ADDR:]PORT); its URL. OSError when the port is taken."""
        from prometheus_client import start_http_server

        addr, port = listen_address(where)
        self.server, _ = start_http_server(port, addr, registry=self.registry)
        host = f"[{addr}]" if ":" in addr else addr
        return f"http://{host}:{port}/metrics"

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
