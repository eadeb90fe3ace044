"""How a GPT run trains: its hyperparameters (TrainConfig) and the rules derived from them, the
learning-rate schedule and the global batch a restart on another number of ranks keeps."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass
class TrainConfig:
    batch_size: int = 16
    grad_accum: int = 8
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    weight_decay: float = 0.1
    epochs: int = 5
    max_steps_per_epoch: int = 0  # 0: a full pass over the data
    snapshot_every: int = 200
    log_every: int = 10
    seed: int = 1337


def lr_at(step: int, total: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, total - tc.warmup_steps))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


def keep_global_batch(tc: TrainConfig, world: int, env) -> tuple[TrainConfig, str | None]:
    """A job restarted on another number of ranks (fab train --min-nodes) keeps its global batch
    G = batch x accum x world (sequences per optimizer step), the rule README states:
    - exactly, when G divides by the new world: each rank takes G / world sequences a step, as the
      fewest micro-batches (accum) no larger than the planned micro-batch (memory holds);
    - otherwise the nearest G the new world allows (round(G / world) per rank), with a warning.
    With the same G, an epoch keeps its steps and the learning-rate schedule its length, and a
    resumed epoch skips exactly the sequences already trained on (DistributedSampler hands rank r
    every world-th index of one permutation, so the first k sequences of every rank are the first
    k x world of the epoch). FABTRAIN_TARGET_NODES is the node count the job was planned for."""
    nodes = int(env.get("FABTRAIN_TARGET_NODES") or 0)
    target = nodes * int(env.get("LOCAL_WORLD_SIZE") or 1)
    if not nodes or target == world:
        return tc, None
    planned = tc.batch_size * tc.grad_accum * target
    per_rank = max(1, round(planned / world))
    accum = next(a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= tc.batch_size)
    got = per_rank * world
    change = (
        f"world {world} instead of {target}: batch {tc.batch_size} x accum {tc.grad_accum} -> "
        f"{per_rank // accum} x {accum}"
    )
    note = (
        f"{change} keeps the global batch of {planned} sequences"
        if got == planned
        else f"WARNING: {change} gives {got} sequences a step, the nearest to the planned {planned} that "
        f"{world} ranks allow: steps per epoch and the learning-rate schedule change accordingly"
    )
    return dataclasses.replace(tc, batch_size=per_rank // accum, grad_accum=accum), note
