"""An MLP trained with tensor parallelism x data parallelism on a 2-D DeviceMesh (dp, tp).

Each block is a column-wise parallel Linear (weights split by output features across the tp
ranks) followed by a row-wise parallel Linear (split by input features), so the only
communication inside a block is one all-reduce of the output (as in Megatron-LM). Gradients are
then averaged across the dp ranks. TP size is configurable; the world size must be divisible by it.
Runs with gloo on CPU and nccl on GPU, under torchrun, this orchestrator, or a scheduler.

    torchrun --nproc_per_node 4 trainers/mlp_tp.py --tp 2 --steps 50
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish_distributed, log, pg_timeout  # noqa: E402
from tensorboard_events import Board  # noqa: E402


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(dim, hidden), "down": nn.Linear(hidden, dim)})
            for _ in range(layers)
        )
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            b = cast(nn.ModuleDict, b)  # every block is the ModuleDict built above
            x = x + b["down"](self.act(b["up"](x)))
        return x


def tp_plan(model: MLP) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return plan


def make_mesh(world: int, tp: int, device_type: str) -> DeviceMesh:
    if tp < 1 or world % tp:
        raise SystemExit(
            f"mlp_tp: world size {world} is not divisible by --tp {tp}; "
            f"choose a tp that divides {world} (e.g. "
            f"{', '.join(str(d) for d in range(1, world + 1) if world % d == 0)})"
        )
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def shard(model: MLP, mesh: DeviceMesh) -> nn.Module:
    return parallelize_module(model, mesh["tp"], tp_plan(model))


def average_dp_grads(model: nn.Module, mesh: DeviceMesh) -> None:
    """Average every gradient over the data-parallel ranks (each holds its own TP shard)."""
    group = mesh["dp"].get_group()
    size = mesh["dp"].size()
    if size == 1:
        return
    for p in model.parameters():
        if p.grad is None:
            continue
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(local, group=group)
        local.div_(size)


def synthetic_batch(
    step: int, dp_rank: int, batch: int, dim: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable target (a fixed random linear map + tanh); each dp rank gets its own batch."""
    g = torch.Generator().manual_seed(10_000 * step + dp_rank)
    x = torch.randn(batch, dim, generator=g)
    w = torch.randn(dim, dim, generator=torch.Generator().manual_seed(7)) / dim**0.5
    return x.to(device), torch.tanh(x @ w).to(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=None, help="accepted for fab train; steps = 50 x epochs")
    p.add_argument("--model", default=None, help="accepted for fab train; ignored")
    p.add_argument(
        "--out",
        default=os.environ.get("FABTRAIN_OUTPUT", "out"),
        help="directory for the TensorBoard event files (tb/, rank 0)",
    )
    args = p.parse_args(argv)
    if args.epochs:
        args.steps = 50 * args.epochs
    return args


def join_mesh(world: int, tp: int, cuda: bool, tag: str) -> DeviceMesh:
    """Join the process group (one of its own where no launcher started this process) and build the
    (dp, tp) mesh; log this rank's place in it."""
    if world % tp:
        make_mesh(world, tp, "cpu")  # raises the explained error before any collective
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=pg_timeout())
        else:  # run alone, without a launcher: a group of one
            dist.init_process_group(
                backend, timeout=pg_timeout(), rank=0, world_size=1, init_method="tcp://127.0.0.1:29511"
            )
    mesh = make_mesh(world, tp, "cuda" if cuda else "cpu")
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    dp_group_ranks = mesh.mesh[:, tp_rank].tolist()
    tp_group_ranks = mesh.mesh[dp_rank].tolist()
    log(
        f"{tag} dp_rank {dp_rank} tp_rank {tp_rank} | mesh {mesh.mesh.tolist()} "
        f"| dp group {dp_group_ranks} | tp group {tp_group_ranks}"
    )
    return mesh


def train(
    args: argparse.Namespace, model: nn.Module, mesh: DeviceMesh, device: torch.device, rank: int, tag: str
) -> float:
    """args.steps SGD steps on each dp rank's own batches; the last step's loss, averaged over dp."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    dp_rank = mesh["dp"].get_local_rank()
    # Steps as the log lines number them, from 0: a restarted job trains again from step 0.
    board = Board(Path(args.out), rank, tag, first_step=0)
    loss_val = float("nan")
    t0, since = time.perf_counter(), 0
    for step in range(args.steps):
        x, y = synthetic_batch(step, dp_rank, args.batch, args.dim, device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        average_dp_grads(model, mesh)
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t, group=mesh["dp"].get_group())
        loss_val = t.item() / mesh["dp"].size()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            log(f"{tag} step {step} | loss {loss_val:.5f}")
            samples = (step + 1 - since) * args.batch * mesh["dp"].size()
            board.scalars(
                step,
                {
                    "train/loss": loss_val,
                    "train/lr": args.lr,
                    "train/samples_per_s": samples / (time.perf_counter() - t0),
                },
            )
            t0, since = time.perf_counter(), step + 1
    board.close()
    return loss_val


def main(argv: list[str] | None = None, hard_exit: bool = False) -> float:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    node = os.environ.get("FABTRAIN_NODE") or socket.gethostname()
    tag = f"[{node} rank{rank}]"
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = join_mesh(world, args.tp, cuda, tag)
    torch.manual_seed(0)  # identical initial weights everywhere before sharding
    device = torch.device("cuda" if cuda else "cpu")
    model = shard(MLP(args.dim, args.hidden, args.layers).to(device), mesh)
    loss_val = train(args, model, mesh, device, rank, tag)
    finish_distributed(hard_exit)
    return loss_val


if __name__ == "__main__":
    main(hard_exit=True)
