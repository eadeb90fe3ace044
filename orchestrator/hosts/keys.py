"""A detached job's controller key in the SSH user's ~/.ssh/authorized_keys on every host and spare
(backends/ssh/detached.py): added when the job is detached, renewed by its controller while the job
lives, removed at the job's end (by its controller, by `fab status` or `fab logs` once it has ended,
or by `fab stop`: hostops.stop_script).

Its line gives the controller what it needs, from where it runs, for as long as the job lives:

    restrict,from="ADDR,...",expiry-time="YYYYMMDDHHMMSS" ssh-ed25519 AAAA... fabtrain-controller:JOB

- `restrict`: no pty, no forwarding of any kind (agent, TCP, X11, tunnel devices), no ~/.ssh/rc. The
  controller runs commands without a terminal (paramiko's exec_command, rsync's `ssh HOST rsync
  --server`) and forwards nothing: jump hosts are refused for --detach, `fab forward` runs here.
- `from=`: the controller's host's own addresses, found on that host when the job is detached
  (addresses_script; loopback left out). The controller runs on the host's network, so its
  connections to the hosts come from one of them; loopback is allowed on its own host's line only
  when it reaches that host through loopback (its address resolves there to one).
- `expiry-time=`: LIFETIME seconds after the line is written, in the form sshd reads in the host's
  time zone, computed by the host from its own clock, so no clock but the host's matters. The `Z`
  (UTC) form would be simpler, but only OpenSSH 9.1 and later read it: an older sshd (Debian 11's
  8.4, Ubuntu 22.04's 8.9) refuses the whole line, and the controller could reach no host. sshd
  reads the local form as standard time, so in daylight saving time the line lives an hour longer.
  The controller writes its line again (renew_script) every RENEW seconds; a controller that dies
  without removing it (its host lost, `docker kill`) leaves a line that ends by itself.

Adding, renewing and removing a line change no other line: the file is rewritten in place (its
owner, mode and links stay), every other line byte for byte (CRLF endings, comments, blank lines,
lines with options, bytes that are not UTF-8), and a file without a final newline gets one before a
line is added (or the new line would be glued onto the last one, and removing it would remove that
key too; revoke_script takes such a line, glued by an older fabtrain, off the user's line). Each
script checks what it did (the line is there once, or no line of the job is left) and exits
non-zero saying what it saw when it is not so.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping, Sequence

from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import sshargs

FILE = "~/.ssh/authorized_keys"

# Two hours' life, written again every twenty minutes: five renewals may fail in a row (a host
# briefly unreachable, its sshd restarting) before the job loses a host, and a key copied off the
# controller's host, or left by a controller that died, is refused two hours later at most.
LIFETIME = 2 * 3600
RENEW = 20 * 60
LIFETIME_ENV = "FABTRAIN_CONTROLLER_KEY_LIFETIME"  # seconds: a test may use a minute
RENEW_ENV = "FABTRAIN_CONTROLLER_KEY_RENEW"

# How long a script waits for the lock (a change by another job, a renewal), and fab for a script.
LOCK_WAIT = 10
TIMEOUT = 20.0

# renew_script's exit status when the job's line is gone (`fab stop` removed it): it is not added back.
GONE = 3
# revoke_script's exit status when a line of the job is still there after the rewrite.
LEFT = 4

# The options an older fabtrain gave the line (revoke_script still repairs what it glued).
OLD_OPTIONS = "no-agent-forwarding,no-port-forwarding,no-X11-forwarding"

MAX_SOURCES = 64  # addresses in one from= (a host with more is named, not guessed at)
LOOPBACK = ("127.0.0.0/8", "::1")

_PUBLIC_RE = re.compile(r"ssh-ed25519 [A-Za-z0-9+/]+={0,2}")


def marker(job_id: str) -> str:
    return f"fabtrain-controller:{job_id}"


def lifetimes(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(lifetime, renew) in seconds: LIFETIME and RENEW, or the environment's values for them."""
    env = os.environ if env is None else env
    values = []
    for name, default in ((LIFETIME_ENV, LIFETIME), (RENEW_ENV, RENEW)):
        raw = env.get(name, "")
        try:
            values.append(int(raw) if raw.strip() else default)
        except ValueError:
            raise UserError(
                f"{name}={hostile.line(raw, 40)!r} is not a whole number of seconds; unset it or "
                f"give one (default {default})",
                exit_code=2,
            ) from None
    lifetime, renew = values
    if not 0 < renew < lifetime:
        raise UserError(
            f"{RENEW_ENV} ({renew} s) must be above 0 and below {LIFETIME_ENV} ({lifetime} s): "
            "the controller writes its key's line again before it expires",
            exit_code=2,
        )
    return lifetime, renew


# ---------------------------------------------------------------- where the controller's host is

RESOLVED = "@@resolved"


def addresses_script(address: str) -> str:
    """Run on the controller's host: its addresses (`ip -o addr`, else `hostname -I`), then what
    `address` (the inventory's, as the controller connects to it) resolves to there."""
    return (
        f"{{ ip -o addr show 2>/dev/null || hostname -I; }}; echo {RESOLVED}; "
        f"getent ahosts {sshargs.shell([address])} 2>/dev/null; true"
    )


def parse_addresses(text: str, host: str) -> tuple[tuple[str, ...], bool]:
    """(the host's addresses but loopback, whether its own address resolves to loopback there) from
    addresses_script's output (hostile: every word must be an IP address to be taken); UserError
    naming the host when none is found or too many."""
    mine, _, resolved = text.partition(RESOLVED)
    words = mine.split()
    # `ip -o addr`: "2: eth0 inet 10.0.0.5/24 brd ..."; `hostname -I`: addresses alone.
    tagged = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("inet", "inet6")]
    found: list[str] = []
    for word in tagged or words:
        ip = _ip(word.split("/", 1)[0])
        if ip is not None and not ip.is_loopback and str(ip) not in found:
            found.append(str(ip))
    if not found:
        said = hostile.line(mine.strip() or "nothing", 200)
        raise UserError(
            f"--detach: {host}, the controller's host, shows no address but loopback (`ip "
            f"-o addr`, `hostname -I` said {said!r}): its key could not be limited to it; check "
            "that `ip` or `hostname -I` works there",
            exit_code=1,
        )
    if len(found) > MAX_SOURCES:
        raise UserError(
            f"--detach: {host}, the controller's host, has {len(found)} addresses, more than "
            f"{MAX_SOURCES}: its key's from= would be too wide; name another host under "
            "controller: in the inventory",
            exit_code=2,
        )
    resolved_ips = (_ip(line.split(" ", 1)[0]) for line in resolved.splitlines() if line.strip())
    via_loopback = any(ip is not None and ip.is_loopback for ip in resolved_ips)
    return tuple(found), via_loopback


def _ip(word: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(word.split("%", 1)[0])  # fe80::1%eth0: the zone is not the address
    except ValueError:
        return None


def sources_by_host(
    names: Sequence[str], own: str, addresses: Sequence[str], via_loopback: bool
) -> dict[str, tuple[str, ...]]:
    """Each host's from= list: the controller's host's addresses, and on that host's own line
    loopback too when the controller reaches it that way."""
    return {n: tuple(addresses) + (LOOPBACK if n == own and via_loopback else ()) for n in names}


# ---------------------------------------------------------------- the scripts


def authorize_script(job_id: str, public: str, sources: Sequence[str], lifetime: int) -> str:
    """Add the job's line (module docstring), or write it again with a later expiry when it is there."""
    return _write_script(job_id, public, sources, lifetime, renew=False)


def renew_script(job_id: str, public: str, sources: Sequence[str], lifetime: int) -> str:
    """Write the job's line again with a later expiry; exit GONE, adding nothing, when it is not
    there (fab stop took it back: the job is ending)."""
    return _write_script(job_id, public, sources, lifetime, renew=True)


def entry_options(sources: Sequence[str]) -> tuple[str, str]:
    """The line's options up to the expiry and after it (the expiry is written on the host)."""
    patterns = []
    for s in sources:
        try:
            net = ipaddress.ip_network(s, strict=False) if "/" in s else ipaddress.ip_address(s)
        except ValueError:
            raise ValueError(f"from= takes IP addresses and networks, not {s!r}") from None
        patterns.append(str(net))
    if not patterns:
        raise ValueError("from= needs at least one address")
    return f'restrict,from="{",".join(patterns)}",expiry-time="', '" '


def _write_script(job_id: str, public: str, sources: Sequence[str], lifetime: int, renew: bool) -> str:
    if not jobspec.valid_job_id(job_id):
        raise ValueError(f"not a job id: {job_id!r}")
    key = public.removesuffix(" " + marker(job_id))
    if key == public or not _PUBLIC_RE.fullmatch(key):
        raise ValueError(f"not this job's public key line: {public[:80]!r}")
    if not isinstance(lifetime, int) or lifetime <= 0:
        raise ValueError(f"a key's lifetime is a positive number of seconds, not {lifetime!r}")
    before, after = entry_options(sources)
    job = sshargs.shell([job_id])
    if renew:
        absent = (
            "{ printf '%s: no line of job %s is left to renew (fab stop took it back)\\n' "
            f'"$f" {job} >&2; exit {GONE}; }}'
        )
    else:
        absent = f'{_LINE} >> "$f"'
    return _own_shell(
        _prelude([job_id])
        # The host's own clock and time zone, as its sshd reads expiry-time (module docstring).
        + f'e=$(date -d "@$(( $(date +%s) + {lifetime} ))" +%Y%m%d%H%M%S) || exit 1; '
        + f'l={sshargs.shell([before])}"$e"{sshargs.shell([after + public])}; '
        # A last line without its newline gets one first: ours would be glued onto it.
        + 'if [ -s "$f" ] && [ "$(tail -c 1 "$f" | wc -l)" -eq 0 ]; then '
        + "printf '\\n' >> \"$f\" || exit 1; fi; "
        + 'if [ -f "$f" ] && grep -a -q -e "$m0" "$f"; then t=$(mktemp ~/.ssh/.fabtrain.XXXXXX) || exit 1; '
        + f'{{ sed -e "/$m0/d" "$f" && {_LINE}; }} > "$t" && cat "$t" > "$f"; r=$?; rm -f "$t"; '
        + f"[ $r = 0 ] || exit 1; else {absent} || exit 1; fi; "
        + '[ "$(grep -a -c -x -F -e "$l" "$f")" = 1 ] && [ "$(grep -a -c -e "$m0" "$f")" = 1 ] || '
        + "{ printf '%s: the line of job %s is not there once after writing it\\n' "
        + f'"$f" {job} >&2; exit 1; }}'
    )


_LINE = "printf '%s\\n' \"$l\""


def revoke_script(job_ids: Sequence[str], lock_wait: int = LOCK_WAIT) -> str:
    """Remove these jobs' lines; exit 0 only when no line of theirs is left (none was there, or no
    authorized_keys), LEFT when one still is, 1 when the file could not be read or rewritten (or
    its lock not had within `lock_wait` seconds)."""
    ids = [j for j in job_ids if jobspec.valid_job_id(j)]
    if not ids:
        return "true"
    # A line an older fabtrain glued onto a last line that had no newline: the user's part is kept.
    glued = "; ".join(
        f"g{i}={sshargs.shell([OLD_OPTIONS + ' ssh-ed25519 [A-Za-z0-9+/=]*' + _marker_re(j)])}\"$cr\"'*$'"
        for i, j in enumerate(ids)
    )
    delete = " ".join(f'-e "s|\\(.\\)$g{i}|\\1|" -e "/$m{i}/d"' for i in range(len(ids)))
    match = " ".join(f'-e "$m{i}"' for i in range(len(ids)))
    said = f'\\n\' "$f" {sshargs.shell([", ".join(ids)])} >&2'
    return _own_shell(
        f"[ -e {FILE} ] || exit 0; "
        + _prelude(ids, lock_wait)
        + glued
        + "; "
        + f'if grep -a -q {match} "$f"; then t=$(mktemp ~/.ssh/.fabtrain.XXXXXX) || exit 1; '
        + f'sed {delete} "$f" > "$t" && cat "$t" > "$f"; r=$?; rm -f "$t"; '
        + "[ $r = 0 ] || "
        + f"{{ printf '%s: could not be rewritten to remove the key of %s{said}; exit 1; }}; fi; "
        + f'grep -a -q {match} "$f"; case $? in 1) exit 0;; '
        + f"0) printf '%s: the key of %s is still there after its removal{said}; exit {LEFT};; "
        + f"*) printf '%s: could not be read to remove the key of %s{said}; exit 1;; esac"
    )


def _own_shell(script: str) -> str:
    """`script` in a shell of its own: its umask 077, LC_ALL, lock descriptor and variables end with
    it, and its `exit` ends only it. Run before another script in one visit (submit's key, then the
    controller's directory), the umask would otherwise make every missing parent of that directory
    (the output_dir itself, on a new host) 0700, closed to every other account."""
    return f"( {script} )"


def _prelude(job_ids: Sequence[str], lock_wait: int = LOCK_WAIT) -> str:
    """The lock (one change to the file at a time: two --detach at once, a renewal and a fab stop),
    then $f, and $m0, $m1, ... matching the jobs' lines: their marker at the end of the line (a CR
    after it too, should an editor have made the file CRLF since). Bytes are bytes (LC_ALL=C, grep
    -a): sed and grep neither refuse nor change a line that is not UTF-8 or holds a NUL."""
    marks = "; ".join(f"m{i}={sshargs.shell([_marker_re(j)])}\"$cr\"'*$'" for i, j in enumerate(job_ids))
    return (
        "export LC_ALL=C; umask 077; mkdir -p ~/.ssh && exec 8>>~/.ssh/.fabtrain.lock && "
        f"flock -w {lock_wait} 8 || {{ printf 'could not make ~/.ssh or lock ~/.ssh/.fabtrain.lock within "
        f"{lock_wait} s\\n' >&2; exit 1; }}; "
        f"f={FILE}; cr=$(printf '\\r'); {marks}; "
    )


def _marker_re(job_id: str) -> str:
    """A basic regular expression for ` fabtrain-controller:JOB` (a job id's only special is '.')."""
    return " " + marker(job_id).replace(".", "[.]")
