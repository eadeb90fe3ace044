"""The values in a telemetry sample, read from a host's text as hostile input (telemetry/samples.py
and telemetry/amd.py read its sections with these). Pure: no I/O.

Each number is checked (finite, inside a range a real machine can have: else None); names are made
plain text by core/hostile; "[N/A]", "[Not Supported]" and the like are None. A sample's error
lines are gathered in an `Errors` (at most ERRORS_MAX of them), one GPU's fields by `gpu`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from orchestrator.core import hostile

ERRORS_MAX = 20  # error lines kept per sample; the rest counted in one more
GPUS_MAX = 64

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


def integer(value: Any, high: float) -> int | None:
    """A whole number within [0, high] (number's checks), else None."""
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


def mib(value: Any) -> int | None:
    """Bytes of a size in MiB (nvidia-smi's nounits memory), or None."""
    x = number(value, 0, MEM_MAX / MIB)
    return int(x * MIB) if x is not None else None


def percent(value: Any) -> float | None:
    """A percentage (0..100) as a fraction (0..1), or None."""
    x = number(value, 0, 100)
    return x / 100 if x is not None else None


# ---------------------------------------------------------------- a sample's parts


class Errors(list):
    """A sample's error lines, at most ERRORS_MAX, then one line counting the rest."""

    dropped = 0

    def add(self, section: str, what: str, line: str = "") -> None:
        if len(self) < ERRORS_MAX:
            self.append(f"{section}: {what}" + (f": {hostile.line(line, 120)}" if line else ""))
        else:
            self.dropped += 1

    def done(self) -> list[str]:
        return [*self, f"... and {self.dropped} more"] if self.dropped else list(self)


def gpu(
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
    """One GPU of a sample (the shape telemetry/samples.py's docstring gives)."""
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
