"""fab top's pure parts (progress/top.py): the one script a host runs per refresh, reading its
answer, the snapshot (its JSON shape, slots and their holders, step rates) and what the terminal
shows."""

import io
import json
from pathlib import Path

from rich.console import Console

from orchestrator.config.inventory import parse
from orchestrator.hostcmds import touched
from orchestrator.hosts import survey
from orchestrator.progress import top
from orchestrator.telemetry.commands import telemetry_script

INV = parse(
    """\
ssh: {user: u, key: /k/id, known_hosts: /k/kh}
job: {image: img:1, code_dir: /opt/code, output_dir: /opt/out}
hosts:
  - {name: gpu0, address: 10.0.0.1, interface: ib0, gpus: {vendor: nvidia, count: 2}}
  - {name: cpu1, address: 10.0.0.2, interface: eth0}
  - {name: cpu2, address: 10.0.0.3, interface: eth0}
""",
    Path("/i/inv.yaml"),
)


def test_the_steps_script():
    assert top.steps_script(INV) == (
        'timeout -k 2 4 docker ps --filter label=fabtrain.managed=1 --format \'{{.Label "fabtrain.job"}} '
        "{{.Names}}' 2>/dev/null | head -n 64 | while read -r j n; do "
        'case "$j" in ""|*[!A-Za-z0-9._-]*) continue;; esac; '
        '[ "$n" = fabtrain-"$j"-r0 ] || continue; echo; echo "@@fabtrain-step $j"; '
        + touched.tail('/opt/out/"$j"', ".console/node-0.log", 8192)
        + " 2>/dev/null; done; true"
    )


def test_one_script_per_host_survey_steps_then_telemetry():
    assert top.top_script(INV) == (
        f"{survey.survey_script(INV)}; echo; echo '@@fabtrain-top steps'; {top.steps_script(INV)}; "
        f"echo; echo '@@fabtrain-top telemetry'; {telemetry_script(INV, None)}"
    )


# What gpu0 answers: alice's job holds GPU 0 (its rank 0 runs there, at step 120), bob's GPU 1.
GPU0 = """\
alice-1\t0\tfabtrain-alice-1-r0\trunning\tUp 2 minutes\talice@lap\t1
bob-2\t1\tfabtrain-bob-2-r1\trunning\tUp 1 minute\tbob@desk\t1
@@runtime
alice-1 3
bob-2 4
@@controllers
@@claims
16
alice-1 who=alice@lap since=1795560000 units=0 port=29500
bob-2 who=bob@desk since=1795560100 units=1 port=29501
@@queue

@@fabtrain-top steps

@@fabtrain-step alice-1
[rank0] step 119 loss 2.1
[rank0] step 120 loss 2.0

@@fabtrain-top telemetry
== nvidia
0, GPU-a, 00000000:3B:00.0, 97, 40000, 81559, 650.5, 71, 0x0000000000000004, 0
1, GPU-b, 00000000:5C:00.0, 12, 1000, 81559, 120.0, 40, 0x0000000000000001, 0
== xid
== containers
{"CPUPerc":"250.00%","MemUsage":"3GiB / 1TiB","Name":"fabtrain-alice-1-r0"}
{"CPUPerc":"100.00%","MemUsage":"1GiB / 1TiB","Name":"fabtrain-bob-2-r1"}
== host
5.00 4.00 3.00 4/396 21854
MemTotal:       1048576 kB
MemAvailable:   524288 kB
16
"""
# cpu1: alice's job on slots 0-1 of its 4, nothing else.
CPU1 = """\
alice-1\t1\tfabtrain-alice-1-r1\trunning\tUp 2 minutes\talice@lap\t1
@@runtime
alice-1 3
@@controllers
@@claims
4
alice-1 who=alice@lap since=1795560000 units=0,1
@@queue

@@fabtrain-top steps

@@fabtrain-top telemetry
== containers
== host
1.00 1.00 1.00 1/100 1
MemTotal:       1048576 kB
MemAvailable:   1048576 kB
4
"""


def answers(**extra):
    return {
        "gpu0": top.parse_answer(GPU0),
        "cpu1": top.parse_answer(CPU1),
        "cpu2": "cpu2 (u@10.0.0.3:22): connection refused; start sshd there or fix ssh.port in the inventory",
        **extra,
    }


def test_the_snapshot_shows_each_units_holder_and_who_started_it():
    snap = top.snapshot(INV, answers(), now=1000.0, before={"alice-1": (990.0, 100)})
    json.dumps(snap)
    assert list(snap) == ["time", "hosts", "jobs", "errors"]
    gpu0, cpu1, cpu2 = snap["hosts"]
    assert [(s["unit"], s["job"], s["who"], s["util"]) for s in gpu0["slots"]] == [
        (0, "alice-1", "alice@lap", 0.97),
        (1, "bob-2", "bob@desk", 0.12),
    ]
    assert (
        gpu0["slots"][0]["mem_used"] == 40000 * 2**20 and gpu0["kind"] == "GPU" and gpu0["vendor"] == "nvidia"
    )
    assert [(c["name"], c["job"], c["cpu"]) for c in gpu0["containers"]] == [
        ("fabtrain-alice-1-r0", "alice-1", 2.5),
        ("fabtrain-bob-2-r1", "bob-2", 1.0),
    ]
    assert [(s["unit"], s["job"], s["who"], s["util"]) for s in cpu1["slots"]] == [
        (0, "alice-1", "alice@lap", None),
        (1, "alice-1", "alice@lap", None),
        (2, None, None, None),
        (3, None, None, None),
    ]
    assert cpu1["load"] == {"load1": 1.0, "mem_used": 0, "mem_total": 2**30, "cpus": 4}
    assert (cpu2["answered"], cpu2["slots"]) == (False, []) and "connection refused" in cpu2["error"]
    assert snap["errors"] == [cpu2["error"]]
    jobs = {j["job"]: j for j in snap["jobs"]}
    assert jobs["alice-1"] == {
        "job": "alice-1",
        "who": "alice@lap",
        "state": "running",
        "step": 120,
        "rate": 2.0,
        "hosts": {"gpu0": [0], "cpu1": [0, 1]},
    }
    assert (jobs["bob-2"]["step"], jobs["bob-2"]["rate"], jobs["bob-2"]["who"]) == (None, None, "bob@desk")
    assert top.readings(snap) == {"alice-1": (1000.0, 120)}


def test_step_rate():
    assert top.rate((10.0, 100), (12.0, 110)) == 5.0
    assert top.rate(None, (12.0, 110)) is None and top.rate((10.0, 100), None) is None
    assert top.rate((10.0, 100), (10.0, 110)) is None  # no time between the readings
    assert top.rate((10.0, 100), (12.0, 40)) is None  # went back: restarted from a snapshot
    assert top.rate((10.0, 100), (12.0, 100)) == 0.0  # stuck


def test_a_host_answering_garbage_is_shown_empty_not_an_error():
    snap = top.snapshot(
        INV, answers(gpu0=top.parse_answer("\x1b[2J garbage\n@@claims\nnot a number\n")), now=1.0
    )
    gpu0 = snap["hosts"][0]
    assert gpu0["answered"] and [s["job"] for s in gpu0["slots"]] == [None, None]
    assert "no host section" in gpu0["telemetry_errors"][-1]


def rendered(snap) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(top.render(snap))
    return console.export_text()


def test_the_view():
    text = rendered(top.snapshot(INV, answers(), now=1000.0, before={"alice-1": (990.0, 100)}))
    lines = text.splitlines()
    gpu_rows = [line for line in lines if "GPU 0" in line or "GPU 1" in line]
    assert "alice-1" in gpu_rows[0] and "alice@lap" in gpu_rows[0] and "97%" in gpu_rows[0]
    assert "39.1G / 79.6G" in gpu_rows[0] and "bob-2" in gpu_rows[1] and "12%" in gpu_rows[1]
    assert any("slots 0-1" in line and "alice-1" in line for line in lines)
    assert any("slots 2-3" in line and "free" in line for line in lines)
    assert any("cpu2" in line and "not answering" in line for line in lines)
    assert any(
        "fabtrain-alice-1-r0" in line and "2.50" in line and "3.0G / 1024.0G" in line for line in lines
    )
    assert any(
        line.split("│")[1].strip() == "alice-1" and "120" in line and "2.00" in line
        for line in lines
        if line.count("│") > 5
    )
    assert "connection refused" in text


def test_the_view_never_lets_a_host_write_to_the_terminal():
    evil = CPU1.replace(
        "== containers\n",
        '== containers\n{"CPUPerc":"1%","MemUsage":"1B / 2B","Name":"\\u001b]0;pwned\\u0007[red]x[/red]"}\n',
    )
    snap = top.snapshot(INV, answers(cpu1=top.parse_answer(evil)), now=1.0)
    console = Console(width=200, record=True, force_terminal=True, file=io.StringIO())
    console.print(top.render(snap))
    out = console.export_text(styles=False)
    assert "\x1b" not in out and "\x07" not in out and "[red]x[/red]" in out


def test_live_refreshes_with_the_last_readings_and_ctrl_c_ends_it_quietly(monkeypatch):
    seen = []

    def take(session, inv, before):
        seen.append(before)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return top.snapshot(inv, answers(), now=1000.0 + 2 * len(seen), before=before)

    monkeypatch.setattr(top, "take", take)
    monkeypatch.setattr(top.time, "sleep", lambda s: None)
    console = Console(width=200, record=True, file=io.StringIO())
    assert top.live(INV, console) is None
    assert seen == [{}, {"alice-1": (1002.0, 120)}, {"alice-1": (1004.0, 120)}]
    assert "alice-1" in console.export_text()
