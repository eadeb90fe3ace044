"""How rank0.json and rank1.json were recorded (README.md): run under torchrun, 2 processes."""

import datetime
import os
import threading
import time

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
dist.barrier()


def dump() -> None:
    time.sleep(3)
    with open(f"rank{rank}.json", "wb") as fh:
        fh.write(c10d._dump_fr_trace_json(True, False))
    os._exit(0)


threading.Thread(target=dump, daemon=True).start()
if rank == 1:
    time.sleep(8)
else:
    dist.all_reduce(t)
