"""A user-style torchrun script for tests: joins the group, all_reduces, reports what it received.

It has its own argument parsing; every unknown argument is echoed back verbatim (as JSON) so tests
can check that hostile strings arrive intact.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--sleep", type=float, default=0)
p.add_argument(
    "--steps", type=int, default=0, help="then this many steps (an all_reduce each), one per --step-time"
)
p.add_argument("--step-time", type=float, default=0.5)
p.add_argument("--env", action="append", default=[], help="print this variable's value")
p.add_argument("--hash-env", action="append", default=[], help="print a hash of this variable's value")
known, rest = p.parse_known_args()
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
          "node": os.environ.get("GROUP_RANK"), "args": rest,
          "env": {k: os.environ.get(k) for k in known.env},
          "hash": {k: hashlib.sha256(os.environ.get(k, "").encode()).hexdigest() for k in known.hash_env}}
sys.stdout.write("REPORT " + json.dumps(report) + "\n")  # one write: ranks share stdout
sys.stdout.flush()
time.sleep(known.sleep)
for step in range(1, known.steps + 1):
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        print(f"step {step}", flush=True)
    time.sleep(known.step_time)
dist.barrier()
