"""The keeper of fabtrain_memory: the supervisor's side. fabtrain's entrypoint runs one in every
warm node (FABTRAIN_WARM=1), a thread of the supervisor, which outlives its workers: it holds, per
global rank, the newest KEEP complete states as memfds (anonymous memory: nothing on the host's
disk, gone with the container), and serves them on a UNIX socket in a directory of mode 0700 in the
container's /tmp (no network port), whose path reaches the workers as FABTRAIN_KEEPER. Beside it,
the other end of that socket: `KeeperClient`, one connection of a worker's (fabtrain_memory.Memory).

The entrypoint starts it as fabtrain_memory.Keeper (fabtrain_hook.start_memory).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass

KEEP = 2  # states per rank a keeper holds: the newest may be incomplete on another node
TIMEOUT = 120.0  # seconds any exchange with the keeper or a peer may take before it is given up


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
