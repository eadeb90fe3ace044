"""The SSH backend: a job in stages on the inventory's hosts (job.py), followed, stopped and listed
over one Session per command (jobcontrol.py, hosts/hostops.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.base import TRAIN_OPTIONS, Finished, Launch, Option, Status, Stopped
from orchestrator.backends.ssh import jobcontrol
from orchestrator.backends.ssh.job import Job
from orchestrator.backends.ssh.job import run as run_job
from orchestrator.backends.ssh.state import JobResult, PreflightFailed
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.core.events import JsonLines, Reporter, Terminal
from orchestrator.core.policy import Roster
from orchestrator.core.recovery import JobRecord
from orchestrator.hosts import claims, hostops, survey
from orchestrator.transport.remote import CommandTimedOut, Session, describe, failure

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.config.inventory import Inventory


class SshBackend:
    name = "ssh"
    where = ""
    accepts: tuple[Option, ...] = TRAIN_OPTIONS  # every one: they were made for the inventory's hosts
    declines = ""

    def refuse_if_running(self, inv: Inventory, job_id: str, how: str) -> None:
        jobcontrol.refuse_if_running(inv, job_id, how)

    def serves(self, inv: Inventory) -> bool:
        return bool(inv.all_hosts)

    def job(
        self, launch: Launch, session: Session | None = None, known_lost: dict[str, str] | None = None
    ) -> Job:
        reporter: Reporter = JsonLines() if launch.json else Terminal(launch.console)
        return Job(
            launch.inv,
            launch.spec,
            launch.policy,
            launch.runs,
            reporter,
            session=session,
            record=launch.record,
            checks=launch.checks,
            smoke=launch.smoke,
            watch_options={"console": launch.console, "live": launch.live, "echo": not launch.json},
            notify_to=launch.notify,
            queue=launch.queue,
            selected=launch.selected,
            known_lost=known_lost,
        )

    def dry_run(self, launch: Launch) -> str:
        return jobcontrol.dry_run(self.job(launch))

    def run(self, launch: Launch) -> Finished:
        from orchestrator import preflight

        try:
            result = run_job(self.job(launch))
        except PreflightFailed as exc:
            preflight.render(exc.checks, launch.console)
            raise
        return self.finished(launch, result)

    def detach(self, launch: Launch) -> Finished:
        from orchestrator.backends.ssh import submit

        return submit.submit(launch, self.job(launch).record)

    def take_over(self, launch: Launch) -> Finished:
        from orchestrator.backends.ssh import detached, runcopy, takeover

        with Session(launch.inv.all_hosts) as session:
            found = survey.survey(session, launch.inv)
            takeover.refuse_if_looked_after(found, launch.spec.job_id)
            places = []
            if launch.record is not None and detached.unfetched(launch.record):
                places = detached.places_of(launch.inv, launch.record)
            p = detached.newest_run(places, detached.look(session, places)) if places else None
            if p is not None and launch.record is not None:
                # A detached job whose controllers are gone: its newest record is theirs.
                taken = replace(detached.controller_of(launch.record), taken_over=time.time())
                record = runcopy.copy_runs(session, p, launch.record, launch.runs, taken)
                launch = replace(launch, record=record, spec=record.spec)
            job = self.job(launch, session)
            running = takeover.running_attempt(found, launch.inv, job.record)
            if places:
                detached.remove(session, *places)
            state, plan = takeover.plan(job, job.state, running)
            result = run_job(job, running=plan, state=state)
        return self.finished(launch, result)

    def fail_over(
        self,
        launch: Launch,
        session: Session,
        events: list[tuple[str, dict]],
        seen: float,
        silent: str | None = None,
    ) -> Finished:
        """A detached job taken over by its standby controller (failover.py): the events said, then
        its running attempt followed as `fab attach` does; with nothing running, the job continued
        as `fab train --resume` does, a host that does not answer giving its rank to a spare.
        `silent`: the lost controller's host when the standby found it not answering: it is not
        surveyed again, and its node of the running attempt is lost from the start of the watch."""
        from orchestrator.backends.ssh import takeover
        from orchestrator.core.policy import Failure, HostFailure, Outcome, decide

        known_lost = (
            {silent: f"{silent} did not answer its standby controller; host lost"}
            if silent is not None
            else {}
        )
        job = self.job(launch, session, known_lost)
        job.log_events()
        for event, fields in events:
            job.emit(
                event,
                **fields,
                **({"seconds": round(time.monotonic() - seen, 2)} if event == "controller_started" else {}),
            )
        found = survey.survey(session, launch.inv, tuple(h for h in launch.inv.all_hosts if h.name != silent))
        if silent is not None:
            found[silent] = UserError(known_lost[silent])
        try:
            running = takeover.running_attempt(found, launch.inv, job.record, lease=False)
        except UserError as exc:
            if not job.record.attempts or job.record.state != "running":
                raise
            if job.stopped(launch.inv.all_hosts):  # fab stop ended it while its controller was lost
                job.record_ended("stopped")
                return Finished(launch.spec.job_id, job.run_dir, None, "ended by 'fab stop'")
            job.note(f"nothing to follow ({exc}); going on from the newest snapshot", "warning")
            last = job.record.attempts[-1].hosts
            by_name = {h.name: h for h in launch.inv.all_hosts}
            hosts = tuple(replace(by_name[n], rank=r) for r, n in enumerate(last) if n in by_name)
            lost = tuple(HostFailure(h.name, Failure.LOST) for h in hosts if found.error(h.name) is not None)
            since = job.record.resumes[-1].after_attempt if job.record.resumes else 0
            roster = Roster(
                hosts,
                tuple(h for h in launch.inv.spares if h.name not in last),
                restarts_used=max(0, len(job.record.attempts) - 1 - since),
            )
            if lost:
                d = decide(Outcome(failures=lost), launch.policy, roster, job.target_nodes)
                if d.roster is None:
                    raise UserError(f"job {job.spec.job_id}: {d.reason}") from None
                roster = d.roster
            return self.finished(launch, run_job(job, state=replace(job.state, roster=roster)))
        state, plan = takeover.plan(job, job.state, running)
        return self.finished(launch, run_job(job, running=plan, state=state))

    def finished(self, launch: Launch, result: JobResult) -> Finished:
        again = f" after {result.attempts} attempts" if result.attempts > 1 else ""
        return Finished(
            launch.spec.job_id,
            result.run_dir,
            jobcontrol.explain(result),
            f"job {launch.spec.job_id} finished on every host{again}; logs and outputs in {result.run_dir}",
        )

    def attach(
        self, inv: Inventory, job_id: str | None, runs: Path, console: Console, live: bool, json: bool = False
    ) -> Finished:
        record = (
            JobRecord.load(runs, job_id, "fab logs --job") if job_id and (runs / job_id).is_dir() else None
        )
        from orchestrator.backends.ssh import detached, detachedview

        if record is not None and detached.unfetched(record):
            return detachedview.follow(inv, record, runs, console, live, json)
        if record is None and job_id:
            with Session(inv.all_hosts) as session:
                places = detachedview.found_places(session, inv, job_id)
            if places:  # a detached job another machine started
                return detachedview.follow_unowned(inv, job_id, places, runs, console, live, json)
        if record is not None and record.state != "running":
            return Finished(
                record.job_id,
                None,
                None,
                f"job {record.job_id} is {record.state}, not running: its logs "
                f"are in {runs / record.job_id} ('fab train --resume {record.job_id}' continues it)",
            )
        with Session(inv.all_hosts) as session:
            try:
                result = jobcontrol.attach(session, inv, job_id, runs, console, live=live, json=json)
            except KeyboardInterrupt:
                return Finished(job_id or "", None, None, "detached; the job goes on ('fab stop' ends it)")
        return Finished(result.job_id, result.run_dir, jobcontrol.explain(result))

    def stop(
        self, inv: Inventory, job_id: str | None, everyone: bool, yes: bool, grace: float, runs: Path
    ) -> Stopped:
        with Session(inv.all_hosts) as session:
            found = survey.survey(session, inv)
            views = survey.job_views(found)
            from orchestrator.backends.ssh import detached

            if job_id and not jobcontrol.known_to(found, job_id, runs):
                raise jobcontrol.unknown_job(job_id, f" on the hosts of {inv.path} or in {runs}/")
            chosen, others = jobcontrol.to_stop(views, job_id, everyone, claims.me())
            if everyone and others and not yes:
                jobcontrol.confirm_all(others)
            targets = sorted(chosen)
            hostops.mark_stopped(
                session, inv, {j: list(views[j].hosts) if j in views else [] for j in targets}
            )
            # A detached job's key goes too, in the same command, unless its controller still runs.
            revoke = detached.keys_to_revoke(found, targets, runs)
            results = hostops.stop(session, inv, targets, grace, inv.all_hosts, revoke=revoke)
            for h in inv.all_hosts:  # a host not surveyed may hold anything: it is not done
                if found.error(h.name) and not results.error(h.name):
                    results[h.name] = found[h.name]
            cleared = hostops.clear_stale(session, inv, survey.survey(session, inv))
        out = Stopped()
        for host in inv.all_hosts:
            r = results[host.name]
            why = failure(host, r, "stopping containers")
            if why:
                out.failed.append(host.name)
                out.problems.append(f"{host.name}: could not stop: {why}")
            else:
                out.removed[host.name] = len(r.stdout.split())
                out.lines.append(f"{host.name}: removed {out.removed[host.name]} container(s)")
        out.jobs = list(targets)
        for j in targets:
            out.lines.append(
                hostile.text(f"stopped {j}" + (f" ({views[j].who})" if j in views and views[j].who else ""))
            )
        for v in others.values():
            if v.job not in chosen:
                out.left_alone.append(v.job)
                out.lines.append(
                    hostile.text(
                        f"left alone: {v.job} of {v.who} on {', '.join(v.hosts)}; "
                        f"'fab stop --job {v.job}' ends it"
                    )
                )
        out.lines += [hostile.text(line) for line in cleared]
        return out

    def status(self, inv: Inventory, runs: Path) -> Status:
        from orchestrator.backends.ssh import detachedview

        with Session(inv.all_hosts) as session:
            found = survey.survey(session, inv)
            views = survey.job_views(found)
            steps = survey.last_steps(session, inv, views)
            controllers = detachedview.status_lines(session, inv, runs, found)
        stuck = [h.name for h in inv.all_hosts if isinstance(found[h.name], CommandTimedOut)]
        lost = [h.name for h in inv.all_hosts if found.error(h.name) and h.name not in stuck]
        return Status(
            doc={"jobs": jobcontrol.status_rows(views, steps)},
            tables=[jobcontrol.status_table(views, steps, inv)],
            lines=[
                f"hosts: {len(inv.all_hosts) - len(stuck) - len(lost)} answering"
                + (f"; stuck (Docker engine or host): {', '.join(stuck)}" if stuck else "")
                + (f"; unreachable: {', '.join(lost)}" if lost else ""),
                *controllers,
            ],
            errors=[describe(h, e) for h in inv.all_hosts if (e := found.error(h.name)) is not None],
        )


if TYPE_CHECKING:  # the class has everything base.Backend asks for
    from orchestrator.backends.base import Backend

    _checked: Backend = SshBackend()
