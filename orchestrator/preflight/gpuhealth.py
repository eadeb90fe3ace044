"""A GPU host's health, for the deep check: the judgement of what the commands that read it
(gpucommands) print, once gpuparse has read it (no I/O here; orchestrator/preflight/deepphases.py
runs the commands).

NVIDIA: `nvidia-smi -q` (ECC, retired pages / remapped rows, clocks event reasons, PCIe link), the
kernel log's XID lines, and `dcgmi diag -r 1` where DCGM is installed. AMD: `rocm-smi` (RAS error
counts per block, PCIe link). What is a failure and what a warning is decided from one table,
THRESHOLDS, keyed by GPU model (thresholds_for).

A Finding is one problem: `fail` means the host should not run jobs (drain it), `warn` that it can,
but something is off that a person should look at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from orchestrator.preflight.gpucommands import DCGMI_ABSENT, DCGMI_TIMED_OUT
from orchestrator.preflight.gpuparse import parse_xid, pci_key, read_dcgmi_tests


@dataclass(frozen=True)
class Finding:
    gpu: str  # "0", "1", ... (the tool's GPU index) or "" for the whole host
    level: str  # "fail" or "warn"
    what: str  # short, e.g. "uncorrectable ECC errors"
    detail: str  # e.g. "GPU 2 (00000000:3B:00.0): 4 volatile uncorrectable ECC errors"


FAIL, WARN = "fail", "warn"

# ---------------------------------------------------------------------------------------------
# Thresholds
# ---------------------------------------------------------------------------------------------

# Clocks event reasons (nvidia-smi; "Clocks Throttle Reasons" before driver 535) that mean the GPU
# is slowed by heat or its power supply. Not problems: "Idle", "Applications Clocks Setting",
# "Display Clock Setting" and "Sync Boost" (settings), "SW Power Cap" (the GPU at its power limit,
# normal under full load).
_SLOWDOWNS = ("HW Slowdown", "HW Thermal Slowdown", "HW Power Brake Slowdown", "SW Thermal Slowdown")

# The one table. Keys are matched as case-insensitive substrings of the model name that nvidia-smi
# ("Product Name") or rocm-smi ("Card Series"/"Card model") prints, the longest matching key wins
# ("A100" over "A10"), and an entry overrides only what it names of "default".
#   max_uncorrectable_ecc  uncorrectable ECC errors tolerated (volatile ones on NVIDIA, the RAS
#                          counts on AMD); more fails the GPU
#   max_pending_rows       pending page retirements / row remaps / memory repairs tolerated
#                          (nvidia-smi gives each as Yes/No, so each Yes counts one); more fails
#   pcie_gen, pcie_width   the link the GPU should have (None: no expectation); a maximum below it
#                          is a warning (a slot or riser that cannot do more)
#   throttle_fail          clocks event reasons that fail the GPU when active
#   throttle_warn          clocks event reasons that warn when active
THRESHOLDS: dict[str, dict] = {
    "default": {
        "max_uncorrectable_ecc": 0,
        "max_pending_rows": 0,
        "pcie_gen": None,
        "pcie_width": 16,
        "throttle_fail": (),
        "throttle_warn": _SLOWDOWNS,
    },
    # NVIDIA data center GPUs: PCIe generation from NVIDIA's product pages.
    "H100": {"pcie_gen": 5},
    "H200": {"pcie_gen": 5},
    "A100": {"pcie_gen": 4},
    "A10": {"pcie_gen": 4},  # A10, A10G
    "L40S": {"pcie_gen": 4},
    "V100": {"pcie_gen": 3},
    # AMD Instinct
    "MI300X": {"pcie_gen": 5},
    "MI325X": {"pcie_gen": 5},
    "MI250X": {"pcie_gen": 4},
    "MI250": {"pcie_gen": 4},
    "MI210": {"pcie_gen": 4},
    "MI100": {"pcie_gen": 4},
}


def thresholds_for(model: str) -> dict:
    """THRESHOLDS["default"] overridden by the entry whose key is the longest case-insensitive
    substring of `model` (none: the defaults alone)."""
    low = (model or "").lower()
    keys = [k for k in THRESHOLDS if k != "default" and k.lower() in low]
    best = max(keys, key=len) if keys else None
    return {**THRESHOLDS["default"], **(THRESHOLDS[best] if best else {})}


# ---------------------------------------------------------------------------------------------
# XID
# ---------------------------------------------------------------------------------------------

# XIDs that mean the GPU needs a reset, a reboot or service, from NVIDIA's Xid catalog
# (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) and its memory error
# management guide (https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/): 48 uncorrectable
# (double bit) ECC error; 62 internal micro-controller halt; 63 a row remap / page retirement
# recorded (applied at the next reset); 64 recording it failed; 74 NVLink error; 79 fallen off the
# bus; 92 high single-bit ECC error rate; 94 contained and 95 uncontained ECC error; 119 GSP RPC
# timeout; 120 GSP error; 140 unrecovered ECC error; 154 GPU recovery action changed (a reset or
# reboot is required); 171 and 172 uncorrectable DRAM and SRAM errors (newer drivers, with 48).
# Any other XID is a warning: most (13, 31, ...) are raised by an application's fault. 43 (a context
# stopped) and 45 (preemptive cleanup) follow every killed job, which a cluster that restarts jobs
# sees all the time: they are not findings.
SERIOUS_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140, 154, 171, 172})
ROUTINE_XIDS = frozenset({43, 45})

# ---------------------------------------------------------------------------------------------
# Judgement
# ---------------------------------------------------------------------------------------------


def _name(g: dict) -> str:
    if g.get("index"):
        return f"GPU {g['index']} ({g.get('bus_id') or 'bus unknown'})"
    return f"GPU at {g['bus_id']}" if g.get("bus_id") else "GPUs"


def _pcie_findings(g: dict, t: dict, idle: bool, dpm: bool) -> list[Finding]:
    """The link rules shared by both vendors (see judge_nvidia and judge_amd)."""
    out = []
    gpu, name = g["index"], _name(g)
    wc, wm, gc, gm = (
        g.get(k) for k in ("pcie_width_current", "pcie_width_max", "pcie_gen_current", "pcie_gen_max")
    )
    maybe = (
        " (the GPU is idle: links downtrain at idle, so this may be harmless)"
        if idle
        else " (AMD power management lowers the link when the GPU is not busy, so this may be harmless)"
        if dpm
        else ""
    )
    if wc is not None and wm is not None and wc < wm:
        out.append(
            Finding(
                gpu,
                WARN,
                "PCIe link narrower than its maximum",
                f"{name}: PCIe link x{wc}, max x{wm}{maybe if dpm else ''}",
            )
        )
    if gc is not None and gm is not None and gc < gm:
        out.append(
            Finding(
                gpu,
                WARN,
                "PCIe link below its maximum generation",
                f"{name}: PCIe gen {gc}, max gen {gm}{maybe}",
            )
        )
    if t["pcie_width"] and wm is not None and wm < t["pcie_width"]:
        out.append(
            Finding(
                gpu,
                WARN,
                "PCIe link narrower than expected",
                f"{name}: PCIe link can do at most x{wm}, x{t['pcie_width']} expected "
                "(slot, riser or bridge)",
            )
        )
    if t["pcie_gen"] and gm is not None and gm < t["pcie_gen"]:
        out.append(
            Finding(
                gpu,
                WARN,
                "PCIe link slower than expected",
                f"{name}: PCIe link can do at most gen {gm}, gen {t['pcie_gen']} expected "
                "(slot, riser, bridge or BIOS setting)",
            )
        )
    return out


def _memory_findings(g: dict, t: dict, name: str) -> list[Finding]:
    """A GPU's ECC errors, pending retirements or remaps and RMA conditions (see judge_nvidia)."""
    out = []
    gpu = g["index"]
    limit = t["max_uncorrectable_ecc"]
    vol, agg = g.get("ecc_volatile_uncorrectable"), g.get("ecc_aggregate_uncorrectable")
    if vol is not None and vol > limit:
        out.append(
            Finding(gpu, FAIL, "uncorrectable ECC errors", f"{name}: {vol} volatile uncorrectable ECC errors")
        )
    elif agg is not None and agg > limit:
        out.append(
            Finding(
                gpu,
                WARN,
                "uncorrectable ECC errors in the past",
                f"{name}: {agg} aggregate (lifetime) uncorrectable ECC errors, none since the driver loaded",
            )
        )
    pend = [
        what
        for what, v in (
            ("page retirement pending", g.get("retired_pages_pending")),
            ("row remap pending", g.get("remapped_rows_pending")),
            ("memory repair pending", g.get("repair_pending")),
        )
        if v
    ]
    if len(pend) > t["max_pending_rows"]:
        rows = g.get("remapped_rows_uncorrectable")
        out.append(
            Finding(
                gpu,
                FAIL,
                "pending page retirement or row remap",
                f"{name}: {', '.join(pend)}"
                + (f" ({rows} rows remapped for uncorrectable errors)" if rows else "")
                + "; a GPU reset applies it",
            )
        )
    for key, what in (
        ("remapping_failure", "row remapping failed"),
        ("unrepairable_memory", "unrepairable memory"),
        ("sram_threshold_exceeded", "SRAM error threshold exceeded"),
    ):
        if g.get(key):
            out.append(Finding(gpu, FAIL, what, f"{name}: {what}"))
    return out


def judge_nvidia(gpus: list[dict], xid_text: str = "") -> list[Finding]:
    """Findings from parse_nvidia_smi_q's GPUs and gpucommands.XID_COMMAND's output, per GPU in
    order, with the thresholds of its model (thresholds_for):

    - no GPU listed at all, or a GPU nvidia-smi cannot read: fail;
    - volatile uncorrectable ECC errors above max_uncorrectable_ecc: fail; else lifetime
      (aggregate) ones above it: warn (they were recovered, by row remapping or page retirement);
    - pending page retirement, pending row remap, pending channel/TPC repair: each Yes counts one;
      more than max_pending_rows: fail (a GPU reset applies them);
    - row remapping failure, unrepairable memory, SRAM threshold exceeded: fail (RMA conditions);
    - a recovery action other than None, reset required or drain-and-reset recommended: fail;
    - active clocks event reasons in throttle_fail: fail; in throttle_warn (by default thermal and
      power-brake slowdowns: "HW Slowdown", "HW Thermal Slowdown", "HW Power Brake Slowdown", "SW
      Thermal Slowdown"): warn. "Idle", "Applications Clocks Setting", "SW Power Cap" and the
      other settings are not problems;
    - PCIe: current width below the maximum: warn (width does not change with load, so any
      shortfall is a degraded link); current generation below the maximum: warn, saying so when the
      GPU is idle (many GPUs downtrain the link at idle: a 4090 shows gen 1 of 4 idle); a maximum
      below the model's pcie_width / pcie_gen: warn;
    - each XID code seen on a GPU: fail if in SERIOUS_XIDS, else warn (one finding per GPU and
      code, with the count). An XID on a bus no GPU has is the host's (""). The kernel log keeps
      them until the host reboots, so one that a GPU reset dealt with is still reported."""
    out: list[Finding] = []
    if not gpus:
        out.append(Finding("", FAIL, "no GPUs read", "nvidia-smi -q listed no GPUs (driver not loaded?)"))
    for g in gpus:
        gpu, name = g["index"], _name(g)
        if g.get("error"):
            out.append(Finding(gpu, FAIL, "GPU not readable", f"{name}: {g['error']}"))
            continue
        t = thresholds_for(g.get("product", ""))
        out += _memory_findings(g, t, name)
        action = g.get("recovery_action")
        if action and action.lower() not in ("none", "n/a"):
            out.append(Finding(gpu, FAIL, "GPU recovery action pending", f"{name}: recovery action {action}"))
        elif g.get("reset_required"):
            out.append(Finding(gpu, FAIL, "GPU reset required", f"{name}: reset required"))
        active = g.get("throttle_active") or []
        for level, listed in ((FAIL, t["throttle_fail"]), (WARN, t["throttle_warn"])):
            hit = [r for r in active if r in listed and (level == FAIL or r not in t["throttle_fail"])]
            if hit:
                out.append(Finding(gpu, level, "clocks slowed down", f"{name}: {', '.join(hit)} active"))
        out += _pcie_findings(g, t, idle="Idle" in active, dpm=False)
    out += _xid_findings(gpus, parse_xid(xid_text))
    return out


def _xid_findings(gpus: list[dict], xids: list[tuple[str, int]]) -> list[Finding]:
    by_bus = {pci_key(g["bus_id"]): g for g in gpus if pci_key(g.get("bus_id", ""))}
    counts: dict[tuple[str, int], int] = {}
    for bus, code in xids:
        if code not in ROUTINE_XIDS:
            counts[(bus, code)] = counts.get((bus, code), 0) + 1
    out = []
    for (bus, code), n in counts.items():
        g = by_bus.get(pci_key(bus))
        where = _name(g) if g else f"PCI {bus} (no GPU listed there)"
        serious = code in SERIOUS_XIDS
        out.append(
            Finding(
                g["index"] if g else "",
                FAIL if serious else WARN,
                f"XID {code}" + (" (serious)" if serious else ""),
                f"{where}: XID {code} in the kernel log" + (f" ({n} times)" if n > 1 else ""),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# dcgmi diag
# ---------------------------------------------------------------------------------------------


def parse_dcgmi_diag(text: str) -> list[Finding]:
    """Findings from `dcgmi diag` table output (gpucommands.DCGMI_COMMAND): each test whose result
    is Fail is a fail, Warn a warn, one per GPU the result names ("Fail - GPU: 1", DCGM 4's "GPU0:
    Fail") or one for the host ("Fail - All", deployment tests). The detail carries the test's first
    Error / Warning / Info message. Pass, Skip and Not Run are nothing, nor are Info lines under a
    Pass.
    [] when everything passed, when the text is empty, or when dcgmi is absent (DCGMI_ABSENT).
    A timeout (DCGMI_TIMED_OUT) or output with no result table (dcgmi could not run): warn."""
    text = text or ""
    if DCGMI_ABSENT in text or not text.strip():
        return []
    tests, table = read_dcgmi_tests(text)
    out: list[Finding] = []
    for t in tests:
        for result, level in (("Fail", FAIL), ("Warn", WARN)):
            gpus = [g for res, gs in t["results"] if res == result for g in gs]
            if not gpus:
                continue
            named = sorted({g for g in gpus if g}, key=int)
            for gpu in named or [""]:
                msgs = [m[1].strip() for m in t["messages"]]
                mine = [m for m in msgs if gpu and re.search(rf"\bGPU {gpu}\b", m)] or msgs
                detail = f"dcgmi diag: {t['test']}: {result}" + (f" on GPU {gpu}" if gpu else "")
                if mine:
                    detail += f": {mine[0][:300]}" + (f" (+{len(mine) - 1} more)" if len(mine) > 1 else "")
                out.append(
                    Finding(
                        gpu, level, f"dcgmi {t['test']} {'failed' if level == FAIL else 'warned'}", detail
                    )
                )
    if DCGMI_TIMED_OUT in text:
        out.append(Finding("", WARN, "dcgmi diag timed out", "dcgmi diag -r 1 did not finish"))
    elif not table:
        first = next(line.strip() for line in text.splitlines() if line.strip())
        out.append(Finding("", WARN, "dcgmi diag gave no result", f"dcgmi diag -r 1: {first[:300]}"))
    return out


# ---------------------------------------------------------------------------------------------
# rocm-smi
# ---------------------------------------------------------------------------------------------


def judge_amd(gpus: list[dict]) -> list[Finding]:
    """Findings from parse_rocm_smi's GPUs, with the thresholds of each model (thresholds_for):

    - no GPU listed: warn (rocm-smi absent or failing; RAS and links not checked);
    - uncorrectable errors summed over the RAS blocks above max_uncorrectable_ecc: fail, naming
      the blocks; a block whose RAS state says uncorrectable errors ("MULTIPLE, UNCORRECTABLE"):
      fail;
    - PCIe: current level below the highest supported one, in width or generation: warn (AMD's
      power management moves the link between supported levels, width included, so this may be
      the GPU at rest); highest supported level below the model's pcie_width / pcie_gen: warn."""
    if not gpus:
        return [Finding("", WARN, "no GPUs read", "rocm-smi listed no GPUs; RAS and PCIe links not checked")]
    out: list[Finding] = []
    for g in gpus:
        gpu, name = g["index"], _name(g)
        t = thresholds_for(g.get("product", ""))
        ue = g.get("ecc_uncorrectable")
        if ue is not None and ue > t["max_uncorrectable_ecc"]:
            blocks = ", ".join(f"{b} {c[2]}" for b, c in g["ras"].items() if c[2])
            out.append(
                Finding(
                    gpu, FAIL, "uncorrectable ECC errors", f"{name}: {ue} uncorrectable RAS errors ({blocks})"
                )
            )
        for block, (status, _, _) in g.get("ras", {}).items():
            if "UNCORRECTABLE" in status.upper():
                out.append(
                    Finding(gpu, FAIL, "uncorrectable RAS state", f"{name}: RAS block {block} {status}")
                )
        out += _pcie_findings(g, t, idle=False, dpm=True)
    return out
