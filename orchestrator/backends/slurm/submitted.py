"""A job submitted to Slurm (`SlurmJob`): its state, nodes and end, and its cancel, each one command
on the login node (built in commands.py) with a deadline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.backends.slurm.commands import (
    ENDED,
    End,
    hostnames_command,
    node_name,
    parse_sacct,
    parse_show,
    sacct_command,
    show_command,
)
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import sshargs

if TYPE_CHECKING:
    from orchestrator.config.inventory import Slurm
    from orchestrator.transport.remote import Result, Session

QUERY_TIMEOUT = 30  # a Slurm command that has not answered by then names the login node


class SlurmJob:
    """A submitted job: its state, nodes and end, read on the login node."""

    def __init__(self, session: Session, cfg: Slurm, job_id: str, slurm_id: str) -> None:
        self.session, self.cfg, self.job_id, self.slurm_id = session, cfg, job_id, slurm_id

    def query(self, command: str, what: str) -> Result:
        return self.session.run(self.cfg.login, command, timeout=QUERY_TIMEOUT, what=what)

    def show(self) -> dict[str, str] | None:
        """The job as scontrol shows it; None once slurmctld has forgotten it (MinJobAge)."""
        r = self.query(show_command(self.slurm_id), "scontrol show job")
        if r.ok:
            return parse_show(r.stdout)
        if "Invalid job id" in r.stderr:
            return None
        raise UserError(
            f"scontrol show job {self.slurm_id} on {self.cfg.login.name} failed: "
            f"{hostile.text(r.stderr.strip()[-300:])}"
        )

    def nodes(self, nodelist: str) -> list[str]:
        """The allocation's node names, in node-rank order. Each names a log file here
        (runs/JOB/NODE.log): one that is not a plain name becomes nodeK."""
        r = self.query(hostnames_command(nodelist), "scontrol show hostnames")
        return [node_name(n, i) for i, n in enumerate(r.stdout.split())] if r.ok else []

    def end(self, shown: dict[str, str]) -> End:
        r = self.query(sacct_command(self.slurm_id), "sacct")
        found = parse_sacct(r.stdout, self.slurm_id)
        if found and found[0] in ENDED:
            return End(found[0], found[1], self.slurm_id)
        return End(shown.get("JobState", "UNKNOWN"), shown.get("ExitCode", "0:0"), self.slurm_id)

    def cancel(self) -> None:
        r = self.query(sshargs.shell(["scancel", self.slurm_id]), "scancel")
        if not r.ok:
            raise UserError(
                f"scancel {self.slurm_id} on {self.cfg.login.name} failed: {hostile.text(r.stderr.strip())}"
            )
