"""fab train --on slurm: the same job, submitted to Slurm from its login node and followed from here.

Submit: the code synced to the login node (job.code_dir/KEY, as on SSH hosts), the batch script
(export.slurm_script) written to slurm.workdir and given to sbatch there. Follow: the job's output
file (workdir/JOB-SLURMID.out, every node's lines labelled by srun --label) read with `tail -F` over
SSH; each node's lines go to runs/JOB/NODE.log and the terminal with the same prefixes and live view
as an SSH job. The job's state is polled with scontrol every POLL seconds; a requeue (its Restarts
rising) is a new attempt. The end: state and exit code from sacct (the job completion log where
the cluster keeps no accounting database), rank 0's metrics fetched, curves drawn. Ctrl+C and
`fab stop --job` cancel with scancel; `fab logs` follows the same way and Ctrl+C only detaches;
`fab status` lists the user's fabtrain jobs from squeue.

Everything that talks to Slurm is a command string built here (quoted once) and run on the login
node through the project's Session, so each has a deadline and a recording stand-in sees it.
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.live import Live

from orchestrator.backends import export
from orchestrator.backends.ssh.attempt import secrets_body
from orchestrator.commands import hostfiles, sshargs
from orchestrator.config import codetree
from orchestrator.config.inventory import Inventory, Slurm
from orchestrator.core import hostile, jobspec, recovery
from orchestrator.core.errors import UserError
from orchestrator.hosts import hostops
from orchestrator.progress.live import Board
from orchestrator.transport.logs import HostSink, Multiplexer
from orchestrator.transport.remote import Result, Session, describe

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console
    from rich.table import Table

POLL = 1.0             # seconds between two reads of the job's state
QUERY_TIMEOUT = 30     # a Slurm command that has not answered by then names the login node
UNSEEN_AFTER = 20      # seconds a running job may go without its output file before fab says why
LOGIN_TRIES = 3        # reads of the job's state failing in a row before fab gives up following
DRAIN_TIMEOUT = 15     # seconds to read the rest of the output file once the job has ended
# States a job does not leave (PREEMPTED and NODE_FAIL jobs that Slurm requeues go back to PENDING).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}
LABELLED = re.compile(rb"^\s*(\d+): ?")  # srun --label: "0: text" (" 0: " with ten tasks or more)
ATTEMPT_LINE = re.compile(rb"^\[fabtrain\] job \S+: slurm job \d+ \(restart (\d+)\)")
BATCH = "slurm"        # the log of the batch script's own lines (runs/JOB/slurm.log)


# ---------------------------------------------------------------- commands (pure)

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
    return (f"{sshargs.shell(['sacct', '--allocations', *fields])} 2>/dev/null"
            f" || {sshargs.shell(['sacct', '--completion', *fields])}")


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
        if len(parts) < 8 or parts[5] != export.COMMENT:
            continue
        rows.append({"slurm_id": parts[0], "job": parts[1], "state": parts[2], "nodes": parts[3],
                     "start": parts[4], "who": parts[6], "reason": parts[7]})
    return rows



def node_name(name: str, index: int) -> str:
    """A node name Slurm gave, as the name of its log here; nodeINDEX when it is not a plain name."""
    try:
        return hostile.component(name)
    except hostile.UnsafeName:
        return f"node{index}"

# ---------------------------------------------------------------- the output file, per node

class Demux:
    """Splits the job's output file into one log per node: `N: text` lines (srun --label) go to
    node N's sink, the batch script's own lines to runs/JOB/slurm.log. At each attempt's first line
    (the script's `slurm job ID (restart K)`), `on_attempt(K)` gives the node names of that
    allocation, in node-rank order."""

    def __init__(self, mux: Multiplexer, on_attempt: Callable[[int], list[str]]) -> None:
        self.mux, self.on_attempt = mux, on_attempt
        self.names: list[str] = []
        self.sinks: dict[tuple[str, int], HostSink] = {}
        self.batch = mux.sink(BATCH, 0)
        self.partial = b""
        self.received = 0
        # The unfinished line is held here, so cut here: room for the `N: ` label, the node's sink
        # then cuts its own part at LINE_MAX.
        self.cut = hostile.LineCutter(hostile.LINE_MAX + 64)

    def sink(self, index: int) -> HostSink:
        name = self.names[index] if index < len(self.names) else f"node{index}"
        key = (name, index)
        if key not in self.sinks:
            width = max([len(f"{n} r{i}") for i, n in enumerate(self.names)] + [len(f"{name} r{index}")])
            self.sinks[key] = self.mux.sink(name, index, width)
        return self.sinks[key]

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        data = self.partial + self.cut.feed(data)
        cut = data.rfind(b"\n") + 1
        self.partial = data[cut:]
        for line in data[:cut].splitlines(keepends=True):
            m = LABELLED.match(line)
            if m:
                self.sink(int(m.group(1))).feed(line[m.end():])
                continue
            attempt = ATTEMPT_LINE.match(line)
            if attempt:
                self.names = self.on_attempt(int(attempt.group(1)))
            self.batch.feed(line)

    def close(self) -> None:
        if self.partial:
            self.feed(b"\n")
        for s in (*self.sinks.values(), self.batch):
            s.close()


# ---------------------------------------------------------------- one job on Slurm

@dataclass
class End:
    state: str
    code: str
    slurm_id: str

    @property
    def exit_code(self) -> int:
        return exit_code(self.state, self.code)


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
        raise UserError(f"scontrol show job {self.slurm_id} on {self.cfg.login.name} failed: "
                        f"{hostile.text(r.stderr.strip()[-300:])}")

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


def cfg_of(inv: Inventory) -> Slurm:
    if inv.slurm is None:
        raise UserError(f"{inv.path}: no slurm: section; add one with at least login: (the node where sbatch "
                        "runs), see the README's 'On Slurm'", exit_code=2)
    return inv.slurm


def submit(
    session: Session, inv: Inventory, spec: jobspec.JobSpec, script: str, note: Callable[[str], None]
) -> SlurmJob:
    """Code to the login node, the script (and secrets) to slurm.workdir, sbatch: the submitted job."""
    cfg = cfg_of(inv)
    login = cfg.login
    dest, _ = hostops.sync(session, inv, Path(spec.code), spec.code_only, hosts=(login,))
    note(f"code synced to {login.name}:{dest}")
    r = session.run(
        login, f"mkdir -p {sshargs.shell([cfg.workdir])}", timeout=QUERY_TIMEOUT, what="mkdir workdir"
    )
    if not r.ok:
        raise UserError(
            f"{login.name}: cannot create slurm.workdir {cfg.workdir}: {hostile.text(r.stderr.strip())}"
        )
    session.put(login, script.encode(), f"{cfg.workdir}/{spec.job_id}.sbatch", mode=0o644)
    if inv.job.secret_files:
        r = session.run(login, secrets_dir_command(cfg), timeout=QUERY_TIMEOUT, what="mkdir .secrets")
        if not r.ok:
            raise UserError(
                f"{login.name}: cannot create {cfg.workdir}/.secrets: {hostile.text(r.stderr.strip())}"
            )
        session.put(login, secrets_body(inv), secrets_path(cfg, spec.job_id), mode=0o600)
    r = session.run(
        login,
        submit_command(cfg, spec.job_id, bool(inv.job.secret_files)),
        timeout=QUERY_TIMEOUT,
        what="sbatch",
    )
    slurm_id = r.stdout.strip().split(";")[0]
    if not r.ok or not slurm_id.isdigit():
        raise UserError(
            f"sbatch on {login.name} refused the job: {hostile.text((r.stderr or r.stdout).strip()[-600:])}"
            f"; the script is {cfg.workdir}/{spec.job_id}.sbatch there"
        )
    return SlurmJob(session, cfg, spec.job_id, slurm_id)


class Follower:
    """Streams a submitted job's output into runs/JOB until the job ends (see the module's
    docstring); `detach`: Ctrl+C only stops following."""

    def __init__(self, job: SlurmJob, run_dir: Path, console: Console | None = None, live: bool = False,
                 echo: bool = True, record: recovery.JobRecord | None = None, detach: bool = False) -> None:
        self.job, self.run_dir, self.record, self.detach = job, run_dir, record, detach
        self.console = console
        self.live = live and echo and console is not None and console.is_terminal
        self.board = Board([])
        self.mux = Multiplexer(run_dir, echo=echo, console=console if self.live else None, board=self.board)
        self.demux = Demux(self.mux, self.attempt_nodes)
        self.shown: dict[str, str] = {}
        self.restarts = -1
        self.cancelled = False
        self.running_since: float | None = None
        self.told_unseen = False

    def note(self, line: str) -> None:
        self.mux.note(line)

    def attempt_nodes(self, restart: int) -> list[str]:
        """The nodes of the allocation that printed `restart`'s first line, in node-rank order."""
        try:
            shown = self.job.show() or {}
        except Exception:  # noqa: BLE001 - the poller names a login node that stops answering
            shown = {}
        names = self.job.nodes(shown["NodeList"]) if shown.get("NodeList") not in (None, "", "(null)") else []
        self.board = Board([(n, i) for i, n in enumerate(names)])
        self.mux.board = self.board
        if self.record is not None and names and self.record.attempts:
            self.record.attempts[-1].hosts = names
            self.record.save(self.run_dir)
        return names

    def track(self, shown: dict[str, str]) -> None:
        """Say what changed: pending (and why), running where, requeued (a new attempt)."""
        restarts = int(shown.get("Restarts", "0") or 0)
        if restarts > self.restarts:  # only a rise is a requeue (a read without the field is not)
            if self.restarts >= 0:
                number = len(self.record.attempts) + 1 if self.record is not None else restarts + 1
                self.note(f"attempt {number}: Slurm requeued job {self.job.slurm_id} (restart {restarts}); "
                          "it resumes from its newest snapshot")
            if self.record is not None:
                if self.record.attempts and self.record.attempts[-1].ended is None:
                    self.record.attempts[-1].ended, self.record.attempts[-1].outcome = time.time(), "requeued"
                self.record.attempts.append(recovery.Attempt(len(self.record.attempts) + 1, [], time.time()))
                self.record.save(self.run_dir)
            self.restarts = restarts
        old = (self.shown.get("JobState"), self.shown.get("Reason"))
        new = (shown.get("JobState"), shown.get("Reason"))
        if new != old:
            state, reason = new
            where = f" on {shown.get('NodeList')}" if state == "RUNNING" else ""
            why = f" ({reason})" if reason and reason != "None" else ""
            self.note(f"slurm job {self.job.slurm_id}: {state}{where}{why}")
        self.shown = shown
        if new[0] == "RUNNING" and self.running_since is None:
            self.running_since = time.monotonic()
        if (self.running_since is not None and not self.demux.received and not self.told_unseen
                and time.monotonic() - self.running_since > UNSEEN_AFTER):
            path = out_file(self.job.cfg, self.job.job_id, self.job.slurm_id)
            if not self.job.query(sshargs.shell(["test", "-e", path]), "test -e").ok:
                self.told_unseen = True
                self.note(
                    f"the job runs but {path} is not there on {self.job.cfg.login.name}: Slurm writes it on "
                    "the job's first node; put slurm.workdir on a filesystem the login node and the nodes "
                    "share"
                )

    def stream(self, stop: threading.Event) -> None:
        path = out_file(self.job.cfg, self.job.job_id, self.job.slurm_id)
        try:
            with self.job.session.command(self.job.cfg.login, follow_command(path), None, "tail") as cmd:
                self._cmd = cmd
                while not stop.is_set():
                    data = cmd.recv()
                    if not data:
                        break
                    self.demux.feed(data)
        except Exception as exc:  # noqa: BLE001 - the poller still sees the job's end
            if not stop.is_set():
                self.note(f"reading {path} on {self.job.cfg.login.name} stopped: {hostile.text(str(exc))}")

    def drain(self, stop: threading.Event, reader: threading.Thread) -> None:
        """Once the job has ended: read on until the file's whole length has come (bounded)."""
        path = out_file(self.job.cfg, self.job.job_id, self.job.slurm_id)
        r = self.job.query(sshargs.shell(["stat", "--format", "%s", path]), "stat")
        size = int(r.stdout.strip()) if r.ok and r.stdout.strip().isdigit() else 0
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while self.demux.received < size and time.monotonic() < deadline and reader.is_alive():
            time.sleep(0.1)
        stop.set()
        cmd = getattr(self, "_cmd", None)
        if cmd is not None and cmd.chan is not None:
            cmd.chan.close()
        reader.join(timeout=5)
        self.demux.close()

    def run(self) -> End:
        stop = threading.Event()
        reader = threading.Thread(target=self.stream, args=(stop,), daemon=True, name="slurm-tail")
        reader.start()
        view = (Live(get_renderable=lambda: self.board.render(), console=self.console, refresh_per_second=2,
                     transient=True, redirect_stdout=False, redirect_stderr=False) if self.live
                else contextlib.nullcontext())
        shown: dict[str, str] = {}
        unanswered: list[str] = []
        try:
            with view:
                while True:
                    try:
                        try:
                            now = self.job.show()
                            unanswered.clear()
                        except Exception as exc:  # noqa: BLE001 - a login node or slurmctld not answering
                            unanswered.append(describe(self.job.cfg.login, exc))
                            if len(unanswered) >= LOGIN_TRIES:
                                raise UserError(
                                    f"the job's state could not be read {LOGIN_TRIES} times in a row: "
                                    f"{unanswered[-1]}; the job may still run: 'fab status' or "
                                    f"'fab logs --job {self.job.job_id}' once {self.job.cfg.login.name} "
                                    "answers"
                                ) from None
                            time.sleep(POLL)
                            continue
                        if now is None:
                            break  # forgotten by slurmctld: sacct has it
                        shown = now
                        self.track(shown)
                        if shown.get("JobState") in ENDED:
                            break
                        time.sleep(POLL)
                    except KeyboardInterrupt:
                        if self.detach:
                            raise
                        if self.cancelled:  # a second Ctrl+C: stop waiting for Slurm
                            raise
                        self.cancelled = True
                        self.note(
                            f"Ctrl+C: cancelling slurm job {self.job.slurm_id} (scancel); Ctrl+C again to "
                            "stop waiting for its end"
                        )
                        self.job.cancel()
        finally:
            self.drain(stop, reader)
        return self.job.end(shown)


def finish_record(record: recovery.JobRecord, run_dir: Path, end: End, cancelled: bool) -> None:
    state = "finished" if end.exit_code == 0 else ("interrupted" if cancelled else
                                                     "stopped" if end.state == "CANCELLED" else "failed")
    record.state = state
    if record.attempts:
        last = record.attempts[-1]
        last.ended = last.ended or time.time()
        last.outcome = "finished" if state == "finished" else f"{end.state} {end.code}"
    record.save(run_dir)


def fetch_metrics(session: Session, inv: Inventory, job_id: str, run_dir: Path, rank0: str) -> str | None:
    """Rank 0's metrics.jsonl, read through the login node (output_dir shared with the nodes, or the
    login node is rank 0's); a note when it cannot be read there."""
    cfg = cfg_of(inv)
    path = f"{inv.job.output_dir}/{job_id}/metrics.jsonl"
    r = session.run(cfg.login, sshargs.shell(["cat", path]), timeout=120, what="reading metrics")
    if not r.ok:
        return (f"{path} is not readable on {cfg.login.name} (job.output_dir is not shared with the nodes): "
                "the curves come from the step lines only")
    out = run_dir / "outputs" / rank0
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text(r.stdout)
    return None


def status_rows(session: Session, inv: Inventory) -> list[dict]:
    """The user's fabtrain jobs on Slurm (fab status)."""
    cfg = cfg_of(inv)
    r = session.run(cfg.login, squeue_command(), timeout=QUERY_TIMEOUT, what="squeue")
    if not r.ok:
        raise UserError(f"squeue on {cfg.login.name} failed: {hostile.text(r.stderr.strip()[-300:])}")
    return parse_squeue(r.stdout)


def recorded(run_root: Path, job_id: str) -> tuple[recovery.JobRecord, dict] | None:
    """A job's record when it ran on Slurm (its backend entry), else None."""
    try:
        record = recovery.JobRecord.load(run_root, job_id)
    except UserError:
        return None
    return (record, record.backend) if record.backend.get("on") == "slurm" else None


# ---------------------------------------------------------------- fab train --on slurm

def secrets_path(cfg: Slurm, job_id: str) -> str:
    """The job's secrets on the login node (mode 600, in workdir, which the nodes see): passed to
    the script as FABTRAIN_SECRETS, never on a command line; removed when the job ends."""
    return f"{cfg.workdir}/.secrets/{job_id}.env"


def secrets_dir_command(cfg: Slurm) -> str:
    return f"mkdir -p -m 700 {sshargs.shell([cfg.workdir + '/.secrets'])}"


def prepared(inv: Inventory, spec: jobspec.JobSpec) -> tuple[jobspec.JobSpec, str]:
    """The spec with its code key, and the batch script that `fab train --on slurm` submits."""
    cfg = cfg_of(inv)
    spec = replace(spec, code_key=codetree.key(spec.code, spec.code_only))
    script, _ = export.slurm_script(inv, spec, pyxis=cfg.runtime == "pyxis", partition=cfg.partition,
                                    time_limit=cfg.time, account=cfg.account, nodes=cfg.nodes)
    return spec, script


def dry_run(inv: Inventory, spec: jobspec.JobSpec) -> str:
    """What --dry-run prints: every command on the login node, in order, then the script."""
    cfg = cfg_of(inv)
    spec, script = prepared(inv, spec)
    login = cfg.login
    steps = [
        sshargs.shell(sshargs.rsync_argv(login, spec.code, hostfiles.code_path(inv, spec), spec.code_only)),
        f"mkdir -p {sshargs.shell([cfg.workdir])}",
        f"write {cfg.workdir}/{spec.job_id}.sbatch (below)",
    ]
    if inv.job.secret_files:
        steps.append(secrets_dir_command(cfg))
        steps.append(f"write {secrets_path(cfg, spec.job_id)} (mode 600: "
                     f"{', '.join(n for n, _ in inv.job.secret_files)})")
    steps += [submit_command(cfg, spec.job_id, bool(inv.job.secret_files)),
              follow_command(out_file(cfg, spec.job_id, "SLURMID")),
              f"every {POLL:g}s: {show_command('SLURMID')}",
              f"at the end: {sacct_command('SLURMID')}",
              f"Ctrl+C or fab stop --job {spec.job_id}: {sshargs.shell(['scancel', 'SLURMID'])}"]
    head = [f"job {spec.job_id} on Slurm, from {login.name} ({login.ssh.where()}):"]
    head += [f"  {i}. {s}" for i, s in enumerate(steps, 1)]
    return "\n".join(head) + f"\n\n--- {cfg.workdir}/{spec.job_id}.sbatch ---\n" + script


def train(inv: Inventory, spec: jobspec.JobSpec, run_root: Path, console: Console, live: bool,
          echo: bool = True, record: recovery.JobRecord | None = None) -> tuple[End, Path, Follower]:
    """Submit, follow to the end, record, fetch rank 0's metrics: (End, run_dir, Follower). With
    the `record` of an earlier run (fab train --on slurm --resume JOB), the same job id and output
    directory: its trainer resumes from its newest snapshot, and the attempts go on counting."""
    cfg = cfg_of(inv)
    spec, script = prepared(inv, spec)
    run_dir = run_root / spec.job_id
    run_dir.mkdir(parents=True, exist_ok=True)
    if record is None:
        record = recovery.JobRecord.new(spec, inv, 0, None, 0)
    record.state, record.spec["code_key"] = "running", spec.code_key
    earlier = (
        [*record.backend.get("earlier", []), record.backend["slurm_id"]]
        if "slurm_id" in record.backend
        else []
    )
    record.backend = {"on": "slurm", "login": cfg.login.name, "workdir": cfg.workdir, "earlier": earlier}
    record.save(run_dir)
    (run_dir / "job.sbatch").write_text(script)
    with Session((cfg.login,)) as session:
        def note(line: str) -> None:
            if echo:
                console.print(f"[fabtrain] {hostile.text(line)}", highlight=False, markup=False)
        try:
            job = submit(session, inv, spec, script, note)
        except BaseException:
            record.state = "failed"  # nothing was submitted: the record says so, the error says why
            record.save(run_dir)
            raise
        record.backend["slurm_id"] = job.slurm_id
        record.save(run_dir)
        note(f"submitted job {spec.job_id} as slurm job {job.slurm_id} on {cfg.login.name}")
        follower = Follower(job, run_dir, console, live, echo, record=record)
        try:
            end = follower.run()
        except KeyboardInterrupt:
            record.state = "interrupted"
            record.save(run_dir)
            raise
        finally:
            if inv.job.secret_files:
                session.run(
                    cfg.login,
                    sshargs.shell(["rm", "-f", secrets_path(cfg, spec.job_id)]),
                    timeout=QUERY_TIMEOUT,
                )
        finish_record(record, run_dir, end, follower.cancelled)
        rank0 = record.attempts[-1].hosts[0] if record.attempts and record.attempts[-1].hosts else "node0"
        missing = fetch_metrics(session, inv, spec.job_id, run_dir, rank0)
        if missing:
            note(missing)
    return end, run_dir, follower


# ---------------------------------------------------------------- fab stop / fab logs / fab status

def wait_gone(job: SlurmJob, timeout: float) -> str:
    """Wait until the job has ended and left its nodes (no longer COMPLETING): its state then."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        r = job.query(sshargs.shell(["squeue", "--noheader", "--states", "all", "--format", "%T", "--jobs",
                                  job.slurm_id]), "squeue")
        state = r.stdout.strip() if r.ok else ""
        if state in ENDED or (r.ok and not state) or "Invalid job id" in r.stderr:
            return state or "ended"
        time.sleep(POLL)
    raise UserError(f"slurm job {job.slurm_id} is still {state or 'there'} {timeout:g}s after scancel; "
                    f"see: squeue --jobs {job.slurm_id} on {job.cfg.login.name}")


def stop(inv: Inventory, job_ids: list[str], run_root: Path, grace: float) -> list[str]:
    """scancel each job (a fabtrain job id recorded in runs/, or a Slurm job id from squeue) and wait
    until it has left its nodes (its containers stopped by the script's trap): a line per job."""
    cfg = cfg_of(inv)
    lines = []
    with Session((cfg.login,)) as session:
        for job_id in job_ids:
            found = recorded(run_root, job_id)
            slurm_id = found[1].get("slurm_id") if found else job_id
            if not slurm_id or not slurm_id.isdigit():
                raise UserError(f"job {job_id} has no Slurm job id recorded in {run_root}/{job_id}")
            job = SlurmJob(session, cfg, job_id, slurm_id)
            job.cancel()
            state = wait_gone(job, grace + 90)
            lines.append(f"stopped {job_id} (slurm job {slurm_id}: {state})")
    return lines


def follow_recorded(inv: Inventory, job_id: str, run_root: Path, console: Console, live: bool) -> End:
    """fab logs --job JOB for a Slurm job (one `recorded` finds): its output from the start into
    runs/JOB/attach until it ends; Ctrl+C detaches."""
    cfg = cfg_of(inv)
    found = recorded(run_root, job_id)
    if found is None:
        raise UserError(f"job {job_id} has no Slurm job recorded in {run_root}/{job_id}")
    _, backend = found
    with Session((cfg.login,)) as session:
        job = SlurmJob(session, cfg, job_id, backend["slurm_id"])
        return Follower(job, run_root / job_id / "attach", console, live, detach=True).run()


def status_table(rows: list[dict]) -> Table:
    from rich.table import Table
    from rich.text import Text
    table = Table(title="fabtrain jobs on Slurm")
    for col in ("job", "slurm job", "who", "nodes", "state", "since"):
        table.add_column(col, no_wrap=col == "job")
    for r in rows:
        why = f" ({r['reason']})" if r["reason"] and r["reason"] != "None" else ""
        table.add_row(
            hostile.rich_text(r["job"]),
            hostile.rich_text(r["slurm_id"]),
            hostile.rich_text(r["who"]),
            hostile.rich_text(r["nodes"] or "-"),
            hostile.rich_text(r["state"] + why, "green" if r["state"] == "RUNNING" else ""),
            hostile.rich_text(r["start"]),
        )
    if not rows:
        table.add_row("-", "-", "-", "-", Text("no jobs", style="dim"), "-")
    return table
