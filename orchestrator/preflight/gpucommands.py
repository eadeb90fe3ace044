"""The commands that read a GPU host's health for the deep check (preflight/deepphases.py runs
them, gpuparse reads what they print, gpuhealth judges it): `nvidia-smi -q`, the kernel log's XID
lines and `dcgmi diag -r 1` on NVIDIA hosts, `rocm-smi` on AMD hosts."""

from __future__ import annotations

from orchestrator.telemetry.commands import XID_SOURCE

# The full text query. `-d` is not used: no -d section holds the product name or the PCI block
# (link generation and width), which this check needs; a recorded `-q -d ECC,PAGE_RETIREMENT,
# ROW_REMAPPER,PERFORMANCE,...` on an H100 (tests/unit/recorded/nvidia-h100/nvidia-smi.txt) has
# neither. Without -i every GPU is listed, in nvidia-smi's index order, so a GPU's position in the
# output is its index.
NVIDIA_COMMAND = ["nvidia-smi", "-q"]

# Kernel log lines with NVIDIA XID errors since boot: dmesg, or where it is not permitted
# (kernel.dmesg_restrict) or absent, the kernel messages of this boot from the journal. Prints
# nothing when there are none or neither can be read; always exits 0.
XID_COMMAND = f"{XID_SOURCE} | grep -F 'NVRM: Xid' || true"  # the telemetry's reader, bounded

DCGMI_ABSENT = "gpuhealth: dcgmi absent"
DCGMI_TIMED_OUT = "gpuhealth: dcgmi timed out"
# `dcgmi diag -r 1` (the quick level: deployment checks, seconds) only where dcgmi is installed;
# else a marker line. Bounded below deepphases.py's 300 s so that a hung diag reports itself.
DCGMI_COMMAND = (
    "if command -v dcgmi >/dev/null 2>&1; then timeout 240 dcgmi diag -r 1 2>&1; "
    f"[ $? -eq 124 ] && echo '{DCGMI_TIMED_OUT}'; "
    f"else echo '{DCGMI_ABSENT}'; fi; true"
)

# rocm-smi's text output, one run: --showproductname (model, for gpuhealth.THRESHOLDS), --showbus (PCI
# address), --showclocks (the current PCIe level, "pcie clock level: 1 (16.0GT/s x16)"),
# --showclkfrq (the supported PCIe levels, current one starred; the highest is the link's maximum)
# and --showrasinfo all (per-block RAS state and correctable/uncorrectable error counts; "all"
# because older rocm-smi shows no block without it). Not --json: --showrasinfo prints nothing in
# JSON ("WARNING: No JSON data to report", ROCm/legacy-rocm-build#4374). Not --showpcibandwidth: it
# estimates traffic, it does not give the link state. rocm-smi is deprecated for amd-smi, which
# AMD hosts may have instead; this reads rocm-smi only.
ROCM_COMMAND = [
    "rocm-smi",
    "--showproductname",
    "--showbus",
    "--showclocks",
    "--showclkfrq",
    "--showrasinfo",
    "all",
]
