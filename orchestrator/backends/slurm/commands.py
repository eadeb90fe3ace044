"""What fab says to Slurm on the login node and reads back: each command a string built here
(quoted once) and each answer parsed here; nothing runs. slurm.py runs them through the project's
Session, so each has a deadline and a recording stand-in sees it."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.backends.slurm.script import COMMENT
from orchestrator.config.inventory import Slurm
from orchestrator.core import hostile
from orchestrator.hostcmds import sshargs

# States a job does not leave (PREEMPTED and NODE_FAIL jobs that Slurm requeues go back to PENDING).
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "SPECIAL_EXIT",
    "REVOKED",
}


def out_file(cfg: Slurm, job_id: str, slurm_id: str) -> str:
    """Where Slurm writes the job's output: the script's --output=JOB-%j.out in the submit dir."""
    return f"{cfg.workdir}/{job_id}-{slurm_id}.out"


def submit_command(cfg: Slurm, job_id: str, secrets: bool = False) -> str:
    """sbatch in the workdir (the job's output file lands there); the secrets file, if any, is named
    to the script by FABTRAIN_SECRETS (sbatch passes the environment on)."""
    script = f"{job_id}.sbatch"
    env = f"FABTRAIN_SECRETS={sshargs.shell([secrets_path(cfg, job_id)])} " if secrets else ""
    return f"cd {sshargs.shell([cfg.workdir])} && {env}sbatch --parsable {sshargs.shell([script])}"


def show_command(slurm_id: str) -> str:
    return sshargs.shell(["scontrol", "show", "job", "--oneliner", slurm_id])


def hostnames_command(nodelist: str) -> str:
    return sshargs.shell(["scontrol", "show", "hostnames", nodelist])


def sacct_command(slurm_id: str) -> str:
    """The job's end from the accounting database, or, where the cluster keeps none, from the job
    completion log (sacct --completion)."""
    fields = ["--noheader", "--parsable2", "--format", "JobID,State,ExitCode", "--jobs", slurm_id]
    return (
        f"{sshargs.shell(['sacct', '--allocations', *fields])} 2>/dev/null"
        f" || {sshargs.shell(['sacct', '--completion', *fields])}"
    )


def follow_command(path: str) -> str:
    """Every line of the output file from its start, then what is appended (the file may not
    exist yet while the job is pending)."""
    q = sshargs.shell([path])
    return f"while [ ! -e {q} ]; do sleep 0.2; done; exec tail -n +1 -s 0.2 -F {q}"


def squeue_command() -> str:
    return sshargs.shell(["squeue", "--me", "--noheader", "--format", "%i|%j|%T|%N|%S|%k|%u|%r"])


def parse_show(text: str) -> dict[str, str]:
    """scontrol show job --oneliner: KEY=VALUE fields separated by spaces."""
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def parse_sacct(text: str, slurm_id: str) -> tuple[str, str] | None:
    """(state, exit code "N:SIG") of the job's last record ("CANCELLED by 1000" -> CANCELLED)."""
    found = None
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 3 and parts[0] == slurm_id:
            found = (parts[1].split()[0] if parts[1] else "", parts[2])
    return found


def exit_code(state: str, code: str) -> int:
    """The exit code `fab train --on slurm` ends with: the job's own (N of N:SIG), 128+SIG for a
    signal, and 1 for a job that failed with neither (NODE_FAIL, TIMEOUT)."""
    n, _, sig = code.partition(":")
    n_, sig_ = int(n) if n.isdigit() else 0, int(sig) if sig.isdigit() else 0
    if state == "COMPLETED" and n_ == 0 and sig_ == 0:
        return 0
    return n_ or (128 + sig_ if sig_ else 1)


def parse_squeue(text: str) -> list[dict]:
    """The user's fabtrain jobs in squeue (comment fabtrain)."""
    rows = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 8 or parts[5] != COMMENT:
            continue
        rows.append(
            {
                "slurm_id": parts[0],
                "job": parts[1],
                "state": parts[2],
                "nodes": parts[3],
                "start": parts[4],
                "who": parts[6],
                "reason": parts[7],
            }
        )
    return rows


def node_name(name: str, index: int) -> str:
    """A node name Slurm gave, as the name of its log here; nodeINDEX when it is not a plain name."""
    try:
        return hostile.component(name)
    except hostile.UnsafeName:
        return f"node{index}"


@dataclass
class End:
    """How a job on Slurm ended: its state, its exit code (N:SIG) and its Slurm job id."""

    state: str
    code: str
    slurm_id: str

    @property
    def exit_code(self) -> int:
        return exit_code(self.state, self.code)


def secrets_path(cfg: Slurm, job_id: str) -> str:
    """The job's secrets on the login node (mode 600, in workdir, which the nodes see): passed to
    the script as FABTRAIN_SECRETS, never on a command line; removed when the job ends."""
    return f"{cfg.workdir}/.secrets/{job_id}.env"


def secrets_dir_command(cfg: Slurm) -> str:
    return f"mkdir -p -m 700 {sshargs.shell([cfg.workdir + '/.secrets'])}"
