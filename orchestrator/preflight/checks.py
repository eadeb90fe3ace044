"""The vocabulary of a preflight: a Check (one named check on one host, with its status, what was
seen, and the fix), the statuses and the order checks are shown in, the Limits the judging uses, and
`failed`, which picks the checks that stop a start."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, NA, SKIP = "ok", "warn", "fail", "n/a", "skipped"
CHECKS = (
    "ssh",
    "docker",
    "image",
    "gpus",
    "interface",
    "route",
    "port",
    "reach",
    "mtu",
    "time",
    "shm",
    "disk",
    "dirs",
    "rsync",
    "code",
    "runtime",
    "smoke",
    # the deep check (preflight/deep.py)
    "disk-speed",
    "compute",
    "net",
    "link",
    "gpu-health",
)


@dataclass(frozen=True)
class Check:
    host: str
    check: str
    status: str
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Limits:
    clock_warn: float = 0.050  # seconds of clock offset
    clock_fail: float = 0.500
    shm_warn_mb: int = 1024
    disk_warn_gb: float = 5.0
    disk_fail_gb: float = 1.0


DEFAULT_LIMITS = Limits()


def failed(checks: list[Check], strict: bool = False) -> list[Check]:
    bad = {FAIL, WARN} if strict else {FAIL}
    return [c for c in checks if c.status in bad]


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"
