import os
import socket
import sys
from pathlib import Path

import pytest

TRAINERS = Path(__file__).resolve().parents[2] / "trainers"
sys.path.insert(0, str(TRAINERS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    """Trainers follow the torchrun contract; a test process starts as a plain single process."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def spawn(fn, world: int, *args):
    """Run fn(rank, world, port, *args) in `world` processes joined by gloo over loopback."""
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=True, start_method="spawn")


def init_gloo(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)


def finish_gloo() -> None:
    """Leave together: a rank that tears its gloo pairs down while a peer is still working makes
    that peer's gloo thread abort the process (SIGABRT, "terminate called without an active
    exception")."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
