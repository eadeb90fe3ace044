"""Atomic training snapshots: a crash mid-write never leaves a snapshot that fails to load.

Each snapshot is written to a temporary file in the same directory, fsynced, then renamed into
place (rename is atomic within a filesystem) and the directory fsynced. Resume picks the newest
snapshot that loads.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

PREFIX = "snapshot-"


def save(directory: Path, model, optimizer, epoch: int, step: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f".{PREFIX}*.tmp"):  # left by a writer killed mid-write
        stale.unlink(missing_ok=True)
    final = directory / f"{PREFIX}{step:09d}.pt"
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def load_latest(directory: Path, map_location=None) -> dict | None:
    """The newest snapshot that loads, with its path; None when there is none."""
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob(f"{PREFIX}*.pt"), reverse=True):
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except Exception:  # noqa: BLE001 - a damaged file (e.g. copied in by hand); try the next
            continue
        state["path"] = str(path)
        return state
    return None
