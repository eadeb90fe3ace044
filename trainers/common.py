"""Small helpers shared by the trainers."""

from __future__ import annotations

import datetime
import importlib
import os
import sys
from typing import Any


def log(line: str) -> None:
    """One write per line: ranks sharing a stdout pipe never splice each other's lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def finish_distributed(hard_exit: bool) -> None:
    """The end of a run: every rank reaches the barrier, then leaves. Run as a script (hard_exit),
    the process then exits at once after flushing its output: gloo's teardown after the last
    collective has aborted a rank that had already finished (std::terminate, "terminate called
    without an active exception", about once in 25 runs of the local cluster), failing a job whose
    work was all done. In-process callers (tests) destroy the group as usual."""
    import torch.distributed as dist

    dist.barrier()
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def pg_timeout() -> datetime.timedelta:
    """Collectives give up on a dead peer after this long (set by the entrypoint; default 60 s)."""
    return datetime.timedelta(seconds=float(os.environ.get("FABTRAIN_PG_TIMEOUT", 60)))


def memory_state() -> Any:
    """fabtrain_memory, which fabtrain's entrypoint puts on every worker's path: each rank's training
    state kept in memory on its host and a peer's (save, load). None where it is absent (a plain
    torchrun, a test in one process): the trainer then resumes from disk snapshots only."""
    try:
        return importlib.import_module("fabtrain_memory")
    except ImportError:
        return None
