"""The queue of jobs waiting for a host (fab train --queue): one file per waiting job in the host's
claims directory (claimdir.py), ordered by its ticket (new_ticket). The claim script (claims.py)
keeps a job from a host while one queued there before it waits (queue_scan_script states the rule).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

from orchestrator.commands import hostfiles, sshargs
from orchestrator.config.inventory import Inventory
from orchestrator.core import jobspec
from orchestrator.hosts.claimdir import host_dir, locked, units_text

TICKET_RE = re.compile(r"[0-9]{20}-[A-Za-z0-9._-]+")
QUEUED = 8        # the claim script's exit code when a job queued before it waits for this host
QUEUE = "queue"   # in the host's claims directory: one file per job waiting for the host


@dataclass(frozen=True)
class Waiting:
    """One job's place in a host's queue (fab train --queue)."""

    job: str
    who: str = ""
    since: float = 0.0
    ticket: str = ""              # the order: earlier tickets go first (new_ticket)
    wants: str = ""               # the units it asked for here ("" or all: the whole host)
    age: float = 0.0              # seconds since its fab train last renewed the place

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)) if self.since else "?"
        return f"{self.job} (queued by {self.who or 'unknown'} at {when})"


def new_ticket(job_id: str) -> str:
    """A queued job's place in every host's queue: the time it first asked, then its id (two jobs
    queued at the same moment get distinct places, the same order on every host)."""
    return f"{time.time_ns():020d}-{job_id}"


def parse_waiting(line: str) -> Waiting | None:
    """'JOB age=.. who=.. since=.. ticket=.. wants=..' (the survey's and the claim script's lines)."""
    job, *fields = line.split() or [""]
    if not jobspec.valid_job_id(job):
        return None
    kv = dict(f.partition("=")[::2] for f in fields)

    def number(key: str) -> float:
        try:
            return float(kv.get(key, "0"))
        except ValueError:
            return 0.0
    ticket = kv.get("ticket", "")
    return Waiting(job, kv.get("who", ""), number("since"), ticket if TICKET_RE.fullmatch(ticket) else "",
                   kv.get("wants", ""), number("age"))


def queue_order(waiting: list[Waiting]) -> list[Waiting]:
    """A host's queue, first first."""
    return sorted(waiting, key=lambda w: (w.ticket or "~", w.job))


def queue_scan_script(inv: Inventory, job_id: str, ticket: str | None, who: str,
                      wants: tuple[int, ...]) -> str:
    """Part of claims.claim_script and enqueue_script (in the claims directory, under its lock, `now` set):
    each other job's place in the host's queue is judged: one its fab train has not renewed for
    hostfiles.LEASE_STALE s is dropped and said (`dropped JOB ...`); one queued before this job's
    `ticket` (any, for a job that is not queued) is said (`ahead JOB ...`) and sets `ahead`. Defines
    `wait_here CODE`: with a ticket, take or renew this job's place, then exit CODE.

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
    # A ticket not of new_ticket's form (forged, or empty) orders after every real one.
    before = (
        f'{{ case "$t" in {"[0-9]" * 20}-*) ;; *) t="~";; esac; [ "$t" \\< {q([ticket])} ]; }}'
        if ticket
        else "true"
    )
    return (
        hostfiles.shared_dir_script(QUEUE, check=False) + 'ahead=""; '
        f'for f in {QUEUE}/*; do [ -f "$f" ] && [ ! -L "$f" ] || continue; j=$(basename "$f"); '
        f'case "$j" in *[!A-Za-z0-9._-]*) continue;; esac; [ "$j" = {q([job_id])} ] && continue; '
        f'a=$((now - $(stat -c %Y "$f"))); line="$j age=$a $(tr "\\n" " " < "$f")"; '
        f'if [ "$a" -ge {int(hostfiles.LEASE_STALE)} ]; then rm -f "$f"; echo "dropped $line"; continue; fi; '
        f't=$(sed -n "s/^ticket=//p" "$f"); if {before}; then echo "ahead $line"; ahead=1; fi; done; '
        f'wait_here() {{ {take}exit "$1"; }}; '
    )


def dequeue_command(inv: Inventory, job_id: str) -> str:
    """Leave the host's queue (the job started, or ended while it waited)."""
    return f"d={host_dir(inv)}; rm -f \"$d\"/{QUEUE}/{sshargs.shell([job_id])}"


def enqueue_script(inv: Inventory, job_id: str, ticket: str, who: str, wants: tuple[int, ...]) -> str:
    """Take or renew the job's place in the host's queue (under its lock); prints what the queue
    scan says (jobs ahead, places dropped). Exits 0."""
    return locked(inv, f"now=$(date +%s); {queue_scan_script(inv, job_id, ticket, who, wants)}wait_here 0")


def parse_queue_output(text: str) -> tuple[list[Waiting], list[Waiting]]:
    """(ahead, dropped): the jobs queued before this one on the host, and the places dropped."""
    ahead: list[Waiting] = []
    dropped: list[Waiting] = []
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("ahead", "dropped") and (w := parse_waiting(rest)):
            (ahead if word == "ahead" else dropped).append(w)
    return queue_order(ahead), dropped

