"""The job's Prometheus metrics: what the events said, exposed with conventional names and labels,
and the listen address checked."""

import socket
import urllib.request

import pytest
from prometheus_client import generate_latest

from orchestrator.config.fields import listen_address
from orchestrator.progress.metrics import Metrics


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def scrape(m: Metrics) -> dict[str, float]:
    """Each sample line of the exposition: 'name{labels}' -> value."""
    out = {}
    for line in generate_latest(m.registry).decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def rank(r, step, loss=2.5, rate=1000.0, step_ms=20.0, compute_ms=15.0):
    return {
        "rank": r,
        "step": step,
        "loss": loss,
        "tokens_per_s": rate,
        "step_ms": step_ms,
        "compute_ms": compute_ms,
    }


def test_metrics_follow_the_events_of_a_job_with_a_restart():
    clock = Clock()
    m = Metrics("tiny-1", "alice", clock=clock)
    m.emit("attempt", job="tiny-1", attempt=1, hosts={"node1": 0, "node2": 1}, port=29500)
    m.emit("progress", job="tiny-1", attempt=1, host="node1", step=10, ranks=[rank(0, 10)])
    m.emit("progress", job="tiny-1", attempt=1, host="node2", step=10, ranks=[rank(1, 10, step_ms=None)])
    clock.now += 7
    got = scrape(m)
    assert got['fabtrain_job_info{job_id="tiny-1",owner="alice"}'] == 1
    assert got['fabtrain_attempt{job_id="tiny-1"}'] == 1 and got['fabtrain_running{job_id="tiny-1"}'] == 1
    assert got['fabtrain_step{host="node1",job_id="tiny-1",rank="0"}'] == 10
    assert got['fabtrain_tokens_per_second{host="node2",job_id="tiny-1",rank="1"}'] == 1000
    assert got['fabtrain_step_seconds{host="node1",job_id="tiny-1",rank="0"}'] == 0.02
    assert 'fabtrain_step_seconds{host="node2",job_id="tiny-1",rank="1"}' not in got  # no times on its line
    assert got['fabtrain_last_progress_timestamp_seconds{host="node1",job_id="tiny-1"}'] == 100  # Unix time
    m.emit("progress", job="tiny-1", attempt=1, host="node1", step=10, ranks=[rank(0, 10)])  # no new step
    assert scrape(m)['fabtrain_last_progress_timestamp_seconds{host="node1",job_id="tiny-1"}'] == 100
    m.emit("progress", job="tiny-1", attempt=1, host="node1", step=20, ranks=[rank(0, 20)])
    assert scrape(m)['fabtrain_last_progress_timestamp_seconds{host="node1",job_id="tiny-1"}'] == 107
    assert not any(k.startswith("fabtrain_host_failures_total{") for k in got)

    m.emit("host_failed", job="tiny-1", attempt=1, host="node2", kind="exited", detail="exited with code 1")
    m.emit("attempt_end", job="tiny-1", attempt=1, ok=False, outcome="node2 exited")
    assert scrape(m)['fabtrain_running{job_id="tiny-1"}'] == 0
    m.emit("attempt", job="tiny-1", attempt=2, hosts={"node1": 0, "node3": 1}, port=29500)
    m.emit("host_failed", job="tiny-1", attempt=2, host="node3", kind="lost", detail="no answer")
    got = scrape(m)
    assert got['fabtrain_attempt{job_id="tiny-1"}'] == 2
    assert got['fabtrain_host_failures_total{host="node2",job_id="tiny-1",kind="exited"}'] == 1
    assert got['fabtrain_host_failures_total{host="node3",job_id="tiny-1",kind="lost"}'] == 1
    # The new attempt's hosts only: node2's rank series are gone, no step yet.
    assert not any(k.startswith("fabtrain_step{") for k in got)
    assert got['fabtrain_last_progress_timestamp_seconds{host="node3",job_id="tiny-1"}'] == 107  # its start
    assert 'fabtrain_last_progress_timestamp_seconds{host="node2",job_id="tiny-1"}' not in got


def test_telemetry_samples_become_gpu_and_container_gauges():
    m = Metrics("j", "bob")
    sample = {
        "vendor": "nvidia",
        "gpus": [
            {
                "index": 3,
                "uuid": "GPU-1",
                "bus": "00000000:3B:00.0",
                "util": 0.87,
                "mem_used": 1 << 30,
                "mem_total": 80 << 30,
                "power_w": 301.5,
                "temp_c": 61.0,
                "throttle": [],
                "ecc_uncorrected": None,
            }
        ],
        "containers": [{"name": 'fabtrain-j-r0"} evil', "cpu": 1.5, "mem": 123, "mem_limit": None}],
        "host": {"load1": 2.25, "mem_used": 1, "mem_total": 2, "cpus": 8},
        "xid": [],
        "errors": [],
    }
    m.emit("telemetry", job="j", attempt=1, host="node1", sample=sample)
    got = scrape(m)
    assert got['fabtrain_gpu_utilization_ratio{gpu="3",host="node1",job_id="j"}'] == 0.87
    assert got['fabtrain_gpu_memory_total_bytes{gpu="3",host="node1",job_id="j"}'] == 80 << 30
    assert not any(k.startswith("fabtrain_gpu_ecc_uncorrected_errors_total{") for k in got)  # None: none
    # A container's name is a label value, escaped by the exposition: it cannot add labels.
    cpu = 'fabtrain_container_cpu_cores{container="fabtrain-j-r0\\"} evil",host="node1",job_id="j"}'
    assert got[cpu] == 1.5
    assert got['fabtrain_host_load1{host="node1",job_id="j"}'] == 2.25


def a_job_with_every_series(clock=None) -> Metrics:
    """A job that has reported a step, a host failure and a telemetry sample with every field: each
    metric fab serves has a sample."""
    m = Metrics("j", "bob", **({"clock": clock} if clock else {}))
    m.emit("attempt", job="j", attempt=1, hosts={"node1": 0}, port=1)
    m.emit("progress", job="j", attempt=1, host="node1", step=1, ranks=[rank(0, 1)])
    m.emit("host_failed", job="j", attempt=1, host="node1", kind="lost", detail="")
    m.emit(
        "telemetry",
        job="j",
        attempt=1,
        host="node1",
        sample={
            "gpus": [
                {
                    "index": 0,
                    "util": 0.5,
                    "mem_used": 1,
                    "mem_total": 2,
                    "power_w": 3.0,
                    "temp_c": 4.0,
                    "ecc_uncorrected": 0,
                }
            ],
            "containers": [{"name": "c", "cpu": 1.0, "mem": 5}],
            "host": {"load1": 1.0},
        },
    )
    return m


# Every metric fab serves: its type and its labels besides job_id (docs/observability.md's table).
EXPOSED = {
    "fabtrain_job_info": ("gauge", {"owner"}),
    "fabtrain_attempt": ("gauge", set()),
    "fabtrain_running": ("gauge", set()),
    **{
        f"fabtrain_{n}": ("gauge", {"host", "rank"})
        for n in ("step", "loss", "tokens_per_second", "step_seconds", "compute_seconds")
    },
    "fabtrain_last_progress_timestamp_seconds": ("gauge", {"host"}),
    "fabtrain_host_failures": ("counter", {"host", "kind"}),
    **{
        f"fabtrain_gpu_{n}": ("gauge", {"host", "gpu"})
        for n in (
            "utilization_ratio",
            "memory_used_bytes",
            "memory_total_bytes",
            "power_watts",
            "temperature_celsius",
        )
    },
    "fabtrain_gpu_ecc_uncorrected_errors": ("counter", {"host", "gpu"}),
    "fabtrain_container_cpu_cores": ("gauge", {"host", "container"}),
    "fabtrain_container_memory_bytes": ("gauge", {"host", "container"}),
    "fabtrain_host_load1": ("gauge", {"host"}),
}


def test_the_exposition_follows_prometheus_naming_conventions():
    """The /metrics text read back by prometheus_client's own parser: the names, types and label
    names above; every series carries `job_id` and none `job` (the label Prometheus gives each
    scrape target); a counter's samples end in _total and no gauge's name does; the progress time is
    a Unix timestamp."""
    from prometheus_client.parser import text_string_to_metric_families

    clock = Clock()
    clock.now = 1_790_000_000.25
    m = a_job_with_every_series(clock)
    families = list(text_string_to_metric_families(generate_latest(m.registry).decode()))
    got = {f.name: (f.type, set().union(*(set(s.labels) for s in f.samples)) - {"job_id"}) for f in families}
    assert got == EXPOSED
    for f in families:
        assert f.samples, f.name
        for s in f.samples:
            assert s.labels["job_id"] == "j" and "job" not in s.labels, s
            assert s.name == (f.name + "_total" if f.type == "counter" else f.name), s
            assert s.name.startswith("fabtrain_") and not (f.type == "gauge" and s.name.endswith("_total"))
    [stamp] = next(f for f in families if f.name == "fabtrain_last_progress_timestamp_seconds").samples
    assert stamp.value == 1_790_000_000.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_on_loopback_and_a_taken_port_is_an_error():
    m = Metrics("j", "bob")
    port = free_port()
    url = m.serve(str(port))
    try:
        assert url == f"http://127.0.0.1:{port}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'fabtrain_job_info{job_id="j",owner="bob"} 1.0' in body
        with pytest.raises(OSError):
            Metrics("k", "bob").serve(f"127.0.0.1:{port}")
    finally:
        m.close()


@pytest.mark.parametrize(
    ("text", "want"),
    [("9400", ("127.0.0.1", 9400)), ("0.0.0.0:80", ("0.0.0.0", 80)), ("[::1]:9400", ("::1", 9400))],
)
def test_listen_address(text, want):
    assert listen_address(text) == want


@pytest.mark.parametrize("text", ["", "0", "65536", "x", "host.example:9400", "1.2.3.4:", "٣٣"])
def test_listen_address_refuses(text):
    with pytest.raises(ValueError):
        listen_address(text)


def test_the_grafana_dashboard_uses_only_metrics_fab_serves():
    """docker/grafana/fabtrain.json: valid JSON whose every query names metrics that a job with
    telemetry exposes (a renamed metric would leave a panel empty)."""
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[2] / "docker/grafana/fabtrain.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"fabtrain_\w+", e)}
    served = {key.split("{")[0] for key in scrape(a_job_with_every_series())}
    assert used and used <= served, used - served
    assert {
        "fabtrain_step",
        "fabtrain_host_failures_total",
        "fabtrain_gpu_utilization_ratio",
        "fabtrain_last_progress_timestamp_seconds",
    } <= used
    # Each query picks its job by the job_id label; none by `job`, which names Prometheus's scrape job.
    assert all('job_id=~"$job_id"' in e and not re.search(r"\bjob\s*=", e) for e in exprs), exprs
    [variable] = [v for v in dash["templating"]["list"] if v["type"] == "query"]
    assert variable["name"] == "job_id"
    assert variable["query"]["query"] == "label_values(fabtrain_job_info, job_id)"
