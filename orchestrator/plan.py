"""Pure functions from (inventory, job options) to the exact commands run on each host.

Commands stay argv lists until the very edge, where `shell()` quotes them exactly once with
shlex.join. Nothing here touches the network, so a plan can be printed (dry run) and tested.
"""
from __future__ import annotations

import datetime as _dt
import re
import secrets as _secrets
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from .inventory import Host, Inventory
from .sshconf import SSH

PROJECT_ROOT = Path(__file__).resolve().parent.parent
LABEL_MANAGED = "fabtrain.managed"
LABEL_JOB = "fabtrain.job"
LABEL_RANK = "fabtrain.rank"
LABEL_HOST = "fabtrain.host"
# Inside the container: the synced code, the job's outputs, and secrets (a file, never an env value
# on a command line).
WORKDIR = "/workspace"
OUTDIR = "/output"
SECRETS_PATH = "/run/fabtrain/secrets.env"
# rsync gives up when no data moves for this long (a frozen disk or link), however long the copy.
RSYNC_IO_TIMEOUT = 60
RSYNC_EXCLUDES = (".git", "__pycache__", "*.pyc", ".venv", ".cache", ".cluster", "runs",
                  ".pytest_cache", "*.egg-info")


@dataclass(frozen=True)
class JobSpec:
    """What to run: a script in the synced code and its arguments, handed to torchrun verbatim."""

    job_id: str
    script: str
    args: tuple[str, ...] = ()
    image: str | None = None
    nproc_per_node: str | None = None
    master_port: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    # The local tree synced to job.code_dir (and mounted at /workspace): this project by default,
    # or the user's own code.
    code: str = str(PROJECT_ROOT)


def new_job_id(name: str = "job") -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{_secrets.token_hex(2)}"


JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def valid_job_id(job_id: str) -> bool:
    """A job id that is safe as a local directory name (it may come from a remote label)."""
    return bool(JOB_ID_RE.match(job_id)) and ".." not in job_id


def shell(argv: list[str] | tuple[str, ...]) -> str:
    """The one place an argv becomes a remote command string."""
    return shlex.join(argv)


def container_name(job_id: str, rank: int) -> str:
    return f"fabtrain-{job_id}-r{rank}"


def device_args(host: Host) -> list[str]:
    """Docker flags that expose the host's accelerators to the container."""
    args: list[str] = []
    if host.gpu_vendor == "nvidia":
        # The NVIDIA container toolkit maps every GPU and the driver libraries.
        args += ["--gpus", "all"]
    elif host.gpu_vendor == "amd":
        # ROCm needs the compute interface (kfd), the render nodes (dri), and the groups owning them.
        args += ["--device", "/dev/kfd", "--device", "/dev/dri",
                 "--group-add", "video", "--group-add", "render"]
    for dev in host.devices:
        args += ["--device", dev]
    return args


def job_env(inv: Inventory, host: Host, spec: JobSpec) -> list[tuple[str, str]]:
    """Environment of one node's container, in a stable order (inventory, host, then command line)."""
    env = [
        ("MASTER_ADDR", inv.master.hostname),
        ("MASTER_PORT", str(spec.master_port or inv.job.master_port)),
        ("NNODES", str(len(inv.hosts))),
        ("NODE_RANK", str(host.rank)),
        ("NPROC_PER_NODE", spec.nproc_per_node or inv.job.nproc_per_node),
        ("NCCL_SOCKET_IFNAME", host.interface),
        ("GLOO_SOCKET_IFNAME", host.interface),
        ("FABTRAIN_JOB", spec.job_id),
        ("FABTRAIN_NODE", host.name),
        ("FABTRAIN_OUTPUT", OUTDIR),
    ]
    merged = dict(env)
    for key, value in (*inv.job.env, *host.env, *spec.env):
        merged[key] = value
    return list(merged.items())


def docker_run_argv(inv: Inventory, host: Host, spec: JobSpec, with_secrets: bool = False) -> list[str]:
    """`docker run` of one node of a job, detached so the job outlives a lost SSH session."""
    name = container_name(spec.job_id, host.rank)
    argv = ["docker", "run", "--detach", "--name", name,
            "--label", f"{LABEL_MANAGED}=1", "--label", f"{LABEL_JOB}={spec.job_id}",
            "--label", f"{LABEL_RANK}={host.rank}", "--label", f"{LABEL_HOST}={host.name}",
            # Host networking: NCCL/gloo see the real interfaces, no port mapping, no NAT.
            "--network", "host"]
    # Shared memory for DataLoader workers and NCCL: the host's IPC namespace unless a size is set.
    argv += ["--shm-size", inv.job.shm_size] if inv.job.shm_size else ["--ipc", "host"]
    argv += device_args(host)
    for key, value in job_env(inv, host, spec):
        argv += ["--env", f"{key}={value}"]
    argv += ["--volume", f"{inv.job.code_dir}:{WORKDIR}:ro",
             "--volume", f"{inv.job.output_dir}/{spec.job_id}:{OUTDIR}"]
    if with_secrets:
        argv += ["--volume", f"{secrets_file(inv, spec)}:{SECRETS_PATH}:ro"]
    for m in host.mounts:
        argv += ["--volume", f"{m.source}:{m.target}" + (":ro" if m.read_only else "")]
    argv += ["--workdir", WORKDIR, spec.image or inv.image_for(host), spec.script, *spec.args]
    return argv


def secrets_file(inv: Inventory, spec: JobSpec) -> str:
    return f"{inv.job.output_dir}/.secrets/{spec.job_id}.env"


def prepare_dirs_argv(inv: Inventory, spec: JobSpec) -> list[str]:
    return ["mkdir", "-p", f"{inv.job.output_dir}/{spec.job_id}", inv.job.code_dir]


def follow_logs_argv(spec: JobSpec, rank: int) -> list[str]:
    """Stream one container's output (both streams) from its start until it exits."""
    return ["docker", "logs", "--follow", container_name(spec.job_id, rank)]


TAIL_LINES = 1000


def finish_logs_script(spec: JobSpec, rank: int) -> str:
    """After following ends: print the container's exit code (255 if it is gone) on the first
    line, then its last TAIL_LINES lines of output, which Docker reads from the end of its log.

    `docker logs --follow` stops when the container exits even if it has fallen behind (it does
    under backpressure from a slow reader: it lost up to 45% of 200k fast lines in the log
    benchmark); `logs.missing_output` finds in this tail what the follow did not deliver.
    """
    name = container_name(spec.job_id, rank)
    return (f"code=$({shell(['docker', 'wait', name])} 2>/dev/null); echo \"${{code:-255}}\"; "
            f"if [ -n \"$code\" ]; then {shell(['docker', 'logs', '--tail', str(TAIL_LINES), name])} 2>&1; fi")


def remainder_logs_script(spec: JobSpec, rank: int, received: int) -> str:
    """All output past the first `received` bytes (when the follow missed more than the tail)."""
    name = container_name(spec.job_id, rank)
    return f"{shell(['docker', 'logs', name])} 2>&1 | {shell(['tail', '-c', f'+{received + 1}'])}"


def label_filter(job_id: str | None) -> list[str]:
    args = ["--filter", f"label={LABEL_MANAGED}=1"]
    if job_id:
        args += ["--filter", f"label={LABEL_JOB}={job_id}"]
    return args


def stop_script(job_id: str | None = None, grace: float = 0) -> str:
    """Stop (SIGTERM, grace seconds, then SIGKILL) and remove this project's containers, by label."""
    ids = shell(["docker", "ps", "--all", "--quiet", *label_filter(job_id)])
    parts = []
    if grace > 0:
        parts.append(f"{ids} | xargs -r {shell(['docker', 'stop', '--time', str(int(grace))])} >/dev/null")
    parts.append(f"{ids} | xargs -r {shell(['docker', 'rm', '--force'])}")
    return "; ".join(parts)


def status_argv(job_id: str | None = None) -> list[str]:
    return ["docker", "ps", "--all", *label_filter(job_id), "--format",
            "{{.Label \"" + LABEL_JOB + "\"}}\t{{.Label \"" + LABEL_RANK + "\"}}\t{{.Names}}\t"
            "{{.State}}\t{{.Status}}"]


def ssh_argv(host: Host) -> list[str]:
    """The OpenSSH client command rsync uses to reach a host (its target not included): built from
    the same resolved settings as paramiko's connection (remote.connect_kwargs), so both reach the
    same host with the same keys and the same trust."""
    return ssh_options(host.ssh)


def ssh_options(ssh: SSH) -> list[str]:
    # -F none: every setting is here, already resolved from the user's ssh_config (sshconf), so
    # OpenSSH must not apply that file a second time.
    argv = ["ssh", "-F", "none", "-p", str(ssh.port), "-l", ssh.user,
            # Never prompt; a host whose key is unknown or changed is refused, not trusted.
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", "UserKnownHostsFile=" + " ".join(_ssh_escape(k) for k in ssh.known_hosts),
            "-o", f"ConnectTimeout={int(ssh.connect_timeout)}",
            # Notice a dead link during a long transfer instead of hanging.
            "-o", f"ServerAliveInterval={int(ssh.keepalive)}", "-o", "ServerAliveCountMax=3"]
    for key in ssh.keys:
        argv += ["-i", key]
    if ssh.keys_only:
        argv += ["-o", "IdentitiesOnly=yes"]
    if ssh.jump:
        # Each hop is dialled by its own ssh (same checks) through the hops before it; -W carries
        # the stream on. '%' is ssh's token character, so it is doubled in the command.
        *before, last = ssh.jump
        proxy = [*ssh_options(replace(last, jump=tuple(before))), "-W", f"[{ssh.hostname}]:{ssh.port}",
                 last.hostname]
        argv += ["-o", "ProxyCommand=" + shell(proxy).replace("%", "%%")]
    return argv


def _ssh_escape(path: str) -> str:
    """A known_hosts path for ssh's option parser, which splits on spaces and honours quotes."""
    return f'"{path}"' if " " in path else path


def rsync_argv(host: Host, source: str, dest: str) -> list[str]:
    """Mirror the local tree `source` to `dest` on the host (same path on every host)."""
    argv = ["rsync", "--archive", "--compress", "--delete", "--mkpath", f"--timeout={RSYNC_IO_TIMEOUT}",
            "--rsh", shell(ssh_argv(host))]
    for pattern in RSYNC_EXCLUDES:
        argv += ["--exclude", pattern]
    argv += [source.rstrip("/") + "/", rsync_remote(host, dest + "/")]
    return argv


def rsync_remote(host: Host, path: str) -> str:
    """rsync's HOST:PATH for a remote path (the user comes from ssh's -l)."""
    address = host.ssh.hostname
    return f"[{address}]:{path}" if ":" in address else f"{address}:{path}"


def fetch_argv(host: Host, remote_dir: str, dest: str) -> list[str]:
    """Copy a job's outputs from a host, safely: a host (or a container writing its outputs) may be
    hostile, so no owners, groups, permissions bits beyond the umask (no setuid), devices or special
    files are kept, and symlinks pointing outside the copied tree are skipped."""
    return ["rsync", "--recursive", "--times", "--links", "--safe-links", f"--timeout={RSYNC_IO_TIMEOUT}",
            "--rsh", shell(ssh_argv(host)),
            rsync_remote(host, remote_dir.rstrip("/") + "/"), dest]
