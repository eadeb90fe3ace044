"""Collective smoke test: an all_reduce across every rank, with the measured bus bandwidth.

Bus bandwidth follows nccl-tests: for all_reduce, busbw = algbw x 2(n-1)/n.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish_distributed, log, pg_timeout  # noqa: E402

MB = int(os.environ.get("FABTRAIN_SMOKE_MB", 8))
ITERS = int(os.environ.get("FABTRAIN_SMOKE_ITERS", 5))

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
dist.init_process_group("nccl" if cuda else "gloo", timeout=pg_timeout())
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda") if cuda else torch.device("cpu")
check = torch.full((1,), float(rank + 1), device=device)
dist.all_reduce(check)
want = world * (world + 1) / 2
if check.item() != want:
    log(f"SMOKE wrong sum on rank {rank}: {check.item()} != {want}")
    sys.exit(2)
x = torch.ones(MB * 1024 * 1024 // 4, device=device)
dist.all_reduce(x)  # warm-up
if cuda:
    torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(ITERS):
    dist.all_reduce(x)
if cuda:
    torch.cuda.synchronize()
dt = (time.perf_counter() - t0) / ITERS
busbw = MB / dt * 2 * (world - 1) / max(world, 1)
if int(os.environ.get("LOCAL_RANK", 0)) == 0:
    log(
        f"SMOKE ok backend={dist.get_backend()} world={world} size={MB}MB time={dt * 1000:.1f}ms "
        f"busbw={busbw:.1f} MB/s"
    )
finish_distributed(hard_exit=True)
