"""Image distribution in about the time of one transfer: a pipelined chain of hosts, and only the
layers they lack.

This machine sends one stream to the first host of a chain; a small relay there (relay.py, run with
the host's python3) feeds it to the host's own `docker load` and, at the same time, forwards every
chunk over the cluster network to the next host's relay, and so on. N hosts then cost about one
transfer through this machine's link, and the chain runs at the pace of its slowest host.

What is sent: the image's `docker save` tarball, less the `layer.tar` of every layer that every
host of the chain already holds. A host "holds" a layer when it holds an image whose layers start
with the same layers up to it (the layer's chain ID, as Docker's layer store keys layers). Docker
20.10's `docker load` reads a layer's file only when its store lacks that chain ID, so such a
tarball loads where those layers are, and fails (names the missing file) where they are not: that
host is then sent the whole image directly.

Everything about which host gets what is pure (plan_hosts, relink, judge_round) and unit-tested;
run_round is the one function that runs a chain on real hosts. Every step has a deadline: the
relays time out on a stalled socket (`stall` seconds) and on their whole run, and run_round
stops waiting for a host that has said nothing for `stall` seconds.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.config.inventory import Host
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import sshargs
from orchestrator.images.relay import Relay, Report, control_line
from orchestrator.transport.remote import Session

CHUNK = 1 << 20


# ---- layers: which ones a host lacks -------------------------------------------------------------


def chain_ids(diff_ids: list[str] | tuple[str, ...]) -> list[str]:
    """The chain ID of each layer prefix (OCI image spec): what Docker's layer store keys a layer by,
    so a layer counts as present only on top of the same layers below it."""
    out: list[str] = []
    for diff in diff_ids:
        out.append(diff if not out else "sha256:" + hashlib.sha256(f"{out[-1]} {diff}".encode()).hexdigest())
    return out


def held_chain_ids(layer_lists: list[list[str]]) -> frozenset[str]:
    """Every chain ID a host holds, from the layer lists (RootFS.Layers) of all its images."""
    return frozenset(c for layers in layer_lists for c in chain_ids(layers))


def missing_layers(diff_ids: list[str] | tuple[str, ...], held: frozenset[str]) -> tuple[int, ...]:
    """Indices of the image's layers whose chain ID the host does not hold."""
    return tuple(i for i, c in enumerate(chain_ids(diff_ids)) if c not in held)


@dataclass(frozen=True)
class Probe:
    """What one look at a host found: the id under the tag (None: absent), the chain IDs of
    everything it holds, and whether it has a python3 to run the relay."""

    image_id: str | None
    held: frozenset[str]
    python: bool


PROBE_SCRIPT = (
    "\n"
    "command -v python3 >/dev/null 2>&1 && echo python yes || echo python no\n"
    "ids=$(docker image ls --all --quiet --no-trunc) || exit 3\n"
    "printf 'id %s\\n' \"$(docker image inspect --format '{{.Id}}' \"$1\" 2>/dev/null)\"\n"
    "[ -z \"$ids\" ] || docker image inspect --format 'layers {{json .RootFS.Layers}}' "
    "$(printf '%s\\n' $ids | sort -u)\n"
)


def probe_command(image: str) -> str:
    return sshargs.shell(["sh", "-c", PROBE_SCRIPT, "sh", image])


def parse_probe(stdout: str) -> Probe:
    image_id, python, lists = None, False, []
    for line in stdout.splitlines():
        key, _, rest = line.partition(" ")
        if key == "python":
            python = rest.strip() == "yes"
        elif key == "id":
            image_id = rest.strip() or None
        elif key == "layers":
            lists.append(json.loads(rest) or [])
    return Probe(image_id, held_chain_ids(lists), python)


# ---- the plan: who is already done, who goes in the chain, who is sent directly -----------------


@dataclass(frozen=True)
class HostPlan:
    present: tuple[str, ...]  # same image id: nothing to send
    chain: tuple[str, ...]  # in chain order: this machine -> chain[0] -> chain[1] ...
    direct: tuple[str, ...]  # sent straight from this machine (see plan_hosts)
    failed: dict = field(default_factory=dict)  # host -> why it could not be looked at
    send: tuple[int, ...] = ()  # layer indices the chain's stream carries
    need: dict = field(default_factory=dict)  # host -> layer indices it lacks


def plan_hosts(
    want_id: str, diff_ids: tuple[str, ...], hosts: tuple[str, ...], probes: dict, method: str = "chain"
) -> HostPlan:
    """Who needs what. probes: host -> Probe, or a string saying why the host could not be probed.
    The chain keeps the inventory's order; a host without python3 (no relay) is sent directly, as is
    every host with method="direct". The stream carries the union of the layers the chain's hosts
    lack, so one stream serves all of them."""
    if method not in ("chain", "direct"):
        raise UserError(f"image push method {method!r}: use chain or direct")
    present: list[str] = []
    chain: list[str] = []
    direct: list[str] = []
    failed: dict[str, str] = {}
    need: dict[str, tuple[int, ...]] = {}
    for h in hosts:
        p = probes[h]
        if isinstance(p, str):
            failed[h] = p
        elif p.image_id == want_id:
            present.append(h)
        else:
            need[h] = missing_layers(diff_ids, p.held)
            (chain if method == "chain" and p.python else direct).append(h)
    send = tuple(sorted({i for h in chain for i in need[h]}))
    return HostPlan(tuple(present), tuple(chain), tuple(direct), failed, send, need)


def relink(chain: tuple[str, ...], unreachable: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A host its upstream could not connect to leaves the chain (it is sent directly); the chain
    closes over the gap. Returns (new chain, hosts to send directly)."""
    return tuple(h for h in chain if h not in unreachable), tuple(h for h in chain if h in unreachable)


@dataclass(frozen=True)
class RoundOutcome:
    loaded: tuple[str, ...]
    failed: dict  # host -> why (named to the user)
    retry: tuple[str, ...]  # got a short stream because a host before it failed: goes in the next chain
    load_failed: tuple[str, ...] = ()  # its own `docker load` failed on a stream it received whole


def judge_round(chain: tuple[str, ...], reports: dict, size: int) -> RoundOutcome:
    """What a chain's round means for each host. reports: host -> Report, or a string saying why
    the relay gave no report (lost, timed out).

    A host whose relay gave no report is named (it stopped mid-chain). A host that got the whole
    stream and whose `docker load` failed is named with its error (its relay still forwarded, so
    the hosts after it are unaffected). A host that got a short stream is retried in a chain
    reformed without the named hosts when something before it failed; otherwise (nothing upstream
    explains it) it is named too, so every round ends with each host loaded, named, or retried for
    a reason, and the rounds end."""
    loaded, failed, retry, load_failed = [], {}, [], []
    broken_before = False
    for i, h in enumerate(chain):
        r = reports.get(h)
        upstream = chain[i - 1] if i else "this machine"
        if isinstance(r, str) or r is None:
            failed[h] = r or f"{h}: the image relay gave no report"
            broken_before = True
            continue
        if r.received < size:
            if broken_before or (
                i and isinstance(reports.get(chain[i - 1]), Report) and reports[chain[i - 1]].next_error
            ):
                retry.append(h)
            else:
                failed[h] = f"{h}: received {r.received} of {size} bytes from {upstream}" + (
                    f" ({r.source_error})" if r.source_error else ""
                )
            broken_before = True
            continue
        if r.load_exit == 0:
            loaded.append(h)
        else:
            load_failed.append(h)
            failed[h] = f"{h}: docker load exited {r.load_exit}: {r.load_error.strip()[-300:]}"
        if r.next_error:
            broken_before = True
    return RoundOutcome(tuple(loaded), failed, tuple(retry), tuple(load_failed))


# ---- the local tarball: saved once, sent less the layers nobody lacks ---------------------------


class Spool:
    """`docker save` of the image into a local file, indexed so that a stream can leave out
    layer files: byte ranges of the saved tarball, which stays valid for `docker load` as long as
    the left-out layers are in the receiving engine's store."""

    def __init__(self, path: Path, folder: tempfile.TemporaryDirectory | None = None) -> None:
        self.path, self._dir = Path(path), folder
        self.total = self.path.stat().st_size
        with tarfile.open(self.path) as tar:
            members = tar.getmembers()
            manifest_file = tar.extractfile("manifest.json")
            if manifest_file is None:  # a link or a folder by that name: no image tarball
                raise UserError(f"{path}: manifest.json is not a file")
            manifest = json.load(manifest_file)
        if len(manifest) != 1:
            raise UserError(f"{path}: expected one image in manifest.json, found {len(manifest)}")
        self.layer_paths: list[str] = manifest[0]["Layers"]
        # Each member's bytes: from its first header block to the end of its padded data.
        self._spans = [(m.name, m.offset, m.offset_data + -(-m.size // 512) * 512) for m in members]
        self._end = self._spans[-1][2] if self._spans else 0

    def ranges(self, layers: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
        """Byte ranges of a tarball carrying only these layer indices (None: all), merged."""
        skip = set() if layers is None else {p for i, p in enumerate(self.layer_paths) if i not in layers}
        out: list[tuple[int, int]] = []
        # The members, then the end-of-archive blocks.
        for start, end in [(a, b) for name, a, b in self._spans if name not in skip] + [
            (self._end, self.total)
        ]:
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], end)
            elif end > start:
                out.append((start, end))
        return out

    @classmethod
    def save(cls, image: str, directory: str | None = None, timeout: float = 3600) -> Spool:
        """`docker save` of a local image into a private temporary folder (removed by close)."""
        folder = tempfile.TemporaryDirectory(prefix="fabtrain-push-", dir=directory)
        path = Path(folder.name) / "image.tar"
        try:
            with open(path, "wb") as f:
                proc = subprocess.run(
                    ["docker", "save", image], stdout=f, stderr=subprocess.PIPE, timeout=timeout
                )
            if proc.returncode != 0:
                raise UserError(
                    f"docker save {image} failed: {proc.stderr.decode(errors='replace').strip()[-300:]}"
                )
            return cls(path, folder)
        except subprocess.TimeoutExpired:
            folder.cleanup()
            raise UserError(f"docker save {image} did not finish within {timeout:g}s") from None
        except BaseException:
            folder.cleanup()
            raise

    @staticmethod
    def size(ranges: list[tuple[int, int]]) -> int:
        return sum(b - a for a, b in ranges)

    def chunks(self, ranges: list[tuple[int, int]]) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            for a, b in ranges:
                f.seek(a)
                left = b - a
                while left:
                    data = f.read(min(CHUNK, left))
                    if not data:
                        raise UserError(f"{self.path}: shorter than its own index")
                    left -= len(data)
                    yield data

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()


# ---- one round of a chain on real hosts ---------------------------------------------------------


@dataclass
class RoundResult:
    reports: dict  # host -> Report, or why there is none (the round ran)
    unreachable: tuple[str, ...] = ()  # its upstream could not connect to it (the round did not run)
    dead: dict = field(default_factory=dict)  # host -> why its relay did not start (the round did not run)
    sent: int = 0


def run_round(
    session: Session,
    hosts: tuple[Host, ...],
    chunks: Iterable[bytes],
    size: int,
    deadline: float,
    stall: float = 60,
    connect: float = 5,
    on_sent: Callable[[int], object] | None = None,
) -> RoundResult:
    """Run one chain over `hosts` (in order), feeding it `chunks` (bytes, `size` in all)."""
    relays = [Relay(session, h, i == 0, deadline) for i, h in enumerate(hosts)]
    threads = [threading.Thread(target=r.start, daemon=True) for r in relays]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        not_run = _link(relays, size, deadline, stall, connect)
        if not_run is not None:
            return not_run
        sent = _feed(relays[0], chunks, on_sent)
        return RoundResult(_reports(relays, stall), sent=sent)
    finally:
        for r in relays:
            r.close()


def _link(
    relays: list[Relay], size: int, deadline: float, stall: float, connect: float
) -> RoundResult | None:
    """Every started relay's port, its control line (the next hop), then each link to the next host;
    why the round cannot run (relays that did not start or link, hosts their upstream could not
    reach), or None when the chain is linked."""
    started = time.monotonic() + connect + 10
    dead = {
        r.host.name: r.error or f"{r.host.name}: the image relay did not start within {connect + 10:g}s"
        for r in relays
        if not r.wait_for("port", started)
    }
    if dead:  # named; the others go on in a chain reformed without them
        return RoundResult({}, dead=dead)
    token = secrets.token_hex(16)
    for i, r in enumerate(relays):
        nxt = relays[i + 1] if i + 1 < len(relays) else None
        next_hop = None
        if nxt:
            assert nxt.port is not None  # every relay said its port (wait_for above)
            next_hop = (nxt.host.address, nxt.port)
        r.cmd.send(control_line(token, next_hop, size, stall, deadline, connect))
    linked_by = time.monotonic() + connect + 10
    unreachable = []
    for i, r in enumerate(relays[:-1]):
        if r.wait_for("link", linked_by) and r.link:
            unreachable.append(relays[i + 1].host.name)
        elif r.link is None:  # it said nothing: the relay itself is the one that failed
            dead[r.host.name] = (
                r.error or f"{r.host.name}: the image relay did not link within {connect + 10:g}s"
            )
    if dead:
        return RoundResult({}, dead=dead)
    if unreachable:
        return RoundResult({}, unreachable=tuple(unreachable))
    return None


def _feed(head: Relay, chunks: Iterable[bytes], on_sent: Callable[[int], object] | None) -> int:
    """The stream into the chain's first relay; the bytes sent."""
    sent = 0
    try:
        for data in chunks:
            head.cmd.send(data)
            sent += len(data)
            if on_sent:
                on_sent(sent)
        head.cmd.close_stdin()
    except Exception:  # noqa: BLE001 - the first host failed: judged from its report (_reports)
        pass
    return sent


def _reports(relays: list[Relay], stall: float) -> dict:
    """Each host's Report, or why there is none, once every relay has reported or gone silent."""
    # Every live relay reports within `stall` s of its upstream stopping; a host silent for
    # longer than that (frozen, lost) gets no more waiting.
    while True:
        pending = [r for r in relays if r.report is None and not r.done.is_set()]
        if not pending or time.monotonic() - max(r.heard for r in relays) > stall + 10:
            break
        pending[0].done.wait(0.2)
    return {
        r.host.name: r.report
        if r.report is not None
        else (r.error or f"{r.host.name}: stopped answering mid-chain (nothing for {stall:g}s)")
        for r in relays
    }
