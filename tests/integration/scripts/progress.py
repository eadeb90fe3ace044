"""A user-style script for the hang watchdog: it prints step lines, then either
- `--mode chatty`: a thread keeps printing while every rank is stuck in a collective (the last
  rank sleeps); the watchdog must see no progress, whatever the output;
- `--mode quiet-phase`: a long silent phase (longer than the hang timeout) during which it touches
  its heartbeat file ($FABTRAIN_HEARTBEAT) every second, then more steps and a normal end.
"""
import argparse
import datetime
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["chatty", "quiet-phase"], required=True)
p.add_argument("--quiet", type=float, default=20.0)
a = p.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1)
for step in range(1, 4):
    dist.all_reduce(t)
    print(f"rank {rank} step {step}", flush=True)
if a.mode == "chatty":
    def chatter() -> None:
        while True:
            print(f"rank {rank}: waiting for data...", flush=True)
            time.sleep(0.3)
    threading.Thread(target=chatter, daemon=True).start()
    if rank == world - 1:
        time.sleep(3600)
    dist.all_reduce(t)
else:
    beat = Path(os.environ["FABTRAIN_HEARTBEAT"])
    end = time.monotonic() + a.quiet
    while time.monotonic() < end:  # e.g. a long evaluation: no output, but alive
        beat.touch()
        time.sleep(1)
    for step in range(4, 6):
        dist.all_reduce(t)
        print(f"rank {rank} step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
