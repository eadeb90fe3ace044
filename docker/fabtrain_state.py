"""The bytes of a fabtrain_memory state: HEAD bytes (MAGIC, then where the structure lies and its
length), each tensor's bytes at an ALIGN-ed offset, then a pickle of the structure (tensors replaced
by references), the whole padded to ALIGN. The tensors come first so that they lie where they lay at
the last step (the structure's pickle changes its length with the numbers in it). Written straight
into a memfd (`Slot`, no serialisation buffer), read back without torch.load (`decode`), checked
with `digest_of`. A slot keeps room past the state for the frame it goes to the peer in
(`frame_for`, fabtrain_exchange).
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAGIC = b"FTMEM02\n"
ALIGN = 64
HEAD = 64  # MAGIC, the structure's offset and length, zeros: the tensors' bytes begin here
HEADER = 40  # bytes ending a frame of an exchange: step, size, the next exchange's frame, digest
DIGEST_BLOCK = 64  # 64-bit words digest_of sums as one block (512 bytes)
DIGEST_WORDS = 1 << 20  # words a pass of digest_of takes at once (8 MiB), a multiple of DIGEST_BLOCK
MASK = (1 << 64) - 1

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
