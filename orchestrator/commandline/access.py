"""`fab shell` and `fab forward`: into a running job's node from this machine, over the SSH path
fabtrain uses for that host (the inventory's user, keys, known_hosts, ssh_config and jump hosts).

A job's nodes are found as `fab status` finds them: by their containers' labels on the hosts
(survey), so a job started on another machine, or moved to a spare by a restart, is found too.

    fab shell JOB                      # a shell in rank 0's container
    fab shell JOB --rank 1 -- nvidia-smi
    fab forward JOB 6006               # rank 0's host's port 6006 at http://127.0.0.1:6006

`fab shell JOB -- CMD`: Fabric's own executor reads a command after '--' as "run it on the -H
hosts"; Executor below hands it to `shell` instead and refuses it for every other task.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fabric
from invoke import Exit

from orchestrator.backends.ssh import jobcontrol
from orchestrator.config import inventory as inventory_file
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.recovery import RECORD, JobRecord
from orchestrator.hostcmds import nodeexec
from orchestrator.hosts import survey
from orchestrator.transport import forward as forwarding
from orchestrator.transport.remote import Session, describe

# The tasks that take a command after '--' (fab shell JOB -- CMD).
TAKES_COMMAND = frozenset({"shell"})
# Where Executor leaves that command for the task (Invoke gives a task only its context and options).
COMMAND_KEY = "fabtrain_command"


@dataclass(frozen=True)
class Node:
    """One node of a running job: the host its container runs on, and its node rank."""

    job: str
    host: Host
    rank: int


def whole(option: str, value: str | int | None, low: int, high: int | None = None) -> int | None:
    """A whole-number option within [low, high] (None when not given), or UserError naming it."""
    if value is None:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = low - 1
    if n < low or (high is not None and n > high):
        span = f"from {low} to {high}" if high is not None else f"{low} or more"
        raise UserError(f"{option} {hostile.text(str(value))!r}: give a whole number {span}", exit_code=2)
    return n


def job_inventory(inventory: str | None, job: str, runs: Path) -> Inventory:
    """--inventory, else the one the job was started with (its record in runs/JOB, when this machine
    started it and that file is still there), else the default one."""
    if inventory is None and (runs / job / RECORD).is_file():
        try:
            recorded = JobRecord.load(runs, job).inventory
        except UserError:
            recorded = None
        if recorded and Path(recorded).is_file():
            inventory = recorded
    return inventory_file.load(inventory)


def find_node(
    session: Session,
    inv: Inventory,
    job: str,
    rank: int | None = None,
    host: str | None = None,
    runs: Path | None = None,
) -> Node:
    """The node of `job` to reach: on host `host`, or of node rank `rank` (default 0), where its
    container runs now; UserError naming what was asked, what runs, and what to do (and, given
    `runs`, that no job of that id exists, when neither the hosts nor runs/ know it)."""
    if not jobspec.valid_job_id(job):
        raise UserError(
            f"{hostile.text(job)!r} is not a fabtrain job id; 'fab status' lists the jobs", exit_code=2
        )
    if rank is not None and host is not None:
        raise UserError("give --rank or --host, not both", exit_code=2)
    by_name = {h.name: h for h in inv.all_hosts}
    if host is not None and host not in by_name:
        raise UserError(
            f"--host {hostile.text(host)!r}: no such host in {inv.path}; its hosts are {', '.join(by_name)}",
            exit_code=2,
        )
    asked = (by_name[host],) if host is not None else inv.all_hosts
    found = survey.survey(session, inv, asked)
    ranks = survey.running_jobs(found).get(job, {})
    unreachable = [describe(by_name[n], exc) for n, exc in found.errors().items()]
    where = ", ".join(f"{h} (rank {r})" for h, r in sorted(ranks.items(), key=lambda x: x[1]))
    if host is not None:
        if host in ranks:
            return Node(job, by_name[host], ranks[host])
        if unreachable:
            raise UserError("; ".join(unreachable))
        raise UserError(
            f"job {job} runs no container on {host}; 'fab status' shows where it runs", exit_code=2
        )
    want = 0 if rank is None else rank
    for name, r in ranks.items():
        if r == want:
            return Node(job, by_name[name], r)
    seen = f"; not reached: {'; '.join(unreachable)}" if unreachable else ""
    if not ranks:
        if runs is not None and not jobcontrol.known_to(found, job, runs):
            raise UserError(
                f"job {job} is not running on the hosts of {inv.path}: "
                f"{jobcontrol.unknown_job(job, f' there or in {runs}/')}",
                exit_code=2,
            )
        raise UserError(
            f"job {job} is not running on the hosts of {inv.path}{seen}; 'fab status' lists the jobs",
            exit_code=2,
        )
    raise UserError(f"job {job} has no running node of rank {want}: it runs on {where}{seen}", exit_code=2)


def shell(
    inventory: str | None,
    job: str,
    rank: str | int | None,
    host: str | None,
    command: list[str],
    runs: Path,
    execute: Callable[[str, list[str]], Any] = os.execvp,
    terminal: bool | None = None,
) -> None:
    """fab shell: replace this process with the system's ssh running `docker exec` in the node's
    container (its exit status is the command's). With a pseudo-terminal when stdin and stdout are
    both terminals (`terminal`), as `docker exec -it` would be used by hand."""
    asked = whole("--rank", rank, 0)
    if not jobspec.valid_job_id(job):
        raise jobcontrol.unknown_job(job)
    inv = job_inventory(inventory, job, runs)
    with Session(inv.all_hosts) as session:
        node = find_node(session, inv, job, asked, host, runs)
    tty = sys.stdin.isatty() and sys.stdout.isatty() if terminal is None else terminal
    remote = nodeexec.exec_argv(node.job, node.rank, command, tty, os.environ.get("TERM"))
    argv = nodeexec.ssh_command_argv(node.host, remote, tty)
    sys.stdout.flush()
    sys.stderr.flush()
    execute(argv[0], argv)


def forward(
    inventory: str | None,
    job: str,
    port: str | int,
    local: str | int | None,
    runs: Path,
    say: Callable[[str], None],
    stop: threading.Event | None = None,
) -> Node:
    """fab forward: rank 0's host's port `port` (host networking: the container's port is the host's)
    at 127.0.0.1:`local` (default: the same number) until Ctrl+C or `stop`."""
    remote_port = whole("PORT", port, 1, 65535)
    assert remote_port is not None
    local_port = whole("LOCAL", local, 1, 65535) or remote_port
    if not jobspec.valid_job_id(job):
        raise jobcontrol.unknown_job(job)
    inv = job_inventory(inventory, job, runs)
    listener = forwarding.listen(local_port)  # first: a taken port is refused before any SSH
    with listener, Session(inv.all_hosts) as session:
        node = find_node(session, inv, job, runs=runs)
        session.connection(node.host)  # connected (or a clear error) before the URL is shown
        say(
            f"forwarding http://{forwarding.LOOPBACK}:{local_port} -> {node.host.name}:{remote_port} "
            f"(rank {node.rank} of {job}); Ctrl+C ends it"
        )
        sys.stdout.flush()
        try:
            forwarding.serve(session, node.host, remote_port, listener, stop or threading.Event(), warn)
        except KeyboardInterrupt:
            say("forward ended")
    return node


def warn(text: str) -> None:
    print(f"warning: {hostile.text(text)}", file=sys.stderr, flush=True)


def command_of(c: Any) -> list[str]:
    """The command given after '--' to this task (Executor left it in the context's config)."""
    return list(c.config.get(COMMAND_KEY) or [])


def refusal(tasks: list[str]) -> str:
    """Why a command after '--' was not taken, for the tasks given with it."""
    what = "fab shell JOB -- CMD runs CMD in a job's container"
    if not tasks:
        return f"a command after '--' needs a task: {what}"
    if any(t in TAKES_COMMAND for t in tasks):
        return f"fab {' '.join(tasks)}: a command after '--' is taken only with fab shell alone ({what})"
    hint = '; fab train passes arguments to its script with --args "..."' if "train" in tasks else ""
    return f"fab {' '.join(tasks)} takes no command after '--'; only fab shell does ({what}){hint}"


class Executor(fabric.Executor):
    """Fabric's executor, but a command after '--' goes to `fab shell JOB -- CMD` (as its argv, as
    typed), and is refused with a clear error for every other task (Fabric would run it on -H hosts)."""

    def __init__(
        self, collection: Any, config: Any = None, core: Any = None, argv: list[str] | None = None
    ) -> None:
        super().__init__(collection, config, core)
        self.argv = list(sys.argv if argv is None else argv)

    def expand_calls(self, calls: list, apply_hosts: bool = True) -> list:
        if apply_hosts and self.core is not None and self.core.remainder:
            command = self.remainder()
            names = [str(getattr(c, "called_as", None) or getattr(c, "name", "")) for c in calls]
            if len(calls) != 1 or names[0] not in TAKES_COMMAND:
                raise Exit(f"error: {refusal(names)}", code=2)
            self.config[COMMAND_KEY] = command
            self.core.remainder = ""  # consumed: not a command for Fabric's -H hosts
        return super().expand_calls(calls, apply_hosts)

    def remainder(self) -> list[str]:
        """The words after the first '--', as typed (Invoke keeps them only joined by spaces)."""
        if "--" in self.argv:
            words = self.argv[self.argv.index("--") + 1 :]
            if " ".join(words) == self.core.remainder:
                return words
        raise Exit(f"error: cannot tell the command after '--' apart ({self.core.remainder!r})", code=2)
