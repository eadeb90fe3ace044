"""fab train --queue: a job's place in the queues of its hosts while their GPUs (slots) are held
(queue.queue_scan_script states the queue's rule). The place is taken, renewed while the job
waits (a place not renewed for hostfiles.LEASE_STALE is dropped by the others), and left when
the job starts or ends.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from orchestrator.hosts import claims, queue
from orchestrator.transport import deadlines

if TYPE_CHECKING:
    from collections.abc import Callable

    from orchestrator.backends.ssh.state import Queued
    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.core import jobspec
    from orchestrator.transport.remote import Result, Session

QUEUE_POLL = 5.0  # seconds between a queued job's tries (each renews its place: hostfiles.LEASE_STALE)


class Place:
    """The job's place (its ticket, queue.new_ticket) in its hosts' queues, and what was last said
    about it."""

    def __init__(
        self,
        inv: Inventory,
        spec: jobspec.JobSpec,
        ticket: str,
        note: Callable[[str, str], None],
        emit: Callable[..., None],
    ) -> None:
        self.inv, self.spec, self.ticket = inv, spec, ticket
        self.note, self.emit = note, emit
        self.hosts: tuple[Host, ...] = ()  # where the job holds a place now
        self.since = 0.0
        self.position: int | None = None

    def keep(self, session: Session, hosts: tuple[Host, ...], q: Queued) -> None:
        """Take (or renew) the place on every host; say the position when it changes."""
        want = claims.want_of(self.spec, self.inv.job.nproc_per_node)

        def enqueue(h: Host) -> Result:
            asked = want.of(h, 0)
            script = queue.enqueue_script(
                self.inv,
                self.spec.job_id,
                self.ticket,
                self.spec.owner,
                asked if isinstance(asked, tuple) else (),
            )
            return session.run(
                h, script, timeout=deadlines.STATUS_TIMEOUT, what="keeping its place in the queue"
            )

        got = session.fan_out(enqueue, hosts)
        ahead: dict[str, list[queue.Waiting]] = {}
        for name in got:
            r = got.value(name)
            if r is None:
                continue
            ahead[name], _ = queue.parse_queue_output(r.stdout)
            for warning in queue.queue_warnings(name, r.stdout):
                self.note(warning, "warning")
        if not self.hosts:
            self.hosts, self.since = hosts, time.time()
        position = 1 + max((len(v) for v in ahead.values()), default=0)
        if position != self.position:
            self.position = position
            waits = "; ".join(
                f"{n}: behind {', '.join(w.job for w in v)}" for n, v in ahead.items() if v
            ) or (f"{q.host.name}: held by {', '.join(c.job for c in q.held) or 'another job'}")
            self.note(
                f"queued: position {position} ({waits}); it starts by itself when its hosts are free. "
                f"'fab status' shows the queue; 'fab stop --job {self.spec.job_id}' leaves it",
                "info",
            )
            self.emit("queued", position=position, waits=waits)

    def leave(self, session: Session) -> None:
        """The places removed (the job starts, or ended while it waited)."""
        if self.hosts:
            hosts, self.hosts = self.hosts, ()
            command = queue.dequeue_command(self.inv, self.spec.job_id)
            session.fan_out(
                lambda h: session.run(h, command, timeout=deadlines.STATUS_TIMEOUT, what="leaving the queue"),
                hosts,
            )
            self.note(f"left the queue after {time.time() - self.since:.0f}s", "info")

    def forget(self) -> None:
        """The places are gone already (released with the job's claims): nothing to leave."""
        self.hosts = ()
