"""A torchrun worker that fails on one node after the group forms (for failure-handling tests)."""
import argparse
import os
import sys
import time

import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--node", type=int, required=True)
p.add_argument("--code", type=int, default=1)
p.add_argument("--after", type=float, default=1.0)
a = p.parse_args()
dist.init_process_group("gloo")
node = int(os.environ["GROUP_RANK"])
print(f"rank {dist.get_rank()} on node {node} up", flush=True)
if node == a.node:
    time.sleep(a.after)
    print(f"node {node} giving up with code {a.code}", flush=True)
    sys.exit(a.code)
time.sleep(600)
