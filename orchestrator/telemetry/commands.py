"""A host's telemetry as one POSIX sh script: its GPUs (NVIDIA or AMD), the kernel's XID lines, our
containers' CPU and memory, and the host's load and memory, each section after a marker line
(SECTIONS) so that telemetry/samples.parse_sample reads them apart. Pure: the text only; the
caller runs it over SSH with its own deadline, and every tool in it is bounded here too (a hung
nvidia-smi or Docker engine costs TOOL_TIMEOUT, not the caller's whole deadline), as is the whole
output (OUTPUT_MAX bytes)."""

from __future__ import annotations

from orchestrator.config.inventory import Inventory
from orchestrator.hostcmds.dockerargs import label_filter
from orchestrator.hostcmds.sshargs import shell

# The marker line before each section's output (parse_sample splits on these).
NVIDIA, XID, AMD, AMD_LIST, ROCM, CONTAINERS, HOST = (
    "nvidia",
    "xid",
    "amd",
    "amd-list",
    "rocm",
    "containers",
    "host",
)
SECTIONS = (NVIDIA, XID, AMD, AMD_LIST, ROCM, CONTAINERS, HOST)
MARK = "== "

# Seconds each tool may take on the host (then SIGTERM, SIGKILL 2 s later); the kernel log's reader
# XID_TIMEOUT. At worst one sample takes 3 tools' and 2 readers' time, under the callers' deadlines
# (the sampler's 20 s, fab top's).
TOOL_TIMEOUT = 4
XID_TIMEOUT = 2
OUTPUT_MAX = 256 * 1024  # bytes of the whole script's output kept on the host
XID_LINES = 50  # the newest kernel XID lines sent
CONTAINERS_MAX = 64  # containers whose stats are read (docker stats takes them all at once)

# The fields of `nvidia-smi --query-gpu`, in the order parse_sample reads them. Units are left out
# (nounits): memory in MiB, power in W, temperature in C, utilization in %. The clocks reasons as
# NVML's bitmask: `clocks_throttle_reasons.active` is the name every driver knows; drivers from 535
# on call it clocks_event_reasons and still answer to the old name (recorded on driver 580 in
# tests/unit/recorded/nvidia-h100/nvidia-smi.txt: both queries print the same line).
NVIDIA_FIELDS = (
    "index",
    "uuid",
    "pci.bus_id",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "power.draw",
    "temperature.gpu",
    "clocks_throttle_reasons.active",
    "ecc.errors.uncorrected.volatile.total",
)
NVIDIA_QUERY = ["nvidia-smi", f"--query-gpu={','.join(NVIDIA_FIELDS)}", "--format=csv,noheader,nounits"]
# AMD: amd-smi (ROCm 6 on) where it is installed: usage, power, temperature, ECC and VRAM of every
# GPU as JSON (only these: the whole `metric` reads clocks, PCIe, fans... and takes seconds on an
# 8-GPU host; a guest VM's amd-smi has no --ecc and refuses the narrow form, so the whole one is the
# fallback), and `list` for each GPU's PCI address and UUID; else the older rocm-smi, asked for what
# top and the sampler show (--showmeminfo vram for bytes: --showmemuse gives a percentage only).
AMD_METRIC = ["amd-smi", "metric", "--usage", "--power", "--temperature", "--ecc", "--mem-usage", "--json"]
AMD_METRIC_ALL = ["amd-smi", "metric", "--json"]
AMD_LIST_ARGV = ["amd-smi", "list", "--json"]
ROCM_QUERY = [
    "rocm-smi",
    "--showuse",
    "--showmemuse",
    "--showmeminfo",
    "vram",
    "--showpower",
    "--showtemp",
    "--showbus",
    "--json",
]
# The kernel's XID lines of this boot: dmesg, or where it is not permitted (kernel.dmesg_restrict) or
# absent, the journal's kernel messages; neither needs a terminal. Nothing when neither can be read.
XID_SOURCE = (
    f"{{ timeout -k 1 {XID_TIMEOUT} dmesg 2>/dev/null || "
    f"timeout -k 1 {XID_TIMEOUT} journalctl -k -b -q --no-pager 2>/dev/null; }}"
)


def _bounded(argv: list[str]) -> str:
    """argv under GNU timeout, its stderr with its stdout (a tool's complaint is one line of its
    section, which the parser counts as an error)."""
    return f"timeout -k 2 {TOOL_TIMEOUT} {shell(argv)} 2>&1"


def _mark(section: str) -> str:
    return f"echo {shell([MARK + section])}"


def telemetry_script(inv: Inventory, job_id: str | None) -> str:
    """One sample of a host (see the module's docstring). `job_id`: that job's containers only;
    None: every container fabtrain manages there. `inv` is the inventory the containers were
    started with (their labels are the project's, whatever the host)."""
    del inv  # the same script serves every host: what a host has is found on the host
    # docker stats takes no label filter: the ids come from docker ps (running ones), and with none
    # xargs -r runs nothing (docker stats with no id would list every container of the host).
    ids = shell(["docker", "ps", "--quiet", *label_filter(job_id)])
    stats = shell(["docker", "stats", "--no-stream", "--format", "{{json .}}"])
    # A vendor's section is there only where its tool is: no section, no such GPUs (vendor "none").
    parts = [
        f"if command -v nvidia-smi >/dev/null 2>&1; then {_mark(NVIDIA)}; {_bounded(NVIDIA_QUERY)}; "
        f"{_mark(XID)}; {XID_SOURCE} | grep -F 'NVRM: Xid' | tail -n {XID_LINES}; fi",
        f"if command -v amd-smi >/dev/null 2>&1; then {_mark(AMD)}; "
        f"timeout -k 2 {TOOL_TIMEOUT} {shell(AMD_METRIC)} 2>/dev/null || {_bounded(AMD_METRIC_ALL)}; "
        f"{_mark(AMD_LIST)}; {_bounded(AMD_LIST_ARGV)}; "
        f"elif command -v rocm-smi >/dev/null 2>&1; then {_mark(ROCM)}; {_bounded(ROCM_QUERY)}; fi",
        _mark(CONTAINERS),
        f"timeout -k 2 {TOOL_TIMEOUT} {ids} 2>/dev/null | head -n {CONTAINERS_MAX} | "
        f"xargs -r timeout -k 2 {TOOL_TIMEOUT} {stats} 2>&1",
        _mark(HOST),
        "head -n 1 /proc/loadavg; grep -E '^(MemTotal|MemAvailable):' /proc/meminfo; nproc",
    ]
    return "{ " + "; ".join(parts) + "; } 2>&1 | head -c " + str(OUTPUT_MAX)
