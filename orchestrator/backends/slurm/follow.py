"""Following a submitted job: its output file (workdir/JOB-SLURMID.out, every node's lines
labelled by srun --label) read with `tail -F` over SSH and split into one log per node (Demux), with
the same prefixes and live view as an SSH job; its state polled with scontrol every POLL seconds, a
requeue (its Restarts rising) a new attempt (Follower)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.live import Live

from orchestrator.backends.slurm.commands import ENDED, follow_command, out_file
from orchestrator.core import hostile, recovery
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import sshargs
from orchestrator.progress.live import Board
from orchestrator.transport.logs import HostSink, Multiplexer
from orchestrator.transport.remote import describe

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from orchestrator.backends.slurm.commands import End
    from orchestrator.backends.slurm.submitted import SlurmJob

POLL = 1.0  # seconds between two reads of the job's state
UNSEEN_AFTER = 20  # seconds a running job may go without its output file before fab says why
LOGIN_TRIES = 3  # reads of the job's state failing in a row before fab gives up following
DRAIN_TIMEOUT = 15  # seconds to read the rest of the output file once the job has ended
LABELLED = re.compile(rb"^\s*(\d+): ?")  # srun --label: "0: text" (" 0: " with ten tasks or more)
ATTEMPT_LINE = re.compile(rb"^\[fabtrain\] job \S+: slurm job \d+ \(restart (\d+)\)")
BATCH = "slurm"  # the log of the batch script's own lines (runs/JOB/slurm.log)


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
                self.sink(int(m.group(1))).feed(line[m.end() :])
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


# ---------------------------------------------------------------- following the job


class Follower:
    """Streams a submitted job's output into runs/JOB until the job ends (see the module's
    docstring); `detach`: Ctrl+C only stops following."""

    def __init__(
        self,
        job: SlurmJob,
        run_dir: Path,
        console: Console | None = None,
        live: bool = False,
        echo: bool = True,
        record: recovery.JobRecord | None = None,
        detach: bool = False,
    ) -> None:
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
                self.note(
                    f"attempt {number}: Slurm requeued job {self.job.slurm_id} (restart {restarts}); "
                    "it resumes from its newest snapshot"
                )
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
        if (
            self.running_since is not None
            and not self.demux.received
            and not self.told_unseen
            and time.monotonic() - self.running_since > UNSEEN_AFTER
        ):
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
        view = (
            Live(
                get_renderable=lambda: self.board.render(),
                console=self.console,
                refresh_per_second=2,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            if self.live
            else contextlib.nullcontext()
        )
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
