"""Character-level GPT trained with DDP, following the torchrun contract.

Reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment (torchrun, this
project's orchestrator, or a scheduler sets them) and falls back to one process without them.
NCCL on GPUs, gloo on CPUs. Snapshots are atomic and a restarted job resumes from the newest.

    torchrun --nproc_per_node 2 trainers/gpt.py --model tiny --epochs 5

This module is the command: its presets and options, and main, which puts a run together from the
gpt_* modules (model, config, data, device, resume, train) and runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import snapshot  # noqa: E402
from common import finish_distributed, log  # noqa: E402
from gpt_config import TrainConfig, keep_global_batch  # noqa: E402
from gpt_data import Corpus, make_loaders, read_corpus  # noqa: E402
from gpt_device import Dist, init_distributed  # noqa: E402
from gpt_model import GPT, ModelConfig, n_params  # noqa: E402
from gpt_resume import resume, set_memory_every  # noqa: E402
from gpt_train import Run, train  # noqa: E402
from tensorboard_events import Board  # noqa: E402

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


def configure(
    args: argparse.Namespace, d: Dist, device: torch.device, tag: str
) -> tuple[ModelConfig, TrainConfig]:
    """The run's configuration (kept to its global batch on this world size), its seed, --exact and
    --memory-every put in force."""
    mc, tc = build_config(args, device.type == "cuda")
    tc, note = keep_global_batch(tc, d.world, os.environ)
    if note and d.rank == 0:
        log(f"{tag} {note}")
    torch.manual_seed(tc.seed)
    if args.exact:
        torch.use_deterministic_algorithms(True, warn_only=True)
    set_memory_every(args.memory_every)
    return mc, tc


def wrap_ddp(model: nn.Module, d: Dist, device: torch.device, exact: bool) -> nn.Module:
    """The model in a DDP where the job has several ranks, else the model itself."""
    # --exact: DDP rebuilds its gradient buckets after the first iteration of every start (in the
    # order the gradients became ready), so the first step after a resume would all-reduce with
    # another layout than the uninterrupted run's step there: each element's sum across ranks taken
    # in another order (ring chunks), other float rounding. With find_unused_parameters the reducer
    # never rebuilds (torch's Reducer::should_rebuild_buckets): one layout for the run's whole life.
    return (
        DDP(model, device_ids=[d.local_rank] if device.type == "cuda" else None, find_unused_parameters=exact)
        if d.enabled
        else model
    )


def prepare(
    args: argparse.Namespace,
    mc: ModelConfig,
    tc: TrainConfig,
    d: Dist,
    device: torch.device,
    tag: str,
    data: Corpus,
) -> Run:
    """The model and its optimizer from where the run goes on, its loaders, snapshots and curves."""
    model = GPT(mc).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    out = Path(args.out)
    snap_dir = out / "snapshots"
    writer = snapshot.Writer(snap_dir, keep=snapshot.keep_from_env())
    # The state is loaded before DDP wraps the model, so every rank starts from the same state.
    start = resume(model, optimizer, snap_dir, device, tag)
    ddp = wrap_ddp(model, d, device, args.exact)
    loaders = make_loaders(data, d, tc)
    if d.rank == 0:
        log(
            f"{tag} model {args.model}: {n_params(model) / 1e6:.2f}M params, layers={mc.n_layer} "
            f"embd={mc.n_embd} block={mc.block_size}; world {d.world}, batch {tc.batch_size} x accum "
            f"{tc.grad_accum} x world {d.world}; {loaders.steps_per_epoch} steps/epoch on {device.type}"
        )
        out.mkdir(parents=True, exist_ok=True)
    board = Board(out, d.rank, tag, first_step=start.step + 1)
    return Run(tc, mc, d, device, tag, model, ddp, optimizer, loaders, writer, board, out, start)


def sample(model: GPT, data: Corpus, n: int, device: torch.device) -> str:
    """n characters the trained model writes after a "T"."""
    model.eval()
    seed = torch.tensor([[data.stoi.get("T", 0)]], device=device)
    return "".join(data.chars[i] for i in model.generate(seed, n)[0].tolist())


def main(argv: list[str] | None = None, hard_exit: bool = False) -> dict:
    args = parse_args(argv)
    d, device = init_distributed()
    tag = f"[{d.node} rank{d.rank}]"
    mc, tc = configure(args, d, device, tag)
    data = read_corpus(args.data, mc.block_size)
    mc = dataclasses.replace(mc, vocab_size=len(data.chars))
    run = prepare(args, mc, tc, d, device, tag, data)
    result = train(run)
    run.writer.wait()
    if d.rank == 0 and args.sample_chars:
        log(f"{tag} sample: {sample(run.model, data, args.sample_chars, device)!r}")
    run.board.close()
    if d.enabled:
        finish_distributed(hard_exit)
    return result


if __name__ == "__main__":
    main(hard_exit=True)
