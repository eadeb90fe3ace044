"""One byte stream (a `docker save`, or the layers a saved image's hosts lack) fed to `docker load`
on several hosts at once, each load bounded by the push deadline: a host that fails or stalls is
named as failed and the others go on. The push (images.py) chooses what is sent and to whom."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.config.inventory import Host
from orchestrator.hostcmds import sshargs
from orchestrator.transport.remote import Command, Session, describe

if TYPE_CHECKING:
    from rich.progress import Progress


@dataclass
class PushResult:
    """How an image reached one host (or did not)."""

    host: str
    action: str  # "present" | "sent" | "failed"
    seconds: float = 0.0
    bytes: int = 0
    detail: str = ""


# A push may take as long as the image needs at PUSH_MIN_RATE bytes/s, plus a margin; a host that
# stops taking data for longer is named as failed and the others go on.
PUSH_MIN_RATE = 2e6
PUSH_MARGIN = 120


def push_deadline(size: int) -> float:
    """Seconds a push of `size` bytes may take."""
    return PUSH_MARGIN + size / PUSH_MIN_RATE


def _sender(cmds: dict[str, Command], data: bytes) -> Callable[[Host], None]:
    """Sends `data` to a host's command."""
    return lambda h: cmds[h.name].send(data)


def stream_loads(
    session: Session,
    label: str,
    size: int,
    targets: list[Host],
    progress: Progress | None,
    chunks: Iterable[bytes],
) -> list[PushResult]:
    """Send one stream of chunks to a `docker load` per host, each bounded by the push deadline."""
    failed: dict[str, str] = {}
    cmds = _open_loads(session, targets, push_deadline(size), failed)
    task = progress.add_task(label, total=size) if progress else None
    start = time.monotonic()
    sent = 0
    for chunk in chunks:
        if len(failed) == len(targets):
            break
        sent += len(chunk)
        # Every host gets each chunk before the next is read: one source, N loads, in step, on the
        # session's own worker threads.
        live = tuple(h for h in targets if h.name not in failed)
        for name, error in session.fan_out(_sender(cmds, chunk), live).errors().items():
            failed[name] = f"{name}: transfer failed: {error}"
        if progress is not None and task is not None:
            progress.update(task, completed=min(sent, size or sent))
    if progress is not None and task is not None:
        progress.remove_task(task)
    return [_finish(h, cmds.get(h.name), failed, start, sent) for h in targets]


def _open_loads(
    session: Session, targets: list[Host], deadline: float, failed: dict[str, str]
) -> dict[str, Command]:
    """A `docker load` opened on every host that takes one; why each other host failed, in `failed`."""
    cmds: dict[str, Command] = {}
    for h in targets:
        try:
            cmd = session.command(h, sshargs.shell(["docker", "load", "--quiet"]), deadline, "docker load")
            cmds[h.name] = cmd.__enter__()
        except Exception as exc:  # noqa: BLE001 - this host fails, the others go on
            failed[h.name] = describe(h, exc)
    return cmds


def _finish(h: Host, opened: Command | None, failed: dict[str, str], start: float, sent: int) -> PushResult:
    """A host's `docker load` ended (its stdin closed, its exit status read): how its push went
    (`start`: when the stream began, `sent`: the bytes it carried)."""
    try:
        if h.name not in failed and opened is not None:  # every host not failed has its command
            opened.close_stdin()
            code = opened.exit_status()
            err = b""
            while opened.channel.recv_stderr_ready():
                err += opened.channel.recv_stderr(65536)
        if opened is not None:
            opened.__exit__(None, None, None)
    except Exception as exc:  # noqa: BLE001 - e.g. the deadline passed on this host
        failed[h.name] = describe(h, exc)
    if h.name in failed:
        return PushResult(h.name, "failed", detail=failed[h.name])
    if code != 0:
        return PushResult(
            h.name, "failed", detail=f"docker load exited {code}: {err.decode(errors='replace')[-300:]}"
        )
    return PushResult(h.name, "sent", time.monotonic() - start, sent)
