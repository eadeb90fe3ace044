"""Where a restarted GPT run goes on from: the newest state held in memory (a warm restart,
fabtrain_memory) or else the newest snapshot on disk, and the state a rank keeps in memory as it
trains (model, optimizer, data position and RNG)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import snapshot
import torch
import torch.nn as nn
from common import log, memory_state


def set_memory_every(every: int | None) -> None:
    """--memory-every, for fabtrain_memory, which reads it at its first use (resume, below)."""
    if every is not None:
        if every < 0:
            raise SystemExit(f"--memory-every {every}: a number of steps, 0 or more")
        os.environ["FABTRAIN_MEMORY_EVERY"] = str(every)


@dataclass
class Start:
    """Where the run begins: a fresh one at epoch 0, step 0; a resumed one where its state was."""

    epoch: int = 0
    step: int = 0
    rng: dict | None = (
        None  # the RNG state of the step resumed from memory, set where the next step would begin
    )
    memory: Any = None  # fabtrain_memory where it is present: the state kept in memory as the run goes


def resume(
    model: nn.Module, optimizer: torch.optim.Optimizer, snap_dir: Path, device: torch.device, tag: str
) -> Start:
    """Load the state to go on from into the model and the optimizer (before DDP wraps the model)."""
    # Every rank starts from the same state: rank 0's newest snapshot, sent over when a node's disk
    # lacks it. A newer step held in memory (a warm restart: fabtrain_memory) wins over it.
    snap = snapshot.load_agreed(snap_dir, map_location=device)
    start = Start(memory=memory_state())
    memory = start.memory
    held = memory.load(disk_step=snap["step"] if snap else None) if memory is not None else None
    if held is not None:
        model.load_state_dict(held["model"])
        optimizer.load_state_dict(held["optimizer"])
        start.epoch, start.step, start.rng = held["epoch"], held["step"], held["rng"]
        log(f"{tag} resumed from memory (epoch {start.epoch}, step {start.step})")
    elif snap is not None:
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        start.epoch, start.step = snap["epoch"], snap["step"]
        log(f"{tag} resumed from {snap['path']} (epoch {start.epoch}, step {start.step})")
    return start


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, step: int, device: torch.device
) -> dict:
    """All a rank needs to go on exactly from `step`: the data position is (epoch, step)."""
    rng = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "rng": rng,
    }


def restore_rng(rng: dict, device: torch.device) -> None:
    """Set a resumed step's RNG state (training_state), where the uninterrupted run's next step (or
    eval) began."""
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"], device)
