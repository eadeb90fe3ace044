"""Joins the process group, says when, and exits: the launch benchmark's trainer."""

import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
sys.stdout.write(f"INIT {time.time():.6f} rank {dist.get_rank()}\n")
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
