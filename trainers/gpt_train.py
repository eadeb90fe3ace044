"""The GPT training loop: epochs of optimizer steps (gradient accumulation, DDP's all-reduce on the
last micro-batch), each epoch ending in an evaluation; the log lines, metrics, curves, snapshots and
in-memory state it leaves as it goes."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import snapshot
import torch
import torch.distributed as dist
import torch.nn as nn
from common import log
from gpt_config import TrainConfig, lr_at
from gpt_data import Loaders
from gpt_device import Dist, autocast_for, peak_flops
from gpt_model import GPT, ModelConfig, flops_per_token, n_params
from gpt_resume import Start, restore_rng, training_state
from gpt_timing import StepTimer, progress
from tensorboard_events import Board
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader


@dataclass
class Run:
    """What one run's loop trains, with what, and where it reports; `step` and `rng` move on as it
    goes."""

    tc: TrainConfig
    mc: ModelConfig
    d: Dist
    device: torch.device
    tag: str
    model: GPT  # the model itself: its gradients clipped, its state saved
    ddp: nn.Module  # what the steps run: the model in a DDP exactly when d.enabled
    optimizer: torch.optim.Optimizer
    data: Loaders
    writer: snapshot.Writer
    board: Board
    out: Path
    start: Start

    def __post_init__(self) -> None:
        tc, device = self.tc, self.device
        self.total_steps = self.data.steps_per_epoch * tc.epochs
        self.timer = StepTimer(self.ddp if isinstance(self.ddp, DDP) else None)
        self.autocast = autocast_for(device)
        self.metrics_path = self.out / "metrics.jsonl"
        self.tokens_per_step = tc.batch_size * tc.grad_accum * self.mc.block_size * self.d.world
        self.flops_per_token = flops_per_token(self.mc, n_params(self.model))
        # The device's peak FLOPS, where known: the MFU.
        self.peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else None)
        self.memory = self.start.memory  # fabtrain_memory, or None: the state kept every K steps
        self.step = self.start.step
        # The RNG state of the step resumed from memory, set where the next step would begin.
        self.rng = self.start.rng


def train(run: Run) -> dict:
    """Train from where the run starts to its last epoch's end: that epoch's losses and step."""
    result = {}
    clock = (time.perf_counter(), run.step)  # the run's start: progress's eta
    for epoch in range(run.start.epoch, run.tc.epochs):
        loss_sum = train_epoch(run, epoch, clock)
        if run.rng is not None:  # resumed at an epoch's last step: its eval comes next
            restore_rng(run.rng, run.device)
            run.rng = None
        val = evaluate(run.ddp, run.data.val, run.device, run.d)
        if run.d.rank == 0:
            log(f"{run.tag} epoch {epoch} done | eval loss {val:.4f} | train loss {loss_sum:.4f}")
            _append(
                run.metrics_path,
                {"kind": "eval", "epoch": epoch, "step": run.step, "loss": val, "time": time.time()},
            )
            run.board.scalars(run.step, {"eval/loss": val})
            run.board.flush()  # at every epoch's end, and before its snapshot
            run.writer.save(run.model, run.optimizer, epoch + 1, run.step)
        result = {"eval_loss": val, "train_loss": loss_sum, "step": run.step}
    return result


def train_epoch(run: Run, epoch: int, clock: tuple[float, int]) -> float:
    """The epoch's steps from where the run stands; the last step's loss (nan where none is left)."""
    tc, d = run.tc, run.d
    run.data.train_sampler.set_epoch(epoch)
    run.ddp.train()
    batches = iter(run.data.train)
    skip = run.step - epoch * run.data.steps_per_epoch  # steps of this epoch done before a mid-epoch resume
    for _ in range(max(0, skip) * tc.grad_accum):
        next(batches)
    t0, tokens = time.perf_counter(), 0
    loss_sum = float("nan")  # an epoch resumed after its last step trains none; its eval still runs
    run.timer.reset()
    for i in range(max(0, skip), run.data.steps_per_epoch):
        if run.rng is not None:  # resumed from memory: the RNG as the uninterrupted run's next step found it
            restore_rng(run.rng, run.device)
            run.rng = None
        loss_sum, lr = train_step(run, batches)
        run.step += 1
        step = run.step
        if run.memory is not None:  # kept in memory (every K steps): a restart loses at most K steps
            state = functools.partial(training_state, run.model, run.optimizer, epoch, step, run.device)
            run.memory.save(step, state)
        tokens += run.tokens_per_step
        if step % tc.log_every == 0 or step == run.total_steps:
            report_step(run, epoch, loss_sum, lr, tokens / (time.perf_counter() - t0))
        if d.rank == 0 and (step % tc.log_every == 0 or step == run.total_steps):
            progress(run.tag, epoch, tc.epochs, step, run.total_steps, *clock)
        # The epoch's last step is saved after its eval, as the next epoch's start (below): one
        # saved here too would resume into an epoch with no step left and no eval done.
        last = i == run.data.steps_per_epoch - 1
        if tc.snapshot_every and step % tc.snapshot_every == 0 and d.rank == 0 and not last:
            run.board.flush()  # a restart resumes from a snapshot: the curves up to it are on disk first
            run.writer.save(run.model, run.optimizer, epoch, step)
    return loss_sum


def train_step(run: Run, batches) -> tuple[float, float]:
    """One optimizer step over grad_accum micro-batches: their mean loss, and the step's lr."""
    tc, d, ddp = run.tc, run.d, run.ddp
    run.timer.start()
    lr = lr_at(run.step, run.total_steps, tc)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    loss_sum = 0.0
    for micro in range(tc.grad_accum):
        x, y = (t.to(run.device) for t in next(batches))
        # Gradients are all-reduced once per optimizer step, on the last micro-batch only.
        sync = micro == tc.grad_accum - 1 or not d.enabled
        ctx = ddp.no_sync() if not sync and isinstance(ddp, DDP) else _null()
        with ctx, run.autocast:
            _, loss = ddp(x, y)
            (loss / tc.grad_accum).backward()
        loss_sum += loss.item() / tc.grad_accum
    run.timer.synced()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.timer.stop(run.device)
    return loss_sum, lr


def report_step(run: Run, epoch: int, loss_sum: float, lr: float, rate: float) -> None:
    """A step's log line on every rank; on rank 0 its metrics line and curves too."""
    mfu = run.flops_per_token * rate / (run.peak * run.d.world) if run.peak else None
    log(
        f"{run.tag} epoch {epoch} | step {run.step} | loss {loss_sum:.4f} | lr {lr:.2e} "
        f"| {rate:,.0f} tok/s{run.timer.report()}{'' if mfu is None else f' | MFU {mfu:.1%}'}"
    )
    if run.d.rank == 0:
        _append(
            run.metrics_path,
            {
                "kind": "train",
                "epoch": epoch,
                "step": run.step,
                "loss": loss_sum,
                "lr": lr,
                "tokens_per_s": rate,
                "time": time.time(),
            },
        )
        curves = {"train/loss": loss_sum, "train/tokens_per_s": rate, "train/lr": lr}
        run.board.scalars(run.step, curves if mfu is None else {**curves, "train/mfu": mfu})


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, d: Dist) -> float:
    model.eval()
    total = torch.zeros(2, device=device)
    for x, y in loader:
        _, loss = model(x.to(device), y.to(device))
        total += torch.tensor([loss.item() * len(x), len(x)], device=device)
    if d.enabled:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1].clamp(min=1)).item()


def _append(path: Path, record: dict) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
