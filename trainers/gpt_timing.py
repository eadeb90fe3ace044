"""How fast a GPT run goes, as its log lines say: each rank's step and compute time (StepTimer) and
rank 0's progress line with the time the rest will take."""

from __future__ import annotations

import time

import torch
from common import log
from torch.nn.parallel import DistributedDataParallel as DDP


class StepTimer:
    """Each rank's own step time and compute time (the step less what it spent waiting for the
    other ranks in the gradient all-reduce): a slow rank has the largest compute time, while the
    step time is the same everywhere. DDP calls the comm hook once per gradient bucket when this
    rank's gradients are ready; the last call ends the rank's own backward work. Reported per log
    interval, as the mean of its steps."""

    def __init__(self, ddp: DDP | None) -> None:
        self.ready = 0.0
        if ddp is not None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def hook(state, bucket):
                self.ready = time.perf_counter()
                # None is the default group (torch handles it; its annotation says ProcessGroup).
                return allreduce_hook(None, bucket)  # type: ignore[arg-type]

            ddp.register_comm_hook(None, hook)
        self.reset()

    def reset(self) -> None:
        self.steps, self.step_s, self.compute_s = 0, 0.0, 0.0

    def start(self) -> None:
        self.t0 = self.ready = time.perf_counter()

    def synced(self) -> None:
        """Backward has returned: the gradients are all-reduced (or there are no peers)."""
        self.t_sync = time.perf_counter()
        if self.ready <= self.t0:  # no hook ran: nothing was waited for
            self.ready = self.t_sync

    def stop(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        self.steps += 1
        self.step_s += end - self.t0
        self.compute_s += (self.ready - self.t0) + (end - self.t_sync)

    def report(self) -> str:
        if not self.steps:
            return ""
        step_ms, compute_ms = 1000 * self.step_s / self.steps, 1000 * self.compute_s / self.steps
        text = f" | step {step_ms:.1f} ms | compute {compute_ms:.1f} ms"
        self.reset()
        return text


def progress(tag: str, epoch: int, epochs: int, step: int, total: int, t0: float, step0: int) -> None:
    """Rank 0's progress line: where the run is and how long the rest will take."""
    done = step - step0
    eta = (time.perf_counter() - t0) / max(done, 1) * (total - step)
    bar = "#" * round(20 * step / max(total, 1))
    log(
        f"{tag} progress [{bar:<20}] {100 * step / max(total, 1):5.1f}% epoch {epoch + 1}/{epochs} "
        f"step {step}/{total} eta {eta:.0f}s"
    )
