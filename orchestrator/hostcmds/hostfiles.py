"""Where a job lives on a host (output, code, runtime and console directories, the lease and the
stop marker) and the shell scripts that make and read them safely in directories an admin shares
between accounts. Pure: text only, run by the transport."""

from __future__ import annotations

import os

from orchestrator.config.inventory import Inventory
from orchestrator.core.jobspec import WORK, JobSpec, console_name, container_name, heartbeat_name
from orchestrator.hostcmds import touched
from orchestrator.hostcmds.sshargs import shell


def code_path(inv: Inventory, spec: JobSpec) -> str:
    """The job's code on each host: job.code_dir/KEY, never changed once filled (codetree.py)."""
    return f"{inv.job.code_dir}/{spec.code_key}"


def job_dir(inv: Inventory, spec: JobSpec) -> str:
    """The job's output directory on each host (/output in the container, which writes all of it:
    host-side commands below it go through touched.py)."""
    return f"{inv.job.output_dir}/{spec.job_id}"


def work_dir(inv: Inventory, spec: JobSpec) -> str:
    """The job's working directory on each host (/workspace), in its outputs (fetched with them; a
    program's checkpoints there are work/... to the snapshot copies). A mount source inside the tree
    the container writes could be swapped for a link to any host directory before the next `docker
    run -v` (touched.py), so every container of the job mounts it at /output/work too: a mount point
    cannot be renamed or removed from inside (EBUSY), and the start checks it is this account's own
    directory, no link, in the same command as the `docker run` (touched.mount_sources_check)."""
    return f"{job_dir(inv, spec)}/{WORK}"


def runtime_dir(inv: Inventory, spec: JobSpec) -> str:
    """The job's directory on each host for our entrypoint and the secrets file; removed at the end."""
    return f"{inv.job.output_dir}/.runtime/{spec.job_id}"


def secrets_file(inv: Inventory, spec: JobSpec) -> str:
    return f"{runtime_dir(inv, spec)}/secrets.env"


def controller_dir(inv: Inventory, job_id: str) -> str:
    """A detached job's controller directory on its host (its key, launch, secrets; mounted at /ctl)."""
    return f"{inv.job.output_dir}/.controllers/{job_id}"


def stopped_marker(inv: Inventory, job_id: str) -> str:
    """Left by `fab stop` (hostops.mark_stopped) for the job: it was ended on purpose, so a failure
    it causes is not restarted (fab train --restarts). Beside the job's runtime directory, in one
    the group shares (STOPPED_DIR), so another account of the group that stops the job can leave it
    and the job's own account can remove it."""
    return f"{inv.job.output_dir}/.runtime/{STOPPED_DIR}/{job_id}"


# Directories on a host that several Unix accounts of one group share (the admin gives output_dir
# to the group, `chgrp GROUP DIR; chmod 2775 DIR`): the group can write them and what is made in
# them takes their group (setgid). `.claims` and `.claims/HOSTNAME` have no sticky bit: a stale
# claim of an account that left is removed by the next claim of any account (claims.py). `.runtime`
# has one: only a job's own account (or root) renames or removes its runtime directory, which is
# 0711: no one else lists it, reads the secrets file (0600) or writes there, while everyone can
# still stat its lease by name (survey.survey, the claim script) and a container's non-root user
# can read the entrypoint (0644) through the read-only mount. STOPPED_DIR (in `.runtime`, no
# sticky bit) holds the stop markers any account of the group leaves and removes. Any member can put
# a link where one of these directories or files goes: the scripts refuse a link for a directory
# (not_link_script), change modes only of what they entered or opened and found their own
# (own_dir_chmod, claims.claim_script) and make files new (noclobber). The owner of a directory
# holding others' (output_dir, `.runtime`) can still rename what they hold, the sticky bit
# notwithstanding, so the admin makes those root's (README: install -d -o root -g GROUP -m 3775),
# and the scripts use them as they are.
SHARED_MODE = "g+rwxs"  # only added, by the directory's owner: what it took from others stays taken
RUNTIME_MODE = "0711"
STOPPED_DIR = ".stopped"
NOT_WRITABLE = 6  # exit status: a shared directory this account cannot write (made narrower by another)
NOT_OWN = 7  # ... the job's runtime directory is there and not this account's (or not a directory)


def not_link_script(path: str) -> str:
    """End with NOT_WRITABLE, naming the path and the fix, when the shared directory `path` (a shell
    word) is a symbolic link: any member of the group can put one where a shared directory goes
    (in a directory the group writes), and what this account then did there (chmod, files) would
    land where the link points: its own ~/.ssh, say."""
    return (
        f"if [ -L {path} ]; then printf '%s is a symbolic link, not a directory: another account may have "
        f"put it there; remove it (rm %s) and run again\\n' {path} {path} >&2; exit {NOT_WRITABLE}; fi; "
    )


def enter_script(path: str) -> str:
    """`cd` into the shared directory `path` (an absolute path, a shell word), then check that the
    path, no link, still names the directory entered (else NOT_WRITABLE): what follows works in `.`,
    which stays that directory whatever another account renames or links in its place meanwhile."""
    return (
        f"cd -P {path} && [ ! -L {path} ] && [ {path} -ef . ] || {{ printf '%s changed while this command "
        f"entered it (another account may have put a link there): run again\\n' {path} >&2; "
        f"exit {NOT_WRITABLE}; }}; "
    )


def own_dir_chmod(path: str, mode: str, then: str = "") -> str:
    """`chmod mode` of the directory `path` (an absolute path, a shell word) only when it is this
    account's own and no link, without a race: a subshell enters it (`cd -P`), checks that the path,
    still no link, names the directory it is in, and changes `.` (then runs `then` there), so a link
    another account swaps in meanwhile is never followed."""
    return f"( cd -P {path} && [ ! -L {path} ] && [ {path} -ef . ] && [ -O . ] && chmod {mode} .{then} )"


def shared_dir_script(path: str, sticky: bool = False, check: bool = True) -> str:
    """Make the directory `path` (an absolute path, a shell word, expanded on the host) if missing,
    refusing a link there (not_link_script); when this account owns it, add the group's rights and
    setgid (and the sticky bit); with `check`, end with NOT_WRITABLE, naming its owner and the fix,
    when this account still cannot write it (one an older version, or another account with a narrow
    umask, made). One root made (the admin's setup, README) is used as it is."""
    mode = SHARED_MODE + (",+t" if sticky else "")
    fix = f"{mode} %s; chgrp GROUP %s"
    return (
        not_link_script(path) + f"mkdir -p {path} || exit {NOT_WRITABLE}; "
        f"{{ {own_dir_chmod(path, mode)}; }} 2>/dev/null; "
        + (
            f"[ -w {path} ] || {{ printf '%s is not writable by %s (owner %s): its owner can share it with "
            f'the group: chmod {fix}\\n\' {path} "$(id -un)" "$(stat -c %U {path})" {path} {path} >&2; '
            f"exit {NOT_WRITABLE}; }}; "
            if check
            else ""
        )
    )


def own_runtime_script(inv: Inventory, job_id: str) -> str:
    """Make the job's runtime directory (mode RUNTIME_MODE) in the shared `.runtime`, or end with
    NOT_OWN when it is there and not this account's own directory (another account made it first,
    or put a link there), then touch the job's lease (in the directory entered: own_dir_chmod)."""
    rt, own = shell([f"{inv.job.output_dir}/.runtime"]), shell([f"{inv.job.output_dir}/.runtime/{job_id}"])
    return (
        shared_dir_script(rt, sticky=True) + f"mkdir -m {RUNTIME_MODE} {own} 2>/dev/null; "
        f"if [ -L {own} ] || [ ! -d {own} ] || [ ! -O {own} ]; then printf '%s is not a directory of %s; "
        f"another account made it: job ids are never reused, so remove it (its owner or root)\\n' {own} "
        f'"$(id -un)" >&2; exit {NOT_OWN}; fi; {own_dir_chmod(own, RUNTIME_MODE, f" && touch {LEASE}")}'
    )


def stop_mark_script(inv: Inventory, job_ids: list[str] | tuple[str, ...]) -> str:
    """Leave the stop marker (stopped_marker) of these jobs on the host, in the shared STOPPED_DIR
    (an existing marker, of any account, is kept); made new (noclobber), so a link another account
    put at its name is never written through."""
    d = shell([f"{inv.job.output_dir}/.runtime/{STOPPED_DIR}"])
    marks = "; ".join(
        f"[ -e {m} ] || ( set -C; : > {m} )" for m in (shell([stopped_marker(inv, j)]) for j in job_ids)
    )
    return (
        shared_dir_script(shell([f"{inv.job.output_dir}/.runtime"]), sticky=True, check=False)
        + shared_dir_script(d)
        + f"umask 022; {marks}"
    )


# Not a job: the preflight's cache of image facts (python, torch, CUDA per image id), kept in the
# runtime directory's parent beside the jobs' own directories.
IMAGE_CACHE = "images"
LEASE = "lease"  # in the job's runtime directory: touched while `fab train` looks after the job
LEASE_EVERY = 5.0  # seconds between touches
# A lease younger than this means a `fab train` looks after the job right now (it missed at most
# two touches): `fab stop` ends that job, and a new job on the same hosts is refused. A host lost
# mid-job keeps an older lease, which blocks nobody.
LEASE_LIVE = 3 * LEASE_EVERY
# A runtime directory whose lease is this old, with no container of its job, is left over
# (FABTRAIN_LEASE_STALE: tests wait seconds, not a minute).
LEASE_STALE = float(os.environ.get("FABTRAIN_LEASE_STALE", "60"))


def console_file(inv: Inventory, spec: JobSpec, rank: int | str) -> str:
    """Where node `rank`'s container writes its output (both streams), on the host. The entrypoint
    sends it there (FABTRAIN_CONSOLE) instead of Docker's log: the follower reads plain bytes
    with `tail`, with no JSON encoding by the engine and decoding by `docker logs` in between
    (BENCHMARKS.md: the log path). The file stays with the job's outputs on the host. The container
    may have put anything at that name: it is read only through touched.py, as console_rel under
    the job's directory."""
    return f"{job_dir(inv, spec)}/{console_name(rank)}"


def end_rel(rank: int | str) -> str:
    """Node `rank`'s end file, relative to the job's directory (end_file)."""
    return console_name(rank) + ".end"


def end_file(inv: Inventory, spec: JobSpec, rank: int | str) -> str:
    """Written by a warm node (FABTRAIN_WARM) when a generation ends: its exit code; the container
    stays and waits for its go file (warm_go_file)."""
    return f"{job_dir(inv, spec)}/{end_rel(rank)}"


def warm_go_file(inv: Inventory, spec: JobSpec, rank: int | str) -> str:
    """What starts a warm node's next generation: KEY=VALUE lines, in the runtime directory the
    container mounts read-only (the entrypoint's warm_paths)."""
    return f"{runtime_dir(inv, spec)}/warm-{rank}.env"


def follow_logs_script(inv: Inventory, spec: JobSpec, rank: int, warm: bool = False) -> str:
    """Stream node `rank`'s output from its start until its container exits: its console file, once
    it appears, followed through its descriptor (touched.follow: a link or a FIFO put there is never
    read), ended by a `docker wait` for the container; tail reads the file to its end before it
    leaves. A warm node's follow also ends when its generation ends (its end file appears), the
    container still running."""
    name, root = container_name(spec.job_id, rank), shell([job_dir(inv, spec)])
    wait = f"{shell(['docker', 'wait', name])} >/dev/null 2>&1"
    if warm:
        wait = f"( {wait} & w=$!; {touched.until(root, end_rel(rank), '$w')}; kill $w 2>/dev/null )"
    # tail reads new output at once (inotify); it looks every 0.05 s whether the wait ended: a warm
    # node's end is seen within 0.1 s, a restart waits for it.
    return f"{wait} & w=$!; {touched.follow(root, console_name(rank), '$w')} 2>/dev/null; wait"


# The end of a node's output read after it exits, in bytes, not lines: one line can be any size.
TAIL_BYTES = 256 * 1024


def finish_logs_script(inv: Inventory, spec: JobSpec, rank: int, warm: bool = False) -> str:
    """After following ends: print the container's exit code (255 if it is gone) on the first
    line, then the last TAIL_BYTES bytes of its output: of its console file, or of Docker's log
    when the container ended before the entrypoint made the file (an image without python3).
    `logs.missing_output` finds in this tail anything the follow did not deliver. A warm node whose
    generation ended gives that generation's code (its end file: digits only are taken) and the
    word warm: its container waits for the next generation."""
    name, root = container_name(spec.job_id, rank), shell([job_dir(inv, spec)])
    code = f"code=$({shell(['docker', 'wait', name])} 2>/dev/null); "
    if warm:
        end = touched.head(root, end_rel(rank), 12)
        code = (
            f"if {touched.is_file(root, end_rel(rank))}; then code=$({end} | tr -cd 0-9); w=' warm'; "
            f"else {code}fi; "
        )
    return (
        f'{code}echo "${{code:-255}}{"$w" if warm else ""}"; '
        f"{touched.tail(root, console_name(rank), TAIL_BYTES)}; "
        f'[ $? = 4 ] && [ -n "$code" ] && {shell(["docker", "logs", "--tail", "1000", name])} 2>&1 '
        f"| {shell(['tail', '-c', str(TAIL_BYTES)])}; true"
    )


def remainder_logs_script(inv: Inventory, spec: JobSpec, rank: int, start: int | str) -> str:
    """All output from byte `start` on, counted from 1 (when the follow missed more than the tail).
    A plan renders it with a placeholder word, replaced by the number when it runs."""
    name, root = container_name(spec.job_id, rank), shell([job_dir(inv, spec)])
    return (
        f"{touched.read_from(root, console_name(rank), start)}; [ $? = 4 ] && "
        f"{shell(['docker', 'logs', name])} 2>&1 | {shell(['tail', '-c', f'+{start}'])}; true"
    )


def progress_script(inv: Inventory, spec: JobSpec, rank: int) -> str:
    """Seconds since node `rank`'s heartbeat file was last touched, by the host's own clock
    ('none' when the job never touched it, or put something else than a file there)."""
    age = touched.age(shell([job_dir(inv, spec)]), heartbeat_name(rank))
    return f'a=$({age} 2>/dev/null); echo "${{a:-none}}"'
