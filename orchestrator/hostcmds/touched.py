"""A path a container could have touched: the one place for what host-side commands do there.

A job's containers write /output (job.output_dir/JOB on the host) and /workspace (its work
directory): any name in those trees may be, by the time a host-side command looks, a symbolic link
to the host's files (/root, another job's secrets, a controller's key), a FIFO that blocks its
reader for ever, or a device node (a container holds CAP_MKNOD by default). `mkdir -p`, `tail`,
`[ -f ]`, `cat` and `docker run -v` all follow links; this is the class of Kubernetes' subPath
escape (CVE-2017-1002101). So every host-side command on such a path is built here, and:

- enters a container-writable directory only as the directory it is: the tree's root is one
  fabtrain made and no container can replace (a mount source: the container sees only inside it),
  and each component below it is checked, after `cd -P`, to be the very inode that `stat` (which
  does not follow links) saw at its name: a link, or a swap between the look and the cd, is refused;
- reads a file only as a regular file, opened on a descriptor: the name's own inode must be the
  descriptor's and the descriptor's a regular file (no link followed, no FIFO or device read), the
  open bounded (a FIFO swapped in between the look and the open ends the command within
  OPEN_BOUND s, it does not block it), then read or followed through the descriptor
  (/proc/self/fd), never by its name again;
- removes only names inside a directory entered that way (unlink never follows the last component);
- checks mount sources (mount_sources_check) in the same shell command as the `docker run` that
  mounts them: each a directory of the SSH user's own, no link. None lies inside a tree a
  container writes, but the work directory (/workspace), which every container of the job also
  mounts at /output/work, so none can rename or remove it (hostfiles.work_dir).

Each script is `sh -c SCRIPT sh ARGS...`: the paths are arguments, the script is constant, so it is
quoted once and the watchdog of a bounded open can end exactly that shell (its $$), nothing else.
Pure: text only, run by the transport.
"""

from __future__ import annotations

from orchestrator.hostcmds.sshargs import shell

REFUSED = "refused: "  # what every refusal the scripts print on stderr starts with
OPEN_BOUND = 10  # seconds an open may block (only a FIFO swapped in after the look does)
NOT_SAFE = 5  # exit status: a name there is not the directory or regular file it must be

# $1 root (made by fabtrain, no container can replace it), $2 the directories below it ('/'
# between, each a name of ours), $3 the file's name there, $4 what to do, $5 its argument.
# One line (a plan shows each command on one line), read as these statements in turn.
_SCRIPT = " ".join(
    (
        'cd -P "$1" 2>/dev/null || exit 4;',
        "IFS=/; set -f;",
        'for c in $2; do [ -e "$c" ] || [ -L "$c" ] || exit 4;',
        'p=$(stat -c %d:%i -- "$c" 2>/dev/null) && cd -P -- "$c" 2>/dev/null'
        ' && [ "$(stat -c %d:%i .)" = "$p" ]',
        '|| { echo "refused: $1/$2 is not a directory (a link, or changed while entered)" >&2;'
        " exit 5; }; done;",
        "unset IFS; n=$3;",
        'case $4 in remove) shift 4; exec rm -f -- "$@";;',
        'age) [ -f "$n" ] && [ ! -L "$n" ] && echo $(( $(date +%s) - $(stat -c %Y -- "$n") )); exit;;',
        'is) [ -f "$n" ] && [ ! -L "$n" ]; exit;;',
        'until) while [ ! -e "$n" ] && [ ! -L "$n" ] && kill -0 "$5" 2>/dev/null;'
        " do sleep 0.05; done; exit 0;;",
        'follow) while [ ! -e "$n" ] && [ ! -L "$n" ] && kill -0 "$5" 2>/dev/null;'
        " do sleep 0.05; done;; esac;",
        '[ -e "$n" ] || [ -L "$n" ] || exit 4;',
        '[ -f "$n" ] && [ ! -L "$n" ]',
        '|| { echo "refused: $1/$2/$n is not a regular file (a link?)" >&2; exit 5; };',
        f"( sleep {OPEN_BOUND}; kill -KILL $$ ) >/dev/null 2>&1 </dev/null & w=$!;",
        'command exec 3<"$n"; r=$?; kill $w 2>/dev/null;',
        "[ $r = 0 ] && [ -f /proc/self/fd/3 ]",
        '&& [ "$(stat -L -c %d:%i /proc/self/fd/3)" = "$(stat -c %d:%i -- "$n")" ]',
        '|| { echo "refused: $1/$2/$n changed while opened (a link?)" >&2; exit 5; };',
        'case $4 in tail) exec tail -c "$5" /proc/self/fd/3;;',
        'from) exec tail -c "+$5" /proc/self/fd/3;;',
        'head) exec head -c "$5" /proc/self/fd/3;;',
        'follow) exec tail -c +1 -s 0.05 -f --pid="$5" /proc/self/fd/3;; esac',
    )
)
_SH = shell(["sh", "-c", _SCRIPT, "sh"])


def _run(root: str, rel: str, how: str, arg: str = "", pid: str = "") -> str:
    """The script on `rel` (a relative path of ours: directories, then the file) under `root`, a
    shell word (quoted by the caller, so a loop's "$j" can be part of it); `pid` a shell word too."""
    directory, _, name = rel.rpartition("/")
    tail = f' "{pid}"' if pid else ""
    return f"{_SH} {root} {shell([directory, name, how, *([arg] if arg else [])])}{tail}"


def tail(root: str, rel: str, nbytes: int) -> str:
    """The last `nbytes` bytes of the regular file `rel` under `root` (nothing, exit 4, when it is
    missing; exit NOT_SAFE, saying so, when it is not a regular file)."""
    return _run(root, rel, "tail", str(nbytes))


def read_from(root: str, rel: str, start: int | str) -> str:
    """The file's bytes from byte `start` on, counted from 1 (a plan's placeholder word too)."""
    return _run(root, rel, "from", str(start))


def head(root: str, rel: str, nbytes: int) -> str:
    """The first `nbytes` bytes of the file."""
    return _run(root, rel, "head", str(nbytes))


def follow(root: str, rel: str, pid: str) -> str:
    """The file from its first byte on, followed through its descriptor until process `pid` (a
    shell variable with its $, e.g. "$w") ends; waits for it to appear meanwhile. A file removed,
    renamed or swapped for a link after it was opened is still the file opened."""
    return _run(root, rel, "follow", pid=pid)


def until(root: str, rel: str, pid: str) -> str:
    """Wait until a name `rel` is there (of any kind: nothing of it is read) or process `pid` ends."""
    return _run(root, rel, "until", pid=pid)


def is_file(root: str, rel: str) -> str:
    """Succeeds when `rel` is there as a regular file (a link never counts)."""
    return _run(root, rel, "is")


def age(root: str, rel: str) -> str:
    """Seconds since the regular file `rel` was modified, by the host's clock (nothing when none)."""
    return _run(root, rel, "age")


def remove(root: str, directory: str, names: list[str]) -> str:
    """`rm -f` of these names in `directory` under `root`, entered as the directory it is."""
    return f"{_SH} {root} {shell([directory, '', 'remove', *names])}"


def make_dir(root: str, directory: str) -> str:
    """The directory `directory` (one name) under `root` made when missing; a link or other file
    there (a container's) is removed first: unlink never follows it."""
    d = shell([directory])
    # -p: nodes sharing job.output_dir (Slurm) make it at the same moment; a link put back in between
    # is refused by mount_sources_check
    return f"( cd -P {root} && {{ [ -d {d} ] && [ ! -L {d} ] || {{ rm -f -- {d}; mkdir -p -- {d}; }}; }} )"


def mount_sources_check(paths: list[str]) -> str:
    """Fail, naming the path and the fix, unless every path is a directory of this account's own
    and no link: joined with && to the `docker run` that mounts them, in the same shell command."""
    return (
        f'{{ for d in {shell(paths)}; do if [ -L "$d" ] || [ ! -d "$d" ] || [ ! -O "$d" ]; then '
        "printf '%s is not a directory of %s (a link, or made by another account): not mounted; remove it "
        f'and run again\\n\' "$d" "$(id -un)" >&2; exit {NOT_SAFE}; fi; done; }}'
    )
