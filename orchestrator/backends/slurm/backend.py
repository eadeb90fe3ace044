"""The Slurm backend: the job submitted to the inventory's slurm: login node and followed there
(slurm.py); Slurm picks the nodes and requeues. It also renders the job as the sbatch script alone
(script.py), for fab export.slurm."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.backends.base import Finished, Launch, Option, Rendered, Status, Stopped
from orchestrator.backends.slurm import script, slurm
from orchestrator.core.errors import UserError
from orchestrator.transport.remote import Session, failure

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.config.inventory import Inventory


class SlurmBackend:
    """A Runner (submit, follow, stop, list) and a Renderer (the sbatch script, fab export.slurm's)."""

    name = "slurm"
    where = " on Slurm"
    # None of TRAIN_OPTIONS: Slurm places, queues and restarts the job, and checks its nodes.
    accepts: tuple[Option, ...] = ()
    declines = (
        "Slurm picks the nodes, queues the job, restarts it by requeue and has its own checks; set "
        "nodes, partition and time in the inventory's slurm: section (Slurm's --mail-type and "
        "--mail-user tell a job's end)"
    )
    settings: tuple[Option, ...] = (
        Option("pyxis", bool, False, "run the image with pyxis/enroot (srun --container-image)"),
        Option("partition", str, None, "#SBATCH --partition"),
        Option("time", str, None, "#SBATCH --time (e.g. 12:00:00)"),
    )

    def render(self, launch: Launch, settings: dict[str, Any]) -> Rendered:
        """The job as one sbatch script (JOB.sbatch), and the settings it cannot give every node."""
        spec = launch.spec
        text, warnings = script.slurm_script(
            launch.inv,
            spec,
            pyxis=settings["pyxis"],
            partition=settings["partition"],
            time_limit=settings["time"],
        )
        return Rendered(
            spec.job_id,
            {f"{spec.job_id}.sbatch": text},
            tuple(warnings),
            title=f"job {spec.job_id} as an sbatch script (fab export.slurm writes it):",
        )

    def detach(self, launch: Launch) -> Finished:
        raise UserError("--detach: not with --on slurm", exit_code=2)

    def take_over(self, launch: Launch) -> Finished:
        raise UserError(
            f"job {launch.spec.job_id} runs on Slurm, whose controller looks after it; "
            f"'fab logs --job {launch.spec.job_id}' follows it",
            exit_code=2,
        )

    def serves(self, inv: Inventory) -> bool:
        return inv.slurm is not None

    def refuse_if_running(self, inv: Inventory, job_id: str, how: str) -> None:
        """Asked of squeue on the login node: resuming a job Slurm still runs would submit a second one."""
        with Session((slurm.cfg_of(inv).login,)) as session:
            slurm.refuse_if_running(session, inv, job_id, how)

    def dry_run(self, launch: Launch) -> str:
        return slurm.dry_run(launch.inv, launch.spec)

    def run(self, launch: Launch) -> Finished:
        spec = launch.spec
        try:
            end, run_dir, _ = slurm.train(
                launch.inv, spec, launch.runs, launch.console, live=launch.live, record=launch.record
            )
        except KeyboardInterrupt:
            raise UserError(
                f"stopped following job {spec.job_id}; Slurm may still be ending it ('fab status' shows it)",
                exit_code=130,
            ) from None
        error = None
        if end.exit_code:
            error = UserError(
                f"job {spec.job_id}: slurm job {end.slurm_id} ended {end.state} (exit code "
                f"{end.code}); logs in {run_dir}",
                exit_code=end.exit_code,
            )
        return Finished(
            spec.job_id,
            run_dir,
            error,
            f"job {spec.job_id} finished on Slurm (slurm job {end.slurm_id}); logs and curves in {run_dir}",
        )

    def attach(
        self, inv: Inventory, job_id: str | None, runs: Path, console: Console, live: bool, json: bool = False
    ) -> Finished:
        if json:
            raise UserError(
                "fab logs --json follows jobs on SSH hosts; a Slurm job's events are in "
                "runs/JOB/events.jsonl once it ends",
                exit_code=2,
            )
        if job_id is None:
            raise UserError("fab logs on Slurm needs --job JOB ('fab status' lists them)", exit_code=2)
        try:
            end = slurm.follow_recorded(inv, job_id, runs, console, live=live)
        except KeyboardInterrupt:
            return Finished(job_id, None, None, "detached; the job goes on ('fab stop --job' ends it)")
        error = None
        if end.exit_code:
            error = UserError(
                f"slurm job {end.slurm_id} ended {end.state} (exit code {end.code})", exit_code=end.exit_code
            )
        return Finished(job_id, runs / job_id, error)

    def stop(
        self, inv: Inventory, job_id: str | None, everyone: bool, yes: bool, grace: float, runs: Path
    ) -> Stopped:
        if job_id is None:  # your fabtrain jobs on Slurm (squeue --me)
            with Session((slurm.cfg_of(inv).login,)) as session:
                ids = [r["slurm_id"] for r in slurm.status_rows(session, inv)]
        else:
            ids = [job_id]
        return Stopped(lines=slurm.stop(inv, ids, runs, grace))

    def status(self, inv: Inventory, runs: Path) -> Status:
        login = slurm.cfg_of(inv).login
        with Session((login,)) as session:
            try:
                rows = slurm.status_rows(session, inv)
            except Exception as exc:  # noqa: BLE001 - the hosts' jobs are still listed; this is named
                return Status(errors=[f"slurm: {failure(login, exc, 'squeue')}"])
        return Status(doc={"slurm": rows}, tables=[slurm.status_table(rows)])


if TYPE_CHECKING:  # the class has everything base.Runner and base.Renderer ask for
    from orchestrator.backends.base import Renderer, Runner

    _runs: Runner = SlurmBackend()
    _renders: Renderer = SlurmBackend()
