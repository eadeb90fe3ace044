"""A user-style script that hangs: the last rank sleeps while the others wait in all_reduce, with a
collective timeout of an hour, so nothing inside the job ever gives up (hang watchdog tests)."""
import datetime
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
rank, world = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} of {world} ready", flush=True)
t = torch.ones(1)
if rank == world - 1:
    time.sleep(3600)
dist.all_reduce(t)
print("never reached", flush=True)
