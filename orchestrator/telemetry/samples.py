"""One telemetry sample of a host, read from what telemetry/commands.telemetry_script prints there
(parse_sample), and what a run's samples add up to (summarise). Pure: no I/O.

Everything here comes from a host, so it is hostile input: the text is cut at INPUT_MAX, a line at
LINE_MAX; each number is checked (finite, inside a range a real machine can have: else None); names
are made plain text by core/hostile; "[N/A]", "[Not Supported]" and the like are None; a line that
cannot be read is skipped and counted in `errors` (at most ERRORS_MAX of them). parse_sample never
raises: a sample is always a dict of SAMPLE_KEYS.

A sample (JSON-able):

    {"vendor": "nvidia" | "amd" | "none",
     "gpus": [{"index", "uuid", "bus", "util" (0..1), "mem_used", "mem_total" (bytes), "power_w",
               "temp_c", "throttle" (reasons: THROTTLE_BITS' names), "ecc_uncorrected"}],
     "xid": [[bus, code], ...],
     "containers": [{"name", "cpu" (cores busy), "mem", "mem_limit" (bytes)}],
     "host": {"load1", "mem_used", "mem_total" (bytes), "cpus"},
     "errors": [str, ...]}
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from typing import Any

from orchestrator.core import hostile
from orchestrator.telemetry import commands

SAMPLE_KEYS = ("vendor", "gpus", "xid", "containers", "host", "errors")
INPUT_MAX = 2 * commands.OUTPUT_MAX  # characters of a host's output read (the script cuts at half)
LINE_MAX = 4096  # characters of one line read (a real one is under 300)
ERRORS_MAX = 20  # error lines kept per sample; the rest counted in one more
GPUS_MAX = 64
CONTAINERS_MAX = commands.CONTAINERS_MAX

# What a real machine can report; anything outside is garbage (None).
MIB = 1024 * 1024
MEM_MAX = 1 << 50  # bytes (1 PiB): a GPU's memory, a container's, a host's
POWER_MAX = 10_000.0  # W, one GPU
TEMP_MAX = 200.0  # C
ECC_MAX = 10**12
CPUS_MAX = 1 << 16
LOAD_MAX = 1e6

# NVML's clocks event (throttle) reasons, bit -> name (nvmlClocksEventReasons, NVML API reference).
# GPU idle (0x1) is no slowdown: it is left out, as is "none" (0).
THROTTLE_BITS = {
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}
_IDLE = 0x1
_KNOWN_BITS = _IDLE | sum(THROTTLE_BITS)

_NOT_A_VALUE = re.compile(
    r"^\[?\s*(n/a|not supported|unknown( error)?|insufficient permissions|gpu is lost|"
    r"requested functionality has been deprecated)\s*\]?$",
    re.I,
)
_BUS = re.compile(r"^(?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
# The kernel's XID lines, as preflight/gpuparse.parse_xid reads them: "NVRM: Xid (PCI:0000:3b:00):
# 79, pid=...", with a MIG instance "(PCI:0000:01:00 GPU-I:05)", and in old drivers without "PCI:".
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2})"
    r"(?:\.[0-9A-Fa-f])?(?:\s[^)]*)?\):\s*(\d{1,6})"
)
# docker stats sizes: "264MiB", "23.54GiB", "0B" (binary units: memory), "1.2kB", "3MB" (decimal
# ones: what docker prints for network and block I/O).
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(B|[KMGTP]iB|[kKMGTP]B)\s*$")
_UNITS = {
    "B": 1,
    **{f"{p}iB": 1024 ** (i + 1) for i, p in enumerate("KMGTP")},
    **{f"{p}B": 1000 ** (i + 1) for i, p in enumerate("KMGTP")},
    "kB": 1000,
}


# ---------------------------------------------------------------- numbers


def number(value: Any, low: float, high: float) -> float | None:
    """A finite number within [low, high] from a host's text or JSON value ("12.5", "12.5 W", 12);
    None for N/A, garbage, NaN, infinities and anything out of range."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        x = float(value)
    elif isinstance(value, str):
        s = value.strip()
        if not s or len(s) > 40 or _NOT_A_VALUE.match(s):
            return None
        token = s.split()[0].rstrip("%")
        try:
            x = float(token)
        except ValueError:
            return None
    else:
        return None
    return x if math.isfinite(x) and low <= x <= high else None


def _int(value: Any, high: float) -> int | None:
    x = number(value, 0, high)
    return int(x) if x is not None and x == int(x) else None


def size(text: str) -> int | None:
    """Bytes of a docker size ("264MiB", "23.54GiB", "0B"); None when it is not one or is absurd."""
    m = _SIZE.match(text or "")
    if not m:
        return None
    x = number(m.group(1), 0, MEM_MAX)
    if x is None:
        return None
    got = x * _UNITS[m.group(2)]
    return int(got) if got <= MEM_MAX else None


def throttle_reasons(mask: str) -> list[str] | None:
    """NVML's active clocks reasons ("0x0000000000000028") as names, in bit order; idle and none
    are []; bits NVML does not name are "other"; None when it is not a bitmask."""
    s = (mask or "").strip()
    if not re.fullmatch(r"0x[0-9A-Fa-f]{1,16}", s):
        return None
    bits = int(s, 16)
    names = [name for bit, name in THROTTLE_BITS.items() if bits & bit]
    return names + (["other"] if bits & ~_KNOWN_BITS else [])


def bus_id(value: Any) -> str:
    """A PCI address as the tool printed it ("00000000:3B:00.0"), or "" when it is not one."""
    s = value.strip() if isinstance(value, str) else ""
    return s if _BUS.match(s) else ""


def plain(value: Any, limit: int = 120) -> str:
    """A name from a host as one plain line (no control characters, at most `limit` characters)."""
    return hostile.line(value, limit) if isinstance(value, str) else ""


def parse_xid(text: str) -> list[list[Any]]:
    """[PCI bus id ("0000:3b:00", lower case), XID code] of each kernel XID line, in order."""
    return [[m.group(1).lower(), int(m.group(2))] for m in _XID_RE.finditer(text or "")]


# ---------------------------------------------------------------- sections


class _Errors(list):
    """A sample's error lines, at most ERRORS_MAX, then one line counting the rest."""

    dropped = 0

    def add(self, section: str, what: str, line: str = "") -> None:
        if len(self) < ERRORS_MAX:
            self.append(f"{section}: {what}" + (f": {hostile.line(line, 120)}" if line else ""))
        else:
            self.dropped += 1

    def done(self) -> list[str]:
        return [*self, f"... and {self.dropped} more"] if self.dropped else list(self)


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


def _gpu(
    index: int,
    uuid: str = "",
    bus: str = "",
    util: float | None = None,
    mem_used: int | None = None,
    mem_total: int | None = None,
    power_w: float | None = None,
    temp_c: float | None = None,
    throttle: list[str] | None = None,
    ecc_uncorrected: int | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": uuid,
        "bus": bus,
        "util": util,
        "mem_used": mem_used,
        "mem_total": mem_total,
        "power_w": power_w,
        "temp_c": temp_c,
        "throttle": throttle or [],
        "ecc_uncorrected": ecc_uncorrected,
    }


def _mib(value: Any) -> int | None:
    x = number(value, 0, MEM_MAX / MIB)
    return int(x * MIB) if x is not None else None


def _util(value: Any) -> float | None:
    x = number(value, 0, 100)
    return x / 100 if x is not None else None


def parse_nvidia(lines: list[str], errors: _Errors) -> list[dict]:
    """nvidia-smi's CSV (commands.NVIDIA_FIELDS, noheader, nounits): one GPU per line."""
    gpus: list[dict] = []
    for line in lines:
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        index = _int(cells[0], GPUS_MAX - 1) if cells else None
        if len(cells) != len(commands.NVIDIA_FIELDS) or index is None or len(gpus) >= GPUS_MAX:
            errors.add("nvidia-smi", "unreadable line", line)
            continue
        _, uuid, bus, util, used, total, power, temp, reasons, ecc = cells
        gpus.append(
            _gpu(
                index,
                plain(uuid, 80),
                bus_id(bus),
                _util(util),
                _mib(used),
                _mib(total),
                number(power, 0, POWER_MAX),
                number(temp, 0, TEMP_MAX),
                throttle_reasons(reasons),
                _int(ecc, ECC_MAX),
            )
        )
    return gpus


def _json(lines: list[str], section: str, errors: _Errors) -> Any:
    """The JSON document in a section (a tool's warnings before it skipped); None when there is
    none or it cannot be read (one error line)."""
    text = "\n".join(lines)
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        if text.strip():
            errors.add(section, "no JSON", text)
        return None
    try:
        doc, _ = json.JSONDecoder().raw_decode(text, min(starts))
    except (ValueError, RecursionError):
        errors.add(section, "unreadable JSON", text[min(starts) :])
        return None
    return doc


def _entries(doc: Any) -> list[dict]:
    """amd-smi's per-GPU entries: a list (ROCm 6) or {"gpu_data": [...]} (later releases)."""
    if isinstance(doc, dict):
        doc = doc.get("gpu_data")
    return [e for e in doc if isinstance(e, dict)][:GPUS_MAX] if isinstance(doc, list) else []


def _value(field: Any) -> tuple[Any, str]:
    """(value, unit) of an amd-smi field: {"value": 10, "unit": "W"}, "10 W" or 10."""
    if isinstance(field, dict):
        return field.get("value"), str(field.get("unit") or "")
    if isinstance(field, str):
        parts = field.split()
        return (parts[0], parts[1] if len(parts) > 1 else "") if parts else (None, "")
    return field, ""


def _get(entry: dict, *path: str) -> Any:
    for key in path:
        if not isinstance(entry, dict):
            return None
        entry = entry.get(key)  # type: ignore[assignment]
    return entry


_AMD_UNITS = {"": MIB, "MB": MIB, "MIB": MIB, "GB": 1 << 30, "GIB": 1 << 30, "KB": 1024, "B": 1}


def _amd_mem(field: Any) -> int | None:
    """amd-smi memory: MB (MiB: the tool divides bytes by 1024*1024), GB, or with no unit MB."""
    value, unit = _value(field)
    scale = _AMD_UNITS.get(unit.upper())
    x = number(value, 0, MEM_MAX)
    return int(x * scale) if x is not None and scale is not None and x * scale <= MEM_MAX else None


def parse_amd(metric: list[str], listing: list[str], errors: _Errors) -> list[dict]:
    """`amd-smi metric --json` (with `amd-smi list --json` for each GPU's PCI address and UUID)."""
    ids = {}
    for e in _entries(_json(listing, "amd-smi list", errors)):
        index = _int(e.get("gpu"), GPUS_MAX - 1)
        if index is not None:
            ids[index] = (plain(e.get("uuid"), 80), bus_id(e.get("bdf")))
    gpus: list[dict] = []
    doc = _json(metric, "amd-smi", errors)
    if doc is not None and not _entries(doc):
        errors.add("amd-smi", "no GPU entries")
    for e in _entries(doc):
        index = _int(e.get("gpu"), GPUS_MAX - 1)
        if index is None:
            errors.add("amd-smi", "an entry without a GPU index")
            continue
        temp = number(_value(_get(e, "temperature", "edge"))[0], 0, TEMP_MAX)
        if temp is None:
            temp = number(_value(_get(e, "temperature", "hotspot"))[0], 0, TEMP_MAX)
        throttled = str(_get(e, "power", "throttle_status") or "").upper() == "THROTTLED"
        uuid, bus = ids.get(index, ("", ""))
        gpus.append(
            _gpu(
                index,
                uuid,
                bus,
                _util(_value(_get(e, "usage", "gfx_activity"))[0]),
                _amd_mem(_get(e, "mem_usage", "used_vram")),
                _amd_mem(_get(e, "mem_usage", "total_vram")),
                number(_value(_get(e, "power", "socket_power"))[0], 0, POWER_MAX),
                temp,
                ["throttled"] if throttled else [],
                _int(_value(_get(e, "ecc", "total_uncorrectable_count"))[0], ECC_MAX),
            )
        )
    return gpus


def parse_rocm(lines: list[str], errors: _Errors) -> list[dict]:
    """`rocm-smi ... --json`: {"card0": {"GPU use (%)": "37", ...}, "system": {...}}."""
    doc = _json(lines, "rocm-smi", errors)
    if not isinstance(doc, dict):
        return []
    gpus = []
    for card, f in list(doc.items())[: GPUS_MAX + 1]:
        m = re.fullmatch(r"card(\d{1,3})", str(card))
        if not m or not isinstance(f, dict):
            continue

        def first(*keys: str, f: dict = f) -> Any:
            return next((f[k] for k in keys if k in f), None)

        total = _int(first("VRAM Total Memory (B)"), MEM_MAX)
        used = _int(first("VRAM Total Used Memory (B)"), MEM_MAX)
        power = first("Average Graphics Package Power (W)", "Current Socket Graphics Package Power (W)")
        temp = number(first("Temperature (Sensor edge) (C)"), 0, TEMP_MAX)
        gpus.append(
            _gpu(
                int(m.group(1)),
                plain(first("Unique ID") or "", 80),
                bus_id(first("PCI Bus")),
                _util(first("GPU use (%)")),
                used,
                total,
                number(power, 0, POWER_MAX),
                temp if temp is not None else number(first("Temperature (Sensor junction) (C)"), 0, TEMP_MAX),
            )
        )
    return gpus


def parse_containers(lines: list[str], errors: _Errors) -> list[dict]:
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


def parse_host(lines: list[str], errors: _Errors) -> dict[str, Any]:
    """/proc/loadavg's first line, MemTotal and MemAvailable (kB), nproc."""
    host: dict[str, Any] = {"load1": None, "mem_used": None, "mem_total": None, "cpus": None}
    mem: dict[str, int | None] = {}
    for line in lines:
        words = line.split()
        if not words:
            continue
        if words[0] in ("MemTotal:", "MemAvailable:") and len(words) >= 2:
            kb = _int(words[1], MEM_MAX / 1024)
            mem[words[0]] = kb * 1024 if kb is not None else None
        elif len(words) == 1 and host["cpus"] is None and words[0].isdigit():
            host["cpus"] = _int(words[0], CPUS_MAX) or None
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
    errors = _Errors()
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
