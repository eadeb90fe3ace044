"""Claims: which GPUs of a host (CPU slots on a host without GPUs) each job holds.

A host's units are its GPUs 0..count-1 (the inventory's gpus: count), or on a CPU host its slots
0..CPUs-1 (one per CPU, `nproc` on the host). A job holds some units of each of its hosts; jobs
holding disjoint units run on the same host at once.

On each host, a job's claim is a file `job.output_dir/.claims/HOSTNAME/JOB` (HOSTNAME as the host
itself says, so inventories that name the host differently still see each other's claims):

    who=alice@laptop
    since=1763900000
    units=0,1

Claiming is atomic on the host: the check of the other claims and the write of this one happen
under `flock` of the directory's lock file (`claim_script`). A claim whose job has no container on
that host and no fresh lease (renewed within hostfiles.LEASE_STALE by the host's clock, and dated
no more than claimdir.FUTURE_SLACK ahead of it) is stale: the next claim there removes it and says
so. A file there that is no claim (a link, not a regular file, not named by a job id, no units=
line) is named and obeyed not at all. A job claims its hosts one at a time in one order (`order`),
so two jobs started at the same moment over overlapping hosts meet first on the same host and
exactly one of them gets it; the other releases what it took and is refused, naming the holder.

Several Unix accounts of one group share these directories (hostfiles.shared_dir_script): any of them
claims, and clears another's stale claim; none reads another's runtime files (secrets).
"""

from __future__ import annotations

import getpass
import os
import socket
import time
from dataclasses import dataclass

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import hostfiles, sshargs
from orchestrator.hosts.claimdir import (
    FUTURE_SLACK,
    entries_script,
    first_fields,
    host_dir,
    locked,
    parse_units,
    units_text,
    where,
)
from orchestrator.hosts.queue import QUEUE, QUEUED, Waiting, parse_waiting, queue_scan_script, queue_warnings

REFUSED = 3  # the claim script's exit code when a unit it wants is held
PORT_TAKEN = 5  # ... when its master port was claimed by another job on this host meanwhile


def me() -> str:
    """Who starts a job: user@machine of this process (`fab stop` ends only these by default).
    FABTRAIN_USER names the user instead, for people who share one account to run fab from."""
    user = os.environ.get("FABTRAIN_USER", "").strip()
    if not user:
        try:
            user = getpass.getuser()
        except Exception:  # noqa: BLE001 - no user name in the environment or passwd
            user = "unknown"
    return f"{''.join(ch for ch in user if ch.isalnum() or ch in '._-') or 'unknown'}@{socket.gethostname()}"


def kind(host: Host) -> str:
    return "GPU" if host.gpu_vendor != "none" else "slot"


def capacity(host: Host, cpus: int) -> int:
    """How many units the host has: its GPUs, or one slot per CPU."""
    return host.gpu_count if host.gpu_vendor != "none" else max(cpus, 1)


@dataclass(frozen=True)
class Holder:
    """One job's claim on one host."""

    job: str
    who: str = ""
    since: float = 0.0
    units: tuple[int, ...] = ()
    port: int | None = None  # the job's master port, in its claim of its rank-0 host
    age: float | None = None  # a cleared claim's lease's age by the host's clock (None: none)

    def describe(self, host: Host | None = None) -> str:
        what = f"{kind(host)}s " if host is not None else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)) if self.since else "?"
        return (
            f"{self.job} (started by {self.who or 'unknown'} at {when}, "
            f"{what}{units_text(self.units) or 'all'})"
        )


def parse_holder(line: str) -> Holder | None:
    """'JOB who=... since=... units=...' (how the survey and the claim script print a claim file;
    the claim script puts the lease's age, `age=`, first when it clears one). None for a line that
    is no claim: a name that is no job id, no units= of numbers (the claim script obeys no such
    file). The first of a key counts (claimdir.first_fields)."""
    job, *fields = line.split() or [""]
    if not jobspec.valid_job_id(job):
        return None
    kv = first_fields(fields)
    units = kv.get("units")
    if units is None or not all(ch in "0123456789," for ch in units):
        return None
    try:
        since = float(kv.get("since", "0"))
    except ValueError:
        since = 0.0
    port, age = kv.get("port", ""), kv.get("age", "")
    return Holder(
        job,
        hostile.line(kv.get("who", ""), 100),
        since,
        parse_units(units),
        int(port) if port.isdigit() else None,
        float(age) if age.lstrip("-").isdigit() else None,
    )


# ------------------------------------------------------------------ on the hosts


def survey_script(inv: Inventory) -> str:
    """Read-only: the host's CPU count, then one line per claim file (parse_survey); links (which
    another account of the group may put there) are not claims and are never read, nor is a claims
    directory that is one (the files are listed in the directory entered and checked, as in
    claim_script)."""
    return (
        f"echo @@claims; nproc; d={host_dir(inv)}; "
        '( cd -P "$d" 2>/dev/null && [ ! -L "$d" ] && [ "$d" -ef . ] && '
        'for f in ./*; do case "${f##*/}" in *[!A-Za-z0-9._-]*) continue;; esac; '
        '[ -f "$f" ] && [ ! -L "$f" ] && echo "$(basename "$f") $(tr "\\n" " " < "$f")"; '
        "done ); echo @@queue; now=$(date +%s); "
        f'( q="$d"/{QUEUE}; cd -P "$q" 2>/dev/null && [ ! -L "$q" ] && [ "$q" -ef . ] && '
        'for f in ./*; do case "${f##*/}" in *[!A-Za-z0-9._-]*) continue;; esac; '
        '[ -f "$f" ] && [ ! -L "$f" ] && '
        'echo "$(basename "$f") age=$((now - $(stat -c %Y "$f"))) $(tr "\\n" " " < "$f")"; '
        "done ); true"
    )


def parse_survey(text: str) -> tuple[int, list[Holder], list[Waiting]]:
    """(CPUs, claims, the queue) from survey_script's output (after its @@claims line)."""
    text, _, queued = text.partition("@@queue\n")
    # Only the script's own newlines end a line: splitlines() also breaks at a \r in a file's text.
    lines = text.split("\n")
    cpus = int(lines[0]) if lines and lines[0].strip().isdigit() else 1
    return (
        cpus,
        [h for line in lines[1:] if line.strip() and (h := parse_holder(line))],
        [w for line in queued.split("\n") if line.strip() and (w := parse_waiting(line))],
    )


def claim_script(
    inv: Inventory,
    job_id: str,
    units: tuple[int, ...] | None,
    who: str,
    first: bool,
    port: int | None = None,
    ticket: str | None = None,
) -> str:
    """Under the host's claims lock: each other claim is judged by the host's own clock (held: its
    job has a container here, or a lease renewed within hostfiles.LEASE_STALE and dated no more than
    claimdir.FUTURE_SLACK ahead; else stale, removed, and said so with its lease's age), and a file
    that is no claim is named and obeyed not at all (claimdir.entries_script); if none of the held
    ones overlaps `units`, this job's claim file is written (replacing its own earlier one) with its
    runtime directory and lease. Prints `in DIR`, then `held JOB who=.. since=.. units=..`, `cleared
    JOB age=SECONDS|none who=..` and `ignored FILE WHY` lines (claim_warnings says them, with the
    queue's); exits REFUSED when a unit is held, PORT_TAKEN when `port` (given on the rank-0 host)
    is another held claim's. The job's first attempt also clears a stop marker left from an earlier
    run of it. `units` None: a short job of fabtrain's own that claims nothing, only its runtime
    directory and lease (the preflight's smoke test claims its units itself beforehand,
    preflight/smoke.py).

    Several accounts of one group share these directories (hostfiles.shared_dir_script): the lock is
    opened read-write where this account may (flock over NFS needs that), else read-only (a lock
    file an older version made 0644). Since any account of the group can put a link anywhere in
    them, nothing there is followed: the script works in the claims directory it entered and
    checked (hostfiles.enter_script: one renamed meanwhile and replaced by a link to this account's
    ~/.ssh is never listed, read or cleared), a link at the lock's name is removed before it is
    opened, and what was opened must be the directory's own plain file, no link (else NOT_WRITABLE,
    naming the fix); the lock is made group-writable through the open descriptor (/dev/fd/9), and
    only when it is this account's and has no other name (a hard link to another of its files).
    The claim file is written new (noclobber, after removing whatever another account put at its
    temporary name), 0644 by the umask for every account's survey (no chmod, which would follow a
    link swapped in), and renamed into place (`mv -T`: never into a directory put at its name);
    links in the directory are not claims; the runtime directory is the job's account's own
    (hostfiles.own_runtime_script)."""
    q = sshargs.shell
    clear = f"{q(['rm', '-f', hostfiles.stopped_marker(inv, job_id)])}; " if first else ""
    if units is None:
        return f"{clear}{hostfiles.own_runtime_script(inv, job_id)}"
    tmp = f'"$d"/.{job_id}.tmp'
    body = (
        'now=$(date +%s); taken=""; ports=""; '
        + entries_script()
        # The queue binds a job's first claim of its hosts; its restarts (spares too) never wait in it.
        + (
            queue_scan_script(inv, job_id, ticket, who, units)
            if first
            else 'ahead=""; wait_here() { exit "$1"; }; '
        )
        + _others_script(inv, job_id)
        + _verdict_script(job_id, units, port)
        + f"{clear}{hostfiles.own_runtime_script(inv, job_id)} && rm -f {tmp} && "
        f'( set -C; printf "who=%s\\nsince=%s\\nunits=%s\\nport=%s\\n" {q([who])} "$now" '
        f"{q([units_text(units)])} "
        f'{q([str(port or "")])} > {tmp} ) && mv -T {tmp} "$d"/{job_id}'
    )
    return locked(inv, body)


def _others_script(inv: Inventory, job_id: str) -> str:
    """claim_script's loop over the other claims in the claims directory "$d" (after
    claimdir.entries_script, whose `entry` reads a file's text into $c and its job into $j): each
    held one (its job has a container here, or a fresh lease by the host's clock) is printed as
    `held`, its units added to $taken and its port to $ports; each stale one is removed and printed
    as `cleared` with its lease's age ($la); a file with no units= line of numbers is `ignored`."""
    rt = sshargs.shell([f"{inv.job.output_dir}/.runtime"])
    q = sshargs.shell
    ps = q(["docker", "ps", "--quiet", "--filter", f"label={jobspec.LABEL_JOB}="])
    lease = hostfiles.LEASE
    return (
        f'for f in "$d"/*; do [ "$f" = "$d"/{q([job_id])} ] && continue; '
        f'[ "$f" = "$d"/{QUEUE} ] && [ -d "$f" ] && [ ! -L "$f" ] && continue; entry "$f" || continue; '
        # One units= line of numbers (none: the whole host), or this is no claim.
        'u=$(printf "%s\\n" "$c" | sed -n "s/^units=/=/p"); '
        'case "$u" in ""|*[!0-9,=]*|?*=*) ignored "$f" units; continue;; esac; '
        f'u=$(printf %s "${{u#=}}" | tr , " "); r={rt}/"$j"; '
        # A job whose engine does not answer counts as live: never clear what cannot be checked.
        f'ids=$(timeout -k 2 8 {ps}"$j" 2>/dev/null) || ids=unknown; la=none; '
        f'[ ! -L "$r" ] && [ -f "$r"/{lease} ] && [ ! -L "$r"/{lease} ] && '
        f'la=$((now - $(stat -c %Y "$r"/{lease}))); '
        'if [ -n "$ids" ] || { [ "$la" != none ] && '
        f'[ "$la" -ge -{FUTURE_SLACK} ] && [ "$la" -lt {int(hostfiles.LEASE_STALE)} ]; }}; then '
        # printf, not echo: dash's echo would make a line of a \n in the file's text.
        'printf "held %s %s\\n" "$j" "$(printf %s "$c" | tr "\\n" " ")"; taken="$taken ${u:-all}"; '
        'ports="$ports $(printf "%s\\n" "$c" | sed -n "s/^port=//p")"; else rm -f "$f"; '
        'printf "cleared %s age=%s %s\\n" "$j" "$la" "$(printf %s "$c" | tr "\\n" " ")"; fi; done; '
    )


def _verdict_script(job_id: str, units: tuple[int, ...], port: int | None) -> str:
    """claim_script's verdict, once _others_script has gathered the held units ($taken) and ports
    ($ports): `wait_here REFUSED` when a unit this job wants is held, `wait_here QUEUED` when the
    queue binds it ($ahead), exit PORT_TAKEN when `port` is another held claim's."""
    q = sshargs.shell
    return (
        # A claim of no units in particular (units=) is the whole host.
        f"for u in {' '.join(str(u) for u in units) or 'all'}; do "
        f'case " $taken " in *" all "*|*" $u "*) wait_here {REFUSED};; '
        f'esac; [ "$u" = all ] && [ -n "$(echo $taken)" ] && wait_here {REFUSED}; done; '
        # The queue binds a job that does not hold this host yet (a restart keeps its own).
        f'[ -z "$ahead" ] || [ -f "$d"/{q([job_id])} ] || wait_here {QUEUED}; '
        + (f'case " $ports " in *" {int(port)} "*) exit {PORT_TAKEN};; esac; ' if port else "")
    )


def release_command(
    inv: Inventory, job_ids: list[str] | tuple[str, ...], runtime: bool = True, queue: bool = True
) -> str:
    """Remove these jobs' claims on the host it runs on, (`queue`) their places in its queue, and
    (`runtime`) their runtime directories and stop markers (`fab stop` leaves both for the job's own
    `fab train` to see)."""
    ids = [j for j in job_ids if jobspec.valid_job_id(j)]
    if not ids:
        return "true"
    rt = f"{inv.job.output_dir}/.runtime"
    gone = [p for j in ids for p in (f"{rt}/{j}", hostfiles.stopped_marker(inv, j))]
    return (
        f"d={host_dir(inv)}; "
        + (f"rm -rf {sshargs.shell(gone)}; " if runtime else "")
        + "; ".join(f'rm -f "$d"/{j}' + (f' "$d"/{QUEUE}/{j}' if queue else "") for j in ids)
    )


def parse_claim_output(text: str) -> tuple[list[Holder], list[Holder]]:
    """(held, cleared) claims of other jobs, from claim_script's output."""
    held: list[Holder] = []
    cleared: list[Holder] = []
    for line in text.split("\n"):
        word, _, rest = line.partition(" ")
        h = parse_holder(rest) if rest else None
        if h is not None and word in ("held", "cleared"):
            (held if word == "held" else cleared).append(h)
    return held, cleared


def cleared_why(age: float | None, host: str) -> str:
    """Why a claim whose lease is `age` s old by `host`'s clock (None: none) was cleared (no container
    of its job ran there)."""
    if age is None:
        return "it has no lease (the file its fab train renews while it looks after the job)"
    if age < 0:
        return (
            f"its lease is future-dated by {-age:.0f} s on {host}'s clock (more than the "
            f"{FUTURE_SLACK} s allowed): fab train renews it with the host's own clock, so something "
            "else wrote this date"
        )
    return f"its lease was not renewed for {age:.0f} s (its fab train is gone)"


def claim_warnings(host: Host, text: str) -> list[str]:
    """The warnings claim_script's output calls for, each naming the file by its path on the host,
    the owner it claims and why: claims cleared, places dropped from the queue, files ignored."""
    here = where(text)
    return [
        f"{host.name}: cleared {here}/{c.job}, the claim of {c.describe(host)}: no container of that job "
        f"runs there and {cleared_why(c.age, host.name)}"
        for c in parse_claim_output(text)[1]
    ] + queue_warnings(host.name, text)


# ------------------------------------------------------------------ choosing units


@dataclass(frozen=True)
class Want:
    """What a job asks of each host: exact units (--include node1:0,1), or a count."""

    exact: dict[str, tuple[int, ...]]
    count: int | None = None  # --gpus N (or --nproc N): N units on each host
    explicit: bool = False  # the units were asked for (sets each node's processes)

    def of(self, host: Host, cap: int) -> tuple[int, ...] | int:
        if host.name in self.exact:
            return self.exact[host.name]
        if self.count is not None:
            return min(self.count, cap) if host.gpu_vendor == "none" else self.count
        return cap if host.gpu_vendor != "none" else 1


def want_of(spec: jobspec.JobSpec, nproc: str = "auto") -> Want:
    """What the job asks of each host: JobSpec.units (--include's unit lists), --gpus N, or N
    processes per node (--nproc, else the inventory's job.nproc_per_node: `nproc`) take N units."""
    exact = {}
    for part in filter(None, spec.units.split("@")):
        name, _, listed = part.partition(":")
        exact[name] = parse_units(listed)
    count, per_node = spec.gpus, str(spec.nproc_per_node or nproc)
    if count is None and per_node.isdigit() and int(per_node) > 0:
        count = int(per_node)
    return Want(exact, count, explicit=bool(exact) or spec.gpus is not None)


def held_units(holders: list[Holder], cap: int) -> set[int]:
    """Units held by these claims (a claim listing none holds the whole host)."""
    return {u for h in holders for u in (h.units or range(cap))}


def choose(host: Host, cap: int, holders: list[Holder], asked: tuple[int, ...] | int) -> tuple[int, ...]:
    """The units this job takes on the host, or UserError naming who holds what it asks for and
    what is free."""
    taken = held_units(holders, cap)
    free = [u for u in range(cap) if u not in taken]
    if isinstance(asked, tuple):
        beyond = [u for u in asked if u >= cap]
        if beyond:
            raise UserError(
                f"--include {host.name}:{units_text(asked)}: {host.name} has {cap} {kind(host)}(s) "
                f"(0..{cap - 1}); {units_text(tuple(beyond))} is not one of them",
                exit_code=2,
            )
        if not set(asked) & taken:
            return asked
    elif len(free) >= asked:
        return tuple(free[:asked])
    need = f"{kind(host)}s {units_text(asked)}" if isinstance(asked, tuple) else f"{asked} {kind(host)}(s)"
    holding = "; ".join(h.describe(host) for h in holders)
    raise UserError(
        f"{host.name}: this job needs {need}, but {holding} hold(s) "
        f"{units_text(tuple(sorted(taken)))}; free there: {units_text(tuple(free)) or 'none'}. "
        "Wait for that job, stop it if it is yours ('fab stop --job JOB'), or ask for free ones "
        "(--include HOST:i,j, --gpus N, --num-nodes N), or add --queue: the job waits in line "
        "and starts by itself when they are free",
        exit_code=1,
    )


def order(hosts: tuple[Host, ...]) -> list[Host]:
    """The order every job claims hosts in: by address, the same for every inventory naming them."""
    return sorted(hosts, key=lambda h: (h.hostname, h.ssh.port))
