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
    return {"rank": r, "step": step, "loss": loss, "tokens_per_s": rate, "step_ms": step_ms,
            "compute_ms": compute_ms}


def test_metrics_follow_the_events_of_a_job_with_a_restart():
    clock = Clock()
    m = Metrics("tiny-1", "alice", clock=clock)
    m.emit("attempt", job="tiny-1", attempt=1, hosts={"node1": 0, "node2": 1}, port=29500)
    m.emit("progress", job="tiny-1", attempt=1, host="node1", step=10, ranks=[rank(0, 10)])
    m.emit("progress", job="tiny-1", attempt=1, host="node2", step=10, ranks=[rank(1, 10, step_ms=None)])
    clock.now += 7
    got = scrape(m)
    assert got['fabtrain_job_info{job="tiny-1",owner="alice"}'] == 1
    assert got['fabtrain_attempt{job="tiny-1"}'] == 1 and got['fabtrain_running{job="tiny-1"}'] == 1
    assert got['fabtrain_step{host="node1",job="tiny-1",rank="0"}'] == 10
    assert got['fabtrain_tokens_per_second{host="node2",job="tiny-1",rank="1"}'] == 1000
    assert got['fabtrain_step_seconds{host="node1",job="tiny-1",rank="0"}'] == 0.02
    assert 'fabtrain_step_seconds{host="node2",job="tiny-1",rank="1"}' not in got  # no times on its line
    assert got['fabtrain_seconds_since_progress{host="node1",job="tiny-1"}'] == 7
    assert not any(k.startswith("fabtrain_host_failures_total{") for k in got)

    m.emit("host_failed", job="tiny-1", attempt=1, host="node2", kind="exited", detail="exited with code 1")
    m.emit("attempt_end", job="tiny-1", attempt=1, ok=False, outcome="node2 exited")
    assert scrape(m)['fabtrain_running{job="tiny-1"}'] == 0
    m.emit("attempt", job="tiny-1", attempt=2, hosts={"node1": 0, "node3": 1}, port=29500)
    m.emit("host_failed", job="tiny-1", attempt=2, host="node3", kind="lost", detail="no answer")
    got = scrape(m)
    assert got['fabtrain_attempt{job="tiny-1"}'] == 2
    assert got['fabtrain_host_failures_total{host="node2",job="tiny-1",kind="exited"}'] == 1
    assert got['fabtrain_host_failures_total{host="node3",job="tiny-1",kind="lost"}'] == 1
    # The new attempt's hosts only: node2's rank series are gone, no step yet.
    assert not any(k.startswith("fabtrain_step{") for k in got)
    assert 'fabtrain_seconds_since_progress{host="node3",job="tiny-1"}' in got
    assert 'fabtrain_seconds_since_progress{host="node2",job="tiny-1"}' not in got


def test_telemetry_samples_become_gpu_and_container_gauges():
    m = Metrics("j", "bob")
    sample = {"vendor": "nvidia",
              "gpus": [{"index": 3, "uuid": "GPU-1", "bus": "00000000:3B:00.0", "util": 0.87,
                        "mem_used": 1 << 30, "mem_total": 80 << 30, "power_w": 301.5, "temp_c": 61.0,
                        "throttle": [], "ecc_uncorrected": None}],
              "containers": [{"name": 'fabtrain-j-r0"} evil', "cpu": 1.5, "mem": 123, "mem_limit": None}],
              "host": {"load1": 2.25, "mem_used": 1, "mem_total": 2, "cpus": 8}, "xid": [], "errors": []}
    m.emit("telemetry", job="j", attempt=1, host="node1", sample=sample)
    got = scrape(m)
    assert got['fabtrain_gpu_utilization_ratio{gpu="3",host="node1",job="j"}'] == 0.87
    assert got['fabtrain_gpu_memory_total_bytes{gpu="3",host="node1",job="j"}'] == 80 << 30
    assert not any(k.startswith("fabtrain_gpu_ecc_uncorrected_errors{") for k in got)  # None: not exposed
    # A container's name is a label value, escaped by the exposition: it cannot add labels.
    assert got['fabtrain_container_cpu_cores{container="fabtrain-j-r0\\"} evil",host="node1",job="j"}'] == 1.5
    assert got['fabtrain_host_load1{host="node1",job="j"}'] == 2.25


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
        assert 'fabtrain_job_info{job="j",owner="bob"} 1.0' in body
        with pytest.raises(OSError):
            Metrics("k", "bob").serve(f"127.0.0.1:{port}")
    finally:
        m.close()


@pytest.mark.parametrize(("text", "want"), [("9400", ("127.0.0.1", 9400)), ("0.0.0.0:80", ("0.0.0.0", 80)),
                                            ("[::1]:9400", ("::1", 9400))])
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
    m = Metrics("j", "bob")
    m.emit("attempt", job="j", attempt=1, hosts={"node1": 0}, port=1)
    m.emit("progress", job="j", attempt=1, host="node1", step=1, ranks=[rank(0, 1)])
    m.emit("host_failed", job="j", attempt=1, host="node1", kind="lost", detail="")
    m.emit("telemetry", job="j", attempt=1, host="node1", sample={
        "gpus": [{"index": 0, "util": 0.5, "mem_used": 1, "mem_total": 2, "power_w": 3.0, "temp_c": 4.0,
                  "ecc_uncorrected": 0}],
        "containers": [{"name": "c", "cpu": 1.0, "mem": 5}], "host": {"load1": 1.0}})
    served = {key.split("{")[0] for key in scrape(m)}
    assert used and used <= served, used - served
    assert {"fabtrain_step", "fabtrain_host_failures_total", "fabtrain_gpu_utilization_ratio"} <= used
