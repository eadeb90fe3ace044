"""A host's claims directory (job.output_dir/.claims/HOSTNAME), where the claims (claims.py) and
the queue of jobs waiting for the host (queue.py) live: where it is, made shared by the group,
and a script run in it under its lock; the units (GPUs, CPU slots) as its files write them.
"""
from __future__ import annotations

from orchestrator.commands import hostfiles, sshargs
from orchestrator.config.inventory import Inventory

DIR = ".claims"
LOCK_WAIT = 10    # seconds the claim script waits for another claim on the same host


def units_text(units: tuple[int, ...]) -> str:
    return ",".join(str(u) for u in units)


def parse_units(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(u) for u in text.split(",") if u.strip().isdigit()}))


def host_dir(inv: Inventory) -> str:
    """The claims directory of the host a command runs on (a shell word, expanded there)."""
    return f"{sshargs.shell([f'{inv.job.output_dir}/{DIR}'])}/\"$(hostname)\""


def dirs_script(inv: Inventory) -> str:
    """`d` set to the host's claims directory, made if missing: `.claims` and `.claims/HOSTNAME`
    shared by the group without a sticky bit (hostfiles.shared_dir_script), so the next claim of any
    account of the group removes a stale claim of another; NOT_WRITABLE, naming the fix, when
    this account cannot write there."""
    return (
        f"d={host_dir(inv)}; "
        + hostfiles.shared_dir_script(sshargs.shell([f"{inv.job.output_dir}/{DIR}"]), check=False)
        + hostfiles.shared_dir_script('"$d"')
    )


def locked(inv: Inventory, body: str) -> str:
    """`body` run in the host's claims directory (d=.) under its lock (see claims.claim_script)."""
    lock, enter = '"$d"/.lock', hostfiles.enter_script('"$d"')
    return (
        f"{dirs_script(inv)}( umask 022; {enter}d=.; {{ [ ! -L {lock} ] || rm -f {lock}; }}; "
        f"{{ command exec 9<>{lock}; }} 2>/dev/null || command exec 9<{lock} || "
        f"exit {hostfiles.NOT_WRITABLE}; "
        f"[ -f {lock} ] && [ ! -L {lock} ] && [ {lock} -ef /dev/fd/9 ] || "
        f"{{ printf '%s/.lock is not a plain file "
        f'(another account may have put a link there): remove it (rm %s/.lock) and run again\\n\' "$PWD" '
        f'"$PWD" >&2; exit {hostfiles.NOT_WRITABLE}; }}; {{ [ -O /dev/fd/9 ] && '
        f'[ "$(stat -L -c %h /dev/fd/9)" = 1 ] && chmod 0664 /dev/fd/9; }} 2>/dev/null; '
        f"flock -w {LOCK_WAIT} 9 || {{ echo 'another claim on this host held its lock for {LOCK_WAIT}s' >&2; "
        f"exit 4; }}; {body} )"
    )
