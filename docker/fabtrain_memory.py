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

`save(step, state)` writes the state (tensors and plain Python values) straight into a new memfd
(one copy, from the GPU too) and hands the memfd to the keeper before it returns: a rank that has
returned from save(s) has step s in its keeper, which is what makes "at most one step lost" hold
(every rank that passed the collectives of step s + 1 returned from save(s)). A background thread
then hashes it (SHA-256) and exchanges it with the peer node over a gloo group of the job's own
process group (rank r of node n sends to the same local rank of node n + 1, and receives from node
n - 1's); the received state goes to this node's keeper. The next save waits for that exchange, so
its time counts in the measured cost (K grows when the network is slow).

`load()` is collective: every rank lists what its keeper holds, the ranks gather the lists, and
agree on S, the newest step held somewhere for every rank. A rank whose keeper lacks its own state
(its host was replaced by a hot spare) receives it from a rank whose keeper holds its replica,
checked against the SHA-256 its origin computed. A disk snapshot at step S or later wins
(`disk_step`). Rank 0 prints which, and how many steps were lost.

K, how often: every step when that costs at most BUDGET (3%) of a step in the training thread,
else the smallest K that does, measured over the first PROBE saves and agreed by all ranks (the
largest); FABTRAIN_MEMORY_EVERY=K forces it, 0 turns memory off.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import math
import mmap
import os
import pickle
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
BUDGET = 0.03  # the training thread's share of a step that memory may take
PROBE = 8  # saves timed (every step) before K is chosen; the first 2 are not counted
SETTLE = 2  # (groups made, the first steps' warm-up, the next generation's workers importing)
EXIT_WAIT = 10.0  # seconds a worker's exit waits for its last exchange
TIMEOUT = 120.0  # seconds any exchange with the keeper or a peer may take before it is given up
MAGIC = b"FTMEM01\n"
ALIGN = 64

# ---------------------------------------------------------------------------------------------
# The keeper: the supervisor's side.


@dataclass
class Held:
    """One state in a keeper: the memfd holding its bytes, and its SHA-256 once known."""

    rank: int
    step: int
    world: int
    size: int
    fd: int
    sha256: str | None = None

    def row(self) -> list:
        return [self.rank, self.step, self.world, self.size, self.sha256]


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
        """One request: put (a memfd), digest, list, get (a dup of the memfd), trim."""
        op = req.get("op")
        if op == "put":
            if fd is None:
                raise ValueError("put without a memfd")
            self.put(
                Held(
                    int(req["rank"]),
                    int(req["step"]),
                    int(req["world"]),
                    int(req["size"]),
                    fd,
                    req.get("sha256"),
                )
            )
            return {"ok": True}, None
        with self.lock:
            if op == "digest":
                rank, step = int(req["rank"]), int(req["step"])
                found = [h for h in self.held.get(rank, []) if h.step == step]
                for h in found:
                    h.sha256 = str(req["sha256"])
                if not found:
                    self.early = {k: v for k, v in self.early.items() if k[0] != rank or k[1] > step}
                    self.early[(rank, step)] = str(req["sha256"])
                return {"ok": True}, None
            if op == "list":
                return {"ok": True, "held": [h.row() for states in self.held.values() for h in states]}, None
            if op == "get":
                for h in self.held.get(int(req["rank"]), []):
                    if h.step == int(req["step"]):
                        reply = {"ok": True, "size": h.size, "sha256": h.sha256, "world": h.world}
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

    def put(self, new: Held) -> None:
        """A rank's states arrive in step order; one older than a state held means the job went back
        (a resume from an older step), and the states past it belong to a timeline that is gone."""
        with self.lock:
            new.sha256 = new.sha256 or self.early.pop((new.rank, new.step), None)
            states = self.held.get(new.rank, [])
            for h in states:
                if h.step >= new.step:
                    os.close(h.fd)
            states = [*(h for h in states if h.step < new.step), new]
            for h in states[: -self.keep]:
                os.close(h.fd)
            self.held[new.rank] = states[-self.keep :]


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
# The bytes of a state: MAGIC, the length of a pickle of the structure (tensors replaced by
# references), the pickle, then each tensor's bytes at an ALIGN-ed offset. Written straight into a
# memfd (no serialisation buffer), read back without torch.load.

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


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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


def encode(state: object) -> tuple[int, int]:
    """(a memfd holding `state`, its size). Tensors go in as their bytes (a GPU tensor's copied
    straight from the device); anything but tensors and plain Python values is refused here, at
    the save, rather than at the resume."""
    import torch

    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    records: list[tuple[int, int]] = []  # (relative offset, nbytes)
    end = 0

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            nonlocal end
            if type(obj) in COMMON:
                return None
            if isinstance(obj, torch.Tensor):
                if hasattr(obj, "to_local") or obj.layout != torch.strided or obj.is_quantized:
                    raise TypeError(
                        f"fabtrain_memory.save: a {type(obj).__name__} ({obj.layout}); save a "
                        "plain dense tensor (a DTensor's shard: t.to_local())"
                    )
                if id(obj) not in index:
                    index[id(obj)] = len(tensors)
                    tensors.append(obj)
                    nbytes = obj.numel() * obj.element_size()
                    records.append((end, nbytes))
                    end = _align(end + nbytes)
                i = index[id(obj)]
                return ("t", i, str(obj.dtype), tuple(obj.shape), records[i][0])
            if not _plain(obj):
                raise TypeError(
                    f"fabtrain_memory.save: the state holds a {type(obj).__module__}."
                    f"{type(obj).__qualname__}; keep to tensors and plain Python values"
                )
            return None

    meta = io.BytesIO()
    Pickler(meta, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    head = len(MAGIC) + 8 + len(meta.getbuffer())
    data_start = _align(head)
    size = data_start + end
    fd = os.memfd_create("fabtrain-state", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mm:
            mm[:head] = MAGIC + len(meta.getbuffer()).to_bytes(8, "little") + meta.getbuffer()
            if tensors:
                buf = torch.frombuffer(mm, dtype=torch.uint8)
                for t, (off, nbytes) in zip(tensors, records, strict=True):
                    if nbytes:
                        src = t.detach()
                        src = src if src.is_contiguous() else src.contiguous()
                        into = buf[data_start + off : data_start + off + nbytes]
                        into.copy_(src.reshape(-1).view(torch.uint8))
                        del into
                del buf
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def decode(data: memoryview | bytes | mmap.mmap, map_location: Any = None) -> Any:
    """The state encode() wrote, its tensors copied out of `data` (onto map_location, if given)."""
    import torch

    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a fabtrain memory state (bad magic)")
    meta_len = int.from_bytes(view[len(MAGIC) : len(MAGIC) + 8], "little")
    head = len(MAGIC) + 8 + meta_len
    data_start = _align(head)
    holder = [torch.frombuffer(data, dtype=torch.uint8)]  # emptied before the caller closes `data`

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            _tag, _i, dtype_name, shape, off = pid
            dtype = _dtype(dtype_name)
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            raw = holder[0][data_start + off : data_start + off + nbytes]
            t = (raw.view(dtype) if nbytes else torch.empty(0, dtype=dtype)).reshape(shape).clone()
            return t.to(map_location) if map_location is not None else t

        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in SAFE_CLASSES or module.split(".")[0] == "numpy":
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"fabtrain_memory: refusing {module}.{name} in a state")

    try:
        return Unpickler(io.BytesIO(view[len(MAGIC) + 8 : head])).load()
    finally:
        holder.clear()
        view.release()


def sha256_of(fd: int, size: int) -> str:
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
        return hashlib.sha256(mm).hexdigest()


# ---------------------------------------------------------------------------------------------
# Agreeing on the step to resume from: pure.


@dataclass(frozen=True)
class Agreement:
    step: int | None  # the newest step held somewhere for every rank; None: none is
    newest: int | None  # the newest step any keeper holds (for any rank)
    source: dict[int, int] = field(default_factory=dict)  # rank -> the rank whose keeper sends it
    sha256: dict[int, str | None] = field(default_factory=dict)  # rank -> the SHA-256 to expect


def agree(reports: list[list[list]], world: int) -> Agreement:
    """From each rank's list of what its keeper holds ([rank, step, world, size, sha256] rows, the
    same list from every rank of a node), the step to resume from and where each rank's state
    comes from: its own keeper when that holds it, else the lowest rank whose keeper does."""
    where: dict[int, dict[int, list[tuple[int, str | None]]]] = {r: {} for r in range(world)}
    newest = None
    for reporter, rows in enumerate(reports):
        for rank, step, w, _size, sha in rows:
            if w != world or not 0 <= rank < world:
                continue  # a state of another world (the job shrank or grew): of no use now
            where[rank].setdefault(step, []).append((reporter, sha))
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
        digests[rank] = next((sha for _, sha in holders if sha), None)  # the origin's, carried by its replica
    return Agreement(step, newest, source, digests)


def choose_every(costs: list[float], steps: list[float], budget: float = BUDGET) -> int:
    """The smallest K whose cost per step (a save's cost / K) is at most `budget` of a step."""
    cost, step = statistics.median(costs), statistics.median(steps)
    if step <= 0:
        return 1
    return max(1, math.ceil(cost / (budget * step) - 1e-9))


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
        self.calls: list[tuple[float, float]] = []  # (when a save began, its cost), while probing
        self.job: threading.Thread | None = None
        self.broken: str | None = None  # why replicas stopped (a peer died): never retried in this process
        self.last_cost = 0.0
        self.pending: int | None = None  # the step whose put the keeper has not answered yet

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
        if self.job is not None:
            self.job.join(EXIT_WAIT)
            if not self.job.is_alive():
                self.job = None
        try:
            self.acknowledged()
        except (OSError, RuntimeError):
            pass

    # -- save
    def due(self, step: int) -> bool:
        if self.k == 0:
            return False
        return self.k is None or step % self.k == 0

    def save(self, step: int, state: dict | Callable[[], dict]) -> bool:
        began = time.perf_counter()
        if not self.due(step):
            return False
        self.groups()
        if self.job is not None:
            self.job.join()  # the previous exchange: pairs must happen in the same order on every rank
            self.job = None
        self.acknowledged()
        fd, size = encode(state() if callable(state) else state)
        try:
            # Handed over once sent: the keeper's answer is read at the next save (no round trip here).
            self.keeper().send(
                {"op": "put", "rank": self.rank, "step": step, "world": self.world, "size": size}, fd
            )
            self.pending = step
        except OSError as exc:
            os.close(fd)
            raise RuntimeError(
                f"fabtrain_memory: the keeper at {self.path} did not take step {step}: {exc}"
            ) from exc
        self.job = threading.Thread(
            target=self.replicate, args=(fd, size, step), daemon=True, name="fabtrain-memory"
        )
        self.job.start()
        self.last_cost = time.perf_counter() - began
        if self.k is None:
            self.probe(began, self.last_cost)
        elif self.forced and self.rank == 0 and not self.calls:
            self.calls.append((began, self.last_cost))
            say(
                f"[fabtrain] memory: each rank's state kept every {self.k} step{'s' if self.k > 1 else ''} "
                f"({EVERY_ENV}={self.k})"
            )
        return True

    def acknowledged(self) -> None:
        """The keeper's answer to the last put, before this connection carries anything else."""
        if self.pending is None:
            return
        step, self.pending = self.pending, None
        reply, _ = self.keeper().reply()
        if not reply.get("ok"):
            raise RuntimeError(f"fabtrain_memory: the keeper refused step {step}: {reply.get('error')}")

    def probe(self, began: float, cost: float) -> None:
        """Time the first PROBE saves (made every step), then choose K with every rank: the largest."""
        self.calls.append((began, cost))
        if len(self.calls) < PROBE:
            return
        timed = self.calls[SETTLE:]
        costs = [c for _, c in timed]
        steps = [b - a - c for (a, c), (b, _) in zip(timed, timed[1:], strict=False)]
        k = choose_every(costs, steps)
        dist = _dist()
        if dist is not None and self.ctrl is not None:
            import torch

            t = torch.tensor([k], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
            k = int(t.item())
        self.k = k
        if self.rank == 0:
            c, s = statistics.median(costs), statistics.median(steps)
            say(
                f"[fabtrain] memory: each rank's state kept every {k} step{'s' if k > 1 else ''} (a copy "
                f"costs {1000 * c:.1f} ms of a {1000 * s:.1f} ms step, {c / s:.1%}; at most {BUDGET:.0%} "
                f"allowed; {EVERY_ENV}=K forces K)"
                if s > 0
                else f"[fabtrain] memory: each rank's state kept every {k} step(s)"
            )

    def replicate(self, fd: int, size: int, step: int) -> None:
        """Background: the state's SHA-256 to the keeper, then the exchange with the peer nodes."""
        try:
            sha = sha256_of(fd, size)
            client = KeeperClient(self.path)
            try:
                client.call({"op": "digest", "rank": self.rank, "step": step, "sha256": sha})
                pair = self.peers()
                if pair is not None and self.repl is not None and self.broken is None:
                    try:
                        self.exchange(client, fd, size, step, sha, *pair)
                    except Exception as exc:  # noqa: BLE001 - a peer died: training goes on, replicas stop
                        self.broken = repr(exc)
                        say(
                            f"[fabtrain] memory: rank {self.rank}'s replicas stopped at step {step} "
                            f"({type(exc).__name__}); its own host's copy is still kept"
                        )
            finally:
                client.close()
        except Exception as exc:  # noqa: BLE001 - never let the background thread end a rank
            say(f"[fabtrain] memory: rank {self.rank} could not finish step {step}'s copy ({exc!r})")
        finally:
            os.close(fd)

    def exchange(
        self, client: KeeperClient, fd: int, size: int, step: int, sha: str, dst: int, src: int
    ) -> None:
        """Send this rank's state to `dst`, receive `src`'s into a memfd for this node's keeper."""
        import datetime

        import torch

        dist = _dist()
        timeout = datetime.timedelta(seconds=TIMEOUT)
        out_head = _header(step, size, sha)
        in_head = torch.zeros(48, dtype=torch.uint8)
        works = [
            dist.isend(out_head, dst, group=self.repl, tag=71),
            dist.irecv(in_head, src, group=self.repl, tag=71),
        ]
        for w in works:
            w.wait(timeout)
        got_step, got_size, got_sha = _parse_header(in_head)
        if got_step != step:
            raise RuntimeError(f"rank {src} sent step {got_step} while this rank sent {step}")
        in_fd = os.memfd_create("fabtrain-replica", os.MFD_CLOEXEC)
        try:
            os.ftruncate(in_fd, max(got_size, 1))
            with (
                mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as out_mm,
                mmap.mmap(in_fd, max(got_size, 1)) as in_mm,
            ):
                out_t = torch.frombuffer(out_mm, dtype=torch.uint8)
                in_t = torch.frombuffer(in_mm, dtype=torch.uint8)[:got_size]
                works = [
                    dist.isend(out_t, dst, group=self.repl, tag=72),
                    dist.irecv(in_t, src, group=self.repl, tag=72),
                ]
                for w in works:
                    w.wait(timeout)
                del out_t, in_t, works
                if hashlib.sha256(memoryview(in_mm)[:got_size]).hexdigest() != got_sha:
                    raise RuntimeError(f"rank {src}'s step {step} arrived with other bytes than it sent")
            reply, _ = client.call(
                {
                    "op": "put",
                    "rank": src,
                    "step": step,
                    "world": self.world,
                    "size": got_size,
                    "sha256": got_sha,
                },
                in_fd,
            )
        finally:
            os.close(in_fd)

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
                    state = self.local(self.rank, got.step, got.sha256[self.rank], map_location)
                except Exception as exc:  # noqa: BLE001 - told to every rank below, then the disk is used
                    ok = self.failed(exc)
            for rank in sorted(r for r, q in got.source.items() if q != r):
                if self.rank == got.source[rank]:
                    self.send(rank, got.step)
                elif self.rank == rank:
                    try:
                        state = self.receive(got.source[rank], got.step, got.sha256[rank], map_location)
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

    def local(self, rank: int, step: int, sha: str | None, map_location: Any) -> Any:
        reply, fd = self.keeper().call({"op": "get", "rank": rank, "step": step})
        if fd is None:
            raise RuntimeError(f"this host's keeper no longer holds rank {rank}'s step {step}")
        try:
            with mmap.mmap(fd, reply["size"], access=mmap.ACCESS_COPY) as mm:
                if sha and hashlib.sha256(mm).hexdigest() != sha:
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
            dist.send(_header(step, -1, "0" * 64), to, group=self.ctrl)
            return
        try:
            size = reply["size"]
            with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mm:
                sha = reply.get("sha256") or hashlib.sha256(mm).hexdigest()
                dist.send(_header(step, size, sha), to, group=self.ctrl)
                t = torch.frombuffer(mm, dtype=torch.uint8)
                dist.send(t, to, group=self.ctrl)
                del t
        finally:
            os.close(fd)

    def receive(self, source: int, step: int, sha: str | None, map_location: Any) -> Any:
        import torch

        dist = _dist()
        head = torch.zeros(48, dtype=torch.uint8)
        dist.recv(head, source, group=self.ctrl)
        got_step, size, got_sha = _parse_header(head)
        if size < 0 or got_step != step:
            raise RuntimeError(f"rank {source}'s keeper could not send rank {self.rank}'s step {step}")
        buf = bytearray(max(size, 1))
        t = torch.frombuffer(buf, dtype=torch.uint8)[:size]
        dist.recv(t, source, group=self.ctrl)
        del t
        digest = hashlib.sha256(memoryview(buf)[:size]).hexdigest()
        if digest != (sha or got_sha):
            raise RuntimeError(
                f"rank {self.rank}'s step {step} from rank {source} has SHA-256 "
                f"{digest[:16]}, not {(sha or got_sha)[:16]}"
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
            behind = "" if got.newest is None else f", {max(0, got.newest - disk_step)} steps lost"
            say(f"[fabtrain] resumed from the disk snapshot at step {disk_step} (memory: {held}){behind}")
        elif got.newest is not None:
            say(
                f"[fabtrain] memory holds no step for every rank (newest seen {got.newest}) and there is no "
                "disk snapshot: starting afresh"
            )


def _header(step: int, size: int, sha: str) -> torch.Tensor:
    import torch

    raw = (
        step.to_bytes(8, "little", signed=True) + size.to_bytes(8, "little", signed=True) + bytes.fromhex(sha)
    )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _parse_header(t: torch.Tensor) -> tuple[int, int, str]:
    raw = bytes(t.tolist())
    return (
        int.from_bytes(raw[:8], "little", signed=True),
        int.from_bytes(raw[8:16], "little", signed=True),
        raw[16:48].hex(),
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
