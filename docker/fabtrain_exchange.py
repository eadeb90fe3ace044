"""fabtrain_memory's exchanges of states between ranks, over gloo groups of the job's own process
group. At a save (`Replicas`, the worker's background thread): the state's digest, and the state
sent to the same local rank of the next node (node n to node n + 1, the last to the first) while
the previous node's comes here, one frame each way, checked against its digest and handed to this
node's keeper. At a load (`send_held`, `receive_held`): a rank whose keeper lacks its own state
receives it from the rank whose keeper holds its replica.
"""

from __future__ import annotations

import mmap
import os
import sys
from typing import TYPE_CHECKING, Any

from fabtrain_keeper import TIMEOUT, KeeperClient
from fabtrain_state import HEADER, Slot, decode, digest_of, frame_for, free_slot, still_held

if TYPE_CHECKING:
    import torch


def distributed() -> Any:
    """torch.distributed once the job's process group is made; None before, or without torch."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Replicas:
    """This rank's replicas: each kept state's digest and exchange with the peer nodes, one after
    the other on the worker's background thread (Memory.background)."""

    def __init__(self, path: str, rank: int, world: int, nproc: int) -> None:
        self.path, self.rank, self.world, self.nproc = path, rank, world, nproc
        self.repl: Any = None  # a gloo group for the exchanges (made by Memory.groups)
        self.broken: str | None = None  # why replicas stopped (a peer died): never retried in this process
        self.slots: list[Slot] = []  # the memfds the peer's states are received into, in turn
        self.client: KeeperClient | None = None  # the background thread's connection to the keeper
        # The frames the next exchange sends and receives in (exchange): the first's, its header alone.
        self.out_frame = self.in_frame = HEADER

    def peers(self) -> tuple[int, int] | None:
        """(the rank this rank's states go to, the rank whose states come here), None alone."""
        nnodes = self.world // self.nproc
        if nnodes < 2 or self.world % self.nproc:
            return None
        node, local = divmod(self.rank, self.nproc)
        return ((node + 1) % nnodes) * self.nproc + local, ((node - 1) % nnodes) * self.nproc + local

    def replicate(self, slot: Slot, size: int, step: int) -> None:
        """The state's digest, and the exchange with the peer nodes; the digest reaches the keeper
        with the replica received (one message), or alone."""
        client = None
        try:
            assert slot.mm is not None
            digest = digest_of(slot.mm, size)
            client = self.client = self.client or KeeperClient(self.path)
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
                    client = self.client = KeeperClient(self.path)
            client.call({"op": "digest", "digests": [mine]})
        except Exception as exc:  # noqa: BLE001 - never let the background thread end a rank
            say(f"[fabtrain] memory: rank {self.rank} could not finish step {step}'s copy ({exc!r})")
            if client is not None:  # as above: the next job connects anew
                client.close()
                self.client = None

    def exchange(
        self, client: KeeperClient, slot: Slot, size: int, step: int, mine: list, dst: int, src: int
    ) -> None:
        """Send this rank's state to `dst`, receive `src`'s into a memfd for this node's keeper. One
        frame each way, of a size both sides know (the last exchange said it): the state, then
        HEADER bytes at the frame's end (step, size, digest, and the next exchange's frame). A state
        that outgrew its frame (and the first, whose frame is its header alone) sends the header in
        it, then the state in a frame of its own: a second message, that time only. `mine` (this
        rank's [rank, step, digest]) goes to the keeper with the replica's put."""
        into = free_slot(self.slots, "fabtrain-replica")
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
        still_held(self.slots, reply)

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

        dist = distributed()
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


def send_held(client: KeeperClient, group: Any, to: int, step: int) -> None:
    """Hand rank `to` its state at `step` from this node's keeper (`client`: its replica), on
    `group`: the header always goes, an empty one when it cannot, so `to` never waits for bytes that
    will not come."""
    import torch

    dist = distributed()
    try:
        reply, fd = client.call({"op": "get", "rank": to, "step": step})
    except OSError:
        reply, fd = {}, None
    if fd is None:
        dist.send(_tensor(_header(step, -1, 0, "0" * 32)), to, group=group)
        return
    try:
        size = reply["size"]
        with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mm:
            digest = reply.get("digest") or digest_of(mm, size)
            dist.send(_tensor(_header(step, size, 0, digest)), to, group=group)
            t = torch.frombuffer(mm, dtype=torch.uint8)
            dist.send(t, to, group=group)
            del t
    finally:
        os.close(fd)


def receive_held(group: Any, source: int, rank: int, step: int, digest: str | None, map_location: Any) -> Any:
    """This rank's (`rank`) state at `step` from rank `source`'s keeper (send_held), on `group`,
    checked against `digest` (its origin's) or else the one it came with."""
    import torch

    dist = distributed()
    head = torch.zeros(HEADER, dtype=torch.uint8)
    dist.recv(head, source, group=group)
    got_step, size, _frame, got_digest = _parse_header(head.numpy().tobytes())
    if size < 0 or got_step != step:
        raise RuntimeError(f"rank {source}'s keeper could not send rank {rank}'s step {step}")
    buf = bytearray(max(size, 1))
    t = torch.frombuffer(buf, dtype=torch.uint8)[:size]
    dist.recv(t, source, group=group)
    del t
    want = digest or got_digest
    got = digest_of(buf, size)
    if got != want:
        raise RuntimeError(f"rank {rank}'s step {step} from rank {source} has digest {got}, not {want}")
    return decode(memoryview(buf)[:size], map_location)


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
