"""TensorBoard event files of a run, written by global rank 0 into OUT/tb (fab train fetches the
job's output directory into runs/JOB/outputs/HOST/, so they arrive with it).

Where the `tensorboard` package is missing, `torch.utils.tensorboard` does not import: the run goes
on without event files, and rank 0 says so once. Every attempt of a job writes a new event file into
the same folder, marked with the first step it logs (SummaryWriter's purge_step): TensorBoard hides
what earlier attempts logged from that step on, so a run resumed from a snapshot at step S goes on
from S + 1 with no step twice, and a run that starts over replaces the curves it repeats.

    tensorboard --logdir runs/JOB/outputs
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from common import log

SUBDIR = "tb"
# The writer's thread appends each event to its file as it comes; a flush (this often, and from
# the trainer at each epoch's end and before each snapshot) waits until none is left in its queue.
FLUSH_SECS = 10


class Board:
    """Scalars by global step from `first_step` on; a no-op on every rank but 0 and without
    tensorboard. Closed at exit (an exception too); a run ending with os._exit closes it first."""

    def __init__(self, out: Path, rank: int, tag: str, first_step: int) -> None:
        self.writer = None
        if rank != 0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as exc:  # noqa: BLE001 - missing or broken (a protobuf it rejects): never stops a run
            log(f"{tag} tensorboard: no event files ({type(exc).__name__}: {exc})")
            return
        # An event file is named by the second, host and pid it was opened at: a container started
        # anew runs its trainer with the same pid, so a random suffix keeps two attempts' files apart
        # (the second would empty the first).
        self.writer = SummaryWriter(
            str(out / SUBDIR),
            purge_step=first_step,
            flush_secs=FLUSH_SECS,
            filename_suffix="." + os.urandom(4).hex(),
        )
        atexit.register(self.close)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
