"""Following one node of an attempt (watch.py follows them all, and judges the attempt): its output
streamed to the end, its exit read through Docker, what the stream missed fetched from the log's
rest; and how a node ended (`NodeEnd`), with which worker failed when its tail says so."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.backends.ssh.attempt import AttemptPlan
from orchestrator.config.inventory import Host
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.core.policy import Failure, HostFailure
from orchestrator.hostcmds import hostfiles, touched
from orchestrator.transport.logs import HostSink, missing_output
from orchestrator.transport.remote import CommandTimedOut, Session, describe


@dataclass
class NodeEnd:
    """How one node of an attempt ended."""

    host: Host
    exit_code: int | None = None  # None: never read (lost host, stuck engine before the end)
    failure: Failure | None = None
    detail: str = ""
    tail: str = ""
    by_us: bool = False  # stopped because another node failed, or by Ctrl+C
    warm: bool = False  # its container waits for the next generation (attempt.build)

    def failure_line(self) -> HostFailure:
        return HostFailure(
            self.host.name, self.failure or Failure.EXIT, self.detail + worker_failure(self.tail)
        )

    def summary(self) -> str:
        """'exited with code 3', 'lost: no SSH keepalive answer ...', 'hung: no progress ...'."""
        if self.failure in (None, Failure.EXIT):
            return self.detail
        return f"{self.failure.value}: {self.detail}"


def follow_node(
    session: Session,
    attempt: AttemptPlan,
    host: Host,
    sink: HostSink,
    note: Callable[[str, str], None],
    ended: Callable[[NodeEnd], None],
) -> None:
    """One node followed to its end (the attempt's follow, finish and, when the stream missed
    output, remainder steps), its output fed to `sink`; how it ended handed to `ended`, whatever
    happened. A lost link, a finish that timed out (a stuck engine) or a refused command is how it
    ended, never raised; `note` says what the container put where its console file was."""
    end = NodeEnd(host)
    received, window = 0, bytearray()

    def feed(data: bytes) -> None:
        nonlocal received
        received += len(data)
        window.extend(data)
        del window[:-4096]  # enough to find where the stream stopped in the log's tail
        sink.feed(data)

    try:
        session.stream(host, attempt.step(host.name, "follow").command, feed)
        finish = attempt.step(host.name, "finish")
        r = session.run(host, finish.command, timeout=finish.deadline, what=finish.what)
        refused = [ln for ln in r.stderr.splitlines() if ln.startswith(touched.REFUSED)]
        if refused:  # the container put something else where its console file was
            note(
                f"{host.name}: {hostile.line(refused[0], 300)} (its container's doing; what the "
                "follow had already read is kept)",
                "warning",
            )
        first, _, tail = r.stdout.encode().partition(b"\n")
        code = first.split()
        end.exit_code, end.warm = int(code[0] if code else 255), code[1:] == [b"warm"]
        missed = missing_output(received, bytes(window), tail, hostfiles.TAIL_BYTES)
        if missed is None:
            rest = attempt.step(host.name, "remainder")
            session.stream(
                host, rest.command.replace("+OFFSET", f"+{received + 1}"), sink.feed, timeout=rest.timeout
            )
        elif missed:
            sink.feed(missed)
        if end.exit_code != 0:
            end.failure, end.detail = Failure.EXIT, f"exited with code {end.exit_code}"
    except BaseException as exc:  # noqa: BLE001 - a lost link is an outcome, not a crash
        end.detail = describe(host, exc)
        end.failure = (
            Failure.ENGINE
            if isinstance(exc, CommandTimedOut)
            else (Failure.EXIT if isinstance(exc, UserError) else Failure.LOST)
        )
    finally:
        sink.close()
        end.tail = sink.last_lines()
        ended(end)


def failed_worker(tail: str) -> tuple[int, int] | None:
    """(rank, exit code) of the worker that failed, when the tail says: torchrun's agent exits 1
    whatever its worker did, and its root-cause report says which; the entrypoint's direct launch
    says it in one line (and exits with its code)."""
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", tail, re.S) or re.search(
        r"\[fabtrain\] worker rank (\d+) exited with code (-?\d+)", tail
    )
    return (int(m.group(1)), int(m.group(2))) if m else None


def worker_failure(tail: str) -> str:
    """' (worker rank R exited with code C)' when the tail says which worker failed, else ''."""
    got = failed_worker(tail)
    return f" (worker rank {got[0]} exited with code {got[1]})" if got else ""


# What a rank prints when its collective failed because a peer's connection broke: gloo's
# "Read error [addr]:port: Connection reset by peer" and "Connection closed by peer [addr]:port",
# NCCL's "remote process exited or there was a network error".
PEER_BROKE = re.compile(
    r"Connection (?:reset|closed) by peer|remote process exited or there was a network error"
)


def brought_down_by_a_peer(end: NodeEnd) -> bool:
    """Whether a node's ranks failed because a peer's connection broke, not of themselves: its tail
    says a peer's connection broke, and its worker did not die of a signal (code 128 + N, or -N from
    torchrun) other than SIGABRT, which a broken collective raises. A worker killed (SIGKILL: the
    OOM killer, a kill; SIGSEGV) failed of itself whatever its neighbours printed."""
    if end.failure is not Failure.EXIT or not PEER_BROKE.search(end.tail):
        return False
    worker = failed_worker(end.tail)
    code = worker[1] if worker else end.exit_code
    return code is None or not (code < 0 or code > 128) or code in (-6, 128 + 6)
