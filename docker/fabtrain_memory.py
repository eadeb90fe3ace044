"""Each rank's training state held in memory that outlives the worker, on its own host and on one
peer host, so a restart resumes from the newest step every rank holds: at most one step lost.

    import fabtrain_memory as memory
    state = memory.load(map_location=device)          # None: start afresh (or from a disk snapshot)
    ...
    for step in range(start, steps):
        train_one_step()
        memory.save(step + 1, lambda: {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                       "step": step + 1, "rng": torch.get_rng_state()})

Two halves:

- The keeper (`Keeper`, in fabtrain_keeper.py with the other end of its socket, `KeeperClient`),
  run by fabtrain's entrypoint in every warm node (FABTRAIN_WARM=1): a thread of the supervisor,
  which outlives its workers, serving a UNIX socket in a directory of mode 0700 in the container's
  /tmp (no network port). It holds, per global rank, the newest KEEP complete states as memfds
  (anonymous memory: nothing on the host's disk, gone with the container). Its path reaches the
  workers as FABTRAIN_KEEPER.
- The API a training script imports (`save`, `load`, `every`; fabtrain's entrypoint puts this file,
  and the modules it imports, on every worker's path). Without FABTRAIN_KEEPER (not a warm fabtrain
  node), `save` keeps nothing and `load` returns None: a script runs the same anywhere.

`save(step, state)` copies the state's tensors (one call, from the GPU too) into a memfd of its
own (`Slot`: mapped once, written again once the keeper no longer holds the state in it, so a step
costs no new memory, page faults or mappings) and hands the memfd to the keeper before it returns:
a rank that has returned from save(s) has step s in its keeper, which is what makes "at most one
step lost" hold (every rank that passed the collectives of step s + 1 returned from save(s)). The
worker's background thread then takes the state's digest (`digest_of`: sums of its 64-bit words,
one pass, cheap enough for every step; what it must catch is a transfer that went wrong, not an
adversary) and exchanges it with the peer node over a gloo group of the job's own process group
(rank r of node n sends to the same local rank of node n + 1, and receives from node n - 1's), one
message each way; the received state, its digest checked, goes to this node's keeper. The next save
waits for that exchange, so its time counts in the measured cost (K grows when the network is slow).

`load()` is collective: every rank lists what its keeper holds, the ranks gather the lists, and
agree on S, the newest step held somewhere for every rank. A rank whose keeper lacks its own state
(its host was replaced by a hot spare) receives it from a rank whose keeper holds its replica,
checked against the digest its origin computed. A disk snapshot at step S or later wins
(`disk_step`). Rank 0 prints which, and how many steps were lost.

K, how often: every step when that costs at most BUDGET (3%) of a step, else the smallest K that
does. The cost is measured as the job pays it, not as the copy alone: over the first steps (the
probe, PROBE_STEPS), blocks of steps that keep a state at each alternate with blocks that keep none,
and the ratio of their median step times, averaged over the ranks, gives the overhead at K = 1 (the
copy, and the background digest and exchange where they take CPU or memory bandwidth from
training). FABTRAIN_MEMORY_EVERY=K forces K, 0 turns memory off.

This module holds the API and `Memory`, a worker's side; the modules beside it: fabtrain_keeper
(the keeper and its client), fabtrain_state (a state's bytes: `Slot`, `encode`, `decode`,
`digest_of`), fabtrain_exchange (states sent between ranks: the replicas, and a state handed to the
rank that lacks it at a load) and fabtrain_policy (the pure decisions: `agree`, K).
"""

from __future__ import annotations

import atexit
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

# Names imported `as` themselves are not used here, but reached through this module: Keeper by the
# entrypoint (fabtrain_hook.start_memory), the others by its tests.
from fabtrain_exchange import Replicas, distributed, receive_held, say, send_held
from fabtrain_keeper import KEEP as KEEP
from fabtrain_keeper import TIMEOUT, KeeperClient
from fabtrain_keeper import Keeper as Keeper
from fabtrain_policy import BLOCK as BLOCK
from fabtrain_policy import BUDGET, PROBE_STEPS, Agreement, agree, choose_every, probe_keeps, probe_overhead
from fabtrain_policy import PAIRS as PAIRS
from fabtrain_policy import SETTLE as SETTLE
from fabtrain_state import Slot, decode, digest_of, free_slot, still_held
from fabtrain_state import encode as encode

KEEPER_ENV = "FABTRAIN_KEEPER"  # the keeper's socket, set by the entrypoint for its workers
EVERY_ENV = "FABTRAIN_MEMORY_EVERY"  # force K (0: off)
EXIT_WAIT = 10.0  # seconds a worker's exit waits for its last exchange


class Memory:
    """This worker's side: its rank, its keeper, the peer its states go to, and K."""

    def __init__(self, path: str, env: dict[str, str]) -> None:
        self.path = path
        self.rank = int(env.get("RANK", 0))
        self.world = int(env.get("WORLD_SIZE", 1))
        forced = env.get(EVERY_ENV, "").strip()
        self.k: int | None = int(forced) if forced else None  # None: measured (PROBE), then chosen
        self.forced = bool(forced)
        self.client: KeeperClient | None = None
        self.ctrl: Any = None  # a gloo group for the training thread's collectives (K, load)
        self.grouped = False
        self.calls: list[float] = []  # when each save() call began, while probing
        self.last_cost = 0.0
        self.pending: tuple[int, Slot] | None = None  # the put the keeper has not answered yet
        self.own: list[Slot] = []  # the memfds this rank's states are written into, in turn
        # The background thread (started at the first save), its next job, and whether it has none.
        self.worker: threading.Thread | None = None
        self.jobs: queue.SimpleQueue[tuple[Slot, int, int]] = queue.SimpleQueue()
        self.idle = threading.Event()
        self.idle.set()
        # What the background thread does with each kept state: its digest, and the exchange with
        # the peer nodes (fabtrain_exchange).
        nproc = max(1, int(env.get("LOCAL_WORLD_SIZE") or 1))
        self.replicas = Replicas(path, self.rank, self.world, nproc)

    # -- plumbing
    def keeper(self) -> KeeperClient:
        if self.client is None:
            self.client = KeeperClient(self.path)
        return self.client

    def groups(self) -> None:
        """The two gloo groups (collective: every rank makes them at its first save or load)."""
        if self.grouped:
            return
        self.grouped = True
        dist = distributed()
        if dist is None or self.world < 2:
            return
        import datetime

        timeout = datetime.timedelta(seconds=float(os.environ.get("FABTRAIN_PG_TIMEOUT") or TIMEOUT))
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout)
        self.replicas.repl = dist.new_group(backend="gloo", timeout=timeout)
        atexit.register(self.finish)

    def finish(self) -> None:
        """At exit (or a load): the last exchange ends (bounded) before the process groups are
        destroyed, and the keeper's last answer is read."""
        self.idle.wait(EXIT_WAIT)
        try:
            self.acknowledged()
        except (OSError, RuntimeError):
            pass

    # -- save
    def due(self, step: int) -> bool:
        if self.k == 0:
            return False
        if self.k is None:
            return probe_keeps(len(self.calls) - 1)
        return step % self.k == 0

    def save(self, step: int, state: dict | Callable[[], dict]) -> bool:
        began = time.perf_counter()
        if self.k is None:
            self.calls.append(began)
            if len(self.calls) > PROBE_STEPS:
                self.choose()
        if not self.due(step):
            return False
        self.groups()
        self.idle.wait()  # the previous exchange: pairs must happen in the same order on every rank
        self.acknowledged()
        slot = free_slot(self.own, "fabtrain-state")
        size = slot.write(state() if callable(state) else state, self.replicas.out_frame)
        slot.held = True  # from the moment it is sent: the keeper's answer tells when it is not
        try:
            # Handed over once sent: the keeper's answer is read at the next save (no round trip here).
            self.keeper().send(
                {"op": "put", "rank": self.rank, "step": step, "world": self.world, "size": size}, slot.fd
            )
            self.pending = (step, slot)
        except OSError as exc:
            slot.held = False
            raise RuntimeError(
                f"fabtrain_memory: the keeper at {self.path} did not take step {step}: {exc}"
            ) from exc
        self.idle.clear()
        self.jobs.put((slot, size, step))
        if self.worker is None:
            self.worker = threading.Thread(target=self.background, daemon=True, name="fabtrain-memory")
            self.worker.start()
        self.last_cost = time.perf_counter() - began
        if self.forced and self.k and self.rank == 0 and not self.calls:
            self.calls.append(began)
            say(
                f"[fabtrain] memory: each rank's state kept every {self.k} step{'s' if self.k > 1 else ''} "
                f"({EVERY_ENV}={self.k})"
            )
        return True

    def acknowledged(self) -> None:
        """The keeper's answer to the last put, before this connection carries anything else: which of
        this rank's memfds it still holds (the others may be written again)."""
        if self.pending is None:
            return
        (step, slot), self.pending = self.pending, None
        reply, _ = self.keeper().reply()
        if not reply.get("ok"):
            slot.held = False  # the keeper closed its copy
            raise RuntimeError(f"fabtrain_memory: the keeper refused step {step}: {reply.get('error')}")
        still_held(self.own, reply)

    def choose(self) -> None:
        """The probe's end (the same call on every rank): K from the overhead measured, averaged over
        the ranks, so every rank keeps the same steps."""
        on, off, overhead = probe_overhead(self.calls)
        dist = distributed()
        if dist is not None and self.ctrl is not None:
            import torch

            t = torch.tensor([overhead, on, off], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.ctrl)
            overhead, on, off = (float(v) / self.world for v in t)
        self.k = k = choose_every(overhead)
        if self.rank == 0:
            say(
                f"[fabtrain] memory: each rank's state kept every {k} step{'s' if k > 1 else ''} (a step "
                f"took {1000 * on:.1f} ms keeping it, {1000 * off:.1f} ms not, {overhead:+.1%}; at most "
                f"{BUDGET:.0%} allowed; {EVERY_ENV}=K forces K)"
            )

    def background(self) -> None:
        """The background thread: each kept state's digest and exchange, one after the other."""
        while True:
            job = self.jobs.get()
            try:
                self.replicas.replicate(*job)
            finally:
                self.idle.set()

    # -- load
    def load(self, map_location: Any = None, disk_step: int | None = None) -> Any:
        self.groups()
        self.finish()
        dist = distributed()
        collective = dist is not None and self.ctrl is not None
        held = self.keeper().held()
        reports: list[Any] = [held]
        if collective:
            reports = [None] * self.world
            dist.all_gather_object(reports, held, group=self.ctrl)
        got = agree(reports, self.world)
        state, ok = None, got.step is not None and (disk_step is None or disk_step < got.step)
        if ok and got.step is not None:
            if got.source[self.rank] == self.rank:
                try:
                    state = self.local(self.rank, got.step, got.digest[self.rank], map_location)
                except Exception as exc:  # noqa: BLE001 - told to every rank below, then the disk is used
                    ok = self.failed(exc)
            for rank in sorted(r for r, q in got.source.items() if q != r):
                if self.rank == got.source[rank]:
                    send_held(self.keeper(), self.ctrl, rank, got.step)
                elif self.rank == rank:
                    try:
                        state = receive_held(
                            self.ctrl, got.source[rank], self.rank, got.step, got.digest[rank], map_location
                        )
                    except Exception as exc:  # noqa: BLE001 - as above
                        ok = self.failed(exc)
            if collective:
                import torch

                flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.ctrl)
                ok = bool(flag.item())
        resume = got.step if ok else disk_step
        self.resumed(got if ok else Agreement(got.step, got.newest), None if ok else disk_step)
        # The states past the step resumed from (and any of another world) belong to no timeline now.
        # Every rank's keeper is trimmed before any rank goes on to save the next step.
        self.keeper().call({"op": "trim", "above": -1 if resume is None else resume, "world": self.world})
        if collective:
            dist.barrier(group=self.ctrl)
        return state if ok else None

    def failed(self, exc: BaseException) -> bool:
        say(f"[fabtrain] memory: rank {self.rank} could not take its state ({exc}); every rank falls back")
        return False

    def local(self, rank: int, step: int, digest: str | None, map_location: Any) -> Any:
        reply, fd = self.keeper().call({"op": "get", "rank": rank, "step": step})
        if fd is None:
            raise RuntimeError(f"this host's keeper no longer holds rank {rank}'s step {step}")
        try:
            with mmap.mmap(fd, reply["size"], access=mmap.ACCESS_COPY) as mm:
                if digest and digest_of(mm, reply["size"]) != digest:
                    raise RuntimeError(f"rank {rank}'s step {step} in this host's keeper is damaged")
                return decode(mm, map_location)
        finally:
            os.close(fd)

    def resumed(self, got: Agreement, disk_step: int | None) -> None:
        """Rank 0 says where the job resumes from, and how many steps are trained again."""
        if self.rank != 0:
            return
        if disk_step is None and got.step is not None:
            lost = (got.newest or got.step) - got.step
            moved = sorted(r for r, q in got.source.items() if q != r)
            via = f"; ranks {', '.join(map(str, moved))} from their replicas on another host" if moved else ""
            say(
                f"[fabtrain] resumed from memory at step {got.step} (the newest every rank holds), "
                f"{lost} step{'' if lost == 1 else 's'} lost{via}"
            )
        elif disk_step is not None:
            held = "no step held by every rank" if got.step is None else f"every rank holds step {got.step}"
            gone = None if got.newest is None else max(0, got.newest - disk_step)
            behind = "" if gone is None else f", {gone} step{'' if gone == 1 else 's'} lost"
            say(f"[fabtrain] resumed from the disk snapshot at step {disk_step} (memory: {held}){behind}")
        elif got.newest is not None:
            say(
                f"[fabtrain] memory holds no step for every rank (newest seen {got.newest}) and there is no "
                "disk snapshot: starting afresh"
            )


_MEMORY: Memory | None = None
_LOCK = threading.Lock()


def _memory() -> Memory | None:
    """This process's Memory, made at first use; None where there is no keeper (or K is 0)."""
    global _MEMORY
    path = os.environ.get(KEEPER_ENV)
    if not path or os.environ.get(EVERY_ENV, "").strip() == "0":
        return None
    with _LOCK:
        if _MEMORY is None or _MEMORY.path != path:
            _MEMORY = Memory(path, dict(os.environ))
        return _MEMORY


def save(step: int, state: dict | Callable[[], dict]) -> bool:
    """Keep `state` (a dict of tensors and plain Python values, or a function returning one, called
    only when this step is kept) as this rank's state at `step`. Call it on every rank after every
    step, with the same step numbers; it keeps the steps that are due (every K) and returns whether
    it kept this one. Without a keeper (not under a warm fabtrain node) it keeps nothing."""
    memory = _memory()
    return memory.save(step, state) if memory is not None else False


def load(map_location: Any = None, disk_step: int | None = None) -> Any:
    """The state saved at the newest step every rank holds, the same step on every rank (collective:
    call it on every rank, after init_process_group); None when no step is held by every rank, or
    when the caller's disk snapshot (`disk_step`, the same on every rank) is as new or newer. Its
    tensors are on the CPU, or on `map_location`."""
    memory = _memory()
    return memory.load(map_location, disk_step) if memory is not None else None


def every() -> int | None:
    """K: every how many steps a state is kept (0: never; None: still measuring, or no keeper)."""
    memory = _memory()
    return None if memory is None else memory.k


def last_cost() -> float:
    """Seconds the last kept step took in the training thread (0 without a keeper)."""
    memory = _memory()
    return 0.0 if memory is None else memory.last_cost
