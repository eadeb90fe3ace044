"""A GPU host's health, for the deep check: the commands that read it and pure parsers and judgement
of what they print (no I/O here; orchestrator/preflight/deep.py runs the commands). Every parser is
tested on outputs recorded on real machines (tests/unit/test_gpuhealth.py says where each is from).

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
from typing import Any


@dataclass(frozen=True)
class Finding:
    gpu: str        # "0", "1", ... (the tool's GPU index) or "" for the whole host
    level: str      # "fail" or "warn"
    what: str       # short, e.g. "uncorrectable ECC errors"
    detail: str     # e.g. "GPU 2 (00000000:3B:00.0): 4 volatile uncorrectable ECC errors"


FAIL, WARN = "fail", "warn"

# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------

# The full text query. `-d` is not used: no -d section holds the product name or the PCI block
# (link generation and width), which this check needs; a recorded `-q -d ECC,PAGE_RETIREMENT,
# ROW_REMAPPER,PERFORMANCE,...` on an H100 (tests/unit/recorded/nvidia-h100/nvidia-smi.txt) has
# neither. Without -i every GPU is listed, in nvidia-smi's index order, so a GPU's position in the
# output is its index.
NVIDIA_COMMAND = ["nvidia-smi", "-q"]

# Kernel log lines with NVIDIA XID errors since boot: dmesg, or where it is not permitted
# (kernel.dmesg_restrict) or absent, the kernel messages of this boot from the journal. Prints
# nothing when there are none or neither can be read; always exits 0.
XID_COMMAND = ("{ dmesg 2>/dev/null || journalctl -k -b -q --no-pager 2>/dev/null; } "
               "| grep -F 'NVRM: Xid' || true")

DCGMI_ABSENT = "gpuhealth: dcgmi absent"
DCGMI_TIMED_OUT = "gpuhealth: dcgmi timed out"
# `dcgmi diag -r 1` (the quick level: deployment checks, seconds) only where dcgmi is installed;
# else a marker line. Bounded below deep.py's 300 s so that a hung diag reports itself.
DCGMI_COMMAND = ("if command -v dcgmi >/dev/null 2>&1; then timeout 240 dcgmi diag -r 1 2>&1; "
                 f"[ $? -eq 124 ] && echo '{DCGMI_TIMED_OUT}'; "
                 f"else echo '{DCGMI_ABSENT}'; fi; true")

# rocm-smi's text output, one run: --showproductname (model, for THRESHOLDS), --showbus (PCI
# address), --showclocks (the current PCIe level, "pcie clock level: 1 (16.0GT/s x16)"),
# --showclkfrq (the supported PCIe levels, current one starred; the highest is the link's maximum)
# and --showrasinfo all (per-block RAS state and correctable/uncorrectable error counts; "all"
# because older rocm-smi shows no block without it). Not --json: --showrasinfo prints nothing in
# JSON ("WARNING: No JSON data to report", ROCm/legacy-rocm-build#4374). Not --showpcibandwidth: it
# estimates traffic, it does not give the link state. rocm-smi is deprecated for amd-smi, which
# AMD hosts may have instead; this reads rocm-smi only.
ROCM_COMMAND = ["rocm-smi", "--showproductname", "--showbus", "--showclocks", "--showclkfrq",
                "--showrasinfo", "all"]

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
    "default": {"max_uncorrectable_ecc": 0, "max_pending_rows": 0, "pcie_gen": None, "pcie_width": 16,
                "throttle_fail": (), "throttle_warn": _SLOWDOWNS},
    # NVIDIA data center GPUs: PCIe generation from NVIDIA's product pages.
    "H100": {"pcie_gen": 5},
    "H200": {"pcie_gen": 5},
    "A100": {"pcie_gen": 4},
    "A10": {"pcie_gen": 4},          # A10, A10G
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

# "NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus." Also with a MIG instance
# "(PCI:0000:01:00 GPU-I:05)", and in old drivers without "PCI:".
_XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2})"
                     r"(?:\.[0-9A-Fa-f])?(?:\s[^)]*)?\):\s*(\d+)")


def parse_xid(text: str) -> list[tuple[str, int]]:
    """(PCI bus id, XID code) of each XID line, in order, repeats kept. The bus id as the kernel
    prints it, lower case, without "PCI:": "0000:3b:00" (domain:bus:device)."""
    return [(m.group(1).lower(), int(m.group(2))) for m in _XID_RE.finditer(text or "")]


def _pci_key(bus_id: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of "00000000:3B:00.0" (nvidia-smi), "0000:3b:00" (kernel log) or
    "0000:2F:00.0" (rocm-smi); None when it is none of these."""
    parts = (bus_id or "").strip().removeprefix("PCI:").split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        return None
    try:
        return int(parts[0], 16), int(parts[1], 16), int(parts[2].split(".")[0], 16)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# nvidia-smi -q
# ---------------------------------------------------------------------------------------------

_GPU_HEADER = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_KV = re.compile(r"^(\s*)([^:]+?)\s*:\s?(.*)$")
_UNREADABLE = re.compile(r"Unable to determine the device handle for gpu\s*([0-9A-Fa-f:.]+):\s*(.*)", re.I)
_ATTACHED = re.compile(r"^Attached GPUs\s*:\s*(\d+)", re.M)


def _int(value: str | None) -> int | None:
    """The leading integer of a value ("16x", "4", "0 us"); None for N/A and the like."""
    m = re.match(r"\s*(\d+)", value or "")
    return int(m.group(1)) if m else None


def _yes(value: str | None) -> bool | None:
    v = (value or "").strip().lower()
    return True if v == "yes" else False if v == "no" else None


def _gpu_fields(lines: list[str]) -> dict[tuple[str, ...], tuple[str, str]]:
    """One GPU block as {lower-case path: (key as printed, value)}; the path is the section
    headers above a `key : value` line (by indentation) and the key."""
    fields: dict[tuple[str, ...], tuple[str, str]] = {}
    stack: list[tuple[int, str]] = []
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        m = _KV.match(line)
        if m:
            key = m.group(2).strip()
            path = tuple(s.lower() for _, s in stack) + (key.lower(),)
            fields.setdefault(path, (key, m.group(3).strip()))
        else:
            stack.append((indent, line.strip()))
    return fields


def _sum_ints(values: list[str]) -> int | None:
    nums = [n for n in map(_int, values) if n is not None]
    return sum(nums) if nums else None


def _uncorrectable(fields: dict, scope: str) -> int | None:
    """Uncorrectable ECC errors of one scope ("volatile": since the driver loaded; "aggregate":
    the GPU's lifetime). Ampere and later print SRAM/DRAM counters ("SRAM Uncorrectable Parity",
    "SRAM Uncorrectable SEC-DED", "DRAM Uncorrectable", or "SRAM Uncorrectable" before driver 580);
    Volta and older per-memory "Double Bit" counters with a "Total". None when all are N/A."""
    base = ("ecc errors", scope)
    total = fields.get(base + ("double bit", "total"))
    if total is not None:
        return _int(total[1])
    return _sum_ints([v for p, (_, v) in fields.items()
                      if len(p) == 3 and p[:2] == base and "uncorrectable" in p[2]])


def parse_nvidia_smi_q(text: str) -> list[dict]:
    """One dict per GPU of `nvidia-smi -q`, in order (index = position, as a string):
    index, bus_id, product, ecc_mode ("Enabled"/"Disabled"/None),
    ecc_volatile_uncorrectable, ecc_aggregate_uncorrectable (int, None when N/A),
    retired_pages_sbe, retired_pages_dbe (int|None), retired_pages_pending (bool|None),
    remapped_rows_correctable, remapped_rows_uncorrectable (int|None), remapped_rows_pending,
    remapping_failure (bool|None), sram_threshold_exceeded, repair_pending (channel or TPC repair
    pending), unrepairable_memory (bool|None; driver 580's ECC fields), recovery_action (str|None),
    reset_required (bool|None: "Reset Required" or "Drain and Reset Recommended"),
    throttle_active (the active clocks event reasons, as printed), pcie_gen_current, pcie_gen_max,
    pcie_width_current, pcie_width_max (int|None), error (str|None).
    A GPU nvidia-smi could not read ("Unable to determine the device handle for GPU...") has its
    error set, or when it is not listed, is an entry with only index "" (not known), bus_id and
    error; GPUs counted in "Attached GPUs" and not listed are one more such entry, bus_id ""."""
    text = text or ""
    blocks: list[tuple[str, list[str]]] = []
    errors: list[tuple[str, str]] = []
    for line in text.splitlines():
        m = _GPU_HEADER.match(line)
        if m:
            blocks.append((m.group(1), []))
            continue
        bad = _UNREADABLE.search(line)
        if bad:
            errors.append((bad.group(1).rstrip(":"), bad.group(2).strip() or "unreadable"))
        elif blocks:
            blocks[-1][1].append(line)
    gpus: list[dict[str, Any]] = []
    for bus_id, lines in blocks:
        f = _gpu_fields(lines)

        def get(*path: str, f: dict[tuple[str, ...], tuple[str, str]] = f) -> str | None:
            hit = f.get(tuple(p.lower() for p in path))
            return hit[1] if hit else None

        throttle = [key for p, (key, v) in f.items()
                    if p[0] in ("clocks event reasons", "clocks throttle reasons") and len(p) == 2
                    and v.strip().lower() == "active"]
        pending = [v for p, (_, v) in f.items() if p[:1] == ("retired pages",) and len(p) == 2
                   and p[1].startswith("pending")]
        repair = [_yes(get("ECC Errors", k)) for k in ("Channel Repair Pending", "TPC Repair Pending")]
        reset = [_yes(get("GPU Reset Status", k)) for k in ("Reset Required", "Drain and Reset Recommended")]
        gpus.append({
            "index": str(len(gpus)),
            "bus_id": bus_id,
            "product": get("Product Name") or "",
            "ecc_mode": get("ECC Mode", "Current"),
            "ecc_volatile_uncorrectable": _uncorrectable(f, "volatile"),
            "ecc_aggregate_uncorrectable": _uncorrectable(f, "aggregate"),
            "retired_pages_sbe": _int(get("Retired Pages", "Single Bit ECC")),
            "retired_pages_dbe": _int(get("Retired Pages", "Double Bit ECC")),
            "retired_pages_pending": _yes(pending[0]) if pending else None,
            "remapped_rows_correctable": _int(get("Remapped Rows", "Correctable Error")),
            "remapped_rows_uncorrectable": _int(get("Remapped Rows", "Uncorrectable Error")),
            "remapped_rows_pending": _yes(get("Remapped Rows", "Pending")),
            "remapping_failure": _yes(get("Remapped Rows", "Remapping Failure Occurred")),
            "sram_threshold_exceeded": _yes(get("ECC Errors", "Aggregate", "SRAM Threshold Exceeded")),
            "repair_pending": True if True in repair else False if False in repair else None,
            "unrepairable_memory": _yes(get("ECC Errors", "Unrepairable Memory")),
            "recovery_action": get("GPU Recovery Action"),
            "reset_required": True if True in reset else False if False in reset else None,
            "throttle_active": throttle,
            "pcie_gen_current": _int(get("PCI", "GPU Link Info", "PCIe Generation", "Current")),
            "pcie_gen_max": _int(get("PCI", "GPU Link Info", "PCIe Generation", "Max")),
            "pcie_width_current": _int(get("PCI", "GPU Link Info", "Link Width", "Current")),
            "pcie_width_max": _int(get("PCI", "GPU Link Info", "Link Width", "Max")),
            "error": None,
        })
    listed = {_pci_key(g["bus_id"]): g for g in gpus}
    for bus_id, why in errors:
        if _pci_key(bus_id) in listed:
            listed[_pci_key(bus_id)]["error"] = why
        else:                           # not listed: its index is not known
            gpus.append({"index": "", "bus_id": bus_id, "error": why})
    attached = _ATTACHED.search(text)
    if attached and int(attached.group(1)) > len(gpus):
        gpus.append({"index": "", "bus_id": "", "error": f"nvidia-smi -q counts {attached.group(1)} "
                     f"attached and lists {len(gpus)}"})
    return gpus


def _name(g: dict) -> str:
    if g.get("index"):
        return f"GPU {g['index']} ({g.get('bus_id') or 'bus unknown'})"
    return f"GPU at {g['bus_id']}" if g.get("bus_id") else "GPUs"


def _pcie_findings(g: dict, t: dict, idle: bool, dpm: bool) -> list[Finding]:
    """The link rules shared by both vendors (see judge_nvidia and judge_amd)."""
    out = []
    gpu, name = g["index"], _name(g)
    wc, wm, gc, gm = (g.get(k) for k in ("pcie_width_current", "pcie_width_max",
                                         "pcie_gen_current", "pcie_gen_max"))
    maybe = (" (the GPU is idle: links downtrain at idle, so this may be harmless)" if idle else
             " (AMD power management lowers the link when the GPU is not busy, so this may be harmless)"
             if dpm else "")
    if wc is not None and wm is not None and wc < wm:
        out.append(Finding(gpu, WARN, "PCIe link narrower than its maximum",
                           f"{name}: PCIe link x{wc}, max x{wm}{maybe if dpm else ''}"))
    if gc is not None and gm is not None and gc < gm:
        out.append(Finding(gpu, WARN, "PCIe link below its maximum generation",
                           f"{name}: PCIe gen {gc}, max gen {gm}{maybe}"))
    if t["pcie_width"] and wm is not None and wm < t["pcie_width"]:
        out.append(Finding(gpu, WARN, "PCIe link narrower than expected",
                           f"{name}: PCIe link can do at most x{wm}, x{t['pcie_width']} expected "
                           "(slot, riser or bridge)"))
    if t["pcie_gen"] and gm is not None and gm < t["pcie_gen"]:
        out.append(Finding(gpu, WARN, "PCIe link slower than expected",
                           f"{name}: PCIe link can do at most gen {gm}, gen {t['pcie_gen']} expected "
                           "(slot, riser, bridge or BIOS setting)"))
    return out


def judge_nvidia(gpus: list[dict], xid_text: str = "") -> list[Finding]:
    """Findings from parse_nvidia_smi_q's GPUs and XID_COMMAND's output, per GPU in order, with the
    thresholds of its model (thresholds_for):

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
        limit = t["max_uncorrectable_ecc"]
        vol, agg = g.get("ecc_volatile_uncorrectable"), g.get("ecc_aggregate_uncorrectable")
        if vol is not None and vol > limit:
            out.append(Finding(gpu, FAIL, "uncorrectable ECC errors",
                               f"{name}: {vol} volatile uncorrectable ECC errors"))
        elif agg is not None and agg > limit:
            out.append(Finding(gpu, WARN, "uncorrectable ECC errors in the past",
                               f"{name}: {agg} aggregate (lifetime) uncorrectable ECC errors, "
                               "none since the driver loaded"))
        pend = [what for what, v in (("page retirement pending", g.get("retired_pages_pending")),
                                     ("row remap pending", g.get("remapped_rows_pending")),
                                     ("memory repair pending", g.get("repair_pending"))) if v]
        if len(pend) > t["max_pending_rows"]:
            rows = g.get("remapped_rows_uncorrectable")
            out.append(Finding(gpu, FAIL, "pending page retirement or row remap",
                               f"{name}: {', '.join(pend)}"
                               + (f" ({rows} rows remapped for uncorrectable errors)" if rows else "")
                               + "; a GPU reset applies it"))
        for key, what in (("remapping_failure", "row remapping failed"),
                          ("unrepairable_memory", "unrepairable memory"),
                          ("sram_threshold_exceeded", "SRAM error threshold exceeded")):
            if g.get(key):
                out.append(Finding(gpu, FAIL, what, f"{name}: {what}"))
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
    by_bus = {_pci_key(g["bus_id"]): g for g in gpus if _pci_key(g.get("bus_id", ""))}
    counts: dict[tuple[str, int], int] = {}
    for bus, code in xids:
        if code not in ROUTINE_XIDS:
            counts[(bus, code)] = counts.get((bus, code), 0) + 1
    out = []
    for (bus, code), n in counts.items():
        g = by_bus.get(_pci_key(bus))
        where = _name(g) if g else f"PCI {bus} (no GPU listed there)"
        serious = code in SERIOUS_XIDS
        out.append(Finding(g["index"] if g else "", FAIL if serious else WARN,
                           f"XID {code}" + (" (serious)" if serious else ""),
                           f"{where}: XID {code} in the kernel log" + (f" ({n} times)" if n > 1 else "")))
    return out


# ---------------------------------------------------------------------------------------------
# dcgmi diag
# ---------------------------------------------------------------------------------------------

_RESULT = re.compile(r"^(Pass|Fail|Warn|Skip|Not Run)\b(?:\s*-\s*(.*))?$")
_GPU_RESULT = re.compile(r"^GPU\s*(\d+)\s*:\s*(Pass|Fail|Warn|Skip|Not Run)\b")   # DCGM 4
_MESSAGES = ("Error", "Warning", "Info")


def _scope_gpus(scope: str | None) -> list[str]:
    """"All" or nothing: [""] (every GPU); "GPUs: 0, 2, 3" / "GPU: 1": the indices."""
    m = re.match(r"GPUs?\s*:\s*([\d,\s]+)$", (scope or "").strip())
    return re.findall(r"\d+", m.group(1)) if m else [""]


def parse_dcgmi_diag(text: str) -> list[Finding]:
    """Findings from `dcgmi diag` table output (DCGMI_COMMAND): each test whose result is Fail is a
    fail, Warn a warn, one per GPU the result names ("Fail - GPU: 1", DCGM 4's "GPU0: Fail") or one
    for the host ("Fail - All", deployment tests). The detail carries the test's first Error /
    Warning / Info message. Pass, Skip and Not Run are nothing, nor are Info lines under a Pass.
    [] when everything passed, when the text is empty, or when dcgmi is absent (DCGMI_ABSENT).
    A timeout (DCGMI_TIMED_OUT) or output with no result table (dcgmi could not run): warn."""
    text = text or ""
    if DCGMI_ABSENT in text or not text.strip():
        return []
    tests: list[dict] = []
    current: dict | None = None
    message: list | None = None
    table = False
    for raw in text.splitlines():
        line = raw.strip()
        if not (line.startswith("|") and line.endswith("|")) or line.startswith("|-----"):
            continue
        cells = line[1:-1].split("|")
        if len(cells) != 2:
            continue
        name = cells[0].strip()
        # a cell is " " + text wrapped at a fixed width + "  ": keep a wrapped piece's own edge blanks
        value = cells[1][1:-2] if len(cells[1]) > 3 else cells[1]
        value_s = value.strip()
        table = True
        if name in _MESSAGES:
            message = [name, value]
            if current is not None:
                current["messages"].append(message)
            continue
        if name:
            r = _RESULT.match(value_s)
            current = None
            message = None
            if r:
                current = {"test": name, "results": [], "messages": []}
                tests.append(current)
                current["results"].append((r.group(1), _scope_gpus(r.group(2))))
            continue
        if current is None:
            continue
        r, rg = _RESULT.match(value_s), _GPU_RESULT.match(value_s)
        if rg:
            current["results"].append((rg.group(2), [rg.group(1)]))
        elif r and message is None:
            current["results"].append((r.group(1), _scope_gpus(r.group(2))))
        elif message is not None:
            message[1] += value
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
                out.append(Finding(gpu, level, f"dcgmi {t['test']} {'failed' if level == FAIL else 'warned'}",
                                   detail))
    if DCGMI_TIMED_OUT in text:
        out.append(Finding("", WARN, "dcgmi diag timed out", "dcgmi diag -r 1 did not finish"))
    elif not table:
        first = next(line.strip() for line in text.splitlines() if line.strip())
        out.append(Finding("", WARN, "dcgmi diag gave no result", f"dcgmi diag -r 1: {first[:300]}"))
    return out


# ---------------------------------------------------------------------------------------------
# rocm-smi
# ---------------------------------------------------------------------------------------------

_ROCM_LINE = re.compile(r"^GPU\[(\d+)\]\s*:\s*(.*)$")
_LINK = re.compile(r"([\d.]+)\s*GT/s,?\s*x(\d+)")
_GT_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


def _link(text: str) -> tuple[int | None, int] | None:
    m = _LINK.search(text)
    return (_GT_TO_GEN.get(float(m.group(1))), int(m.group(2))) if m else None


def parse_rocm_smi(text: str) -> list[dict]:
    """One dict per GPU of ROCM_COMMAND's text output, by rocm-smi's GPU index:
    index ("0"), bus_id, product (Card Series, with Card model), ras ({block: (status, correctable,
    uncorrectable)}, counts None where only a status is printed), ecc_uncorrectable (sum over the
    blocks, None when no block has counts), pcie_gen_current, pcie_width_current (the starred
    supported level, or "pcie clock level"), pcie_gen_max, pcie_width_max (the highest supported
    level). The RAS table's counts are taken by position, correctable then uncorrectable: that is
    the order rocm-smi's showRasInfo fills them in, while its header changed between releases."""
    gpus: dict[int, dict] = {}

    def gpu(i: int) -> dict:
        return gpus.setdefault(i, {"index": str(i), "bus_id": "", "product": "", "ras": {},
                                   "levels": [], "current": None})
    levels_of: int | None = None       # inside "Supported PCIe frequencies on GPUn"
    ras_of: int | None = None          # inside GPU n's RAS INFO table
    series: dict[int, str] = {}
    models: dict[int, str] = {}
    for raw in (text or "").splitlines():
        m = _ROCM_LINE.match(raw.strip())
        if not m:
            if ras_of is not None:
                words = raw.split()
                if not words or raw.strip()[0] in "_=-":    # the table's end, or the next section
                    ras_of = None
                elif words[0] != "Block" and re.fullmatch(r"[A-Z0-9_]+", words[0]):
                    nums = words[-2:] if len(words) >= 4 and all(w.isdigit() for w in words[-2:]) else []
                    status = " ".join(words[1:len(words) - len(nums)])
                    gpu(ras_of)["ras"][words[0]] = (
                        (status, *(int(n) for n in nums)) if nums else (status, None, None)
                    )
            continue
        i, rest = int(m.group(1)), m.group(2).strip()
        g = gpu(i)
        ras_of = i if rest == "RAS INFO" else None
        key, _, value = rest.partition(":")
        key, value = key.strip().lower(), value.strip()
        if key.startswith("supported") and "frequencies" in key:
            levels_of = i if "pcie" in key else None
            continue
        if not rest:
            levels_of = None
        elif levels_of == i and key.isdigit():
            link = _link(value)
            if link:
                g["levels"].append(link)
                if value.endswith("*"):
                    g["current"] = link
        elif key == "pcie clock level" and g["current"] is None:
            g["current"] = _link(value)
        elif key == "card series":
            series[i] = value
        elif key == "card model":
            models[i] = value
        elif key == "pci bus":
            g["bus_id"] = value
    out = []
    for i in sorted(gpus):
        g = gpus[i]
        g["product"] = " ".join(
            x for x in (series.get(i, ""), models.get(i, "")) if x and not x.startswith("0x")
        )
        counts = [ue for _, _, ue in g["ras"].values() if ue is not None]
        g["ecc_uncorrectable"] = sum(counts) if counts else None
        cur, levels = g.pop("current"), g.pop("levels")
        top = max(levels, key=lambda level: ((level[0] or 0), level[1])) if levels else None
        g["pcie_gen_current"], g["pcie_width_current"] = cur if cur else (None, None)
        g["pcie_gen_max"], g["pcie_width_max"] = top if top else (None, None)
        out.append(g)
    return out


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
            out.append(Finding(gpu, FAIL, "uncorrectable ECC errors",
                               f"{name}: {ue} uncorrectable RAS errors ({blocks})"))
        for block, (status, _, _) in g.get("ras", {}).items():
            if "UNCORRECTABLE" in status.upper():
                out.append(
                    Finding(gpu, FAIL, "uncorrectable RAS state", f"{name}: RAS block {block} {status}")
                )
        out += _pcie_findings(g, t, idle=False, dpm=True)
    return out
