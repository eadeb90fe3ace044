"""The rsync check of a preflight (`judge_rsync`): the rsync of each host, read by its probe
(probe.RSYNC_FACT), and of this machine (probe.local_rsync), judged by its version and by the
fixes its package names. Pure, so unit-tested without a network."""

from __future__ import annotations

from orchestrator.core import hostile
from orchestrator.core.jobspec import LOCAL
from orchestrator.preflight.checks import FAIL, OK, WARN, Check, _last
from orchestrator.preflight.probe import RSYNC_CVES, parse_rsync_fact, parse_rsync_version

# rsync before 3.2.4 handles remote arguments the old way (a remote shell splits and expands them
# unless -s is given); 3.4.0 fixed two flaws of the receiving client, which is this machine when
# fab fetches a host's outputs and snapshots: CVE-2024-12087 (a sending server writes outside the
# destination) and CVE-2024-12088 (--safe-links bypassed).
RSYNC_MIN = (3, 2, 4)
RSYNC_SAFE = (3, 4, 0)


def judge_rsync(name: str, fact: tuple[int, str]) -> Check:
    """The rsync of a host (`name` its name; the fact from its probe) or of this machine (LOCAL;
    probe.local_rsync): refused before 3.2.4 or when missing or unreadable, a warning before 3.4
    unless its package names the fixes for both CVEs (a distribution's backport). RSYNC_OLD_ARGS
    and RSYNC_PROTECT_ARGS are shown where set: fab's explicit -s (sshargs.RSYNC_PROTECT) overrides
    both here, and a server rsync reads neither, so they change nothing."""
    here = name == LOCAL
    where = "on this machine" if here else f"on {name}"
    upgrade = (
        f"{where}: upgrade rsync to 3.4 or later (a distribution's build of 3.2.7 with the fixes will do)"
    )
    rc, text = fact
    info = parse_rsync_fact(text)
    shown = hostile.line(info["version"], 120)
    if not info["version"]:
        return Check(
            name,
            "rsync",
            FAIL,
            "no rsync" if rc == 0 else f"could not run rsync: {_last(hostile.line(text))}",
            f"{where}: install rsync 3.4 or later (e.g. sudo apt-get install rsync)",
        )
    version = parse_rsync_version(info["version"])
    if version is None:
        return Check(
            name,
            "rsync",
            FAIL,
            f"cannot read rsync's version from {shown!r} (not rsync 3.x?)",
            f"{where}: install rsync 3.4 or later, first in PATH",
        )
    number = ".".join(map(str, version))
    note = _env_note(info["env"], here)
    if version < RSYNC_MIN:
        return Check(
            name,
            "rsync",
            FAIL,
            f"rsync {number} is older than 3.2.4: its argument handling differs "
            "(old style: remote paths split and expanded by the remote shell unless protected)" + note,
            upgrade,
        )
    if version < RSYNC_SAFE:
        if info["fixed"] >= set(RSYNC_CVES):
            return Check(name, "rsync", OK, f"{number}, its package fixes {' and '.join(RSYNC_CVES)}" + note)
        return Check(
            name,
            "rsync",
            WARN,
            f"rsync {number} is older than 3.4 and its package names no fix for "
            f"CVE-2024-12087 (a server can make the receiving rsync write outside its destination) and "
            f"CVE-2024-12088 (--safe-links bypass)" + note,
            upgrade,
        )
    return Check(name, "rsync", OK, number + note)


def _env_note(env: dict[str, str], here: bool) -> str:
    """What the check's detail adds for RSYNC_OLD_ARGS and RSYNC_PROTECT_ARGS where set (`env`, from
    the fact; `here`: this machine's rsync): that they change nothing, and why ("" when none is)."""
    if not env:
        return ""
    names = ", ".join(f"{k}={hostile.line(v, 40)}" for k, v in sorted(env.items()))
    return (
        f"; {names} set (no effect: fab passes -s, which overrides it)"
        if here
        else f"; {names} in its SSH environment (no effect: rsync's server side reads neither)"
    )
