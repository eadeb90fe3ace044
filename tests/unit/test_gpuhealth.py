"""orchestrator.preflight.gpuhealth: the parsers and the judgement, on outputs recorded on real machines.

Every sample below is a real output, trimmed to the lines that matter (whole sections or lines left
out, none reworded; trailing blanks dropped), with a comment naming where it was recorded. Where no
real unhealthy output was to be found, one is DERIVED from a real healthy one by changing numbers or
words, in code (derive(), which checks that each change applies exactly where meant), and the
comment says so. The shell commands run here with stub tools on PATH (no GPU, no root needed)."""

import subprocess
from pathlib import Path

from orchestrator.preflight import gpuhealth
from orchestrator.preflight.gpucommands import (
    DCGMI_ABSENT,
    DCGMI_COMMAND,
    NVIDIA_COMMAND,
    ROCM_COMMAND,
    XID_COMMAND,
)
from orchestrator.preflight.gpuhealth import (
    THRESHOLDS,
    Finding,
    judge_amd,
    judge_nvidia,
    parse_dcgmi_diag,
    thresholds_for,
)
from orchestrator.preflight.gpuparse import parse_nvidia_smi_q, parse_rocm_smi, parse_xid

RECORDED = Path(__file__).parent / "recorded" / "nvidia-h100"


def recorded(path: Path, command: str) -> str:
    """One command's output from a recording made by record.sh ("===== COMMAND =====" ... "----- exit")."""
    text = path.read_text()
    start = text.index(f"===== {command} =====\n") + len(f"===== {command} =====\n")
    return text[start : text.index("----- exit status", start)]


def derive(text: str, *changes: tuple[str, str]) -> str:
    """A real output with some values changed: each `old` must occur exactly once."""
    for old, new in changes:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def q(indent: int, key: str, value: str) -> str:
    """One line of `nvidia-smi -q` as driver 580 aligns it (the colon at column 55)."""
    return f"{' ' * indent}{key:<{55 - indent}}: {value}\n"


def levels(found: list[Finding]) -> list[tuple[str, str, str]]:
    return [(f.gpu, f.level, f.what) for f in found]


# --- nvidia-smi -q ---------------------------------------------------------------------------

# This repository's own recording: `nvidia-smi -q` on one H100 80GB HBM3 (driver 580.159.04),
# tests/unit/recorded/nvidia-h100/nvidia-smi.txt (README.md there), read whole.
H100 = recorded(RECORDED / "nvidia-smi.txt", "nvidia-smi -q")

# Two of the eight GPUs of an RTX 4090 host (driver 535.154.05), leptonai/gpud
# pkg/nvidia-query/testdata/nvidia-smi-query.535.154.05.out.1.valid (commit 4446606e), trimmed to
# the GPU headers and the Product Name, GPU Reset Status, PCI (link), Clocks Event Reasons, ECC
# and row remapper sections; its "Attached GPUs : 8" line left out with the other six GPUs. GPU 0
# is idle with its link at gen 1 of 4; GPU 1 is busy, at its power cap.
RTX4090 = """\
==============NVSMI LOG==============
Driver Version                            : 535.154.05
GPU 00000000:01:00.0
    Product Name                          : NVIDIA GeForce RTX 4090
    GPU Reset Status
        Reset Required                    : No
        Drain and Reset Recommended       : N/A
    PCI
        Bus Id                            : 00000000:01:00.0
        GPU Link Info
            PCIe Generation
                Max                       : 4
                Current                   : 1
                Device Current            : 1
                Device Max                : 4
                Host Max                  : 4
            Link Width
                Max                       : 16x
                Current                   : 16x
    Clocks Event Reasons
        Idle                              : Active
        Applications Clocks Setting       : Not Active
        SW Power Cap                      : Not Active
        HW Slowdown                       : Not Active
            HW Thermal Slowdown           : Not Active
            HW Power Brake Slowdown       : Not Active
        Sync Boost                        : Not Active
        SW Thermal Slowdown               : Not Active
        Display Clock Setting             : Not Active
    ECC Mode
        Current                           : Disabled
        Pending                           : Disabled
    ECC Errors
        Volatile
            SRAM Correctable              : N/A
            SRAM Uncorrectable            : N/A
            DRAM Correctable              : N/A
            DRAM Uncorrectable            : N/A
        Aggregate
            SRAM Correctable              : N/A
            SRAM Uncorrectable            : N/A
            DRAM Correctable              : N/A
            DRAM Uncorrectable            : N/A
    Retired Pages
        Single Bit ECC                    : N/A
        Double Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 0
        Pending                           : No
        Remapping Failure Occurred        : No
GPU 00000000:23:00.0
    Product Name                          : NVIDIA GeForce RTX 4090
    GPU Reset Status
        Reset Required                    : No
        Drain and Reset Recommended       : N/A
    PCI
        Bus Id                            : 00000000:23:00.0
        GPU Link Info
            PCIe Generation
                Max                       : 4
                Current                   : 4
                Device Current            : 4
                Device Max                : 4
                Host Max                  : 4
            Link Width
                Max                       : 16x
                Current                   : 16x
    Clocks Event Reasons
        Idle                              : Not Active
        Applications Clocks Setting       : Not Active
        SW Power Cap                      : Active
        HW Slowdown                       : Not Active
            HW Thermal Slowdown           : Not Active
            HW Power Brake Slowdown       : Not Active
        Sync Boost                        : Not Active
        SW Thermal Slowdown               : Not Active
        Display Clock Setting             : Not Active
    ECC Mode
        Current                           : Disabled
        Pending                           : Disabled
    ECC Errors
        Volatile
            SRAM Correctable              : N/A
            SRAM Uncorrectable            : N/A
            DRAM Correctable              : N/A
            DRAM Uncorrectable            : N/A
        Aggregate
            SRAM Correctable              : N/A
            SRAM Uncorrectable            : N/A
            DRAM Correctable              : N/A
            DRAM Uncorrectable            : N/A
    Retired Pages
        Single Bit ECC                    : N/A
        Double Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 0
        Pending                           : No
        Remapping Failure Occurred        : No
"""

# `nvidia-smi -q -i 1` on a Tesla V100-PCIE-32GB (driver 470.129.06: "Clocks Throttle Reasons",
# per-memory "Single Bit"/"Double Bit" ECC counters, retired pages), from bsyonline/hexo.post
# _posts/llm/nvidia-smi-usage.md (commit 9e4b76de), trimmed like RTX4090. With -i 1 it lists one of
# its 8 attached GPUs (NVIDIA_COMMAND has no -i).
V100 = """\
==============NVSMI LOG==============
Driver Version                            : 470.129.06
Attached GPUs                             : 8
GPU 00000000:1C:00.0
    Product Name                          : Tesla V100-PCIE-32GB
    PCI
        Bus Id                            : 00000000:1C:00.0
        GPU Link Info
            PCIe Generation
                Max                       : 3
                Current                   : 3
            Link Width
                Max                       : 16x
                Current                   : 16x
    Clocks Throttle Reasons
        Idle                              : Active
        Applications Clocks Setting       : Not Active
        SW Power Cap                      : Not Active
        HW Slowdown                       : Not Active
            HW Thermal Slowdown           : Not Active
            HW Power Brake Slowdown       : Not Active
        Sync Boost                        : Not Active
        SW Thermal Slowdown               : Not Active
        Display Clock Setting             : Not Active
    Ecc Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 0
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : N/A
                Total                     : 0
            Double Bit
                Device Memory             : 0
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : 0
                Total                     : 0
        Aggregate
            Single Bit
                Device Memory             : 3
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : N/A
                Total                     : 3
            Double Bit
                Device Memory             : 0
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : 0
                Total                     : 0
    Retired Pages
        Single Bit ECC                    : 1
        Double Bit ECC                    : 0
        Pending Page Blacklist            : No
    Remapped Rows                         : N/A
"""

# The row remapper as nvidia-smi printed it on a GPU with a pending remap, pasted in
# https://github.com/leptonai/gpud/pull/80: the values the derived H100 samples below use.
#     Remapped Rows
#         Correctable Error                 : 0
#         Uncorrectable Error               : 4
#         Pending                           : Yes


def test_recorded_h100_parses_and_is_healthy():
    [g] = parse_nvidia_smi_q(H100)
    assert g["index"] == "0" and g["bus_id"] == "00000000:00:06.0" and g["product"] == "NVIDIA H100 80GB HBM3"
    assert (g["ecc_mode"], g["ecc_volatile_uncorrectable"], g["ecc_aggregate_uncorrectable"]) == (
        "Enabled",
        0,
        0,
    )
    assert g["retired_pages_pending"] is None  # Hopper: N/A, rows are remapped instead
    assert (g["remapped_rows_uncorrectable"], g["remapped_rows_pending"]) == (0, False)
    assert g["remapping_failure"] is False
    assert (g["repair_pending"], g["unrepairable_memory"], g["sram_threshold_exceeded"]) == (
        False,
        False,
        False,
    )
    assert g["recovery_action"] == "None"
    assert g["throttle_active"] == ["Idle"]  # not the "Clocks Event Reasons Counters" below it
    assert (g["pcie_gen_current"], g["pcie_gen_max"]) == (5, 5)
    assert (g["pcie_width_current"], g["pcie_width_max"]) == (16, 16)
    assert g["error"] is None
    assert judge_nvidia([g]) == []


def test_recorded_h100_d_sections_lack_product_and_link_so_the_command_is_plain_q():
    # The same machine's `nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE,...`: no
    # product name (so no thresholds) and no PCI section (so no link check).
    assert NVIDIA_COMMAND == ["nvidia-smi", "-q"]
    d = "ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE,CLOCK,TEMPERATURE,POWER"
    [g] = parse_nvidia_smi_q(recorded(RECORDED / "nvidia-smi.txt", f"nvidia-smi -q -d {d}"))
    assert g["product"] == "" and g["pcie_width_max"] is None
    assert g["ecc_volatile_uncorrectable"] == 0 and g["throttle_active"] == ["Idle"]


def test_h100_with_errors_derived_from_the_recording():
    # DERIVED from the real H100 recording: 4 volatile DRAM uncorrectable errors, the row remapper
    # of gpud#80 (4 uncorrectable rows, pending), a thermal HW slowdown active instead of Idle, and
    # the link at x8 of x16.
    sick = derive(
        H100,
        (
            q(12, "DRAM Uncorrectable", "0") + "        Aggregate\n",
            q(12, "DRAM Uncorrectable", "4") + "        Aggregate\n",
        ),
        (
            q(8, "Uncorrectable Error", "0")
            + q(8, "Inactive Uncorrectable Error", "0")
            + q(8, "Pending", "No"),
            q(8, "Uncorrectable Error", "4")
            + q(8, "Inactive Uncorrectable Error", "0")
            + q(8, "Pending", "Yes"),
        ),
        (q(8, "Idle", "Active"), q(8, "Idle", "Not Active")),
        (
            q(8, "HW Slowdown", "Not Active") + q(12, "HW Thermal Slowdown", "Not Active"),
            q(8, "HW Slowdown", "Active") + q(12, "HW Thermal Slowdown", "Active"),
        ),
        (q(16, "Current", "16x"), q(16, "Current", "8x")),
    )
    [g] = parse_nvidia_smi_q(sick)
    assert (g["ecc_volatile_uncorrectable"], g["ecc_aggregate_uncorrectable"]) == (4, 0)
    assert g["remapped_rows_pending"] is True and g["remapped_rows_uncorrectable"] == 4
    assert g["throttle_active"] == ["HW Slowdown", "HW Thermal Slowdown"]
    found = judge_nvidia([g])
    assert levels(found) == [
        ("0", "fail", "uncorrectable ECC errors"),
        ("0", "fail", "pending page retirement or row remap"),
        ("0", "warn", "clocks slowed down"),
        ("0", "warn", "PCIe link narrower than its maximum"),
    ]
    assert found[0].detail == "GPU 0 (00000000:00:06.0): 4 volatile uncorrectable ECC errors"
    assert "row remap pending" in found[1].detail and "4 rows remapped" in found[1].detail
    assert found[2].detail.endswith("HW Slowdown, HW Thermal Slowdown active")
    assert found[3].detail == "GPU 0 (00000000:00:06.0): PCIe link x8, max x16"


def test_h100_remap_failure_and_recovery_action_derived_from_the_recording():
    # DERIVED from the real H100 recording: a failed row remapping, and a recovery action named as
    # Xid 154 names it (that nvidia-smi prints this exact wording is assumed: any value but None
    # fails). Lifetime (aggregate) uncorrectable errors without volatile ones only warn.
    sick = derive(
        H100,
        (q(8, "Remapping Failure Occurred", "No"), q(8, "Remapping Failure Occurred", "Yes")),
        (q(4, "GPU Recovery Action", "None"), q(4, "GPU Recovery Action", "Node Reboot Required")),
        (
            q(12, "DRAM Uncorrectable", "0") + q(12, "SRAM Threshold Exceeded", "No"),
            q(12, "DRAM Uncorrectable", "2") + q(12, "SRAM Threshold Exceeded", "No"),
        ),
    )
    assert levels(judge_nvidia(parse_nvidia_smi_q(sick))) == [
        ("0", "warn", "uncorrectable ECC errors in the past"),
        ("0", "fail", "row remapping failed"),
        ("0", "fail", "GPU recovery action pending"),
    ]


def test_recorded_4090s_idle_link_downtrain_warns_and_power_cap_is_no_problem():
    gpus = parse_nvidia_smi_q(RTX4090)
    assert [(g["index"], g["bus_id"]) for g in gpus] == [("0", "00000000:01:00.0"), ("1", "00000000:23:00.0")]
    assert [g["ecc_volatile_uncorrectable"] for g in gpus] == [None, None]  # ECC disabled: N/A
    assert [g["reset_required"] for g in gpus] == [False, False]
    assert [g["throttle_active"] for g in gpus] == [["Idle"], ["SW Power Cap"]]
    assert [(g["pcie_gen_current"], g["pcie_gen_max"]) for g in gpus] == [(1, 4), (4, 4)]
    [f] = judge_nvidia(gpus)
    assert (f.gpu, f.level, f.what) == ("0", "warn", "PCIe link below its maximum generation")
    assert f.detail == (
        "GPU 0 (00000000:01:00.0): PCIe gen 1, max gen 4 (the GPU is idle: links downtrain "
        "at idle, so this may be harmless)"
    )


def test_recorded_v100_legacy_counters_and_the_attached_count():
    gpus = parse_nvidia_smi_q(V100)
    g = gpus[0]
    assert (g["bus_id"], g["product"], g["ecc_mode"]) == (
        "00000000:1C:00.0",
        "Tesla V100-PCIE-32GB",
        "Enabled",
    )
    assert (g["ecc_volatile_uncorrectable"], g["ecc_aggregate_uncorrectable"]) == (0, 0)  # Double Bit totals
    assert (g["retired_pages_sbe"], g["retired_pages_dbe"], g["retired_pages_pending"]) == (1, 0, False)
    assert g["remapped_rows_pending"] is None and g["throttle_active"] == ["Idle"]
    assert (g["pcie_gen_max"], g["pcie_width_max"]) == (3, 16)
    # -i 1 listed 1 of "Attached GPUs : 8": were it NVIDIA_COMMAND's output, 7 GPUs would be missing
    assert gpus[1] == {"index": "", "bus_id": "", "error": "nvidia-smi -q counts 8 attached and lists 1"}
    [f] = judge_nvidia(gpus)
    assert (f.gpu, f.level, f.detail) == ("", "fail", "GPUs: nvidia-smi -q counts 8 attached and lists 1")
    assert judge_nvidia(gpus[:1]) == []


def test_v100_double_bit_errors_and_pending_retirement_derived():
    # DERIVED from the real V100 sample: 2 volatile double-bit errors in device memory, a page
    # pending retirement.
    sick = derive(
        V100,
        (
            "            Double Bit\n"
            "                Device Memory             : 0\n"
            "                Register File             : 0\n"
            "                L1 Cache                  : 0\n"
            "                L2 Cache                  : 0\n"
            "                Texture Memory            : N/A\n"
            "                Texture Shared            : N/A\n"
            "                CBU                       : 0\n"
            "                Total                     : 0\n"
            "        Aggregate\n",
            "            Double Bit\n"
            "                Device Memory             : 2\n"
            "                Register File             : 0\n"
            "                L1 Cache                  : 0\n"
            "                L2 Cache                  : 0\n"
            "                Texture Memory            : N/A\n"
            "                Texture Shared            : N/A\n"
            "                CBU                       : 0\n"
            "                Total                     : 2\n"
            "        Aggregate\n",
        ),
        (
            "        Pending Page Blacklist            : No\n",
            "        Pending Page Blacklist            : Yes\n",
        ),
    )
    [g] = parse_nvidia_smi_q(sick)[:1]
    assert g["ecc_volatile_uncorrectable"] == 2 and g["retired_pages_pending"] is True
    assert levels(judge_nvidia([g])) == [
        ("0", "fail", "uncorrectable ECC errors"),
        ("0", "fail", "pending page retirement or row remap"),
    ]


def test_recorded_unreadable_gpu_and_no_gpus_fail():
    # `nvidia-smi` on a GPU that stopped answering, https://github.com/rwth-i6/returnn/issues/1486
    # (plain nvidia-smi; that -q prints the same line is assumed, it comes from the same NVML call).
    gpus = parse_nvidia_smi_q("Unable to determine the device handle for GPU0000:03:00.0: Unknown Error\n")
    assert gpus == [{"index": "", "bus_id": "0000:03:00.0", "error": "Unknown Error"}]
    [f] = judge_nvidia(gpus)
    assert (f.gpu, f.level, f.what, f.detail) == (
        "",
        "fail",
        "GPU not readable",
        "GPU at 0000:03:00.0: Unknown Error",
    )
    assert levels(judge_nvidia(parse_nvidia_smi_q(""))) == [("", "fail", "no GPUs read")]


def test_thresholds_come_from_the_one_table(monkeypatch):
    assert thresholds_for("NVIDIA H100 80GB HBM3")["pcie_gen"] == 5
    assert thresholds_for("NVIDIA A100-SXM4-80GB")["pcie_gen"] == 4  # "A100", not "A10"
    assert thresholds_for("NVIDIA A10G")["pcie_gen"] == 4
    assert thresholds_for("AMD Instinct MI300X VF")["pcie_gen"] == 5
    assert thresholds_for("AMD Instinct MI250X / MI250")["pcie_gen"] == 4
    assert thresholds_for("NVIDIA GeForce RTX 4090") == THRESHOLDS["default"]
    assert thresholds_for("Tesla V100-PCIE-32GB")["max_uncorrectable_ecc"] == 0  # from default
    # the rules read the table: allow 10 uncorrectable errors and a pending remap on H100s, make
    # SW Power Cap a failure on 4090s (DERIVED H100 sample: 4 volatile errors, a remap pending)
    monkeypatch.setitem(
        THRESHOLDS, "H100", {**THRESHOLDS["H100"], "max_uncorrectable_ecc": 10, "max_pending_rows": 1}
    )
    monkeypatch.setitem(THRESHOLDS, "4090", {"throttle_fail": ("SW Power Cap",)})
    sick = derive(
        H100,
        (
            q(12, "DRAM Uncorrectable", "0") + "        Aggregate\n",
            q(12, "DRAM Uncorrectable", "4") + "        Aggregate\n",
        ),
        (q(8, "Pending", "No"), q(8, "Pending", "Yes")),
    )
    assert judge_nvidia(parse_nvidia_smi_q(sick)) == []
    assert ("1", "fail", "clocks slowed down") in levels(judge_nvidia(parse_nvidia_smi_q(RTX4090)))


# --- XID -------------------------------------------------------------------------------------

# https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1151 (RTX 5080, driver 610.57.04): the
# kernel log around an Xid 79, as pasted.
XID_79 = """\
NVRM: GPU at PCI:0000:01:00: GPU-5f7a9ad6-8a58-1f45-473a-76281b72153c
NVRM: GPU Board Serial Number: 0
NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.
NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.
NVRM: krcRcAndNotifyAllChannels_IMPL: RC all channels for critical error 79.
NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (PF FLR)
"""

# https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1150: journal kernel lines, Xid 45 after
# NVLink Xids 149 and 145 on four GPUs (first seven lines of the paste).
XID_45 = """\
kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149
kernel: NVRM: Xid (PCI:0000:ed:00): 45, pid=1818992, name=python3, Ch 0000000c caused by previous Xid 145
kernel: NVRM: Xid (PCI:0000:ba:00): 45, pid=1818989, name=python3, Ch 00000002 caused by previous Xid 145
kernel: NVRM: Xid (PCI:0000:97:00): 45, pid=1818987, name=python3, Ch 00000003 caused by previous Xid 145
kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000002 caused by previous Xid 149
kernel: NVRM: Xid (PCI:0000:ba:00): 45, pid=1818989, name=python3, Ch 00000003 caused by previous Xid 145
kernel: NVRM: Xid (PCI:0000:ed:00): 45, pid=1818992, name=python3, Ch 00000001 caused by previous Xid 145
"""

# https://github.com/leptonai/gpud/pull/46: `dmesg --ctime` lines (without the "> " the PR quotes them with).
XID_13 = """\
[Fri Aug 30 11:11:22 2024] nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, skipping further processing
[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter
[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Global Exception on (GPC 7, TPC 7, SM 0): Multiple Warp Errors
[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception: ESR 0x57c730=0xc04000b 0x57c734=0x24 0x57c728=0x1f81fb60 0x57c72c=0x1174
[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005
"""

# NVIDIA's A100 memory error management guide, "Uncorrectable ECC Errors XID Log Examples"
# (https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/user-visible-statistics.html): a contained
# ECC error with MIG enabled; and https://github.com/leptonai/gpud/pull/1174: NVLink Xids on a
# GB200 (PCI domains 0018 and 0019).
XID_MIG_AND_DOMAINS = """\
NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No
NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)
NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)
"""


def test_parse_xid_on_recorded_lines():
    assert parse_xid(XID_79) == [("0000:01:00", 79), ("0000:01:00", 154)]
    assert parse_xid(XID_45)[:2] == [("0000:dc:00", 45), ("0000:ed:00", 45)] and len(parse_xid(XID_45)) == 7
    assert parse_xid(XID_13) == [("0000:cb:00", 13)] * 3 + [("0000:cb:00", 109)]
    assert parse_xid(XID_MIG_AND_DOMAINS) == [("0000:01:00", 94), ("0019:01:00", 149), ("0018:01:00", 145)]
    # the H100 recording's `dmesg | grep -i xid` printed nothing: no XIDs
    assert recorded(RECORDED / "host.txt", "dmesg 2>&1 | grep -i xid | tail") == ""
    assert parse_xid("") == []


def test_xids_are_matched_to_gpus_by_bus_and_judged_by_code():
    # The 4090 host (GPU 0 at 00000000:01:00.0) with the Xid 79 log of another machine whose GPU
    # was at 0000:01:00, and the Xid 13s at cb:00, where this host has no GPU.
    gpus = parse_nvidia_smi_q(RTX4090)
    found = [f for f in judge_nvidia(gpus, XID_79 + XID_13) if f.what.startswith("XID")]
    assert levels(found) == [
        ("0", "fail", "XID 79 (serious)"),
        ("0", "fail", "XID 154 (serious)"),
        ("", "warn", "XID 13"),
        ("", "warn", "XID 109"),
    ]
    assert found[0].detail == "GPU 0 (00000000:01:00.0): XID 79 in the kernel log"
    assert found[2].detail == "PCI 0000:cb:00 (no GPU listed there): XID 13 in the kernel log (3 times)"
    assert {48, 63, 64, 74, 79, 92, 94, 95, 119, 120} <= gpuhealth.SERIOUS_XIDS
    assert 13 not in gpuhealth.SERIOUS_XIDS and 45 not in gpuhealth.SERIOUS_XIDS
    # Xid 45 follows every killed job: the recorded 45s (after NVLink Xids 149/145 not in that
    # excerpt) are not findings themselves.
    assert [f for f in judge_nvidia(gpus, XID_45) if f.what.startswith("XID")] == []


def stub(tmp_path: Path, name: str, script: str) -> None:
    (tmp_path / name).write_text("#!/bin/sh\n" + script)
    (tmp_path / name).chmod(0o755)


def run_sh(command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, env={"PATH": f"{tmp_path}:/usr/bin:/bin"}
    )


def test_xid_command_reads_dmesg_else_the_journal_and_never_fails(tmp_path):
    (tmp_path / "log").write_text(XID_13)
    stub(tmp_path, "dmesg", f"cat {tmp_path}/log\n")
    stub(tmp_path, "journalctl", "echo journal should not be read; exit 1\n")
    r = run_sh(XID_COMMAND, tmp_path)
    assert r.returncode == 0 and parse_xid(r.stdout) == parse_xid(XID_13) and "peermem" not in r.stdout
    # dmesg not permitted (kernel.dmesg_restrict): the journal's kernel messages of this boot
    (tmp_path / "log").write_text(XID_45)
    stub(tmp_path, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1\n")
    stub(tmp_path, "journalctl", f'[ "$*" = "-k -b -q --no-pager" ] && cat {tmp_path}/log\n')
    r = run_sh(XID_COMMAND, tmp_path)
    assert r.returncode == 0 and len(parse_xid(r.stdout)) == 7
    # neither readable, or nothing found: empty, exit 0
    stub(tmp_path, "journalctl", "exit 1\n")
    r = run_sh(XID_COMMAND, tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


# --- dcgmi diag ------------------------------------------------------------------------------

# brunopistone/sagemaker-training-jobs-cluster-health-check README.md (commit daabee2e), its
# example of a run on two ml.g5.12xlarge (4 x A10G, DCGM 3.3.9): the raw `dcgmi diag -r 1` and
# `-r 3` outputs it recorded for its nodes (JSON-unescaped): all passed at level 1, and at level 3
# on one node all passed, on the other Targeted Power failed on GPU 1.
DCGM_R1_PASS = """\
Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Metadata  ----------+------------------------------------------------|
| DCGM Version              | 3.3.9                                          |
| Driver Version Detected   | 570.195.03                                     |
| GPU Device IDs Detected   | 2237,2237,2237,2237                            |
|-----  Deployment  --------+------------------------------------------------|
| Denylist                  | Pass                                           |
| NVML Library              | Pass                                           |
| CUDA Main Library         | Pass                                           |
| Permissions and OS Blocks | Pass                                           |
| Persistence Mode          | Pass                                           |
| Environment Variables     | Pass                                           |
| Page Retirement/Row Remap | Pass                                           |
| Graphics Processes        | Pass                                           |
| Inforom                   | Pass                                           |
+---------------------------+------------------------------------------------+
"""

DCGM_R3_PASS = """\
Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Metadata  ----------+------------------------------------------------|
| DCGM Version              | 3.3.9                                          |
| Driver Version Detected   | 570.195.03                                     |
| GPU Device IDs Detected   | 2237,2237,2237,2237                            |
|-----  Deployment  --------+------------------------------------------------|
| Denylist                  | Pass                                           |
| NVML Library              | Pass                                           |
| CUDA Main Library         | Pass                                           |
| Permissions and OS Blocks | Pass                                           |
| Persistence Mode          | Pass                                           |
| Environment Variables     | Pass                                           |
| Page Retirement/Row Remap | Pass                                           |
| Graphics Processes        | Pass                                           |
| Inforom                   | Pass                                           |
+-----  Integration  -------+------------------------------------------------+
| PCIe                      | Pass - All                                     |
+-----  Hardware  ----------+------------------------------------------------+
| GPU Memory                | Pass - All                                     |
| Diagnostic                | Pass - All                                     |
+-----  Stress  ------------+------------------------------------------------+
| Targeted Stress           | Pass - All                                     |
| Targeted Power            | Pass - All                                     |
| Memory Bandwidth          | Pass - All                                     |
| EUD Test                  | Skip - All                                     |
+---------------------------+------------------------------------------------+
"""

DCGM_R3_POWER_FAIL = """\
Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Metadata  ----------+------------------------------------------------|
| DCGM Version              | 3.3.9                                          |
| Driver Version Detected   | 570.195.03                                     |
| GPU Device IDs Detected   | 2237,2237,2237,2237                            |
|-----  Deployment  --------+------------------------------------------------|
| Denylist                  | Pass                                           |
| NVML Library              | Pass                                           |
| CUDA Main Library         | Pass                                           |
| Permissions and OS Blocks | Pass                                           |
| Persistence Mode          | Pass                                           |
| Environment Variables     | Pass                                           |
| Page Retirement/Row Remap | Pass                                           |
| Graphics Processes        | Pass                                           |
| Inforom                   | Pass                                           |
+-----  Integration  -------+------------------------------------------------+
| PCIe                      | Pass - All                                     |
+-----  Hardware  ----------+------------------------------------------------+
| GPU Memory                | Pass - All                                     |
| Diagnostic                | Pass - All                                     |
+-----  Stress  ------------+------------------------------------------------+
| Targeted Stress           | Pass - All                                     |
| Targeted Power            | Pass - GPUs: 0, 2, 3                           |
|                           | Fail - GPU: 1                                  |
| Warning                   | GPU 1 Max power of 224.1 did not reach desire  |
|                           | d power minimum target_power_min_ratio of 224  |
|                           | .2 for GPU 1 Verify that the clock speeds and  |
|                           |  GPU utilization are high.                     |
| Info                      | GPU 0 GPU 0 max power: 299.5 W average power   |
|                           | usage: 299.0 W                                 |
| Info                      | GPU 2 GPU 2 max power: 227.0 W average power   |
|                           | usage: 224.0 W                                 |
| Info                      | GPU 3 GPU 3 max power: 225.6 W average power   |
|                           | usage: 223.9 W                                 |
| Memory Bandwidth          | Pass - All                                     |
| EUD Test                  | Skip - All                                     |
+---------------------------+------------------------------------------------+
"""

# https://github.com/NVIDIA/nccl-tests/issues/264: `dcgmi diag --run 3 --fail-early` on 8 x H100
# (DCGM 3.3.8) whose fabric manager was not running: GPU Memory failed on all GPUs. Trimmed: the
# same Warning for GPUs 2 to 7 left out.
DCGM_CUDA_FAIL = """\
Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Metadata  ----------+------------------------------------------------|
| DCGM Version              | 3.3.8                                          |
| Driver Version Detected   | 560.35.03                                      |
| GPU Device IDs Detected   | 2330,2330,2330,2330,2330,2330,2330,2330        |
|-----  Deployment  --------+------------------------------------------------|
| Denylist                  | Pass                                           |
| NVML Library              | Pass                                           |
| CUDA Main Library         | Pass                                           |
| Permissions and OS Blocks | Pass                                           |
| Persistence Mode          | Pass                                           |
| Info                      | Persistence mode for GPU 0 is disabled. Enabl  |
|                           | e persistence mode by running "nvidia-smi -i   |
|                           | <gpuId> -pm 1 " as root.,Persistence mode for  |
|                           |  GPU 1 is disabled. Enable persistence mode b  |
|                           | y running "nvidia-smi -i <gpuId> -pm 1 " as r  |
|                           | oot.,Persistence mode for GPU 2 is disabled.   |
|                           | Enable persistence mode by running "nvidia-sm  |
|                           | i -i <gpuId> -pm 1 " as root.,Persistence mod  |
|                           | e for GPU 3 is disabled. Enable persistence m  |
|                           | ode by running "nvidia-smi -i <gpuId> -pm 1 "  |
|                           |  as root.,Persistence mode for GPU 4 is disab  |
|                           | led. Enable pers                               |
| Environment Variables     | Pass                                           |
| Page Retirement/Row Remap | Pass                                           |
| Graphics Processes        | Pass                                           |
| Inforom                   | Pass                                           |
+-----  Integration  -------+------------------------------------------------+
| PCIe                      | Skip - All                                     |
+-----  Hardware  ----------+------------------------------------------------+
| GPU Memory                | Fail - All                                     |
| Warning                   | GPU 0 Error using CUDA API cuInit Check DCGM   |
|                           | and system logs for errors. Reset GPU. Restar  |
|                           | t DCGM. Rerun diagnostics. Unable to initiali  |
|                           | ze CUDA library: 'system not yet initialized'  |
|                           | . . Please check if a CUDA sample program can  |
|                           |  be run successfully on this host. Refer to h  |
|                           | ttps://github.com/nvidia/cuda-samples          |
| Warning                   | GPU 1 Error using CUDA API cuInit Check DCGM   |
|                           | and system logs for errors. Reset GPU. Restar  |
|                           | t DCGM. Rerun diagnostics. Unable to initiali  |
|                           | ze CUDA library: 'system not yet initialized'  |
|                           | . . Please check if a CUDA sample program can  |
|                           |  be run successfully on this host. Refer to h  |
|                           | ttps://github.com/nvidia/cuda-samples          |
+-----  Stress  ------------+------------------------------------------------+
| Memory Bandwidth          | Skip - All                                     |
| EUD Test                  | Skip - All                                     |
+---------------------------+------------------------------------------------+
"""

# https://github.com/NVIDIA/DCGM/issues/124: `dcgmi diag -r 2 -i 0` with DCGM 4.4.2 (A10G), whose
# table gives each GPU's result on its own line.
DCGM4_PASS = """\
Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Metadata  ----------+------------------------------------------------|
| DCGM Version              | 4.4.2                                          |
| Driver Version Detected   | 580.105.08                                     |
| GPU Device IDs Detected   | 2237                                           |
|-----  Deployment  --------+------------------------------------------------|
| software                  | Pass                                           |
|                           | GPU0: Pass                                     |
+-----  Hardware  ----------+------------------------------------------------+
| memory                    | Pass                                           |
|                           | GPU0: Pass                                     |
+-----  Integration  -------+------------------------------------------------+
| pcie                      | Pass                                           |
|                           | GPU0: Pass                                     |
+---------------------------+------------------------------------------------+
"""


def test_recorded_passing_diags_find_nothing():
    assert parse_dcgmi_diag(DCGM_R1_PASS) == []
    assert parse_dcgmi_diag(DCGM_R3_PASS) == []  # "EUD Test | Skip - All" is no problem
    assert parse_dcgmi_diag(DCGM4_PASS) == []


def test_recorded_failure_on_one_gpu_is_that_gpus():
    [f] = parse_dcgmi_diag(DCGM_R3_POWER_FAIL)
    assert (f.gpu, f.level, f.what) == ("1", "fail", "dcgmi Targeted Power failed")
    assert f.detail == (
        "dcgmi diag: Targeted Power: Fail on GPU 1: GPU 1 Max power of 224.1 did not reach "
        "desired power minimum target_power_min_ratio of 224.2 for GPU 1 Verify that the clock "
        "speeds and GPU utilization are high."
    )


def test_recorded_failure_on_all_gpus_is_the_hosts_and_info_under_a_pass_is_nothing():
    [f] = parse_dcgmi_diag(DCGM_CUDA_FAIL)
    assert (f.gpu, f.level, f.what) == ("", "fail", "dcgmi GPU Memory failed")
    assert f.detail.startswith(
        "dcgmi diag: GPU Memory: Fail: GPU 0 Error using CUDA API cuInit Check DCGM and "
        "system logs for errors. Reset GPU. Restart DCGM. Rerun diagnostics. Unable to "
        "initialize CUDA library: 'system not yet initialized'"
    )
    assert f.detail.endswith("(+1 more)")


def test_dcgm4_per_gpu_failure_and_a_warning_derived():
    # DERIVED from the real DCGM 4.4.2 output: memory failed on GPU0, pcie warned.
    sick = derive(
        DCGM4_PASS,
        (
            "| memory                    | Pass                                           |\n"
            "|                           | GPU0: Pass                                     |\n",
            "| memory                    | Fail                                           |\n"
            "|                           | GPU0: Fail                                     |\n",
        ),
        (
            "| pcie                      | Pass                                           |\n",
            "| pcie                      | Warn                                           |\n",
        ),
    )
    assert levels(parse_dcgmi_diag(sick)) == [
        ("0", "fail", "dcgmi memory failed"),
        ("", "warn", "dcgmi pcie warned"),
    ]


def test_dcgmi_command_absent_timed_out_or_not_running(tmp_path):
    r = run_sh(DCGMI_COMMAND, tmp_path)  # no dcgmi on this PATH
    assert (r.returncode, r.stdout) == (0, DCGMI_ABSENT + "\n") and parse_dcgmi_diag(r.stdout) == []
    (tmp_path / "out").write_text(DCGM_R1_PASS)
    stub(tmp_path, "dcgmi", f'[ "$*" = "diag -r 1" ] && cat {tmp_path}/out\n')
    r = run_sh(DCGMI_COMMAND, tmp_path)
    assert r.returncode == 0 and r.stdout == DCGM_R1_PASS and parse_dcgmi_diag(r.stdout) == []
    stub(tmp_path, "dcgmi", "exit 124\n")  # as when timeout killed it
    r = run_sh(DCGMI_COMMAND, tmp_path)
    assert r.returncode == 0 and levels(parse_dcgmi_diag(r.stdout)) == [("", "warn", "dcgmi diag timed out")]
    # No table at all (dcgmi could not run). The message is dcgmi's connection error as its
    # source prints it (NVIDIA/DCGM dcgmi/Command.cpp, "Error: Unable to connect to host engine. "
    # + the error string): a composed line, not a recording.
    [f] = parse_dcgmi_diag(
        "Error: Unable to connect to host engine. Host engine connection invalid/disconnected.\n"
    )
    assert (f.gpu, f.level, f.what) == ("", "warn", "dcgmi diag gave no result")
    assert parse_dcgmi_diag("") == []


# --- rocm-smi --------------------------------------------------------------------------------

# `sudo rocm-smi --showrasinfo` on 4 x Instinct MI50 (gfx906), from
# https://arkprojects.space/wiki/AMD_GFX906/perf-tuning (mixa3607, "Last updated on May 13, 2026");
# the author cut it after GPU[1]'s header ("...").
MI50_RAS = """\
========================= ROCm System Management Interface =========================
===================================== RAS Info =====================================

GPU[0]:         RAS INFO
         Block       Status    Correctable Error  Uncorrectable Error
           UMC        ENABLED                  0                    0
          SDMA        ENABLED                  0                    0
           GFX        ENABLED                  0                    0
         MMHUB        ENABLED                  0                    0
         ATHUB        ENABLED
      PCIE_BIF        ENABLED                  0                    0
           HDP        ENABLED                  0                    0
     XGMI_WAFL       DISABLED
            DF        ENABLED
           SMN        ENABLED
           SEM        ENABLED
           MP0        ENABLED
           MP1        ENABLED
          FUSE        ENABLED
____________________________________________________________________________________

GPU[1]:         RAS INFO
...
"""

# `rocm-smi -a` on a Radeon RX 6900 XT (driver 5.17.0), https://github.com/ROCm/ROCm/issues/1715,
# trimmed to the current clocks' PCIe line, the supported PCIe levels, the PCI bus, the product and
# the RAS line (RAS unsupported on this card).
RX6900XT = """\
========================== Current clock frequencies ===========================
GPU[0]\t\t: dcefclk clock level: 1: (960Mhz)
GPU[0]\t\t: pcie clock level: 1 (16.0GT/s x16)
========================= Supported clock frequencies ==========================
GPU[0]\t\t: Supported dcefclk frequencies on GPU0
GPU[0]\t\t: 0: 417Mhz
GPU[0]\t\t: 1: 960Mhz *
GPU[0]\t\t: 2: 1200Mhz
GPU[0]\t\t: \n\
GPU[0]\t\t: Supported PCIe frequencies on GPU0
GPU[0]\t\t: 0: 2.5GT/s x1
GPU[0]\t\t: 1: 16.0GT/s x16 *
GPU[0]\t\t: \n\
--------------------------------------------------------------------------------
================================== PCI Bus ID ==================================
GPU[0]\t\t: PCI Bus: 0000:2F:00.0
================================= Product Info =================================
GPU[0]\t\t: Card series: \t\tNavi 21 [Radeon RX 6800/6800 XT / 6900 XT]
GPU[0]\t\t: Card model: \t\tRadeon RX 6900 XT
GPU[0]\t\t: Card vendor: \t\tAdvanced Micro Devices, Inc. [AMD/ATI]
GPU[0]\t\t: Card SKU: \t\tD41201
================================== Pages Info ==================================
ERROR: 2 GPU[0]: ras: RSMI_STATUS_NOT_SUPPORTED: This function is not supported in the current environment.\t
"""

# `rocm-smi -a` on two Radeon RX Vega 56/64 on x1 risers (ROCm 4.5.2), https://github.com/ROCm/ROCm/issues/1746,
# trimmed like RX6900XT; the paste's blank line after every line kept.
VEGA_X1 = """\
========================== Current clock frequencies ===========================
GPU[0]\t\t: pcie clock level: 1 (5.0GT/s x1)

GPU[1]\t\t: dcefclk clock level: 0: (600Mhz)

GPU[1]\t\t: pcie clock level: 1 (5.0GT/s x1)

========================= Supported clock frequencies ==========================
GPU[0]\t\t: Supported PCIe frequencies on GPU0

GPU[0]\t\t: 0: 5.0GT/s x1

GPU[0]\t\t: 1: 5.0GT/s x1 *

GPU[0]\t\t: \n\

--------------------------------------------------------------------------------
GPU[1]\t\t: Supported dcefclk frequencies on GPU1

GPU[1]\t\t: 0: 600Mhz *

GPU[1]\t\t: \n\

GPU[1]\t\t: Supported PCIe frequencies on GPU1

GPU[1]\t\t: 0: 5.0GT/s x1

GPU[1]\t\t: 1: 5.0GT/s x1 *

GPU[1]\t\t: \n\

================================== PCI Bus ID ==================================
GPU[0]\t\t: PCI Bus: 0000:04:00.0

GPU[1]\t\t: PCI Bus: 0000:07:00.0

================================= Product Info =================================
GPU[0]\t\t: Card series: \t\tVega 10 XL/XT [Radeon RX Vega 56/64]

GPU[0]\t\t: Card model: \t\t0xe37f

GPU[1]\t\t: Card series: \t\tVega 10 XL/XT [Radeon RX Vega 56/64]

GPU[1]\t\t: Card model: \t\t0xe37f

"""


def test_rocm_command_flags():
    assert ROCM_COMMAND == [
        "rocm-smi",
        "--showproductname",
        "--showbus",
        "--showclocks",
        "--showclkfrq",
        "--showrasinfo",
        "all",
    ]


def test_recorded_mi50_ras_table_is_healthy():
    gpus = parse_rocm_smi(MI50_RAS)
    assert [g["index"] for g in gpus] == ["0", "1"]
    ras = gpus[0]["ras"]
    assert ras["UMC"] == ("ENABLED", 0, 0) and ras["ATHUB"] == ("ENABLED", None, None)
    assert ras["XGMI_WAFL"] == ("DISABLED", None, None) and len(ras) == 14
    assert gpus[0]["ecc_uncorrectable"] == 0 and gpus[1]["ecc_uncorrectable"] is None
    assert judge_amd(gpus) == []


def test_mi50_uncorrectable_errors_derived():
    # DERIVED from the real MI50 table: 5 correctable and 2 uncorrectable errors in UMC (memory),
    # 1 uncorrectable in SDMA.
    sick = derive(
        MI50_RAS,
        (
            "           UMC        ENABLED                  0                    0\n",
            "           UMC        ENABLED                  5                    2\n",
        ),
        (
            "          SDMA        ENABLED                  0                    0\n",
            "          SDMA        ENABLED                  0                    1\n",
        ),
    )
    [g0, _] = parse_rocm_smi(sick)
    assert g0["ras"]["UMC"] == ("ENABLED", 5, 2) and g0["ecc_uncorrectable"] == 3
    [f] = judge_amd(parse_rocm_smi(sick))
    assert (f.gpu, f.level, f.what) == ("0", "fail", "uncorrectable ECC errors")
    assert f.detail == "GPU 0 (bus unknown): 3 uncorrectable RAS errors (UMC 2, SDMA 1)"


def test_recorded_rx6900xt_link_and_product():
    [g] = parse_rocm_smi(RX6900XT)
    assert g["bus_id"] == "0000:2F:00.0"
    assert g["product"] == "Navi 21 [Radeon RX 6800/6800 XT / 6900 XT] Radeon RX 6900 XT"  # series and model
    assert (g["pcie_gen_current"], g["pcie_width_current"], g["pcie_gen_max"], g["pcie_width_max"]) == (
        4,
        16,
        4,
        16,
    )
    assert g["ras"] == {} and g["ecc_uncorrectable"] is None
    assert judge_amd([g]) == []


def test_recorded_vega_on_x1_risers_warns():
    gpus = parse_rocm_smi(VEGA_X1)
    assert [(g["index"], g["bus_id"], g["product"]) for g in gpus] == [
        ("0", "0000:04:00.0", "Vega 10 XL/XT [Radeon RX Vega 56/64]"),
        ("1", "0000:07:00.0", "Vega 10 XL/XT [Radeon RX Vega 56/64]"),
    ]
    assert [
        (g["pcie_gen_current"], g["pcie_width_current"], g["pcie_gen_max"], g["pcie_width_max"]) for g in gpus
    ] == [(2, 1, 2, 1)] * 2
    found = judge_amd(gpus)
    assert levels(found) == [
        ("0", "warn", "PCIe link narrower than expected"),
        ("1", "warn", "PCIe link narrower than expected"),
    ]
    assert found[0].detail == (
        "GPU 0 (0000:04:00.0): PCIe link can do at most x1, x16 expected (slot, riser or bridge)"
    )


def test_rx6900xt_at_a_lower_level_derived_and_no_gpus():
    # DERIVED from the real RX 6900 XT output: the link at the lower supported level.
    low = derive(
        RX6900XT,
        (
            "GPU[0]\t\t: 0: 2.5GT/s x1\nGPU[0]\t\t: 1: 16.0GT/s x16 *\n",
            "GPU[0]\t\t: 0: 2.5GT/s x1 *\nGPU[0]\t\t: 1: 16.0GT/s x16\n",
        ),
    )
    found = judge_amd(parse_rocm_smi(low))
    assert levels(found) == [
        ("0", "warn", "PCIe link narrower than its maximum"),
        ("0", "warn", "PCIe link below its maximum generation"),
    ]
    assert "power management" in found[0].detail
    assert levels(judge_amd(parse_rocm_smi(""))) == [("", "warn", "no GPUs read")]
