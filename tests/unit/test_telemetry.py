"""A host's telemetry: the script (telemetry/commands.py) to the exact text, and its parser
(telemetry/samples.py) on real tools' outputs and on hostile ones. Where each output is from is
said above it."""

import json
import math
from pathlib import Path

import pytest

from orchestrator.config.inventory import parse
from orchestrator.telemetry import commands
from orchestrator.telemetry.commands import telemetry_script
from orchestrator.telemetry.readings import number, size, throttle_reasons
from orchestrator.telemetry.samples import parse_sample, parse_xid, summarise

INV = parse(
    """\
ssh: {user: u, key: /k/id, known_hosts: /k/kh}
job: {image: img:1, code_dir: /opt/code, output_dir: /opt/out}
hosts:
  - {name: gpu0, address: 10.0.0.1, interface: ib0, gpus: {vendor: nvidia, count: 8}}
  - {name: cpu1, address: 10.0.0.2, interface: eth0}
""",
    Path("/i/inv.yaml"),
)

NVIDIA_PART = (
    "if command -v nvidia-smi >/dev/null 2>&1; then echo '== nvidia'; timeout -k 2 4 nvidia-smi "
    "--query-gpu=index,uuid,pci.bus_id,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu,"
    "clocks_throttle_reasons.active,ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits "
    "2>&1; "
    "echo '== xid'; { timeout -k 1 2 dmesg 2>/dev/null || timeout -k 1 2 journalctl -k -b -q --no-pager "
    "2>/dev/null; } | grep -F 'NVRM: Xid' | tail -n 50; fi; "
    "if command -v amd-smi >/dev/null 2>&1; then echo '== amd'; timeout -k 2 4 amd-smi metric --usage "
    "--power --temperature --ecc --mem-usage --json 2>/dev/null || timeout -k 2 4 amd-smi metric --json "
    "2>&1; "
    "echo '== amd-list'; timeout -k 2 4 amd-smi list --json 2>&1; "
    "elif command -v rocm-smi >/dev/null 2>&1; then echo '== rocm'; timeout -k 2 4 rocm-smi --showuse "
    "--showmemuse --showmeminfo vram --showpower --showtemp --showbus --json 2>&1; fi; "
    "echo '== containers'; "
)
HOST_PART = (
    "echo '== host'; head -n 1 /proc/loadavg; grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; "
    "nproc; } 2>&1 | head -c 262144"
)


def test_the_script_for_one_job():
    assert telemetry_script(INV, "gpt-1") == (
        "{ " + NVIDIA_PART + "timeout -k 2 4 docker ps --quiet --filter label=fabtrain.managed=1 "
        "--filter label=fabtrain.job=gpt-1 "
        "2>/dev/null | head -n 64 | xargs -r timeout -k 2 4 docker stats --no-stream --format '{{json .}}' "
        "2>&1; " + HOST_PART
    )


def test_the_script_for_every_job_and_the_same_on_every_host():
    script = telemetry_script(INV, None)
    assert (
        "timeout -k 2 4 docker ps --quiet --filter label=fabtrain.managed=1 2>/dev/null | head -n 64 | "
        "xargs -r "
    ) in script
    assert "fabtrain.job=" not in script
    # A job id is quoted once: a hostile id (never accepted by JobSpec, but still) stays one word.
    assert "'label=fabtrain.job=x; rm -rf /'" in telemetry_script(INV, "x; rm -rf /")


# ---------------------------------------------------------------- NVIDIA

# The H100 of tests/unit/recorded/nvidia-h100 (driver 580.159.04): its `nvidia-smi --query-gpu=...`
# line there (index, uuid, bus id, memory.total, ECC, clocks reasons 0x...01 = idle) and, from its
# `nvidia-smi -q` recording, utilization 0 %, memory used 0 MiB, power draw 90.94 W (GPU Power
# Readings, Average Power Draw: what power.draw reports on Ampere and later), 34 C: the line the
# telemetry query prints for it (noheader, nounits).
H100 = (
    "0, GPU-80532f88-8240-93c3-d007-90495af3b649, 00000000:00:06.0, 0, 0, 81559, 90.94, 34, "
    "0x0000000000000001, 0"
)
# https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1150 (journal kernel lines, as in
# test_gpuhealth.py) and a line of NVIDIA's A100 memory error management guide with a MIG instance.
XID_LINES = """\
kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149
kernel: NVRM: Xid (PCI:0000:ed:00): 45, pid=1818992, name=python3, Ch 0000000c caused by previous Xid 145
NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No
"""
# Recorded on this project's test host (fabtrain-node1, Docker 20.10.24, the engine the local cluster
# runs; Docker 28 prints the same keys): `docker stats --no-stream --format '{{json .}}'`.
DOCKER_STATS = (
    '{"BlockIO":"0B / 0B","CPUPerc":"0.00%","Container":"2089bfe1344e","ID":"2089bfe1344e",'
    '"MemPerc":"0.00%","MemUsage":"612KiB / 23.54GiB","Name":"other-8a164b","NetIO":"0B / 0B","PIDs":"1"}\n'
    '{"BlockIO":"0B / 0B","CPUPerc":"58.35%","Container":"df572dd85430","ID":"df572dd85430",'
    '"MemPerc":"0.40%","MemUsage":"95.57MiB / 23.54GiB","Name":"fabtrain-preflight-20261125-000033-0b33-r0",'
    '"NetIO":"0B / 0B","PIDs":"2"}\n'
)
# Recorded on the same host: /proc/loadavg's first line, /proc/meminfo's two lines, nproc.
HOST = """\
2.56 2.83 2.37 5/362 13619
MemTotal:       24684096 kB
MemAvailable:   22952856 kB
2
"""


def output(**sections: str) -> str:
    return "".join(f"== {name.replace('_', '-')}\n{text.rstrip()}\n" for name, text in sections.items())


def test_an_nvidia_host_with_xids_and_containers():
    sample = parse_sample(output(nvidia=H100, xid=XID_LINES, containers=DOCKER_STATS, host=HOST))
    assert sample == {
        "vendor": "nvidia",
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-80532f88-8240-93c3-d007-90495af3b649",
                "bus": "00000000:00:06.0",
                "util": 0.0,
                "mem_used": 0,
                "mem_total": 81559 * 2**20,
                "power_w": 90.94,
                "temp_c": 34.0,
                "throttle": [],
                "ecc_uncorrected": 0,
            }
        ],
        "xid": [["0000:dc:00", 45], ["0000:ed:00", 45], ["0000:01:00", 94]],
        "containers": [
            {"name": "other-8a164b", "cpu": 0.0, "mem": 612 * 1024, "mem_limit": int(23.54 * 2**30)},
            {
                "name": "fabtrain-preflight-20261125-000033-0b33-r0",
                "cpu": pytest.approx(0.5835),
                "mem": int(95.57 * 2**20),
                "mem_limit": int(23.54 * 2**30),
            },
        ],
        "host": {
            "load1": 2.56,
            "mem_used": (24684096 - 22952856) * 1024,
            "mem_total": 24684096 * 1024,
            "cpus": 2,
        },
        "errors": [],
    }
    json.dumps(sample)  # JSON-able as it is


def test_a_busy_gpu_not_supported_fields_and_throttle_reasons():
    # A consumer GPU: no ECC ("[N/A]"), power not readable ("[Not Supported]"); clocks slowed by
    # SW power cap (0x4) and HW slowdown (0x8) and SW thermal (0x20), plus a bit NVML does not name.
    line = "1, GPU-x, 00000000:3B:00.0, 97, 40000, 81559, [Not Supported], 81, 0x000000000000102C, [N/A]"
    g = parse_sample(output(nvidia=line, host=HOST))["gpus"][0]
    assert (g["index"], g["util"], g["mem_used"], g["power_w"], g["ecc_uncorrected"]) == (
        1,
        0.97,
        40000 * 2**20,
        None,
        None,
    )
    assert g["throttle"] == ["sw_power_cap", "hw_slowdown", "sw_thermal", "other"]


def test_throttle_reasons():
    assert throttle_reasons("0x0000000000000000") == [] and throttle_reasons("0x0000000000000001") == []
    assert throttle_reasons("0x0000000000000048") == ["hw_slowdown", "hw_thermal"]
    assert throttle_reasons("[N/A]") is None and throttle_reasons("0x" + "f" * 40) is None


# ---------------------------------------------------------------- AMD

# amd-smi metric --json (every number as {"value", "unit"} since units were added). From AMD's own
# examples (ROCm/amdsmi CHANGELOG.md): the `amd-smi metric -p --json` example as printed ("Added units
# of measure to JSON output"), and for usage, temperature, ECC and memory the values of the ROCm 7.1.0
# `amd-smi metric` example (GFX_ACTIVITY and UMC_ACTIVITY 0 %, HOTSPOT 37 C with EDGE N/A, ECC 0, TOTAL_VRAM
# 196592 MB, USED_VRAM 283 MB) in the JSON form amdsmi_cli/amdsmi_commands.py writes them.
AMD_METRIC = """\
[
    {
        "gpu": 0,
        "usage": {"gfx_activity": {"value": 0, "unit": "%"}, "umc_activity": {"value": 0, "unit": "%"}},
        "power": {
            "socket_power": {"value": 10, "unit": "W"},
            "gfx_voltage": {"value": 6, "unit": "mV"},
            "soc_voltage": {"value": 918, "unit": "mV"},
            "mem_voltage": {"value": 1250, "unit": "mV"},
            "power_management": "ENABLED",
            "throttle_status": "UNTHROTTLED"
        },
        "temperature": {"edge": "N/A", "hotspot": {"value": 37, "unit": "C"},
                        "mem": "N/A"},
        "ecc": {"total_correctable_count": 0, "total_uncorrectable_count": 0, "total_deferred_count": 0},
        "mem_usage": {"total_vram": {"value": 196592, "unit": "MB"},
                      "used_vram": {"value": 283, "unit": "MB"},
                      "free_vram": {"value": 196309, "unit": "MB"}}
    }
]"""
# amd-smi list --json: "gpu", "bdf", "uuid" (amdsmi_commands.py's list stores these keys; the bdf of
# GPU 0 in the CHANGELOG's MI300X examples; the uuid is made up, in the form amd-smi prints).
AMD_LIST = '[{"gpu": 0, "bdf": "0000:0c:00.0", "uuid": "8fff74a1-0000-1000-80ab-a4c9f6fcb8d4", "kfd_id": 1}]'


def test_amd_smi():
    sample = parse_sample(output(amd=AMD_METRIC, amd_list=AMD_LIST, host=HOST))
    assert sample["vendor"] == "amd" and sample["errors"] == []
    assert sample["gpus"] == [
        {
            "index": 0,
            "uuid": "8fff74a1-0000-1000-80ab-a4c9f6fcb8d4",
            "bus": "0000:0c:00.0",
            "util": 0.0,
            "mem_used": 283 * 2**20,
            "mem_total": 196592 * 2**20,
            "power_w": 10.0,
            "temp_c": 37.0,
            "throttle": [],
            "ecc_uncorrected": 0,
        }
    ]


def test_amd_smi_wrapped_in_gpu_data_and_throttled():
    # Later amd-smi releases put the GPUs under "gpu_data"; throttle_status THROTTLED is a reason.
    doc = json.loads(AMD_METRIC)
    doc[0]["power"]["throttle_status"] = "THROTTLED"
    sample = parse_sample(output(amd="WARNING: a note first\n" + json.dumps({"gpu_data": doc}), host=HOST))
    assert sample["gpus"][0]["throttle"] == ["throttled"] and sample["gpus"][0]["bus"] == ""


# rocm-smi --showuse --showmemuse --showmeminfo vram --showpower --showtemp --showbus --json: each
# field under "cardN" by the name rocm-smi's printLog gives it (ROCm/amdsmi's copy of
# rocm_smi/python_smi_tools/rocm_smi.py: 'GPU use (%)', 'Average Graphics Package Power (W)',
# 'Temperature (Sensor %s) (C)', '%s Total Memory (B)', 'PCI Bus'), values as strings.
ROCM = json.dumps(
    {
        "card0": {
            "Temperature (Sensor edge) (C)": "35.0",
            "Temperature (Sensor junction) (C)": "36.0",
            "Temperature (Sensor memory) (C)": "44.0",
            "Average Graphics Package Power (W)": "19.0",
            "GPU use (%)": "3",
            "GPU Memory Allocated (VRAM%)": "85",
            "VRAM Total Memory (B)": "34208743424",
            "VRAM Total Used Memory (B)": "29225381888",
            "PCI Bus": "0000:03:00.0",
        },
        "card1": {
            "Temperature (Sensor junction) (C)": "39.0",
            "Current Socket Graphics Package Power (W)": "12.134",
            "GPU use (%)": "N/A",
            "VRAM Total Memory (B)": "4294967296",
            "VRAM Total Used Memory (B)": "72495104",
        },
        "system": {"Driver version": "6.7.0"},
    }
)


def test_rocm_smi():
    sample = parse_sample(output(rocm=ROCM, host=HOST))
    assert sample["vendor"] == "amd" and sample["errors"] == []
    a, b = sample["gpus"]
    assert a == {
        "index": 0,
        "uuid": "",
        "bus": "0000:03:00.0",
        "util": 0.03,
        "mem_used": 29225381888,
        "mem_total": 34208743424,
        "power_w": 19.0,
        "temp_c": 35.0,
        "throttle": [],
        "ecc_uncorrected": None,
    }
    assert (b["index"], b["util"], b["power_w"], b["temp_c"], b["mem_used"]) == (
        1,
        None,
        12.134,
        39.0,
        72495104,
    )


# ---------------------------------------------------------------- nothing there, and hostile hosts


def test_a_cpu_host_with_no_containers():
    sample = parse_sample(output(containers="", host=HOST))
    assert (sample["vendor"], sample["gpus"], sample["containers"], sample["errors"]) == ("none", [], [], [])
    assert sample["host"]["cpus"] == 2


@pytest.mark.parametrize("text", ["", "garbage", "\x00" * 100, "== host\n", "== nvidia\n== nvidia\n"])
def test_nothing_readable_is_an_empty_sample_never_an_error(text):
    sample = parse_sample(text)
    assert set(sample) == {"vendor", "gpus", "xid", "containers", "host", "errors"}
    assert sample["gpus"] == [] and sample["containers"] == []


def test_a_tool_that_fails_is_one_error_line():
    sample = parse_sample(
        output(
            nvidia="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", host=HOST
        )
    )
    assert sample["vendor"] == "nvidia" and sample["gpus"] == []
    assert sample["errors"] == [
        "nvidia-smi: unreadable line: NVIDIA-SMI has failed because it couldn't "
        "communicate with the NVIDIA driver."
    ]


def test_hostile_numbers_are_none():
    line = "0, GPU-\x1b[31mred\x1b[0m, not-a-bus, nan, 1e300, -5, inf, 1000000, 0xZZ, -1"
    g = parse_sample(output(nvidia=line, host=HOST))["gpus"][0]
    assert g == {
        "index": 0,
        "uuid": "GPU-[31mred[0m",
        "bus": "",
        "util": None,
        "mem_used": None,
        "mem_total": None,
        "power_w": None,
        "temp_c": None,
        "throttle": [],
        "ecc_uncorrected": None,
    }
    for bad in (
        "nan",
        "NaN",
        "inf",
        "-inf",
        "1e400",
        "-1",
        "[N/A]",
        "[Not Supported]",
        "x" * 100,
        None,
        True,
    ):
        assert number(bad, 0, 100) is None
    assert number("12.5 W", 0, 100) == 12.5 and number(7, 0, 100) == 7.0


def test_hostile_container_names_and_sizes():
    evil = json.dumps(
        {"Name": "\x1b]52;c;ZXZpbA==\x07\u202eevil\nname", "CPUPerc": "150%", "MemUsage": "1.5GiB / --"}
    )
    absurd = json.dumps({"Name": "big", "CPUPerc": "1e30%", "MemUsage": "999999PiB / 1GiB"})
    sample = parse_sample(output(containers=f'{evil}\n{absurd}\n{{"Name": \n[[[[', host=HOST))
    assert sample["containers"] == [
        {"name": "]52;c;ZXZpbA==evil | name", "cpu": 1.5, "mem": int(1.5 * 2**30), "mem_limit": None}
    ]
    assert len(sample["errors"]) == 3 and all(
        e.startswith("docker stats: unreadable line") for e in sample["errors"]
    )
    assert size("0B") == 0 and size("1.2kB") == 1200 and size("--") is None and size("12 parsecs") is None
    assert size("3MB") == 3_000_000 and size("2GiB") == 2**31 and size("1 KiB") == 1024


def test_a_huge_line_a_json_bomb_and_too_much_output_are_bounded():
    # A line longer than LINE_MAX is skipped; a JSON document nested past Python's recursion limit
    # is an error line; a 1 MB line (more than the script ever sends) cuts the sample, which says so.
    sample = parse_sample(output(nvidia="x" * 300_000, host=HOST))
    assert sample["gpus"] == [] and sample["host"]["cpus"] == 2
    assert sample["errors"] == ["nvidia: a line of 300000 characters skipped"]
    sample = parse_sample(output(amd="[\n" * 100_000, host=HOST))
    assert sample["vendor"] == "amd" and sample["gpus"] == [] and sample["host"]["cpus"] == 2
    assert sample["errors"] == [
        "amd-smi: unreadable JSON: [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | "
        "[ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | [ | ...[cut]"
    ]
    sample = parse_sample(output(nvidia=H100, containers="x" * (1 << 20), host=HOST))
    assert sample["gpus"][0]["uuid"].startswith("GPU-8053") and sample["host"]["cpus"] is None
    assert sample["errors"][0].startswith("sample: output cut at")
    flood = output(containers="\n".join([DOCKER_STATS.splitlines()[0]] * 200_000), host=HOST)
    sample = parse_sample(flood)
    assert len(sample["containers"]) == commands.CONTAINERS_MAX
    assert sample["errors"][0].startswith("sample: output cut at") and sample["errors"][-1].startswith(
        "... and "
    )


def test_truncated_output_says_so():
    text = output(nvidia=H100, host=HOST)
    sample = parse_sample(text[: len("== nvidia\n") + 40])
    assert sample["gpus"] == [] and sample["errors"][0].startswith("nvidia-smi: unreadable line: 0, GPU-8053")
    assert "sample: no host section" in sample["errors"][-1]


def test_xid_lines_as_the_preflight_reads_them():
    assert parse_xid(XID_LINES) == [["0000:dc:00", 45], ["0000:ed:00", 45], ["0000:01:00", 94]]
    assert parse_xid("NVRM: Xid (0000:3B:00): 79, GPU has fallen off the bus") == [["0000:3b:00", 79]]


# ---------------------------------------------------------------- summary


def gpu(util, mem, temp, power, throttle=(), ecc=0):
    return {
        "index": 0,
        "uuid": "GPU-a",
        "bus": "",
        "util": util,
        "mem_used": mem,
        "mem_total": 100,
        "power_w": power,
        "temp_c": temp,
        "throttle": list(throttle),
        "ecc_uncorrected": ecc,
    }


def test_summarise():
    samples = [
        {
            "gpus": [gpu(0.5, 10, 60.0, 300.0)],
            "xid": [["0000:01:00", 13]],
            "errors": [],
            "containers": [{"name": "fabtrain-a-r0", "cpu": 1.0, "mem": 5, "mem_limit": None}],
        },
        {
            "gpus": [gpu(None, 30, 70.0, 350.0, ["sw_power_cap"], 0)],
            "xid": [["0000:01:00", 13]],
            "errors": ["x"],
            "containers": [{"name": "fabtrain-a-r0", "cpu": 3.0, "mem": 7, "mem_limit": None}],
        },
        {
            "gpus": [gpu(1.0, 20, 65.0, 320.0, ["sw_power_cap", "hw_slowdown"], 2)],
            "errors": [],
            "xid": [["0000:01:00", 13], ["0000:01:00", 79]],
            "containers": [],
        },
    ]
    assert summarise(samples) == {
        "samples": 3,
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-a",
                "util_mean": 0.75,
                "util_max": 1.0,
                "mem_max": 30,
                "temp_max": 70.0,
                "power_max": 350.0,
                "throttle": {"hw_slowdown": 1, "sw_power_cap": 2},
                "ecc_rise": 2,
            }
        ],
        "containers": [{"name": "fabtrain-a-r0", "cpu_mean": 2.0, "cpu_max": 3.0, "mem_max": 7}],
        "xid_new": [["0000:01:00", 79]],
        "errors": 1,
    }
    assert summarise([])["gpus"] == [] and summarise([]).get("xid_new") == []
    assert not math.isnan(json.loads(json.dumps(summarise(samples)))["gpus"][0]["util_mean"])
