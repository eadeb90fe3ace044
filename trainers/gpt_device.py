"""Where a GPT rank runs: its place in the job (Dist, from the torchrun environment), its device and
process group, and what that device can do (bf16 autocast, peak FLOPS for the MFU)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from common import pg_timeout


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    node: str = socket.gethostname()

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init_distributed() -> tuple[Dist, torch.device]:
    env = os.environ
    d = Dist(
        int(env.get("RANK", 0)),
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("WORLD_SIZE", 1)),
        env.get("FABTRAIN_NODE") or socket.gethostname(),
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(d.local_rank)
        device = torch.device("cuda", d.local_rank)
    else:
        device = torch.device("cpu")
    if d.enabled:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=pg_timeout())
    return d, device


# Dense bf16 peak per device, TFLOPS, by the exact name torch.cuda.get_device_name() reports (vendor
# datasheets, no sparsity). One MI250X package is two devices (GCDs), so its entry is half the
# package's 383. V100 and older have no bf16 units: no entry, no MFU (and no bf16, see use_bf16).
# FABTRAIN_PEAK_TFLOPS overrides, for any device.
PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100": 989.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA A10": 125.0,
    "NVIDIA GeForce RTX 4090": 165.0,
    "AMD Instinct MI300X": 1307.0,
    "AMD Instinct MI250X": 191.5,
    "AMD Instinct MI250X / MI250": 191.5,
}


def peak_flops(device_name: str | None) -> float | None:
    if os.environ.get("FABTRAIN_PEAK_TFLOPS"):
        return float(os.environ["FABTRAIN_PEAK_TFLOPS"]) * 1e12
    peak = PEAK_TFLOPS.get((device_name or "").strip())
    return peak * 1e12 if peak else None


def use_bf16(device: torch.device) -> bool:
    """bf16 autocast only where the GPU has bf16 units (compute capability 8.0 or newer; ROCm
    reports its gfx9 devices as 9.x): V100 would emulate it, slower than float32."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def autocast_for(device: torch.device) -> torch.autocast:
    """The context the forward and backward passes run in: bf16 where use_bf16, else float32."""
    return (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if use_bf16(device)
        else torch.autocast(device.type, enabled=False)
    )
