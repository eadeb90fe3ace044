"""Telemetry sampling during the watch: a host that does not answer is named once and skipped while
its command is out, the others are still sampled; the job's GPUs only; an idle GPU named once, and
--stop-idle calls for the stop."""

import threading
import time
from dataclasses import dataclass, replace

from orchestrator.backends.ssh import attempt
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.telemetry.sampler import Idle, Sampler, held
from orchestrator.transport.remote import CommandTimedOut

INV = """
ssh: {user: root, key: /dev/null, known_hosts: /dev/null}
job: {telemetry_every: 0.05, idle_gpu_after: 0.2, stop_idle: true}
hosts:
  - name: node1
    address: 10.0.0.1
    interface: eth0
    gpus: {vendor: nvidia, count: 2}
  - name: node2
    address: 10.0.0.2
    interface: eth0
    gpus: {vendor: nvidia, count: 2}
"""

NVIDIA = """== nvidia
0, GPU-aaaa, 00000000:3B:00.0, 0, 10, 81559, 60.00, 30, 0x0000000000000001, 0
1, GPU-bbbb, 00000000:5E:00.0, 95, 70000, 81559, 400.00, 70, 0x0000000000000000, 0
== host
0.50 0.40 0.30 1/100 1234
MemTotal:       1000 kB
MemAvailable:    400 kB
8
"""


@dataclass
class Result:
    stdout: str
    stderr: str = ""
    exit_status: int = 0


class Hosts:
    """Stands in for the SSH session: node1 answers with a sample, node2's command times out."""

    def __init__(self):
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def run(self, host, command, timeout=60, stdin=None, what=""):
        with self.lock:
            self.calls.append(host.name)
        if host.name == "node2":
            time.sleep(0.15)
            raise CommandTimedOut(f"{what} did not finish within {timeout:g}s")
        return Result(NVIDIA)


def plan(tmp_path):
    inv = parse(INV, tmp_path / "inventory.yaml")
    spec = jobspec.JobSpec(job_id="j-1", script="x.py")
    return attempt.build(inv, spec, 1, 29500, units={"node1": (1,), "node2": (0, 1)})


def test_sampling_goes_on_past_a_silent_host_and_names_an_idle_gpu(tmp_path):
    a = plan(tmp_path)
    session, events, notes, stops = Hosts(), [], [], []
    s = Sampler(
        session,
        a,
        lambda event, **f: events.append((event, f)),
        lambda t, level: notes.append(t),
        on_idle=stops.append,
    )
    s.start()
    time.sleep(0.6)
    s.stop()
    samples = [f for e, f in events if e == "telemetry"]
    assert samples and {f["host"] for f in samples} == {"node1"}
    # The job holds GPU 1 on node1: GPU 0 (idle, another job's) is left out.
    assert {g["index"] for f in samples for g in f["sample"]["gpus"]} == {1}
    assert [n for n in notes if "node2" in n] == [
        n for n in notes if n.startswith("telemetry: node2") and "sampling goes on with the other hosts" in n
    ] and len([n for n in notes if "node2" in n]) == 1
    # node2 is never asked twice at once: at most one command out per host.
    assert session.calls.count("node1") > session.calls.count("node2") >= 2
    assert stops == []  # node1's GPU 1 is busy


def test_an_idle_gpu_the_job_holds_is_named_once_and_stops_the_job_with_stop_idle(tmp_path):
    a = plan(tmp_path)
    a = replace(a, units={"node1": (0,), "node2": (0,)})
    session, notes, stops = Hosts(), [], []
    s = Sampler(session, a, lambda event, **f: None, lambda t, level: notes.append(t), on_idle=stops.append)
    s.start()
    time.sleep(0.6)
    s.stop()
    idle = [n for n in notes if "GPU 0: idle" in n]
    assert len(idle) == 1 and idle[0].startswith("node1 GPU 0: idle") and "stopping the job" in idle[0]
    assert len(stops) == 1 and stops[0].startswith("node1 GPU 0 idle for")


def test_idle_needs_the_whole_time_and_a_busy_sample_starts_it_again():
    idle = Idle(after=10)
    gpu = [{"index": 0, "util": 0.0}]
    assert idle.see("h", gpu, 0) == [] and idle.see("h", gpu, 9) == []
    assert idle.see("h", [{"index": 0, "util": 0.5}], 9.5) == []
    assert idle.see("h", gpu, 12) == [] and idle.see("h", gpu, 22) == [(0, 10)]
    assert idle.see("h", gpu, 40) == []  # named once
    assert idle.see("h", [{"index": 0, "util": None}], 41) == []  # unreadable: not idle


def test_held_keeps_the_jobs_gpus_on_gpu_hosts_only(tmp_path):
    a = plan(tmp_path)
    sample = {"gpus": [{"index": 0}, {"index": 1}], "containers": []}
    assert held(sample, a.hosts[0], (1,))["gpus"] == [{"index": 1}]
    assert held(sample, a.hosts[0], None) == sample
