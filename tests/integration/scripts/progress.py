"""A user-style script for the hang watchdog:
- `--mode chatty`: every rank waits in all_reduce (the last one sleeps) while a logging thread on
  rank 0 prints every 2 s, before any step was printed: the watchdog must judge by where the
  ranks' main threads are, not by the output;
- `--mode quiet-phase`: a healthy job that prints nothing for a long time: first its main thread
  tokenizes (it moves), then it only sleeps while touching its heartbeat file
  ($FABTRAIN_HEARTBEAT) every second; then more steps and a normal end.
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
p.add_argument("--compute", type=float, default=25.0)
p.add_argument("--quiet", type=float, default=15.0)
a = p.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1)


def encode(text: str) -> list[int]:
    words = text.split()
    ids = [hash(w) % 50_000 for w in words]
    return [i for i in ids if i % 7]


def pairs(ids: list[int]) -> dict:
    counts: dict = {}
    for x, y in zip(ids, ids[1:], strict=False):
        counts[(x, y)] = counts.get((x, y), 0) + 1
    return counts


if a.mode == "chatty":
    def chatter() -> None:
        while True:
            print(f"rank {rank}: waiting for data...", flush=True)
            time.sleep(2)
    if rank == 0:
        threading.Thread(target=chatter, daemon=True).start()
    dist.barrier()
    print(f"rank {rank} stuck from {time.time():.3f}", flush=True)
    if rank == world - 1:
        time.sleep(3600)
    dist.all_reduce(t)
else:
    for step in range(1, 3):
        dist.all_reduce(t)
        print(f"rank {rank} step {step}", flush=True)
    end, doc = time.monotonic() + a.compute, 0
    while time.monotonic() < end:  # tokenizing a corpus: silent, but the main thread moves
        doc += 1
        pairs(encode(" ".join(f"w{doc * j % 9973}" for j in range(400))))
    beat = Path(os.environ["FABTRAIN_HEARTBEAT"])
    end = time.monotonic() + a.quiet
    while time.monotonic() < end:  # e.g. waiting on a slow file system: still, but alive
        beat.touch()
        time.sleep(1)
    for step in range(3, 6):
        dist.all_reduce(t)
        print(f"rank {rank} step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
