"""Where a detached job's controllers run (fab train --detach): out of the blast radius by default.

Two places, on two hosts: the active controller, and a standby that holds a mirror of the
controller's record, events and snapshots (pushed by the active one) and takes the job over when the
active one is lost (failover.py). The candidates, in order: the inventory's `controller: {host}`,
then the spares (they run no rank until a host fails), then the hosts from the last (the first is
rank 0's, the one whose loss costs most). The active controller takes the first candidate, the
standby the next; a controller on a host that runs a rank is said as a risk, in the plan and in
`fab status`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.record import Controller, ControllerPlace
from orchestrator.hostcmds import hostfiles

if TYPE_CHECKING:
    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.core.recovery import JobRecord

MIRROR = "mirror"  # in a standby's directory: what the active controller pushes (runs/JOB, done.json)


@dataclass(frozen=True)
class Place:
    """Where one controller of a detached job runs (its directory: what it owns there)."""

    job: str
    host: Host
    dir: str  # on the host: <job.output_dir>/.controllers/JOB
    container: str  # fabtrain-ctl-JOB

    def record(self) -> ControllerPlace:
        return ControllerPlace(self.host.name, self.dir, self.container)

    def mirror(self) -> Place:
        """The same host, read where the active controller pushes its copies (a standby's mirror)."""
        return replace(self, dir=f"{self.dir}/{MIRROR}")


@dataclass(frozen=True)
class Placement:
    """The active controller's place, the standby's (None: a single host), and why, for people."""

    active: Place
    standby: Place | None
    why: str
    risk: str = ""  # set when the active controller's host runs a rank of the job

    def record(self, keys: Iterable[str] = ()) -> Controller:
        """As the job's record keeps it, with the hosts that may hold the job's controller key."""
        return Controller.at(self.active.record(), self.standby.record() if self.standby else None, keys)

    def said(self) -> str:
        """One line for the plan and the detach message."""
        standby = (
            f"; its standby on {self.standby.host.name} takes the job over if it is lost"
            if self.standby
            else "; no standby: the inventory has one host"
        )
        return f"controller on {self.active.host.name} ({self.why}){standby}" + (
            f". Risk: {self.risk}" if self.risk else ""
        )


def candidates(inv: Inventory) -> list[tuple[Host, str]]:
    """Every host that may run a controller, best first, with why (module docstring)."""
    out: list[tuple[Host, str]] = []
    if inv.controller.host:
        out += [
            (h, "the inventory's controller: host") for h in inv.all_hosts if h.name == inv.controller.host
        ]
    out += [(h, "a spare: it runs no rank until a host fails") for h in inv.spares]
    last = len(inv.hosts) - 1
    out += [
        (
            h,
            "the last host: the inventory names no controller: host and no spare"
            if i == last
            else "a host of the job",
        )
        for i, h in reversed(list(enumerate(inv.hosts)))
    ]
    unique: dict[str, tuple[Host, str]] = {}
    for h, why in out:
        unique.setdefault(h.name, (h, why))
    return list(unique.values())


def placement(inv: Inventory, job_id: str) -> Placement:
    if inv.controller.host and not any(h.name == inv.controller.host for h in inv.all_hosts):
        raise UserError(
            f"--detach: the controller's host {inv.controller.host} (the inventory's controller:) is not "
            "among this job's hosts and spares: include it, or name another there",
            exit_code=2,
        )
    found = candidates(inv)
    (host, why), standby = found[0], (found[1][0] if len(found) > 1 else None)
    ranks = {h.name: i for i, h in enumerate(inv.hosts)}
    risk = ""
    if host.name in ranks:
        risk = (
            f"{host.name} also runs rank {ranks[host.name]} of the job: losing it loses a rank and the "
            "controller at once"
        )
        risk += f" (the standby on {standby.name} then takes over)" if standby else ""
    return Placement(at(inv, job_id, host), at(inv, job_id, standby) if standby else None, why, risk)


def at(inv: Inventory, job_id: str, host: Host) -> Place:
    return Place(job_id, host, hostfiles.controller_dir(inv, job_id), f"fabtrain-ctl-{job_id}")


def place(inv: Inventory, job_id: str) -> Place:
    """The active controller's place."""
    return placement(inv, job_id).active


def unfetched(record: JobRecord) -> bool:
    """A detached job whose run is still with its controller (not fetched here, not taken over)."""
    c = record.controller
    return c is not None and not c.fetched and not c.taken_over


def places_of(inv: Inventory, record: JobRecord) -> list[Place]:
    """The controllers' places a job's record names, active first ([]: not detached, or hosts this
    inventory lacks, or not a job id)."""
    c, by_name = record.controller, {h.name: h for h in inv.all_hosts}
    if c is None or not jobspec.valid_job_id(record.job_id):
        return []
    named = [c.host, c.standby.host if c.standby else None]
    return [at(inv, record.job_id, by_name[n]) for n in named if n is not None and n in by_name]


def place_of(inv: Inventory, record: JobRecord) -> Place | None:
    """The first controller a job's record names (None: not detached, or a host this inventory lacks)."""
    found, c = places_of(inv, record), record.controller
    return found[0] if found and c is not None and found[0].host.name == c.host else None
