"""What a job is, before any host is involved: the JobSpec (what to run, with which options),
its id, a program's checkpoint pattern, and the fixed layout of a job's container (its labels and
mount points) that every backend renders the same way. Pure: no I/O, no other layer."""

from __future__ import annotations

import datetime as _dt
import re
import secrets as _secrets
from dataclasses import dataclass
from pathlib import Path

# This checkout's root (the built-in trainers are synced from here by default).
PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Where a step runs when it is not on a host: this machine (rsync to or from a host).
LOCAL = "local"


LABEL_MANAGED = "fabtrain.managed"
LABEL_JOB = "fabtrain.job"
LABEL_RANK = "fabtrain.rank"
LABEL_HOST = "fabtrain.host"
LABEL_OWNER = "fabtrain.owner"  # user@machine that started the job (fab stop ends only its own)
LABEL_ATTEMPT = "fabtrain.attempt"
LABEL_WARM = (
    "fabtrain.warm"  # a warm node's key (hostcmds/node.py warm_key): what its next generation may keep
)
# Inside the container: the job's working directory (writable, in its outputs: WORK), its code
# (read-only, codetree.py; the entrypoint links its files into the working directory), its outputs,
# and its runtime directory (our entrypoint, and secrets as a file, never an env value on a command
# line), read-only.
WORKDIR = "/workspace"
CODE_MOUNT = "/run/fabtrain-code"
OUTDIR = "/output"
WORK = "work"  # the working directory, in the job's output directory on the host (/output/work)
RUNTIME_MOUNT = "/run/fabtrain"
SECRETS_PATH = f"{RUNTIME_MOUNT}/secrets.env"
CONSOLE_DIR = ".console"  # in the job's output directory: each node's output (console_file)
ENTRYPOINT_PATH = f"{RUNTIME_MOUNT}/entrypoint.py"

MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class JobSpec:
    """What to run: a script in the synced code (or, with module, a Python module in the image or
    the synced code) and its arguments, handed to torchrun verbatim."""

    job_id: str
    script: str
    module: bool = False
    args: tuple[str, ...] = ()
    image: str | None = None
    nproc_per_node: str | None = None
    master_port: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    # The local tree synced to job.code_dir/code_key (codetree.py): this project's trainers by
    # default, or the user's own code.
    code: str = str(PROJECT_ROOT)
    code_only: str = ""  # only this top folder of `code` (the built-in trainers': codetree.BUILTIN_ONLY)
    code_key: str = ""
    # A program's own checkpoints (fab train --checkpoint): a glob relative to the job's output
    # directory (work/... for the working directory); "" for our trainers' snapshots.
    checkpoint: str = ""
    # Sharing hosts (claims.py): GPUs (CPU slots) asked for per host, in --include's syntax
    # ("node1:0,1@node2:2,3"; hosts not named take `gpus` or the default), --gpus N, whether CPU
    # hosts' containers are pinned to their slots' CPUs, and who started the job (user@machine).
    units: str = ""
    gpus: int | None = None
    cpuset: bool = False
    owner: str = ""


def checkpoint_pattern(value: str) -> str:
    """A program's checkpoint path or glob as given (relative to the working directory, or under
    /output) -> JobSpec.checkpoint (relative to the job's output directory). ValueError says what
    is wrong with it."""
    v = value.strip()
    if v.startswith(OUTDIR + "/"):
        rel = v[len(OUTDIR) + 1 :]
    elif v.startswith("/"):
        raise ValueError(
            f"{value!r} is outside the job's folders: give a path relative to the working "
            f"directory (checkpoints/ckpt.pt) or under {OUTDIR}/"
        )
    else:
        rel = f"{WORK}/{v.removeprefix('./')}"
    if rel.endswith("/"):
        rel += "*"  # a directory: every file in it
    parts = rel.split("/")
    if ".." in parts or "" in parts or "." in parts or any(c < " " or c in "\x7f\\" for c in rel):
        raise ValueError(
            f"{value!r} is not a plain path (no '..', no empty parts, no control characters or backslashes)"
        )
    # The first folder is named, not matched: a glob there would take in fabtrain's own folders
    # (.console, .progress, snapshots) and the temporary folders a checkpoint is placed through.
    if (
        parts[0] in (CONSOLE_DIR, PROGRESS_DIR, "snapshots")
        or parts[0].startswith(".")
        or any(c in parts[0] for c in "*?[")
    ):
        raise ValueError(
            f"{value!r} is fabtrain's own folder or a pattern over the whole output folder; "
            f"name the folder your program writes its checkpoints in ({OUTDIR}/ckpt/*)"
        )
    return rel


def new_job_id(name: str = "job") -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{_secrets.token_hex(2)}"


JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def valid_job_id(job_id: str) -> bool:
    """A job id that is safe as a local directory name (it may come from a remote label)."""
    return bool(JOB_ID_RE.match(job_id)) and ".." not in job_id


SPARE = "spare"  # a hot spare's "rank" until it is given one: its container name, console, go file


def container_name(job_id: str, rank: int | str) -> str:
    """Node `rank`'s container (a hot spare's: rank SPARE, renamed when it takes a rank)."""
    return f"fabtrain-{job_id}-spare" if rank == SPARE else f"fabtrain-{job_id}-r{rank}"


def rank_of_container(job_id: str, name: str) -> int | None:
    """The node rank in a container's name (None: not a rank's, e.g. a hot spare still waiting)."""
    prefix = f"fabtrain-{job_id}-r"
    tail = name[len(prefix) :] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and len(tail) < 6 else None


def console_name(rank: int | str) -> str:
    """Node `rank`'s console file, relative to the job's output directory (/output inside)."""
    return f"{CONSOLE_DIR}/node-{rank}.log"


PROGRESS_DIR = ".progress"  # in the job's output directory: each node's heartbeat file


def heartbeat_name(rank: int) -> str:
    """Node `rank`'s heartbeat file, relative to the job's output directory: the entrypoint gives
    its path to the workers as FABTRAIN_HEARTBEAT; touching it is progress (docs/recovery.md)."""
    return f"{PROGRESS_DIR}/node-{rank}"
