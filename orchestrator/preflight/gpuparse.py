"""Pure parsers of what the GPU tools print on a host, for gpuhealth (which holds the commands and
judges what is read here): `nvidia-smi -q`, the kernel log's XID lines, `dcgmi diag`'s result table
and `rocm-smi`. Every parser is tested on outputs recorded on real machines
(tests/unit/test_gpuhealth.py says where each is from)."""

from __future__ import annotations

import re
from typing import Any

from orchestrator.telemetry import samples

# ---------------------------------------------------------------------------------------------
# XID
# ---------------------------------------------------------------------------------------------


def parse_xid(text: str) -> list[tuple[str, int]]:
    """(PCI bus id, XID code) of each XID line, in order, repeats kept (telemetry/samples.py reads
    them, for the deep check and the job's telemetry alike). The bus id as the kernel prints it,
    lower case, without "PCI:": "0000:3b:00" (domain:bus:device)."""
    return [(bus, code) for bus, code in samples.parse_xid(text)]


def pci_key(bus_id: str) -> tuple[int, int, int] | None:
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
    return _sum_ints(
        [v for p, (_, v) in fields.items() if len(p) == 3 and p[:2] == base and "uncorrectable" in p[2]]
    )


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
    blocks, errors = _nvidia_blocks(text)
    gpus: list[dict[str, Any]] = [
        _nvidia_gpu(str(i), bus_id, _gpu_fields(lines)) for i, (bus_id, lines) in enumerate(blocks)
    ]
    listed = {pci_key(g["bus_id"]): g for g in gpus}
    for bus_id, why in errors:
        if pci_key(bus_id) in listed:
            listed[pci_key(bus_id)]["error"] = why
        else:  # not listed: its index is not known
            gpus.append({"index": "", "bus_id": bus_id, "error": why})
    attached = _ATTACHED.search(text)
    if attached and int(attached.group(1)) > len(gpus):
        gpus.append(
            {
                "index": "",
                "bus_id": "",
                "error": f"nvidia-smi -q counts {attached.group(1)} attached and lists {len(gpus)}",
            }
        )
    return gpus


def _nvidia_blocks(text: str) -> tuple[list[tuple[str, list[str]]], list[tuple[str, str]]]:
    """`nvidia-smi -q` cut into GPU blocks, (bus id, the block's lines), and the GPUs it could not
    read, (bus id, why)."""
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
    return blocks, errors


def _nvidia_gpu(index: str, bus_id: str, f: dict[tuple[str, ...], tuple[str, str]]) -> dict[str, Any]:
    """One GPU of parse_nvidia_smi_q from its block's fields (_gpu_fields), error None."""

    def get(*path: str) -> str | None:
        hit = f.get(tuple(p.lower() for p in path))
        return hit[1] if hit else None

    throttle = [
        key
        for p, (key, v) in f.items()
        if p[0] in ("clocks event reasons", "clocks throttle reasons")
        and len(p) == 2
        and v.strip().lower() == "active"
    ]
    pending = [
        v
        for p, (_, v) in f.items()
        if p[:1] == ("retired pages",) and len(p) == 2 and p[1].startswith("pending")
    ]
    repair = [_yes(get("ECC Errors", k)) for k in ("Channel Repair Pending", "TPC Repair Pending")]
    reset = [_yes(get("GPU Reset Status", k)) for k in ("Reset Required", "Drain and Reset Recommended")]
    return {
        "index": index,
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
    }


# ---------------------------------------------------------------------------------------------
# dcgmi diag
# ---------------------------------------------------------------------------------------------

_RESULT = re.compile(r"^(Pass|Fail|Warn|Skip|Not Run)\b(?:\s*-\s*(.*))?$")
_GPU_RESULT = re.compile(r"^GPU\s*(\d+)\s*:\s*(Pass|Fail|Warn|Skip|Not Run)\b")  # DCGM 4
_MESSAGES = ("Error", "Warning", "Info")


def _scope_gpus(scope: str | None) -> list[str]:
    """ "All" or nothing: [""] (every GPU); "GPUs: 0, 2, 3" / "GPU: 1": the indices."""
    m = re.match(r"GPUs?\s*:\s*([\d,\s]+)$", (scope or "").strip())
    return re.findall(r"\d+", m.group(1)) if m else [""]


def read_dcgmi_tests(text: str) -> tuple[list[dict], bool]:
    """The tests of `dcgmi diag` table output, each {"test", "results": [(result, the GPU indices
    it names, or [""] for all)], "messages": [[kind, text]]}, and whether any table row was read."""
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
    return tests, table


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
    """One dict per GPU of gpucommands.ROCM_COMMAND's text output, by rocm-smi's GPU index:
    index ("0"), bus_id, product (Card Series, with Card model), ras ({block: (status, correctable,
    uncorrectable)}, counts None where only a status is printed), ecc_uncorrectable (sum over the
    blocks, None when no block has counts), pcie_gen_current, pcie_width_current (the starred
    supported level, or "pcie clock level"), pcie_gen_max, pcie_width_max (the highest supported
    level). The RAS table's counts are taken by position, correctable then uncorrectable: that is
    the order rocm-smi's showRasInfo fills them in, while its header changed between releases."""
    gpus: dict[int, dict] = {}

    def gpu(i: int) -> dict:
        return gpus.setdefault(
            i, {"index": str(i), "bus_id": "", "product": "", "ras": {}, "levels": [], "current": None}
        )

    levels_of: int | None = None  # inside "Supported PCIe frequencies on GPUn"
    ras_of: int | None = None  # inside GPU n's RAS INFO table
    series: dict[int, str] = {}
    models: dict[int, str] = {}
    for raw in (text or "").splitlines():
        m = _ROCM_LINE.match(raw.strip())
        if not m:
            if ras_of is not None and not _ras_row(raw, gpu(ras_of)["ras"]):
                ras_of = None
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
    return [_rocm_gpu(gpus[i], series.get(i, ""), models.get(i, "")) for i in sorted(gpus)]


def _ras_row(raw: str, ras: dict) -> bool:
    """One line of a GPU's RAS INFO table: a block's row put into `ras` ({block: (status,
    correctable, uncorrectable)}), the header or anything else skipped; False at the table's end
    (a blank line, or the next section's rule)."""
    words = raw.split()
    if not words or raw.strip()[0] in "_=-":  # the table's end, or the next section
        return False
    if words[0] != "Block" and re.fullmatch(r"[A-Z0-9_]+", words[0]):
        nums = words[-2:] if len(words) >= 4 and all(w.isdigit() for w in words[-2:]) else []
        status = " ".join(words[1 : len(words) - len(nums)])
        ras[words[0]] = (status, *(int(n) for n in nums)) if nums else (status, None, None)
    return True


def _rocm_gpu(g: dict, series: str, model: str) -> dict:
    """A GPU of parse_rocm_smi as read (its "levels" and "current" PCIe links) made final: its
    product, the sum of its uncorrectable RAS errors, its current and its highest PCIe link."""
    g["product"] = " ".join(x for x in (series, model) if x and not x.startswith("0x"))
    counts = [ue for _, _, ue in g["ras"].values() if ue is not None]
    g["ecc_uncorrectable"] = sum(counts) if counts else None
    cur, levels = g.pop("current"), g.pop("levels")
    top = max(levels, key=lambda level: ((level[0] or 0), level[1])) if levels else None
    g["pcie_gen_current"], g["pcie_width_current"] = cur if cur else (None, None)
    g["pcie_gen_max"], g["pcie_width_max"] = top if top else (None, None)
    return g
