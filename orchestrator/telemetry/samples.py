"""One telemetry sample of a host, read from what telemetry/commands.telemetry_script prints there
(parse_sample), and what a run's samples add up to (summarise). Pure: no I/O.

Everything here comes from a host, so it is hostile input: the text is cut at INPUT_MAX, a line at
LINE_MAX; each value is read by telemetry/readings (finite numbers in a real machine's ranges, plain
names, "[N/A]" and the like None); a line that cannot be read is skipped and counted in `errors` (at
most readings.ERRORS_MAX of them). nvidia-smi, docker stats and the host's lines are read here, the
AMD tools' JSON in telemetry/amd.py. parse_sample never raises: a sample is always a dict of
SAMPLE_KEYS.

A sample (JSON-able):

    {"vendor": "nvidia" | "amd" | "none",
     "gpus": [{"index", "uuid", "bus", "util" (0..1), "mem_used", "mem_total" (bytes), "power_w",
               "temp_c", "throttle" (reasons: readings.THROTTLE_BITS' names), "ecc_uncorrected"}],
     "xid": [[bus, code], ...],
     "containers": [{"name", "cpu" (cores busy), "mem", "mem_limit" (bytes)}],
     "host": {"load1", "mem_used", "mem_total" (bytes), "cpus"},
     "errors": [str, ...]}
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from orchestrator.telemetry import commands
from orchestrator.telemetry.amd import parse_amd, parse_rocm
from orchestrator.telemetry.readings import (
    CPUS_MAX,
    ECC_MAX,
    GPUS_MAX,
    LOAD_MAX,
    MEM_MAX,
    POWER_MAX,
    TEMP_MAX,
    Errors,
    bus_id,
    gpu,
    integer,
    mib,
    number,
    percent,
    plain,
    size,
    throttle_reasons,
)

SAMPLE_KEYS = ("vendor", "gpus", "xid", "containers", "host", "errors")
INPUT_MAX = 2 * commands.OUTPUT_MAX  # characters of a host's output read (the script cuts at half)
LINE_MAX = 4096  # characters of one line read (a real one is under 300)
CONTAINERS_MAX = commands.CONTAINERS_MAX

# The kernel's XID lines, as preflight/gpuparse.parse_xid reads them: "NVRM: Xid (PCI:0000:3b:00):
# 79, pid=...", with a MIG instance "(PCI:0000:01:00 GPU-I:05)", and in old drivers without "PCI:".
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2})"
    r"(?:\.[0-9A-Fa-f])?(?:\s[^)]*)?\):\s*(\d{1,6})"
)


def parse_xid(text: str) -> list[list[Any]]:
    """[PCI bus id ("0000:3b:00", lower case), XID code] of each kernel XID line, in order."""
    return [[m.group(1).lower(), int(m.group(2))] for m in _XID_RE.finditer(text or "")]


# ---------------------------------------------------------------- sections


def sections(text: str) -> dict[str, list[str]]:
    """The lines under each marker line of telemetry_script's output, by section name (names it
    does not print are not sections: their lines stay where they are)."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(commands.MARK) and line[len(commands.MARK) :].strip() in commands.SECTIONS:
            current = out.setdefault(line[len(commands.MARK) :].strip(), [])
        elif current is not None:
            current.append(line)
    return out


def parse_nvidia(lines: list[str], errors: Errors) -> list[dict]:
    """nvidia-smi's CSV (commands.NVIDIA_FIELDS, noheader, nounits): one GPU per line."""
    gpus: list[dict] = []
    for line in lines:
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        index = integer(cells[0], GPUS_MAX - 1) if cells else None
        if len(cells) != len(commands.NVIDIA_FIELDS) or index is None or len(gpus) >= GPUS_MAX:
            errors.add("nvidia-smi", "unreadable line", line)
            continue
        _, uuid, bus, util, used, total, power, temp, reasons, ecc = cells
        gpus.append(
            gpu(
                index,
                plain(uuid, 80),
                bus_id(bus),
                percent(util),
                mib(used),
                mib(total),
                number(power, 0, POWER_MAX),
                number(temp, 0, TEMP_MAX),
                throttle_reasons(reasons),
                integer(ecc, ECC_MAX),
            )
        )
    return gpus


def parse_containers(lines: list[str], errors: Errors) -> list[dict]:
    """`docker stats --no-stream --format '{{json .}}'`: one JSON object per line; CPUPerc is a
    percentage of one CPU (200% = two cores busy), MemUsage "used / limit"."""
    out: list[dict] = []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            row = None
        if not isinstance(row, dict) or len(out) >= CONTAINERS_MAX:
            errors.add("docker stats", "unreadable line", line)
            continue
        name = plain(row.get("Name"), 200)
        cpu = number(str(row.get("CPUPerc", "")).strip().rstrip("%"), 0, 100.0 * CPUS_MAX)
        used_text, _, limit_text = str(row.get("MemUsage", "")).partition("/")
        mem = size(used_text)
        if not name or cpu is None or mem is None:
            errors.add("docker stats", "unreadable line", line)
            continue
        out.append({"name": name, "cpu": cpu / 100, "mem": mem, "mem_limit": size(limit_text) or None})
    return out


def parse_host(lines: list[str], errors: Errors) -> dict[str, Any]:
    """/proc/loadavg's first line, MemTotal and MemAvailable (kB), nproc."""
    host: dict[str, Any] = {"load1": None, "mem_used": None, "mem_total": None, "cpus": None}
    mem: dict[str, int | None] = {}
    for line in lines:
        words = line.split()
        if not words:
            continue
        if words[0] in ("MemTotal:", "MemAvailable:") and len(words) >= 2:
            kb = integer(words[1], MEM_MAX / 1024)
            mem[words[0]] = kb * 1024 if kb is not None else None
        elif len(words) == 1 and host["cpus"] is None and words[0].isdigit():
            host["cpus"] = integer(words[0], CPUS_MAX) or None
        elif len(words) >= 3 and host["load1"] is None and "/" in " ".join(words[3:4]):
            host["load1"] = number(words[0], 0, LOAD_MAX)
        else:
            errors.add("host", "unreadable line", line)
    total, available = mem.get("MemTotal:"), mem.get("MemAvailable:")
    host["mem_total"] = total
    if total is not None and available is not None and available <= total:
        host["mem_used"] = total - available
    return host


def parse_sample(text: str) -> dict[str, Any]:
    """One sample from telemetry_script's output (the module's docstring says its shape)."""
    errors = Errors()
    sample: dict[str, Any] = {
        "vendor": "none",
        "gpus": [],
        "xid": [],
        "containers": [],
        "host": {"load1": None, "mem_used": None, "mem_total": None, "cpus": None},
        "errors": errors,
    }
    try:
        text = text if isinstance(text, str) else ""
        if len(text) > INPUT_MAX:
            errors.add("sample", f"output cut at {INPUT_MAX} characters")
            text = text[:INPUT_MAX]
        found = sections(text)
        for name, lines in found.items():
            long = [i for i, line in enumerate(lines) if len(line) > LINE_MAX]
            for i in reversed(long):
                errors.add(name, f"a line of {len(lines[i])} characters skipped")
                del lines[i]
        if commands.NVIDIA in found:
            sample["vendor"] = "nvidia"
            sample["gpus"] = parse_nvidia(found[commands.NVIDIA], errors)
            sample["xid"] = parse_xid("\n".join(found.get(commands.XID, [])))[-commands.XID_LINES :]
        elif commands.AMD in found:
            sample["vendor"] = "amd"
            sample["gpus"] = parse_amd(found[commands.AMD], found.get(commands.AMD_LIST, []), errors)
        elif commands.ROCM in found:
            sample["vendor"] = "amd"
            sample["gpus"] = parse_rocm(found[commands.ROCM], errors)
        sample["containers"] = parse_containers(found.get(commands.CONTAINERS, []), errors)
        sample["host"] = parse_host(found.get(commands.HOST, []), errors)
        if commands.HOST not in found:
            errors.add("sample", "no host section (the output was cut, or the script did not run)")
    except Exception as exc:  # noqa: BLE001 - a host's output must never end the caller
        errors.add("sample", f"unreadable ({type(exc).__name__})")
    sample["errors"] = errors.done()
    return sample


# ---------------------------------------------------------------- summary


def _stats(values: list[float | None]) -> tuple[float | None, float | None]:
    seen = [v for v in values if v is not None]
    return (sum(seen) / len(seen), max(seen)) if seen else (None, None)


def _max(values: list[Any]) -> Any:
    seen = [v for v in values if v is not None]
    return max(seen) if seen else None


def summarise(samples: list[dict]) -> dict[str, Any]:
    """What one host's samples (in time order) add up to, for summary.json:

    {"samples": n,
     "gpus": [{"index", "uuid", "util_mean", "util_max", "mem_max", "temp_max", "power_max",
               "throttle": {reason: samples it was seen in}, "ecc_rise": last - first (None:
               not read twice)}],
     "containers": [{"name", "cpu_mean", "cpu_max", "mem_max"}],
     "xid_new": [[bus, code], ...] (in the last sample's kernel log, not in the first's),
     "errors": error lines over all samples}
    """
    samples = [s for s in samples if isinstance(s, dict)]
    gpus: dict[int, list[dict]] = {}
    containers: dict[str, list[dict]] = {}
    for s in samples:
        for g in s.get("gpus") or []:
            gpus.setdefault(g["index"], []).append(g)
        for c in s.get("containers") or []:
            containers.setdefault(c["name"], []).append(c)
    gpu_rows = []
    for index, seen in sorted(gpus.items()):
        mean, top = _stats([g["util"] for g in seen])
        ecc = [g["ecc_uncorrected"] for g in seen if g["ecc_uncorrected"] is not None]
        gpu_rows.append(
            {
                "index": index,
                "uuid": next((g["uuid"] for g in seen if g["uuid"]), ""),
                "util_mean": mean,
                "util_max": top,
                "mem_max": _max([g["mem_used"] for g in seen]),
                "temp_max": _max([g["temp_c"] for g in seen]),
                "power_max": _max([g["power_w"] for g in seen]),
                "throttle": dict(sorted(Counter(r for g in seen for r in set(g["throttle"])).items())),
                "ecc_rise": ecc[-1] - ecc[0] if len(ecc) >= 2 else None,
            }
        )
    container_rows = []
    for name, seen in sorted(containers.items()):
        mean, top = _stats([c["cpu"] for c in seen])
        container_rows.append(
            {"name": name, "cpu_mean": mean, "cpu_max": top, "mem_max": _max([c["mem"] for c in seen])}
        )
    xid_new: list[list[Any]] = []
    if samples:
        first = Counter(tuple(x) for x in samples[0].get("xid") or [])
        last = Counter(tuple(x) for x in samples[-1].get("xid") or [])
        xid_new = [list(x) for x in (last - first).elements()]
    return {
        "samples": len(samples),
        "gpus": gpu_rows,
        "containers": container_rows,
        "xid_new": xid_new,
        "errors": sum(len(s.get("errors") or []) for s in samples),
    }
