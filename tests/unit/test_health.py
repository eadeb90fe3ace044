"""The deep check's pure parts (health.py): the pairing schedule, telling a slow host from a slow
link, compute against peers, the disk probe's output, and the measuring scripts run for real
(on loopback) here."""

import itertools
import json
import subprocess
import sys

import pytest

from orchestrator.preflight import health
from orchestrator.preflight.checks import FAIL, OK, WARN


@pytest.mark.parametrize("n", range(1, 10))
def test_every_pair_exactly_once_each_host_once_per_round(n):
    hosts = [f"h{i}" for i in range(n)]
    rounds = health.rounds(hosts)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n) or n == 1
    pairs = [frozenset(p) for r in rounds for p in r]
    assert sorted(map(sorted, pairs)) == sorted(map(sorted, map(frozenset, itertools.combinations(hosts, 2))))
    for r in rounds:
        members = [h for p in r for h in p]
        assert len(members) == len(set(members))  # no host twice in a round


def links(hosts, fast=9000.0, **slow):
    bw = {(a, b): fast for a in hosts for b in hosts if a != b}
    for key, v in slow.items():
        a, b = key.split("_")
        bw[(a, b)] = v
    rtt = {(a, b): 0.2 for a in hosts for b in hosts if a != b}
    return bw, rtt


HOSTS = ["n1", "n2", "n3", "n4"]


def test_a_host_slow_with_every_peer_is_named_not_its_peers():
    bw, rtt = links(HOSTS, n2_n1=48, n2_n3=47, n2_n4=49)  # n2's egress shaped
    v = health.network_outliers(bw, rtt, HOSTS)
    assert list(v.slow_hosts) == ["n2"] and v.slow_hosts["n2"].startswith(
        "sends slowly to every peer (to n1 48"
    )
    assert v.slow_links == {}
    bw, rtt = links(HOSTS, n1_n3=40, n2_n3=41, n4_n3=39)  # n3 receives slowly
    v = health.network_outliers(bw, rtt, HOSTS)
    assert list(v.slow_hosts) == ["n3"] and v.slow_hosts["n3"].startswith("receives slowly from every peer")


def test_one_slow_link_is_named_as_a_link():
    bw, rtt = links(HOSTS, n1_n3=45)
    v = health.network_outliers(bw, rtt, HOSTS)
    assert v.slow_hosts == {} and list(v.slow_links) == [("n1", "n3")]
    assert v.slow_links[("n1", "n3")] == "45 Mbit/s (typical link 9000)"
    # Shaping n1 -> n3 also queues n1's ACKs of the stream n3 -> n1: one link, the slower way named.
    bw, rtt = links(HOSTS, n1_n3=47, n3_n1=1031)
    assert health.network_outliers(bw, rtt, HOSTS).slow_links == {
        ("n1", "n3"): "47 Mbit/s (typical link 9000); back 1031"
    }
    # Round trips: one laggy pair is a link, a host laggy with everyone is the host.
    bw, rtt = links(HOSTS)
    rtt[("n1", "n2")] = 30.0
    assert list(health.network_outliers(bw, rtt, HOSTS).slow_links) == [("n1", "n2")]
    for p in ("n1", "n3", "n4"):
        rtt[(p, "n2")] = rtt[("n2", p)] = 25.0
    v = health.network_outliers(bw, rtt, HOSTS)
    assert list(v.slow_hosts) == ["n2"] and v.slow_links == {}


def test_noise_is_not_a_verdict():
    bw, rtt = links(HOSTS, n1_n2=6000, n3_n4=5200, n4_n1=12000)  # within 2x of the median
    v = health.network_outliers(bw, rtt, HOSTS)
    assert v.slow_hosts == {} and v.slow_links == {}


def test_compute_against_peers_of_the_same_kind():
    speed = {"n1": 40.0, "n2": 38.0, "n3": 9.5, "g1/gpu0": 50000.0, "g1/gpu1": 30000.0, "g2/gpu0": 49000.0}
    kind = {
        "n1": "CPU",
        "n2": "CPU",
        "n3": "CPU",
        "g1/gpu0": "NVIDIA H100 80GB HBM3",
        "g1/gpu1": "NVIDIA H100 80GB HBM3",
        "g2/gpu0": "NVIDIA H100 80GB HBM3",
    }
    slow = health.compute_outliers(speed, kind)
    assert sorted(slow) == ["g1/gpu1", "n3"]
    assert slow["n3"] == "9.5 GFLOP/s, 24% of its peers' median 39.0 (CPU)"
    assert health.compute_outliers({"n1": 5.0}, {"n1": "CPU"}) == {}  # alone: nothing to compare with


def test_disk_probe_output_and_verdicts():
    text = (
        "DISK\t/opt/fabtrain/output\t5120\tdd: error writing '/opt/fabtrain/output/.fabtrain-disk-probe': "
        "No space left on device\n"
        "DISK\t/opt/fabtrain/code\t52428800\t16777216 bytes (17 MB, 16 MiB) copied, 0.0461 s, 364 MB/s\n"
    )
    found = health.parse_disk(text)
    assert found["/opt/fabtrain/code"][0] == 50.0 and round(found["/opt/fabtrain/code"][1]) == 364
    assert found["/opt/fabtrain/output"][:2] == (5120 / 1024**2, None)
    checks = health.judge_disk("node3", found)
    assert [c.status for c in checks] == [FAIL, OK]
    assert checks[0].detail.startswith(
        "/opt/fabtrain/output: 5.0 MB free; a 16 MB write failed: dd: error writing"
    )
    slow = health.judge_disk("n", {"/d": (100.0, 5.0, "")})
    assert slow[0].status == WARN and "write + fsync 5 MB/s (below 20)" in slow[0].detail


def test_disk_script_runs_here(tmp_path):
    out = subprocess.run(
        ["sh", "-c", health.disk_script([str(tmp_path / "a b")])], capture_output=True, text=True
    )
    ((free, speed, said),) = health.parse_disk(out.stdout).values()
    assert free > 0 and speed > 0 and said == "" and not (tmp_path / "a b" / ".fabtrain-disk-probe").exists()


def test_the_network_script_measures_both_ways_on_loopback():
    """Two copies of NET_PY, each the other's peer, on 127.0.0.1 and 127.0.0.2."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", health.NET_PY, me, peer, "29977", "0.5"], stdout=subprocess.PIPE, text=True
        )
        for me, peer in (("127.0.0.1", "127.0.0.2"), ("127.0.0.2", "127.0.0.1"))
    ]
    outs = [health.parse_line("NET", p.communicate(timeout=60)[0]) for p in procs]
    for out in outs:
        assert out["rx_mbit_s"] > 10 and 0 < out["rtt_ms"] < 50


def test_matrix_text():
    bw, rtt = links(["a", "b"], a_b=50)
    text = health.matrix_text(["a", "b"], bw, rtt)
    assert text.splitlines()[1].split() == ["a", "-", "50"] and text.splitlines()[2].split() == [
        "b",
        "9000",
        "-",
    ]
    assert json.dumps(text)


def test_the_gate_leaves_sick_hosts_out_and_takes_healthy_spares(tmp_path):
    from pathlib import Path

    from orchestrator.config.inventory import parse
    from orchestrator.core.errors import UserError
    from orchestrator.preflight import deep

    inv = parse(
        """\
hosts:
  - {name: node1, address: 10.0.0.1, interface: eth0}
  - {name: node2, address: 10.0.0.2, interface: eth0}
spares:
  - {name: node3, address: 10.0.0.3, interface: eth0}
  - {name: node4, address: 10.0.0.4, interface: eth0}
""",
        Path("inv.yaml"),
    )
    results = tmp_path / "health.json"
    bad = {"check": "net", "status": "fail", "detail": "sends slowly to every peer", "host": "x", "fix": ""}
    ok = {"check": "net", "status": "ok", "detail": "", "host": "x", "fix": ""}
    results.write_text(
        json.dumps(
            {
                "node1": {"time": 1000.0, "ok": True, "checks": [ok]},
                "node2": {"time": 1000.0, "ok": False, "checks": [bad]},
                "node3": {"time": 1000.0, "ok": False, "checks": [dict(bad, check="compute", detail="slow")]},
                "node4": {"time": 1000.0, "ok": True, "checks": [ok]},
            }
        )
    )
    # Fresh results are reused: nothing is measured (no session needed).
    got, lines = deep.gate(None, inv, path=results, now=1000.0 + 60)
    assert [(h.name, h.rank) for h in got.hosts] == [("node1", 0), ("node4", 1)] and got.spares == ()
    assert lines == [
        f"deep check results from the last hour reused ({results})",
        "node2 left out (net: sends slowly to every peer); spare node4 takes its place",
        "spare node3 is not healthy either (compute: slow)",
    ]
    three = parse(
        """\
hosts:
  - {name: node1, address: 10.0.0.1, interface: eth0}
  - {name: node2, address: 10.0.0.2, interface: eth0}
spares:
  - {name: node3, address: 10.0.0.3, interface: eth0}
""",
        Path("inv3.yaml"),
    )
    with pytest.raises(
        UserError,
        match=r"node2 is not healthy \(net: sends slowly to every peer\) and no healthy "
        r"spare is left; spare node3 is not healthy either \(compute: slow\); .* --exclude node2",
    ):
        deep.gate(None, three, path=results, now=1000.0 + 60)
    # The one healthy spare went to an earlier sick host: said, not only that none is left.
    first_sick = json.loads(results.read_text())
    first_sick["node1"] = {"time": 1000.0, "ok": False, "checks": [dict(bad, check="compute", detail="slow")]}
    first_sick["node3"]["ok"] = True
    results.write_text(json.dumps(first_sick))
    with pytest.raises(
        UserError,
        match=r"node2 is not healthy \(net: sends slowly to every peer\) and no healthy spare is left; "
        r"spare node3 took the place of node1 \(compute: slow\); fix it",
    ):
        deep.gate(None, three, path=results, now=1000.0 + 60)


class Measured:
    """A Session whose hosts answer the compute benchmark with the GFLOP/s of `rounds[i]` in its
    round i+1 (the round is in the container's name); a host missing from a round does not answer."""

    def __init__(self, rounds):
        self.rounds, self.ran = rounds, []

    def run(self, host, command, timeout=60, stdin=None, what=""):
        from orchestrator.transport.remote import Result

        n = int(command.split(f"-{host.name}-compute")[0].rsplit("-", 1)[1])
        self.ran.append((n, host.name))
        if host.name not in self.rounds[n - 1]:
            raise OSError("No route to host")
        line = json.dumps({"cpu": [self.rounds[n - 1][host.name], "CPU"]})
        return Result(f"COMPUTE {line}\n", "", 0, 0.01)

    def fan_out(self, fn, hosts):
        from orchestrator.transport.remote import PerHost

        out = PerHost()
        for h in hosts:
            try:
                out[h.name] = fn(h)
            except Exception as exc:  # noqa: BLE001 - as Session.fan_out
                out[h.name] = exc
        return out


@pytest.mark.parametrize(
    "rounds, named, measured",
    [
        ([{"a": 40.0, "b": 39.0, "c": 39.5}], set(), 3),  # none slow: no second round
        ([{"a": 40.0, "b": 39.0, "c": 20.0}, {"a": 40.0, "b": 39.0, "c": 10.0}], {"c"}, 6),
        ([{"a": 40.0, "b": 39.0, "c": 20.0}, {"a": 40.0, "b": 39.0, "c": 38.0}], set(), 6),  # a moment
        ([{"a": 40.0, "b": 39.0, "c": 20.0}, {"a": 20.0, "b": 39.0, "c": 38.0}], set(), 6),  # never twice
        ([{"a": 40.0, "b": 39.0, "c": 20.0}, {"a": 40.0, "b": 39.0}], {"c"}, 6),  # its first figure kept
    ],
)
def test_a_host_is_named_slow_only_when_slow_twice(rounds, named, measured):
    from pathlib import Path

    from orchestrator.config.inventory import parse
    from orchestrator.preflight import deepphases
    from orchestrator.preflight.health import THRESHOLDS

    inv = parse(
        "hosts:\n"
        + "".join(f"  - {{name: {n}, address: 10.0.0.{i}, interface: eth0}}\n" for i, n in enumerate("abc")),
        Path("inv.yaml"),
    )
    session, data = Measured(rounds), {}
    checks = deepphases.compute_checks(session, inv, list(inv.hosts), THRESHOLDS, data, "img", {}, "t")
    assert {c.host for c in checks if c.status == FAIL} == named
    assert len(session.ran) == measured
    assert data["compute"]["c"]["gflop_s"] == (rounds[-1].get("c") or rounds[0]["c"])


def test_the_health_cache_is_state_beside_runs_or_under_xdg_state_home(monkeypatch, tmp_path):
    from pathlib import Path

    from orchestrator.preflight import deep
    from orchestrator.preflight.checks import Check

    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert deep.results_path() == Path(".fabtrain/health.json")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert deep.results_path() == tmp_path / "fabtrain" / "health.json"
    monkeypatch.chdir(tmp_path)
    deep.save({"time": 5.0}, [Check("node1", "net", OK, "")])
    assert json.loads((tmp_path / "fabtrain" / "health.json").read_text())["node1"]["ok"] is True
