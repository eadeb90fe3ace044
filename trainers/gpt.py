"""Character-level GPT trained with DDP, following the torchrun contract.

Reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment (torchrun, this
project's orchestrator, or a scheduler sets them) and falls back to one process without them.
NCCL on GPUs, gloo on CPUs. Snapshots are atomic and a restarted job resumes from the newest.

    torchrun --nproc_per_node 2 trainers/gpt.py --model tiny --epochs 5
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
import snapshot  # noqa: E402
from common import finish_distributed, log, memory_state, pg_timeout  # noqa: E402
from tensorboard_events import Board  # noqa: E402


@dataclass
class ModelConfig:
    vocab_size: int = 0
    block_size: int = 256
    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 720
    dropout: float = 0.0


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


# GPU presets (effective batch 256 sequences over 2 nodes: batch x accum x world). On a CPU the
# same architecture is shrunk (CPU_SCALE) so the local 2-host demo finishes in minutes.
PRESETS = {
    "tiny": (ModelConfig(n_layer=8, n_head=8, n_embd=720), TrainConfig(batch_size=16, grad_accum=8)),
    "small": (ModelConfig(n_layer=12, n_head=14, n_embd=896), TrainConfig(batch_size=8, grad_accum=16)),
    "medium": (ModelConfig(n_layer=24, n_head=16, n_embd=1088), TrainConfig(batch_size=4, grad_accum=32)),
}
# Keyword overrides of each preset's (ModelConfig, TrainConfig), for dataclasses.replace.
CPU_SCALE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tiny": (
        dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
        dict(batch_size=16, grad_accum=1, lr=3e-3, min_lr=3e-4, warmup_steps=20),
    ),
    "small": (
        dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
        dict(batch_size=8, grad_accum=2, lr=2e-3, min_lr=2e-4, warmup_steps=20),
    ),
    "medium": (
        dict(n_layer=6, n_head=6, n_embd=192, block_size=128),
        dict(batch_size=4, grad_accum=4, lr=1e-3, min_lr=1e-4, warmup_steps=20),
    ),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tok.weight = self.head.weight  # weight tying
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = (
            None
            if targets is None
            else F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        )
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n: int, temperature: float = 0.8) -> torch.Tensor:
        for _ in range(n):
            logits, _ = self(idx[:, -self.cfg.block_size :])
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1)], dim=1)
        return idx


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig, params: int) -> float:
    """Training FLOPs per token (forward + backward), as in the PaLM paper: 6N + 12 L d T."""
    return 6 * params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


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


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of block_size + 1 characters (input and shifted target)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block = data, block_size

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block : i * self.block + self.block + 1]
        return chunk[:-1], chunk[1:]


def lr_at(step: int, total: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, total - tc.warmup_steps))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


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


def build_config(args: argparse.Namespace, on_gpu: bool) -> tuple[ModelConfig, TrainConfig]:
    preset_mc, preset_tc = PRESETS[args.model]
    mc, tc = dataclasses.replace(preset_mc), dataclasses.replace(preset_tc)
    if not on_gpu:
        m_over, t_over = CPU_SCALE[args.model]
        mc, tc = dataclasses.replace(mc, **m_over), dataclasses.replace(tc, **t_over)
    if args.config:
        import yaml

        doc = yaml.safe_load(Path(args.config).read_text()) or {}
        mc = dataclasses.replace(mc, **doc.get("model", {}))
        tc = dataclasses.replace(tc, **doc.get("train", {}))
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if getattr(args, f.name, None) is not None
    }
    return mc, dataclasses.replace(tc, **overrides)


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


def load_text(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8")
    return corpus.generate()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--config", help="YAML with 'model:' and 'train:' sections (overrides the preset)")
    p.add_argument("--data", help="a UTF-8 text file to train on (default: the generated corpus)")
    p.add_argument(
        "--out",
        default=os.environ.get("FABTRAIN_OUTPUT", "out"),
        help="directory for snapshots and metrics (fab train draws the curves from them)",
    )
    for f in dataclasses.fields(TrainConfig):
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), default=None)
    p.add_argument("--sample-chars", type=int, default=200)
    p.add_argument(
        "--memory-every",
        type=int,
        default=None,
        help="keep each rank's state in memory every K steps (0: never; default: every step "
        "that costs at most 3%% of one, measured; FABTRAIN_MEMORY_EVERY)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        default=os.environ.get("FABTRAIN_EXACT") == "1",
        help="a resumed run ends bit for bit where an uninterrupted one does: DDP's gradient "
        "buckets fixed for the run's life, deterministic algorithms (FABTRAIN_EXACT=1)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None, hard_exit: bool = False) -> dict:
    args = parse_args(argv)
    d, device = init_distributed()
    tag = f"[{d.node} rank{d.rank}]"
    mc, tc = build_config(args, device.type == "cuda")
    tc, note = keep_global_batch(tc, d.world, os.environ)
    if note and d.rank == 0:
        log(f"{tag} {note}")
    torch.manual_seed(tc.seed)
    if args.exact:
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.memory_every is not None:  # read by fabtrain_memory at its first use (below)
        if args.memory_every < 0:
            raise SystemExit(f"--memory-every {args.memory_every}: a number of steps, 0 or more")
        os.environ["FABTRAIN_MEMORY_EVERY"] = str(args.memory_every)

    text = load_text(args.data)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train_ds, val_ds = CharDataset(data[:split], mc.block_size), CharDataset(data[split:], mc.block_size)
    mc = dataclasses.replace(mc, vocab_size=len(chars))

    model = GPT(mc).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    out = Path(args.out)
    snap_dir = out / "snapshots"
    writer = snapshot.Writer(snap_dir, keep=snapshot.keep_from_env())
    start_epoch, step = 0, 0
    # The snapshot is loaded before DDP wraps the model, so every rank starts from the same state:
    # rank 0's newest, sent over when a node's disk lacks it. A newer step held in memory (a warm
    # restart: fabtrain_memory) wins over it.
    snap = snapshot.load_agreed(snap_dir, map_location=device)
    memory = memory_state()
    held = memory.load(disk_step=snap["step"] if snap else None) if memory is not None else None
    rng = None  # the RNG state of the step resumed from memory, set where the next step would begin
    if held is not None:
        model.load_state_dict(held["model"])
        optimizer.load_state_dict(held["optimizer"])
        start_epoch, step, rng = held["epoch"], held["step"], held["rng"]
        log(f"{tag} resumed from memory (epoch {start_epoch}, step {step})")
    elif snap is not None:
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        start_epoch, step = snap["epoch"], snap["step"]
        log(f"{tag} resumed from {snap['path']} (epoch {start_epoch}, step {step})")
    # --exact: DDP rebuilds its gradient buckets after the first iteration of every start (in the
    # order the gradients became ready), so the first step after a resume would all-reduce with
    # another layout than the uninterrupted run's step there: each element's sum across ranks taken
    # in another order (ring chunks), other float rounding. With find_unused_parameters the reducer
    # never rebuilds (torch's Reducer::should_rebuild_buckets): one layout for the run's whole life.
    ddp = (
        DDP(
            model,
            device_ids=[d.local_rank] if device.type == "cuda" else None,
            find_unused_parameters=args.exact,
        )
        if d.enabled
        else model
    )
    timer = StepTimer(ddp if isinstance(ddp, DDP) else None)  # a DDP exactly when d.enabled

    # A sampler yields the dataset's indices.
    train_sampler: DistributedSampler[int] = DistributedSampler(
        train_ds, num_replicas=d.world, rank=d.rank, shuffle=True, seed=tc.seed
    )
    val_sampler: DistributedSampler[int] = DistributedSampler(
        val_ds, num_replicas=d.world, rank=d.rank, shuffle=False
    )
    train_dl = DataLoader(train_ds, batch_size=tc.batch_size, sampler=train_sampler, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=tc.batch_size, sampler=val_sampler)
    steps_per_epoch = len(train_dl) // tc.grad_accum
    if tc.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, tc.max_steps_per_epoch)
    total_steps = steps_per_epoch * tc.epochs
    if d.rank == 0:
        log(
            f"{tag} model {args.model}: {n_params(model) / 1e6:.2f}M params, layers={mc.n_layer} "
            f"embd={mc.n_embd} block={mc.block_size}; world {d.world}, batch {tc.batch_size} x accum "
            f"{tc.grad_accum} x world {d.world}; {steps_per_epoch} steps/epoch on {device.type}"
        )
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if use_bf16(device)
        else torch.autocast(device.type, enabled=False)
    )
    metrics_path = out / "metrics.jsonl"
    if d.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    board = Board(out, d.rank, tag, first_step=step + 1)
    tokens_per_step = tc.batch_size * tc.grad_accum * mc.block_size * d.world
    fpt, peak = (
        flops_per_token(mc, n_params(model)),
        peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else None),
    )
    result = {}
    run_start, run_start_step = time.perf_counter(), step
    for epoch in range(start_epoch, tc.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        batches = iter(train_dl)
        skip = step - epoch * steps_per_epoch  # steps of this epoch done before a mid-epoch resume
        for _ in range(max(0, skip) * tc.grad_accum):
            next(batches)
        t0, tokens = time.perf_counter(), 0
        loss_sum = float("nan")  # an epoch resumed after its last step trains none; its eval still runs
        timer.reset()
        for i in range(max(0, skip), steps_per_epoch):
            if rng is not None:  # resumed from memory: the RNG as the uninterrupted run's next step found it
                restore_rng(rng, device)
                rng = None
            timer.start()
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, total_steps, tc)
            loss_sum = 0.0
            for micro in range(tc.grad_accum):
                x, y = (t.to(device) for t in next(batches))
                # Gradients are all-reduced once per optimizer step, on the last micro-batch only.
                sync = micro == tc.grad_accum - 1 or not d.enabled
                ctx = ddp.no_sync() if not sync and isinstance(ddp, DDP) else _null()
                with ctx, autocast:
                    _, loss = ddp(x, y)
                    (loss / tc.grad_accum).backward()
                loss_sum += loss.item() / tc.grad_accum
            timer.synced()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timer.stop(device)
            step += 1
            if memory is not None:  # kept in memory (every K steps): a restart loses at most K steps
                memory.save(step, functools.partial(training_state, model, optimizer, epoch, step, device))
            tokens += tokens_per_step
            if step % tc.log_every == 0 or step == total_steps:
                rate = tokens / (time.perf_counter() - t0)
                mfu = fpt * rate / (peak * d.world) if peak else None
                log(
                    f"{tag} epoch {epoch} | step {step} | loss {loss_sum:.4f} | lr {g['lr']:.2e} "
                    f"| {rate:,.0f} tok/s{timer.report()}{'' if mfu is None else f' | MFU {mfu:.1%}'}"
                )
                if d.rank == 0:
                    _append(
                        metrics_path,
                        {
                            "kind": "train",
                            "epoch": epoch,
                            "step": step,
                            "loss": loss_sum,
                            "lr": g["lr"],
                            "tokens_per_s": rate,
                            "time": time.time(),
                        },
                    )
                    curves = {"train/loss": loss_sum, "train/tokens_per_s": rate, "train/lr": g["lr"]}
                    board.scalars(step, curves if mfu is None else {**curves, "train/mfu": mfu})
            if d.rank == 0 and (step % tc.log_every == 0 or step == total_steps):
                progress(tag, epoch, tc.epochs, step, total_steps, run_start, run_start_step)
            # The epoch's last step is saved after its eval, as the next epoch's start (below): one
            # saved here too would resume into an epoch with no step left and no eval done.
            last = i == steps_per_epoch - 1
            if tc.snapshot_every and step % tc.snapshot_every == 0 and d.rank == 0 and not last:
                board.flush()  # a restart resumes from a snapshot: the curves up to it are on disk first
                writer.save(model, optimizer, epoch, step)
        if rng is not None:  # resumed at an epoch's last step: its eval comes next
            restore_rng(rng, device)
            rng = None
        val = evaluate(ddp, val_dl, device, d)
        if d.rank == 0:
            log(f"{tag} epoch {epoch} done | eval loss {val:.4f} | train loss {loss_sum:.4f}")
            _append(
                metrics_path, {"kind": "eval", "epoch": epoch, "step": step, "loss": val, "time": time.time()}
            )
            board.scalars(step, {"eval/loss": val})
            board.flush()  # at every epoch's end, and before its snapshot
            writer.save(model, optimizer, epoch + 1, step)
        result = {"eval_loss": val, "train_loss": loss_sum, "step": step}
    writer.wait()
    if d.rank == 0 and args.sample_chars:
        model.eval()
        seed = torch.tensor([[stoi.get("T", 0)]], device=device)
        sample = "".join(chars[i] for i in model.generate(seed, args.sample_chars)[0].tolist())
        log(f"{tag} sample: {sample!r}")
    board.close()
    if d.enabled:
        finish_distributed(hard_exit)
    return result


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


class StepTimer:
    """Each rank's own step time and compute time (the step less what it spent waiting for the
    other ranks in the gradient all-reduce): a slow rank has the largest compute time, while the
    step time is the same everywhere. DDP calls the comm hook once per gradient bucket when this
    rank's gradients are ready; the last call ends the rank's own backward work. Reported per log
    interval, as the mean of its steps."""

    def __init__(self, ddp: DDP | None) -> None:
        self.ready = 0.0
        if ddp is not None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def hook(state, bucket):
                self.ready = time.perf_counter()
                # None is the default group (torch handles it; its annotation says ProcessGroup).
                return allreduce_hook(None, bucket)  # type: ignore[arg-type]

            ddp.register_comm_hook(None, hook)
        self.reset()

    def reset(self) -> None:
        self.steps, self.step_s, self.compute_s = 0, 0.0, 0.0

    def start(self) -> None:
        self.t0 = self.ready = time.perf_counter()

    def synced(self) -> None:
        """Backward has returned: the gradients are all-reduced (or there are no peers)."""
        self.t_sync = time.perf_counter()
        if self.ready <= self.t0:  # no hook ran: nothing was waited for
            self.ready = self.t_sync

    def stop(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        self.steps += 1
        self.step_s += end - self.t0
        self.compute_s += (self.ready - self.t0) + (end - self.t_sync)

    def report(self) -> str:
        if not self.steps:
            return ""
        step_ms, compute_ms = 1000 * self.step_s / self.steps, 1000 * self.compute_s / self.steps
        text = f" | step {step_ms:.1f} ms | compute {compute_ms:.1f} ms"
        self.reset()
        return text


def progress(tag: str, epoch: int, epochs: int, step: int, total: int, t0: float, step0: int) -> None:
    """Rank 0's progress line: where the run is and how long the rest will take."""
    done = step - step0
    eta = (time.perf_counter() - t0) / max(done, 1) * (total - step)
    bar = "#" * round(20 * step / max(total, 1))
    log(
        f"{tag} progress [{bar:<20}] {100 * step / max(total, 1):5.1f}% epoch {epoch + 1}/{epochs} "
        f"step {step}/{total} eta {eta:.0f}s"
    )


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


if __name__ == "__main__":
    main(hard_exit=True)
