"""Each rank's training state held in memory that outlives the worker, on its own host and on one
peer host, so a restart resumes from the newest step every rank holds: at most one step lost.

    import fabtrain_memory as memory
    state = memory.load(map_location=device)          # None: start afresh (or from a disk snapshot)
    ...
    for step in range(start, steps):
        train_one_step()
        memory.save(step + 1, lambda: {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                       "step": step + 1, "rng": torch.get_rng_state()})

Two halves, in one file so that the protocol between them lives in one place:

- The keeper (`Keeper`), run by fabtrain's entrypoint in every warm node (FABTRAIN_WARM=1): a
  thread of the supervisor, which outlives its workers, serving a UNIX socket in a directory of
  mode 0700 in the container's /tmp (no network port). It holds, per global rank, the newest KEEP
  complete states as memfds (anonymous memory: nothing on the host's disk, gone with the container).
  Its path reaches the workers as FABTRAIN_KEEPER.
- The API a training script imports (`save`, `load`, `every`; fabtrain's entrypoint puts this file
  on every worker's path). Without FABTRAIN_KEEPER (not a warm fabtrain node), `save` keeps
  nothing and `load` returns None: a script runs the same anywhere.

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
"""

from __future__ import annotations

import atexit
import io
import json
import math
import mmap
import os
import pickle
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KEEPER_ENV = "FABTRAIN_KEEPER"  # the keeper's socket, set by the entrypoint for its workers
EVERY_ENV = "FABTRAIN_MEMORY_EVERY"  # force K (0: off)
KEEP = 2  # states per rank a keeper holds: the newest may be incomplete on another node
BUDGET = 0.03  # how much longer a step may take with memory on (a fraction of a step without)
# The probe: SETTLE steps keeping a state at each (groups made, the first steps' warm-up), then PAIRS
# pairs of BLOCK steps keeping none and BLOCK steps keeping one at each; a step's time is from its
# save() call to the next one, the first of each block not counted (the other block's work may end
# in it). At most BLOCK steps are not kept in memory while it lasts.
SETTLE = 2
BLOCK = 4
PAIRS = 4
PROBE_STEPS = SETTLE + 2 * BLOCK * PAIRS
MAX_EVERY = 100  # the largest K chosen
EXIT_WAIT = 10.0  # seconds a worker's exit waits for its last exchange
TIMEOUT = 120.0  # seconds any exchange with the keeper or a peer may take before it is given up
MAGIC = b"FTMEM02\n"
ALIGN = 64
HEAD = 64  # MAGIC, the structure's offset and length, zeros: the tensors' bytes begin here
HEADER = 40  # bytes ending a frame of an exchange: step, size, the next exchange's frame, digest
DIGEST_BLOCK = 64  # 64-bit words digest_of sums as one block (512 bytes)
DIGEST_WORDS = 1 << 20  # words a pass of digest_of takes at once (8 MiB), a multiple of DIGEST_BLOCK
MASK = (1 << 64) - 1

# ---------------------------------------------------------------------------------------------
# The keeper: the supervisor's side.


@dataclass
class Held:
    """One state in a keeper: the memfd holding its bytes (`ino`: which memfd it is, so its writer
    knows when it may write that memfd again), and its digest once known."""

    rank: int
    step: int
    world: int
    size: int
    fd: int
    digest: str | None = None
    ino: int = 0

    def row(self) -> list:
        return [self.rank, self.step, self.world, self.size, self.digest]


class Keeper:
    """The states of this node's ranks and of the previous node's (their replicas), in memory, served
    on a UNIX socket (SOCK_SEQPACKET: a request is one message, a memfd travels beside it)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self.dir = tempfile.mkdtemp(prefix="fabtrain-keeper-")  # mode 0700: only this container's user
        self.path = os.path.join(self.dir, "keeper.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self.sock.listen(64)
        self.held: dict[int, list[Held]] = {}
        # A digest that came (on the background thread's connection) before its put was read.
        self.early: dict[tuple[int, int], str] = {}
        self.lock = threading.Lock()
        self.closed = False

    def start(self) -> Keeper:
        threading.Thread(target=self._accept, daemon=True, name="fabtrain-keeper").start()
        atexit.register(self.close)
        return self

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
        with self.lock:
            for states in self.held.values():
                for h in states:
                    os.close(h.fd)
            self.held.clear()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn,), daemon=True, name="fabtrain-keeper-conn"
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 1)
                except OSError:
                    return
                if not data:
                    for fd in fds:
                        os.close(fd)
                    return
                try:
                    reply, out_fd = self.handle(json.loads(data), fds[0] if fds else None)
                except Exception as exc:  # noqa: BLE001 - a bad request is answered, never fatal to the node
                    for fd in fds:
                        os.close(fd)
                    reply, out_fd = {"ok": False, "error": repr(exc)}, None
                try:
                    if out_fd is None:
                        conn.send(json.dumps(reply).encode())
                    else:
                        socket.send_fds(conn, [json.dumps(reply).encode()], [out_fd])
                except OSError:
                    return
                finally:
                    if out_fd is not None:
                        os.close(out_fd)

    def handle(self, req: dict, fd: int | None) -> tuple[dict, int | None]:
        """One request: put (a memfd), digest, list, get (a dup of the memfd), trim. Any request may
        carry `digests` ([rank, step, digest] of states held or on their way), recorded first. A put
        is answered with the memfds (`inos`) the keeper still holds for that rank: the others its
        writer may write again."""
        for rank, step, digest in req.get("digests", []):
            self.digest(int(rank), int(step), str(digest))
        op = req.get("op")
        if op == "digest":
            return {"ok": True}, None
        if op == "put":
            if fd is None:
                raise ValueError("put without a memfd")
            rank = int(req["rank"])
            new = Held(rank, int(req["step"]), int(req["world"]), int(req["size"]), fd, req.get("digest"))
            new.ino = os.fstat(fd).st_ino
            return {"ok": True, "inos": self.put(new)}, None
        with self.lock:
            if op == "list":
                return {"ok": True, "held": [h.row() for states in self.held.values() for h in states]}, None
            if op == "get":
                for h in self.held.get(int(req["rank"]), []):
                    if h.step == int(req["step"]):
                        reply = {"ok": True, "size": h.size, "digest": h.digest, "world": h.world}
                        return reply, os.dup(h.fd)
                return {"ok": False, "error": "not held"}, None
            if op == "trim":
                above, world = int(req["above"]), int(req["world"])
                for rank, states in self.held.items():
                    keep = [h for h in states if h.step <= above and h.world == world]
                    for h in states:
                        if h not in keep:
                            os.close(h.fd)
                    self.held[rank] = keep
                return {"ok": True}, None
        raise ValueError(f"unknown op {op!r}")

    def digest(self, rank: int, step: int, digest: str) -> None:
        """A state's digest, which may come (on its writer's background connection) before the state
        itself was read (`early`)."""
        with self.lock:
            found = [h for h in self.held.get(rank, []) if h.step == step]
            for h in found:
                h.digest = digest
            if not found:
                self.early = {k: v for k, v in self.early.items() if k[0] != rank or k[1] > step}
                self.early[(rank, step)] = digest

    def put(self, new: Held) -> list[int]:
        """A rank's states arrive in step order; one older than a state held means the job went back
        (a resume from an older step), and the states past it belong to a timeline that is gone.
        Returns the memfds (inode numbers) held for that rank now."""
        with self.lock:
            new.digest = new.digest or self.early.pop((new.rank, new.step), None)
            states = self.held.get(new.rank, [])
            for h in states:
                if h.step >= new.step:
                    os.close(h.fd)
            states = [*(h for h in states if h.step < new.step), new]
            for h in states[: -self.keep]:
                os.close(h.fd)
            self.held[new.rank] = states[-self.keep :]
            return [h.ino for h in self.held[new.rank]]


class KeeperClient:
    """One connection to the keeper (one per thread that talks to it)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect(path)

    def call(self, req: dict, fd: int | None = None) -> tuple[dict, int | None]:
        self.send(req, fd)
        return self.reply()

    def send(self, req: dict, fd: int | None = None) -> None:
        """A request on its way: once this returns, the keeper reads it even if this process dies
        (the message, and the memfd with it, wait in the keeper's socket)."""
        data = json.dumps(req).encode()
        if fd is None:
            self.sock.send(data)
        else:
            socket.send_fds(self.sock, [data], [fd])

    def reply(self) -> tuple[dict, int | None]:
        reply, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 1)
        if not reply:
            raise ConnectionError("the keeper closed the connection")
        return json.loads(reply), (fds[0] if fds else None)

    def held(self) -> list[list]:
        return self.call({"op": "list"})[0]["held"]

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------------
# The bytes of a state: HEAD bytes (MAGIC, then where the structure lies and its length), each
# tensor's bytes at an ALIGN-ed offset, then a pickle of the structure (tensors replaced by
# references), the whole padded to ALIGN. The tensors come first so that they lie where they lay
# at the last step (the structure's pickle changes its length with the numbers in it). Written
# straight into a memfd (no serialisation buffer), read back without torch.load.

SAFE_CLASSES = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("builtins", "range"),
    ("builtins", "bytearray"),
    ("torch", "Size"),
}
PLAIN = (dict, list, tuple, str, int, float, bool, bytes, type(None), set, frozenset, complex)
COMMON = frozenset((dict, list, tuple, str, int, float, bool, type(None)))  # checked first: most of a state


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _plain(obj: object) -> bool:
    """A value a state may hold besides tensors: plain Python, a dtype, and numpy's (an RNG state);
    classes and functions only those the loader accepts (SAFE_CLASSES, numpy's)."""
    import torch

    if isinstance(obj, PLAIN) or isinstance(obj, (torch.dtype, torch.Size)):
        return True
    if isinstance(obj, type) or callable(obj):
        name = (getattr(obj, "__module__", None) or "", getattr(obj, "__qualname__", None) or "")
        return name in SAFE_CLASSES or name[0].split(".")[0] == "numpy"
    return type(obj).__module__.split(".")[0] == "numpy"


@dataclass
class Layout:
    """Where a state's parts go: its structure pickled, and each distinct tensor with its place."""

    meta: bytes
    tensors: list[torch.Tensor]
    places: tuple[tuple[int, torch.dtype, tuple[int, ...]], ...]  # (offset past HEAD, dtype, shape)
    end: int  # the tensors' bytes, aligned
    cpu: bool  # every tensor on the CPU

    @property
    def size(self) -> int:
        return _align(HEAD + self.end + len(self.meta))


def layout(state: object) -> Layout:
    """Pickle the structure of `state`, each tensor replaced by a reference to its place; anything
    but tensors and plain Python values is refused here, at the save, rather than at the resume.
    (Called at every kept step, on a few hundred objects: each tensor is looked at once.)"""
    import torch

    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    places: list[tuple[int, torch.dtype, tuple[int, ...]]] = []
    pids: list[tuple] = []
    end, cpu = 0, True

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            nonlocal end, cpu
            kind = type(obj)
            if kind in COMMON:
                return None
            if kind is torch.Tensor or isinstance(obj, torch.Tensor):
                i = index.get(id(obj))
                if i is not None:
                    return pids[i]
                t: Any = obj
                if (
                    (kind is not torch.Tensor and hasattr(t, "to_local"))
                    or t.layout != torch.strided
                    or t.is_quantized
                ):
                    raise TypeError(
                        f"fabtrain_memory.save: a {kind.__name__} ({t.layout}); save a plain dense tensor "
                        "(a DTensor's shard: t.to_local())"
                    )
                index[id(obj)] = len(tensors)
                tensors.append(t)
                places.append((end, t.dtype, tuple(t.shape)))
                pids.append(("t", len(pids), str(t.dtype), places[-1][2], end))
                end = _align(end + t.nbytes)
                cpu = cpu and t.is_cpu
                return pids[-1]
            if not _plain(obj):
                raise TypeError(
                    f"fabtrain_memory.save: the state holds a {kind.__module__}.{kind.__qualname__}; keep "
                    "to tensors and plain Python values"
                )
            return None

    meta = io.BytesIO()
    Pickler(meta, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    return Layout(meta.getvalue(), tensors, tuple(places), end, cpu)


class Slot:
    """A memfd this process writes states into: mapped once (grown when a state outgrows it), and
    written again only once the keeper no longer holds the state in it (`held`)."""

    def __init__(self, name: str) -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.ino = os.fstat(self.fd).st_ino
        self.held = False
        self.cap = 0
        self.mm: mmap.mmap | None = None
        self.buf: torch.Tensor | None = None  # its bytes, as a tensor
        self.places: tuple = ()  # the places `views` were made for
        self.views: list[torch.Tensor] = []  # a tensor over each place, to copy into
        self.nonempty: list[int] = []  # the places with bytes to copy

    def reserve(self, size: int) -> torch.Tensor:
        """Its bytes, at least `size` of them. Never closed by hand: a mapping goes when the last
        tensor over it does (torch holds the mmap object, not its buffer)."""
        import torch

        if self.buf is None or size > self.cap:
            self.views, self.places, self.buf, self.mm = [], (), None, None
            self.cap = _align(max(size + size // 16, 1), mmap.PAGESIZE)  # room for the structure to grow
            os.ftruncate(self.fd, self.cap)
            self.mm = mmap.mmap(self.fd, self.cap)
            self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self.buf

    def write(self, state: object, frame: int = 0) -> int:
        """`state` into this memfd, its tensors in one copy each; returns its size. The memfd keeps
        room past it for the frame it goes to the peer in (at least `frame` bytes: Memory.frames)."""
        import torch

        lay = layout(state)
        size = lay.size
        buf, mm = self.reserve(max(frame_for(size), frame)), self.mm
        assert mm is not None
        if lay.places != self.places:
            self.views = [
                buf[HEAD + off : HEAD + off + math.prod(shape) * _itemsize(dtype)].view(dtype).view(shape)
                for off, dtype, shape in lay.places
            ]
            self.nonempty = [i for i, v in enumerate(self.views) if v.numel()]
            self.places = lay.places
        at = HEAD + lay.end
        head = MAGIC + at.to_bytes(8, "little") + len(lay.meta).to_bytes(8, "little")
        mm[:HEAD] = head.ljust(HEAD, b"\0")
        mm[at : at + len(lay.meta)] = lay.meta
        into = [self.views[i] for i in self.nonempty]
        srcs = [lay.tensors[i] for i in self.nonempty]
        with torch.no_grad():  # (a tensor that requires grad is copied as its value)
            if not into:
                pass
            elif lay.cpu and hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(into, srcs)  # one call, not one each
            else:  # a GPU's tensors (or an older torch): copied one by one, each straight from the device
                for v, t in zip(into, srcs, strict=True):
                    v.copy_(t)
        return size

    def tail(self, end: int) -> bytes:
        """The HEADER bytes before `end` (a frame's header)."""
        assert self.mm is not None
        return self.mm[end - HEADER : end]

    def close(self) -> None:
        self.views, self.buf, self.mm = [], None, None
        os.close(self.fd)


def _itemsize(dtype: torch.dtype) -> int:
    import torch

    return torch.empty(0, dtype=dtype).element_size()


def encode(state: object) -> tuple[int, int]:
    """(a memfd holding `state`, its size): a slot of its own, for one state."""
    slot = Slot("fabtrain-state")
    try:
        size = slot.write(state)
    except BaseException:
        slot.close()
        raise
    slot.views, slot.buf, slot.mm = [], None, None
    return slot.fd, size


def decode(data: memoryview | bytes | bytearray | mmap.mmap, map_location: Any = None) -> Any:
    """The state encode() wrote, its tensors copied out of `data` (onto map_location, if given)."""
    import torch

    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a fabtrain memory state (bad magic)")
    at = int.from_bytes(view[len(MAGIC) : len(MAGIC) + 8], "little")
    meta_len = int.from_bytes(view[len(MAGIC) + 8 : len(MAGIC) + 16], "little")
    holder = [torch.frombuffer(data, dtype=torch.uint8)]  # emptied before the caller closes `data`

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            _tag, _i, dtype_name, shape, off = pid
            dtype = _dtype(dtype_name)
            nbytes = math.prod(shape) * _itemsize(dtype)
            raw = holder[0][HEAD + off : HEAD + off + nbytes]
            t = (raw.view(dtype) if nbytes else torch.empty(0, dtype=dtype)).reshape(shape).clone()
            return t.to(map_location) if map_location is not None else t

        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in SAFE_CLASSES or module.split(".")[0] == "numpy":
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"fabtrain_memory: refusing {module}.{name} in a state")

    try:
        return Unpickler(io.BytesIO(view[at : at + meta_len])).load()
    finally:
        holder.clear()
        view.release()


def digest_of(data: memoryview | bytearray | mmap.mmap, size: int) -> str:
    """A digest of the first `size` bytes of `data` (writable), over its 64-bit words in blocks of
    DIGEST_BLOCK (512 bytes; the bytes past the last whole word, zero-padded, are a block of their
    own): the sum of every word, and the sum of each block's sum times 2b + 1 (b: the block's
    index), each mod 2^64. What it must catch is a state that arrived other than it left (a
    transfer cut short or mangled, a range not written, bytes landed elsewhere): any one word
    changed changes the first sum, and blocks moved, or bytes moved from one block to another,
    change the second; a truncation also changes the size, checked beside it. What it misses:
    words swapped inside one block, which no transfer does. One pass over the bytes (torch's
    integer sums; a hash would take several times as long, and every kept step pays it twice)."""
    import torch

    words = size // 8
    plain = weighted = 0
    whole = torch.frombuffer(data, dtype=torch.int64, count=words) if words else None
    for start in range(0, words, DIGEST_WORDS):
        assert whole is not None
        part = whole[start : start + DIGEST_WORDS]
        full = len(part) // DIGEST_BLOCK * DIGEST_BLOCK
        sums = part[:full].view(-1, DIGEST_BLOCK).sum(1)  # (wraps mod 2^64, as int64 does)
        if full < len(part):
            sums = torch.cat([sums, part[full:].sum().view(1)])
        s = int(sums.sum())
        plain += s
        weighted += int((sums * _odd(len(sums))).sum()) + 2 * (start // DIGEST_BLOCK) * s
    if size % 8:
        tail = int.from_bytes(bytes(memoryview(data)[words * 8 : size]), "little")
        plain += tail
        weighted += (2 * -(-words // DIGEST_BLOCK) + 1) * tail
    return f"{plain & MASK:016x}{weighted & MASK:016x}"


_ODD = threading.local()  # digest_of's weights (1, 3, 5, ...), per thread: made once, then reused


def _odd(n: int) -> torch.Tensor:
    import torch

    got = getattr(_ODD, "weights", None)
    if got is None or len(got) < n:
        got = _ODD.weights = torch.arange(
            1, 2 * max(n, DIGEST_WORDS // DIGEST_BLOCK + 1), 2, dtype=torch.int64
        )
    return got[:n]


# ---------------------------------------------------------------------------------------------
# Agreeing on the step to resume from: pure.


@dataclass(frozen=True)
class Agreement:
    step: int | None  # the newest step held somewhere for every rank; None: none is
    newest: int | None  # the newest step any keeper holds (for any rank)
    source: dict[int, int] = field(default_factory=dict)  # rank -> the rank whose keeper sends it
    digest: dict[int, str | None] = field(default_factory=dict)  # rank -> the digest to expect


def agree(reports: list[list[list]], world: int) -> Agreement:
    """From each rank's list of what its keeper holds ([rank, step, world, size, digest] rows, the
    same list from every rank of a node), the step to resume from and where each rank's state
    comes from: its own keeper when that holds it, else the lowest rank whose keeper does."""
    where: dict[int, dict[int, list[tuple[int, str | None]]]] = {r: {} for r in range(world)}
    newest = None
    for reporter, rows in enumerate(reports):
        for rank, step, w, _size, digest in rows:
            if w != world or not 0 <= rank < world:
                continue  # a state of another world (the job shrank or grew): of no use now
            where[rank].setdefault(step, []).append((reporter, digest))
            newest = step if newest is None else max(newest, step)
    common = set.intersection(*(set(steps) for steps in where.values())) if world else set()
    if not common:
        return Agreement(None, newest)
    step = max(common)
    source, digests = {}, {}
    for rank in range(world):
        holders = where[rank][step]
        own = [h for h in holders if h[0] == rank]
        pick = own[0] if own else min(holders)
        source[rank] = pick[0]
        digests[rank] = next((d for _, d in holders if d), None)  # the origin's, carried by its replica
    return Agreement(step, newest, source, digests)


def choose_every(overhead: float, budget: float = BUDGET) -> int:
    """The smallest K whose overhead per step (the overhead at K = 1, a fraction of a step, / K) is
    at most `budget`; MAX_EVERY at most."""
    if not overhead > 0:  # none measured (or NaN)
        return 1
    return max(1, min(MAX_EVERY, math.ceil(overhead / budget - 1e-9)))


def probe_keeps(call: int) -> bool:
    """Whether the probe's `call`-th save() (0-based) keeps a state: its settling steps and its
    blocks that keep one."""
    return call < SETTLE or ((call - SETTLE) // BLOCK) % 2 == 1


def probe_overhead(began: list[float]) -> tuple[float, float, float]:
    """(the median step keeping a state, the median step keeping none, in seconds; the overhead at
    K = 1 as a fraction of the latter) from the times the probe's save() calls began, one more than
    PROBE_STEPS: step i runs from call i to call i + 1."""
    kept: list[float] = []
    not_kept: list[float] = []
    for i in range(SETTLE, PROBE_STEPS):
        if (i - SETTLE) % BLOCK:  # the first of each block is not counted
            (kept if probe_keeps(i) else not_kept).append(began[i + 1] - began[i])
    on, off = statistics.median(kept), statistics.median(not_kept)
    return on, off, (on - off) / off if off > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# The API: the worker's side.


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Memory:
    """This worker's side: its rank, its keeper, the peer its states go to, and K."""

    def __init__(self, path: str, env: dict[str, str]) -> None:
        self.path = path
        self.rank = int(env.get("RANK", 0))
        self.world = int(env.get("WORLD_SIZE", 1))
        self.nproc = max(1, int(env.get("LOCAL_WORLD_SIZE") or 1))
        forced = env.get(EVERY_ENV, "").strip()
        self.k: int | None = int(forced) if forced else None  # None: measured (PROBE), then chosen
        self.forced = bool(forced)
        self.client: KeeperClient | None = None
        self.ctrl: Any = None  # a gloo group for the training thread's collectives (K, load)
        self.repl: Any = None  # a gloo group for the background thread's replica exchanges
        self.grouped = False
        self.calls: list[float] = []  # when each save() call began, while probing
        self.broken: str | None = None  # why replicas stopped (a peer died): never retried in this process
        self.last_cost = 0.0
        self.pending: tuple[int, Slot] | None = None  # the put the keeper has not answered yet
        self.own: list[Slot] = []  # the memfds this rank's states are written into, in turn
        self.replicas: list[Slot] = []  # the memfds the peer's states are received into, in turn
        # The background thread (started at the first save), its next job, and whether it has none.
        self.worker: threading.Thread | None = None
        self.jobs: queue.SimpleQueue[tuple[Slot, int, int]] = queue.SimpleQueue()
        self.idle = threading.Event()
        self.idle.set()
        self.bg_client: KeeperClient | None = None  # the background thread's connection to the keeper
        # The frames the next exchange sends and receives in (exchange): the first's, its header alone.
        self.out_frame = self.in_frame = HEADER

    # -- plumbing
    def keeper(self) -> KeeperClient:
        if self.client is None:
            self.client = KeeperClient(self.path)
        return self.client

    def peers(self) -> tuple[int, int] | None:
        """(the rank this rank's states go to, the rank whose states come here), None alone."""
        nnodes = self.world // self.nproc
        if nnodes < 2 or self.world % self.nproc:
            return None
        node, local = divmod(self.rank, self.nproc)
        return ((node + 1) % nnodes) * self.nproc + local, ((node - 1) % nnodes) * self.nproc + local

    def groups(self) -> None:
        """The two gloo groups (collective: every rank makes them at its first save or load)."""
        if self.grouped:
            return
        self.grouped = True
        dist = _dist()
        if dist is None or self.world < 2:
            return
        import datetime

        timeout = datetime.timedelta(seconds=float(os.environ.get("FABTRAIN_PG_TIMEOUT") or TIMEOUT))
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout)
        self.repl = dist.new_group(backend="gloo", timeout=timeout)
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
        size = slot.write(state() if callable(state) else state, self.out_frame)
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
        dist = _dist()
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
                self.replicate(*job)
            finally:
                self.idle.set()

    def replicate(self, slot: Slot, size: int, step: int) -> None:
        """The state's digest, and the exchange with the peer nodes; the digest reaches the keeper
        with the replica received (one message), or alone."""
        client = None
        try:
            assert slot.mm is not None
            digest = digest_of(slot.mm, size)
            client = self.bg_client = self.bg_client or KeeperClient(self.path)
            mine = [self.rank, step, digest]
            pair = self.peers()
            if pair is not None and self.repl is not None and self.broken is None:
                try:
                    return self.exchange(client, slot, size, step, mine, *pair)
                except Exception as exc:  # noqa: BLE001 - a peer died: training goes on, replicas stop
                    self.broken = repr(exc)
                    say(
                        f"[fabtrain] memory: rank {self.rank}'s replicas stopped at step {step} "
                        f"({type(exc).__name__}); its own host's copy is still kept"
                    )
                    client.close()  # its answers may be out of step now
                    client = self.bg_client = KeeperClient(self.path)
            client.call({"op": "digest", "digests": [mine]})
        except Exception as exc:  # noqa: BLE001 - never let the background thread end a rank
            say(f"[fabtrain] memory: rank {self.rank} could not finish step {step}'s copy ({exc!r})")
            if client is not None:  # as above: the next job connects anew
                client.close()
                self.bg_client = None

    def exchange(
        self, client: KeeperClient, slot: Slot, size: int, step: int, mine: list, dst: int, src: int
    ) -> None:
        """Send this rank's state to `dst`, receive `src`'s into a memfd for this node's keeper. One
        frame each way, of a size both sides know (the last exchange said it): the state, then
        HEADER bytes at the frame's end (step, size, digest, and the next exchange's frame). A state
        that outgrew its frame (and the first, whose frame is its header alone) sends the header in
        it, then the state in a frame of its own: a second message, that time only. `mine` (this
        rank's [rank, step, digest]) goes to the keeper with the replica's put."""
        into = free_slot(self.replicas, "fabtrain-replica")
        first, second, out_next = self.frames(slot, size, step, mine[2])
        frame = self.in_frame
        self.pairwise(first, into.reserve(frame)[:frame], dst, src, 71)
        got_step, got_size, in_next, got_digest = _parse_header(into.tail(frame))
        if got_step != step:
            raise RuntimeError(f"rank {src} sent step {got_step} while this rank sent {step}")
        more = got_size + HEADER > frame  # only its header came: its state follows, in a frame of in_next
        if more or second is not None:
            self.pairwise(second, into.reserve(in_next)[:in_next] if more else None, dst, src, 72)
        if more and _parse_header(into.tail(in_next))[:2] != (step, got_size):
            raise RuntimeError(f"rank {src}'s step {step} came in a frame that does not say so")
        self.in_frame, self.out_frame = in_next, out_next
        assert into.mm is not None
        if digest_of(into.mm, got_size) != got_digest:
            raise RuntimeError(f"rank {src}'s step {step} arrived with other bytes than it sent")
        into.held = True
        req = {"op": "put", "rank": src, "step": step, "world": self.world, "size": got_size}
        reply, _ = client.call({**req, "digest": got_digest, "digests": [mine]}, into.fd)
        if not reply.get("ok"):
            into.held = False
            raise RuntimeError(f"this host's keeper refused rank {src}'s step {step}: {reply.get('error')}")
        still_held(self.replicas, reply)

    def frames(
        self, slot: Slot, size: int, step: int, digest: str
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """What goes to the peer: this exchange's frame (out_frame bytes), a second one holding the
        state when it does not fit in the first, and the frame the next exchange uses. The header
        is written into the slot past the state (the keeper reads `size` bytes: the state)."""
        import torch

        assert slot.mm is not None and slot.buf is not None
        frame, want = self.out_frame, frame_for(size)
        fits = size + HEADER <= frame
        following = frame if fits and frame <= 2 * want else want  # (shrunk to half: framed anew)
        head = _header(step, size, following, digest)
        if fits:
            slot.mm[frame - HEADER : frame] = head
            return slot.buf[:frame], None, following
        slot.mm[want - HEADER : want] = head  # the slot has room: Memory.save reserved frame_for(size)
        only = torch.zeros(frame, dtype=torch.uint8)
        only[frame - HEADER :] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        return only, slot.buf[:want], following

    def pairwise(
        self, out: torch.Tensor | None, into: torch.Tensor | None, dst: int, src: int, tag: int
    ) -> None:
        """`out` to rank `dst` while `into` comes from rank `src` (either may be None), on the
        replicas' group. Every operation is waited for (bounded) even when one failed: one left
        pending on a broken connection may throw from gloo as the process exits (seen once:
        std::terminate, a rank ended with SIGABRT after its own error)."""
        import datetime

        dist = _dist()
        works = [dist.isend(out, dst, group=self.repl, tag=tag)] if out is not None else []
        if into is not None:
            works.append(dist.irecv(into, src, group=self.repl, tag=tag))
        failed: list[Exception] = []
        for w in works:
            try:
                w.wait(datetime.timedelta(seconds=TIMEOUT))
            except Exception as exc:  # noqa: BLE001 - raised below, once every operation ended
                failed.append(exc)
        if failed:
            raise failed[0]

    # -- load
    def load(self, map_location: Any = None, disk_step: int | None = None) -> Any:
        self.groups()
        self.finish()
        dist = _dist()
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
                    self.send(rank, got.step)
                elif self.rank == rank:
                    try:
                        state = self.receive(got.source[rank], got.step, got.digest[rank], map_location)
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

    def send(self, to: int, step: int) -> None:
        """Hand rank `to` its state from this node's keeper (its replica): the header always goes,
        an empty one when it cannot, so `to` never waits for bytes that will not come."""
        import torch

        dist = _dist()
        try:
            reply, fd = self.keeper().call({"op": "get", "rank": to, "step": step})
        except OSError:
            reply, fd = {}, None
        if fd is None:
            dist.send(_tensor(_header(step, -1, 0, "0" * 32)), to, group=self.ctrl)
            return
        try:
            size = reply["size"]
            with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mm:
                digest = reply.get("digest") or digest_of(mm, size)
                dist.send(_tensor(_header(step, size, 0, digest)), to, group=self.ctrl)
                t = torch.frombuffer(mm, dtype=torch.uint8)
                dist.send(t, to, group=self.ctrl)
                del t
        finally:
            os.close(fd)

    def receive(self, source: int, step: int, digest: str | None, map_location: Any) -> Any:
        import torch

        dist = _dist()
        head = torch.zeros(HEADER, dtype=torch.uint8)
        dist.recv(head, source, group=self.ctrl)
        got_step, size, _frame, got_digest = _parse_header(head.numpy().tobytes())
        if size < 0 or got_step != step:
            raise RuntimeError(f"rank {source}'s keeper could not send rank {self.rank}'s step {step}")
        buf = bytearray(max(size, 1))
        t = torch.frombuffer(buf, dtype=torch.uint8)[:size]
        dist.recv(t, source, group=self.ctrl)
        del t
        want = digest or got_digest
        got = digest_of(buf, size)
        if got != want:
            raise RuntimeError(
                f"rank {self.rank}'s step {step} from rank {source} has digest {got}, not {want}"
            )
        return decode(memoryview(buf)[:size], map_location)

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


def _header(step: int, size: int, frame: int, digest: str) -> bytes:
    """HEADER bytes about a state on its way: its step, size, the next exchange's frame, digest."""
    ints = b"".join(n.to_bytes(8, "little", signed=True) for n in (step, size, frame))
    return ints + bytes.fromhex(digest)


def _parse_header(raw: bytes) -> tuple[int, int, int, str]:
    step, size, frame = (int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8, 16))
    return step, size, frame, raw[24:HEADER].hex()


def _tensor(raw: bytes) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def frame_for(size: int) -> int:
    """The frame a state of `size` bytes goes to its peer in: room for its header, and for the state
    to grow a little (its structure's pickle changes length with the numbers in it)."""
    return _align(size + size // 64 + HEADER)


def still_held(slots: list[Slot], reply: dict) -> None:
    """A keeper's answer to a put (`inos`: the memfds it holds for that rank) marks which of
    `slots` it still holds; the others may be written again."""
    held = set(reply["inos"])
    for slot in slots:
        slot.held = slot.ino in held


def free_slot(slots: list[Slot], name: str) -> Slot:
    """A slot whose state the keeper no longer holds (a new one when each is held)."""
    for slot in slots:
        if not slot.held:
            return slot
    slots.append(Slot(name))
    return slots[-1]


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
