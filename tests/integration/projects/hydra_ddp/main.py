"""A user's training program as such programs are written (pytorch/examples' minGPT-DDP among
them): hydra config, torch.distributed, a relative checkpoint that each node's first process
writes and every process loads "if it exists", relative outputs. Nothing in it knows fabtrain."""
import os
import time

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    start = 0
    if os.path.exists(cfg.snapshot_path):
        state = torch.load(cfg.snapshot_path)
        start = state["epoch"] + 1
        print(f"RESUMED rank {rank} epoch {state['epoch']}", flush=True)
    for epoch in range(start, cfg.epochs):
        total = torch.tensor([float(epoch)])
        dist.all_reduce(total)
        print(f"rank {rank} step {epoch} sum {total.item():g}", flush=True)
        if int(os.environ["LOCAL_RANK"]) == 0:
            os.makedirs(os.path.dirname(cfg.snapshot_path), exist_ok=True)
            torch.save({"epoch": epoch}, cfg.snapshot_path)
        time.sleep(cfg.sleep)
    if rank == 0:
        with open("outputs/done.txt", "w") as fh:
            fh.write(f"{cfg.epochs}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
