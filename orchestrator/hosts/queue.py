"""The queue of jobs waiting for a host (fab train --queue): one file per waiting job in the host's
claims directory (claimdir.py), ordered by its ticket (new_ticket). The claim script (claims.py)
keeps a job from a host while one queued there before it waits (queue_scan_script states the rule).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from orchestrator.config.inventory import Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.hostcmds import hostfiles, sshargs
from orchestrator.hosts.claimdir import (
    FUTURE_SLACK,
    entries_script,
    first_fields,
    host_dir,
    ignored_warnings,
    locked,
    units_text,
    where,
)

TICKET_RE = re.compile(r"[0-9]{20}-[A-Za-z0-9._-]+")
QUEUED = 8  # the claim script's exit code when a job queued before it waits for this host
QUEUE = "queue"  # in the host's claims directory: one file per job waiting for the host


@dataclass(frozen=True)
class Waiting:
    """One job's place in a host's queue (fab train --queue)."""

    job: str
    who: str = ""
    since: float = 0.0
    ticket: str = ""  # the order: earlier tickets go first (new_ticket)
    wants: str = ""  # the units it asked for here ("" or all: the whole host)
    age: float = 0.0  # seconds since its fab train last renewed the place

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)) if self.since else "?"
        return f"{self.job} (queued by {self.who or 'unknown'} at {when})"


def new_ticket(job_id: str) -> str:
    """A queued job's place in every host's queue: the time it first asked, then its id (two jobs
    queued at the same moment get distinct places, the same order on every host)."""
    return f"{time.time_ns():020d}-{job_id}"


def parse_waiting(line: str) -> Waiting | None:
    """'JOB age=.. who=.. since=.. ticket=.. wants=..' (the survey's and the claim script's lines;
    the first of a key counts, claimdir.first_fields)."""
    job, *fields = line.split() or [""]
    if not jobspec.valid_job_id(job):
        return None
    kv = first_fields(fields)

    def number(key: str) -> float:
        try:
            return float(kv.get(key, "0"))
        except ValueError:
            return 0.0

    ticket = kv.get("ticket", "")
    return Waiting(
        job,
        hostile.line(kv.get("who", ""), 100),
        number("since"),
        ticket if TICKET_RE.fullmatch(ticket) else "",
        kv.get("wants", ""),
        number("age"),
    )


def queue_order(waiting: list[Waiting]) -> list[Waiting]:
    """A host's queue, first first."""
    return sorted(waiting, key=lambda w: (w.ticket or "~", w.job))


def queue_scan_script(
    inv: Inventory, job_id: str, ticket: str | None, who: str, wants: tuple[int, ...]
) -> str:
    """Part of claims.claim_script and enqueue_script (in the claims directory, under its lock, `now`
    set, claimdir.entries_script's functions defined): each other job's place in the host's queue is
    judged by the host's own clock: one its fab train has not renewed for hostfiles.LEASE_STALE s, or
    dated more than claimdir.FUTURE_SLACK s ahead (nobody renews it: it would be fresh until that date
    came), is dropped and said (`dropped JOB age=A ...`, A negative when dated ahead); one queued
    before this job's `ticket` (any, for a job that is not queued) is said (`ahead JOB ...`) and sets
    `ahead`. A file that is no place at all (a link, not a regular file, not named by a job id, no
    ticket of new_ticket's form) is named (`ignored`) and holds up nobody. Defines `wait_here CODE`:
    with a ticket, take or renew this job's place, then exit CODE.

    The queue's rule: first come, first served on each host. A job does not start on a host while a
    job queued there before it still waits, even when it would fit beside the running ones: with
    no run times known, a small job started beside the head of the queue could keep it waiting for
    ever. A job whose hosts nobody waits for starts as soon as its GPUs (slots) are free."""
    q = sshargs.shell
    mine = q([f"{QUEUE}/{job_id}"])
    take = (
        f"if [ -f {mine} ] && [ ! -L {mine} ]; then touch {mine}; else rm -f {mine} {QUEUE}/.{job_id}.tmp; "
        f'( set -C; printf "who=%s\\nsince=%s\\nticket=%s\\nwants=%s\\n" {q([who])} "$now" {q([ticket])} '
        f"{q([units_text(wants) or 'all'])} > {QUEUE}/.{job_id}.tmp ) && "
        f"mv -T {QUEUE}/.{job_id}.tmp {mine}; fi; "
        if ticket
        else ""
    )
    before = f'[ "$t" \\< {q([ticket])} ]' if ticket else "true"
    digits = "[0-9]" * 20
    return (
        hostfiles.shared_dir_script(QUEUE, check=False) + 'ahead=""; '
        f'for f in {QUEUE}/*; do [ "$f" = {mine} ] && continue; entry "$f" || continue; '
        f't=$(printf "%s\\n" "$c" | sed -n "s/^ticket=//p"); '
        # One ticket= line of new_ticket's form, or this is no place (forged, or not ours).
        f'case "$t" in {digits}-*[!A-Za-z0-9._-]*) t="";; {digits}-?*) ;; *) t="";; esac; '
        '[ -n "$t" ] || { ignored "$f" ticket; continue; }; '
        'line="$j age=$a $(printf %s "$c" | tr "\\n" " ")"; '
        f'if [ "$a" -lt -{FUTURE_SLACK} ] || [ "$a" -ge {int(hostfiles.LEASE_STALE)} ]; then '
        # printf, not echo: dash's echo would make a line of a \n in the file's text.
        'rm -f "$f"; printf "dropped %s\\n" "$line"; continue; fi; '
        f'if {before}; then printf "ahead %s\\n" "$line"; ahead=1; fi; done; '
        f'wait_here() {{ {take}exit "$1"; }}; '
    )


def dequeue_command(inv: Inventory, job_id: str) -> str:
    """Leave the host's queue (the job started, or ended while it waited)."""
    return f'd={host_dir(inv)}; rm -f "$d"/{QUEUE}/{sshargs.shell([job_id])}'


def enqueue_script(inv: Inventory, job_id: str, ticket: str, who: str, wants: tuple[int, ...]) -> str:
    """Take or renew the job's place in the host's queue (under its lock); prints what the queue
    scan says (jobs ahead, places dropped). Exits 0."""
    scan = queue_scan_script(inv, job_id, ticket, who, wants)
    return locked(inv, f"now=$(date +%s); {entries_script()}{scan}wait_here 0")


def parse_queue_output(text: str) -> tuple[list[Waiting], list[Waiting]]:
    """(ahead, dropped): the jobs queued before this one on the host, and the places dropped."""
    ahead: list[Waiting] = []
    dropped: list[Waiting] = []
    for line in text.split("\n"):  # only the scripts' own newlines: splitlines() also breaks at \r, \f ...
        word, _, rest = line.partition(" ")
        if word in ("ahead", "dropped") and (w := parse_waiting(rest)):
            (ahead if word == "ahead" else dropped).append(w)
    return queue_order(ahead), dropped


def dropped_why(age: float, host: str) -> str:
    """Why a place `age` s old by `host`'s clock was dropped (the queue scan's rule)."""
    if age < 0:
        return (
            f"future-dated by {-age:.0f} s on {host}'s clock (more than the {FUTURE_SLACK} s allowed): "
            "fab train dates its places by the host's own clock, so something else wrote this date, "
            "and the place would have held up every later job until then"
        )
    return (
        f"not renewed for {age:.0f} s (its fab train, or controller, renews it every few seconds while "
        f"it waits; a place is dropped after {hostfiles.LEASE_STALE:g} s)"
    )


def queue_warnings(host: str, text: str) -> list[str]:
    """The warnings the queue scan's output (enqueue_script, claims.claim_script) calls for: each
    place dropped, by its path on the host, its owner and why; each file ignored."""
    here = where(text)
    return [
        f"{host}: dropped {here}/{QUEUE}/{w.job} from the queue, the place of {w.describe()}: "
        f"{dropped_why(w.age, host)}"
        for w in parse_queue_output(text)[1]
    ] + ignored_warnings(host, text)
