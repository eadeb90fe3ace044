"""Operations on the hosts outside one attempt: `fab sync`, `stop`, a free master port, and
clearing what a lost job left.

A runtime directory left over (survey.stale_runtime says which) is cleared by `fab stop` and by preflight,
which say so. Several Unix accounts of one group may share a host's directories
(hostfiles.shared_dir_script): a left-over runtime directory of another account is never read or removed
(its secrets are its own), only named, and blocks no one.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import codetree
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import dockerargs, hostfiles, sshargs
from orchestrator.hosts import claims
from orchestrator.hosts.keys import LEFT, revoke_script
from orchestrator.hosts.survey import stale_runtime
from orchestrator.progress import bars
from orchestrator.transport.deadlines import COPY_TIMEOUT, STATUS_TIMEOUT, STOP_MARGIN
from orchestrator.transport.remote import PerHost, Session


def sync(
    session: Session,
    inv: Inventory,
    source: Path,
    only: str = "",
    hosts: tuple[Host, ...] | None = None,
    transfers: bars.Transfers | None = None,
) -> tuple[str, dict[str, float]]:
    """rsync the local tree (with `only`, its top folder of that name) to job.code_dir/KEY on every
    host at once (codetree.py): where it went, and the seconds per host. With `transfers`, each
    host's bytes as they go (a bar, `transfer` events)."""
    hosts = hosts or inv.hosts
    dest = f"{inv.job.code_dir}/{codetree.key(source, only)}"
    total = codetree.select(source, only).bytes if transfers else 0

    def one(host: Host) -> float:
        argv = sshargs.rsync_argv(host, str(source), dest, only)
        if transfers is None:
            r = session.local(argv, COPY_TIMEOUT)
        else:
            t = transfers.start(host.name, "code sync", total)
            r = session.local(argv, COPY_TIMEOUT, on_output=t.output)
            t.finish(r.ok)
        if not r.ok:
            raise UserError(
                f"sync to {host.name} ({host.ssh.where()}) failed (rsync exit {r.exited}): "
                f"{hostile.text(r.stderr.strip()[-400:])}; check SSH access with: "
                f"{sshargs.shell([*sshargs.ssh_argv(host), host.hostname, 'true'])}"
            )
        return r.seconds

    results = session.fan_out(one, hosts)
    raise_any(hosts, results, "sync")
    return dest, {h.name: results[h.name] for h in hosts}


def tree_lines(source: Path, only: str = "") -> list[str]:
    """What a sync of the tree copies and what its ignore rules leave out, for a person (a warning
    above codetree.WARN_BYTES synced): codetree.summary's lines."""
    shown = Path(source) / only if only else Path(source)
    return [
        ("warning: " if level == "warning" else "") + hostile.text(text)
        for level, text in codetree.summary(codetree.select(source, only), shown)
    ]


def raise_any(hosts: tuple[Host, ...], results: PerHost, what: str) -> None:
    from orchestrator.transport.remote import describe

    errors = [describe(h, e) for h in hosts if (e := results.error(h.name))]
    if errors:
        raise UserError(f"{what} failed:\n" + "\n".join(errors))


def port_script(inv: Inventory) -> str:
    """One round trip to rank 0's host: the ports listening there, then its claims (claims.survey_script)."""
    from orchestrator.hostcmds.ports import port_command

    return f"{port_command()}; {claims.survey_script(inv)}"


def parse_ports(text: str, base: int) -> int | None:
    """The first port from `base` that nothing listens on and no claim file there names (as
    `fab train` chooses it: another job's claim holds its master port before its rank 0 listens),
    from port_script's output."""
    from orchestrator.hostcmds.ports import free_port

    listening, _, claimed = text.partition("@@claims\n")
    return free_port(listening, base, {h.port for h in claims.parse_survey(claimed)[1] if h.port})


def free_port(session: Session, inv: Inventory) -> int | None:
    """parse_ports at rank 0's host from job.master_port; None when it does not answer."""
    try:
        r = session.run(inv.master, port_script(inv), timeout=STATUS_TIMEOUT, what="listing ports")
    except Exception:  # noqa: BLE001 - the preflight's own checks name the host
        return None
    return parse_ports(r.stdout, inv.job.master_port) if r.ok else None


def with_free_port(session: Session, inv: Inventory) -> Inventory:
    """The inventory with job.master_port moved to the first port from it that nothing listens on
    and no job claims at rank 0's host, as `fab train` chooses it (other jobs may hold
    job.master_port). Unchanged when the host does not answer: the preflight names it."""
    from dataclasses import replace

    port = free_port(session, inv)
    return replace(inv, job=replace(inv.job, master_port=port)) if port else inv


def clear_stale_script(inv: Inventory, jobs: list[str]) -> str:
    """Remove these left-over runtime directories (and stop markers) that are this account's own
    (root: any), printing `removed JOB`; one of another account is kept, printing `kept JOB OWNER`:
    its secrets are not ours to read or remove, and a stale job blocks no one."""
    rt = f"{inv.job.output_dir}/.runtime"
    parts = []
    for j in (j for j in jobs if jobspec.valid_job_id(j)):
        d, word = sshargs.shell([f"{rt}/{j}"]), sshargs.shell([j])
        parts.append(
            f'if [ -O {d} ] || [ "$(id -u)" = 0 ]; then '
            f"rm -rf {d} {sshargs.shell([hostfiles.stopped_marker(inv, j)])} "
            f'&& echo removed {word}; else echo kept {word} "$(stat -c %U {d} 2>/dev/null)"; fi'
        )
    return "; ".join(parts) or "true"


def parse_clear_stale(text: str) -> tuple[list[str], dict[str, str]]:
    """(removed jobs, kept job -> its owner) from clear_stale_script's output."""
    removed, kept = [], {}
    for line in text.splitlines():
        word, job, *owner = line.split(" ", 2)
        if not jobspec.valid_job_id(job):
            continue
        if word == "removed":
            removed.append(job)
        elif word == "kept":
            kept[job] = hostile.line(owner[0] if owner else "") or "?"
    return removed, kept


def clear_stale(session: Session, inv: Inventory, found: PerHost) -> list[str]:
    """Remove left-over runtime directories (secrets files included) this account may; one line per
    host saying what was removed, and which were kept as another account's."""
    stale = stale_runtime(found)
    hosts = {h.name: h for h in inv.all_hosts}

    def one(h: Host) -> tuple[list[str], dict[str, str]]:
        r = session.run(
            h,
            clear_stale_script(inv, stale[h.name]),
            timeout=STATUS_TIMEOUT,
            what="removing left-over runtime files",
        )
        return parse_clear_stale(r.stdout)

    done = session.fan_out(one, tuple(hosts[n] for n in stale if n in hosts))
    lines = []
    for n in stale:
        if n in done and done.error(n) is None:
            removed, kept = done.value(n)
            if removed:
                lines.append(
                    f"{n}: removed the left-over runtime files (secrets included) of {', '.join(removed)}"
                )
            if kept:
                lines.append(
                    f"{n}: left-over runtime files of another account kept (only it or root can remove "
                    f"them): {', '.join(f'{j} ({o})' for j, o in kept.items())}"
                )
    return lines


def mark_stopped(session: Session, inv: Inventory, jobs: dict[str, list[str]]) -> None:
    """Tell a watching `fab train` that these jobs (job -> its hosts) were ended on purpose: a
    marker in the job's runtime directory on its hosts, which the job looks for between stages."""

    def mark(h: Host) -> None:
        ids = [j for j, where in jobs.items() if h.name in where and jobspec.valid_job_id(j)]
        if ids:  # in a directory the group shares: the job's account removes a marker another left
            session.run(
                h,
                hostfiles.stop_mark_script(inv, ids),
                timeout=STATUS_TIMEOUT,
                what="leaving the stop marker",
            )

    # A host that cannot take its marker is still stopped afterwards (and named there).
    session.fan_out(mark, tuple(h for h in inv.all_hosts if any(h.name in w for w in jobs.values())))


def stop(
    session: Session,
    inv: Inventory,
    job_ids: list[str] | None,
    grace: float,
    hosts: tuple[Host, ...] | None = None,
    revoke: list[str] | tuple[str, ...] = (),
) -> PerHost:
    """Stop and remove these jobs' containers (None: every fabtrain container) on each host, all at
    once, and release their claims there: host -> Result (the removed ids on stdout) or error.
    Their runtime directories stay for a `fab train` watching them to see the stop marker
    (clear_stale removes them once no one does). In the same command, the controller keys of the
    jobs in `revoke` (detached ones) leave authorized_keys there (stop_script)."""
    script = stop_script(inv, job_ids, grace, revoke)
    return session.fan_out(
        lambda h: session.run(h, script, timeout=grace + STOP_MARGIN, what="stopping containers"), hosts
    )


def stop_script(
    inv: Inventory, job_ids: list[str] | None, grace: float, revoke: list[str] | tuple[str, ...] = ()
) -> str:
    """What `stop` runs on each host: the containers stopped and removed, the claims released, then
    (`revoke`) those jobs' controller keys and directories removed (keys.revoke_script; a controller
    that died before its end leaves its directory, private key and secrets included). The command's
    stdout is the removed ids; its status the stop's, or keys.LEFT when the stop went well but a key
    could still be there after three tries (its stderr says which and why), so that `fab stop` names
    the host (`fab status` takes the key back later)."""
    ids = [j for j in job_ids if jobspec.valid_job_id(j)] if job_ids is not None else None
    script = "true" if ids == [] else dockerargs.stop_script(ids, grace)
    if ids:
        script += "; " + claims.release_command(inv, ids, runtime=False)
    jobs = [j for j in revoke if jobspec.valid_job_id(j)]
    if jobs:
        dirs = sshargs.shell(["rm", "-rf", "--", *(hostfiles.controller_dir(inv, j) for j in jobs)])
        # Tried three times, a short wait for the lock each (the stop's deadline is grace + STOP_MARGIN);
        # each try's reason goes to stderr, the last one is what fab stop names.
        script += (
            f"; s=$?; k=1; for i in 1 2 3; do {revoke_script(jobs, lock_wait=2)} >/dev/null && "
            f"{{ k=0; break; }}; [ $i = 3 ] || sleep $i; done; [ $k = 0 ] || [ $s != 0 ] || s={LEFT}; "
            f"{dirs} >/dev/null 2>&1; exit $s"
        )
    return script
