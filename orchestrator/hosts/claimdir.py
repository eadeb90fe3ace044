"""A host's claims directory (job.output_dir/.claims/HOSTNAME), where the claims (claims.py) and
the queue of jobs waiting for the host (queue.py) live: where it is, made shared by the group,
and a script run in it under its lock; the units (GPUs, CPU slots) as its files write them; how
the scripts read its files (entries_script), which anyone of the group may have written.
"""

from __future__ import annotations

from orchestrator.config.inventory import Inventory
from orchestrator.core import hostile
from orchestrator.hostcmds import hostfiles, sshargs

DIR = ".claims"
LOCK_WAIT = 10  # seconds the claim script waits for another claim on the same host
# How far ahead of the host's clock (`date +%s` there) a lease or a queue place may be dated and
# still count as renewed. fab train dates them by the host's own clock, so only a file server's clock
# (NFS sets times by its own) puts a real one ahead; a server a minute behind would already make
# every lease look stale (hostfiles.LEASE_STALE), so a working setup keeps them far closer than
# this. Beyond it the date is not believed: one dated a day ahead would otherwise stay fresh, and
# hold the host, for a day; with it, a planted date holds it FUTURE_SLACK + LEASE_STALE at most.
FUTURE_SLACK = 60
ENTRY_MAX = 4096  # bytes of a claim or a place read: a file of gigabytes put there costs nothing

# Why entries_script obeys a file of the claims directory (or its queue) not at all: its `ignored`
# line's word -> what it means.
IGNORED = {
    "link": "a symbolic link (never followed)",
    "special": "not a regular file",
    "name": "its name is not a job id",
    "changed": "it was replaced while it was read",
    "units": "no units= line of a claim (fab train writes units=N,M)",
    "ticket": "no ticket= line of a place in the queue (fab train writes ticket=TIME-JOB)",
}


def units_text(units: tuple[int, ...]) -> str:
    return ",".join(str(u) for u in units)


def parse_units(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(u) for u in text.split(",") if u.strip().isdigit()}))


def host_dir(inv: Inventory) -> str:
    """The claims directory of the host a command runs on (a shell word, expanded there)."""
    return f'{sshargs.shell([f"{inv.job.output_dir}/{DIR}"])}/"$(hostname)"'


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


def first_fields(words: list[str]) -> dict[str, str]:
    """KEY=VALUE words of a scripts' line as a dict, the first of a key counting: the scripts put what
    they measured (an age) before a file's own text, which cannot then choose it."""
    kv: dict[str, str] = {}
    for word in words:
        key, _, value = word.partition("=")
        kv.setdefault(key, value)
    return kv


def renewed_within(age: float | None, bound: float) -> bool:
    """Whether a lease or a queue place `age` seconds old by its host's clock (None: none there)
    counts as renewed within `bound` seconds: one dated more than FUTURE_SLACK ahead does not."""
    return age is not None and -FUTURE_SLACK <= age < bound


def entries_script() -> str:
    """Prints `in DIR` (the claims directory, as the host names it) and defines, for the scripts
    run there under its lock (`now` set): `entry FILE`, which reads one file of the directory or
    its queue (a path from there), setting `j` (its name), `c` (its content: at most ENTRY_MAX bytes,
    printable ASCII and newlines only, so no line of it reads as a line of ours) and `a` (its age in
    seconds by this host's clock, negative when dated ahead), or returns 1 having named it in an
    `ignored` line when it is no claim or place at all: a link (never followed, its target never
    read), not a regular file, not named by a job id, or replaced between the check and the read;
    and `ignored FILE WORD`, which names a file (odd characters shown as ?) and why (IGNORED)."""
    return (
        'printf "in %s\\n" "$PWD"; '
        'ignored() { printf "ignored %s %s\\n" "$(printf %s "${1#./}" | LC_ALL=C tr -c "A-Za-z0-9._/-" "?")" '
        '"$2"; }; '
        'entry() { j=${1##*/}; { [ -e "$1" ] || [ -L "$1" ]; } || return 1; '
        'if [ -L "$1" ]; then ignored "$1" link; return 1; fi; '
        '[ -f "$1" ] || { ignored "$1" special; return 1; }; '
        'case "$j" in [!A-Za-z0-9]*|*[!A-Za-z0-9._-]*|*..*) ignored "$1" name; return 1;; esac; '
        '[ ${#j} -le 128 ] || { ignored "$1" name; return 1; }; '
        # Gone meanwhile (fab stop removes claims without the lock): nothing to obey. Opened, then
        # checked to be the plain file at that name: a link swapped in after the check above is
        # caught here, and its target's content is never read.
        '{ command exec 8<"$1"; } 2>/dev/null || return 1; [ ! -L "$1" ] && [ "$1" -ef /dev/fd/8 ] || '
        '{ exec 8<&-; ignored "$1" changed; return 1; }; '
        f'c=$(head -c {ENTRY_MAX} <&8 | LC_ALL=C tr -cd "\\n -~"); '
        "a=$((now - $(stat -L -c %Y /dev/fd/8))); exec 8<&-; }; "
    )


def where(text: str) -> str:
    """The claims directory as the host named it (entries_script's `in` line), safe to print."""
    for line in text.split("\n"):
        if line.startswith("in "):
            return hostile.line(line[3:], 300)
    return "the claims directory"


def ignored_warnings(host: str, text: str) -> list[str]:
    """One warning per file that a script using entries_script obeyed not at all (its `ignored`
    lines), naming the file by its path on the host, why, and the fix."""
    here, out = where(text), []
    for line in text.split("\n"):
        word, _, rest = line.partition(" ")
        name, _, why = rest.partition(" ")
        if word != "ignored" or not name:
            continue
        path = f"{here}/{hostile.line(name, 300)}"
        fix = (
            f"remove it unless someone of the group needs it: rm -- {sshargs.shell([path])}"
            if "?" not in name
            else "each ? in its name stands for a character that cannot be shown: "
            f"ls -b {sshargs.shell([path.rpartition('/')[0]])} shows it, to remove it"
        )
        seen = IGNORED.get(why, hostile.line(why, 40))
        out.append(
            f"{host}: ignored {path}: {seen}, so it holds up no job (fabtrain writes no such file); {fix}"
        )
    return out
