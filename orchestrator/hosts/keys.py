"""A detached job's controller key in the SSH user's ~/.ssh/authorized_keys on every host
(backends/ssh/detached.py): added when the job is detached, marked `fabtrain-controller:JOB` and
restricted, removed at the job's end (by its controller, or by `fab stop`: hostops.stop)."""
from __future__ import annotations

from orchestrator.commands import sshargs
from orchestrator.core import jobspec


def marker(job_id: str) -> str:
    return f"fabtrain-controller:{job_id}"


# authorized_keys is changed by one controller key at a time (two --detach at once, a fab stop).
KEYS_LOCK = "exec 8>>~/.ssh/.fabtrain.lock && flock -w 10 8"


def authorize_script(line: str) -> str:
    """Add the job's key to this account's authorized_keys (no forwarding of any kind)."""
    entry = "no-agent-forwarding,no-port-forwarding,no-X11-forwarding " + line
    return (f"umask 077; mkdir -p ~/.ssh && {KEYS_LOCK} && "
            f"printf '%s\\n' {sshargs.shell([entry])} >> ~/.ssh/authorized_keys")


def revoke_script(job_ids: list[str] | tuple[str, ...]) -> str:
    """Remove these jobs' controller keys from this account's authorized_keys (the file rewritten in
    place, so its owner, mode and links stay as they are)."""
    ids = [j for j in job_ids if jobspec.valid_job_id(j)]
    if not ids:
        return "true"
    pattern = "|".join(f" {marker(j)}$" for j in ids).replace(".", "\\.")
    f = "~/.ssh/authorized_keys"
    # grep exits 1 when no line is left, 2 on an error: then the file is left as it was.
    return (f"[ -f {f} ] || exit 0; {KEYS_LOCK} && t=$(mktemp ~/.ssh/.fabtrain.XXXXXX) && "
            f"{{ grep -Ev {sshargs.shell([pattern])} {f} > \"$t\"; [ $? -le 1 ] && cat \"$t\" > {f}; "
            f"rm -f \"$t\"; }}")
