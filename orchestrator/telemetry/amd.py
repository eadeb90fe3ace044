"""AMD GPUs in a telemetry sample: what `amd-smi metric --json` (with `amd-smi list --json`) or,
on older ROCm, `rocm-smi ... --json` prints, read as hostile input into telemetry/readings.gpu
records (telemetry/samples.parse_sample picks the tool's section). Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any

from orchestrator.telemetry.readings import (
    ECC_MAX,
    GPUS_MAX,
    MEM_MAX,
    MIB,
    POWER_MAX,
    TEMP_MAX,
    Errors,
    bus_id,
    gpu,
    integer,
    number,
    percent,
    plain,
)


def _json(lines: list[str], section: str, errors: Errors) -> Any:
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


def parse_amd(metric: list[str], listing: list[str], errors: Errors) -> list[dict]:
    """`amd-smi metric --json` (with `amd-smi list --json` for each GPU's PCI address and UUID)."""
    ids = {}
    for e in _entries(_json(listing, "amd-smi list", errors)):
        index = integer(e.get("gpu"), GPUS_MAX - 1)
        if index is not None:
            ids[index] = (plain(e.get("uuid"), 80), bus_id(e.get("bdf")))
    gpus: list[dict] = []
    doc = _json(metric, "amd-smi", errors)
    if doc is not None and not _entries(doc):
        errors.add("amd-smi", "no GPU entries")
    for e in _entries(doc):
        index = integer(e.get("gpu"), GPUS_MAX - 1)
        if index is None:
            errors.add("amd-smi", "an entry without a GPU index")
            continue
        temp = number(_value(_get(e, "temperature", "edge"))[0], 0, TEMP_MAX)
        if temp is None:
            temp = number(_value(_get(e, "temperature", "hotspot"))[0], 0, TEMP_MAX)
        throttled = str(_get(e, "power", "throttle_status") or "").upper() == "THROTTLED"
        uuid, bus = ids.get(index, ("", ""))
        gpus.append(
            gpu(
                index,
                uuid,
                bus,
                percent(_value(_get(e, "usage", "gfx_activity"))[0]),
                _amd_mem(_get(e, "mem_usage", "used_vram")),
                _amd_mem(_get(e, "mem_usage", "total_vram")),
                number(_value(_get(e, "power", "socket_power"))[0], 0, POWER_MAX),
                temp,
                ["throttled"] if throttled else [],
                integer(_value(_get(e, "ecc", "total_uncorrectable_count"))[0], ECC_MAX),
            )
        )
    return gpus


def parse_rocm(lines: list[str], errors: Errors) -> list[dict]:
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

        total = integer(first("VRAM Total Memory (B)"), MEM_MAX)
        used = integer(first("VRAM Total Used Memory (B)"), MEM_MAX)
        power = first("Average Graphics Package Power (W)", "Current Socket Graphics Package Power (W)")
        temp = number(first("Temperature (Sensor edge) (C)"), 0, TEMP_MAX)
        gpus.append(
            gpu(
                int(m.group(1)),
                plain(first("Unique ID") or "", 80),
                bus_id(first("PCI Bus")),
                percent(first("GPU use (%)")),
                used,
                total,
                number(power, 0, POWER_MAX),
                temp if temp is not None else number(first("Temperature (Sensor junction) (C)"), 0, TEMP_MAX),
            )
        )
    return gpus
