"""The storage checks of a preflight, each host's on its own: /dev/shm's size (`judge_shm`), the
free space at the job's directories (`judge_disk`), and whether the SSH user can create and write
them (`judge_dirs`), from the facts of its probe (the "shm" and "dirs" facts). Pure, so unit-tested
without a network."""

from __future__ import annotations

from orchestrator.config.inventory import Host, Inventory
from orchestrator.preflight.checks import FAIL, OK, WARN, Check, Limits, _last


def judge_dirs(host: Host, fact: tuple[int, str]) -> Check:
    """job.code_dir and job.output_dir must exist or be creatable, and be writable, by the SSH user."""
    n, user = host.name, host.ssh.user
    rc, text = fact
    denied = [line.split() for line in text.splitlines() if line.startswith("denied ")]
    if rc != 0 or not any(line.startswith(("ok ", "denied ")) for line in text.splitlines()):
        return Check(n, "dirs", WARN, f"could not check the job directories: {_last(text)}", "")
    if not denied:
        return Check(n, "dirs", OK, "code and output dirs writable by " + user)
    parts, closed = [], []
    for fields in denied:
        path, blocker = fields[1], fields[2]
        owner = fields[3] if len(fields) > 3 else "?"
        if blocker == path:
            why = "not writable"
        elif fields[4:5] == ["closed"]:
            # The user cannot enter it: what is below, the path itself too, may be there unseen.
            why = f"{blocker} is closed to {user} (owner {owner})"
            closed += [blocker] if blocker not in closed else []
        else:
            why = f"cannot be created: {blocker} is owned by {owner}"
        parts.append(f"{path} ({why})")
    paths = " ".join(f[1] for f in denied)
    opening = f"sudo chmod a+x {' '.join(closed)}; " if closed else ""
    return Check(
        n,
        "dirs",
        FAIL,
        f"{user} cannot write " + ", ".join(parts),
        f"on {n}: {opening}sudo install -d -o {user} -g $(id -gn {user}) {paths}  (or set job.code_dir / "
        f"job.output_dir to directories {user} owns)",
    )


def judge_shm(inv: Inventory, host: Host, fact: tuple[int, str], limits: Limits) -> Check:
    n = host.name
    if inv.job.shm_size:
        return Check(n, "shm", OK, f"--shm-size {inv.job.shm_size}")
    rc, text = fact
    fields = text.splitlines()[-1].split() if rc == 0 and text else []
    if len(fields) < 4 or not fields[1].isdigit():
        return Check(
            n, "shm", WARN, f"could not read /dev/shm: {_last(text)}", "check that /dev/shm is mounted"
        )
    mb = int(fields[1]) // 1024
    if mb < limits.shm_warn_mb:
        return Check(
            n,
            "shm",
            WARN,
            f"/dev/shm is {mb} MB (--ipc host)",
            f"enlarge /dev/shm on {n}, or set job.shm_size (e.g. 16g)",
        )
    return Check(n, "shm", OK, f"{mb} MB (--ipc host)")


def judge_disk(inv: Inventory, host: Host, fact: tuple[int, str], limits: Limits) -> Check:
    n = host.name
    rc, text = fact
    rows = [line.split() for line in text.splitlines() if len(line.split()) >= 6]
    if rc != 0 or len(rows) < 2:
        return Check(n, "disk", WARN, f"could not read free space: {_last(text)}", "")
    worst = min(int(r[3]) for r in rows[:2]) / 1024**2
    paths = f"{inv.job.code_dir}, {inv.job.output_dir}"
    if worst < limits.disk_fail_gb:
        return Check(
            n, "disk", FAIL, f"{worst:.1f} GB free at {paths}", f"free space on {n} or move output_dir"
        )
    if worst < limits.disk_warn_gb:
        return Check(
            n, "disk", WARN, f"{worst:.1f} GB free at {paths}", f"snapshots may not fit; free space on {n}"
        )
    return Check(n, "disk", OK, f"{worst:.0f} GB free")
