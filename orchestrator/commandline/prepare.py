"""Getting hosts ready for jobs, as the tasks do it and print it: the local test cluster (fab
cluster.up), a job image built here and copied to the hosts (fab image.build, image.push), the code
synced (fab sync) and every host checked (fab preflight)."""

from __future__ import annotations

import json as _json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from invoke import Exit

from orchestrator import preflight as _preflight
from orchestrator.backends.ssh import steps
from orchestrator.commandline import cli
from orchestrator.config import inventory as inventory_file
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.hosts import hostops
from orchestrator.images import images
from orchestrator.preflight import deep as _deep
from orchestrator.transport.remote import Session

if TYPE_CHECKING:
    from rich.console import Console


def sync(inventory: str | None, code: str | None, json: bool, console: Console) -> None:
    """fab sync: the code (--code, else the built-in trainers) to every host, and how long each took."""
    from orchestrator.progress import bars

    inv = inventory_file.load(inventory)
    tree = cli.code_tree(code)
    say = cli.stderr_console() if json else console
    for line in hostops.tree_lines(*tree):
        say.print(line, markup=False, highlight=False)
    with Session(inv.hosts) as session, bars.bar(say) as progress:
        dest, times = hostops.sync(session, inv, *tree, transfers=bars.Transfers(progress))
    if json:
        print(
            _json.dumps(
                {"destination": dest, "seconds": {h: round(t, 3) for h, t in times.items()}}, indent=2
            )
        )
        return
    for host, seconds in times.items():
        print(f"{host}: synced to {dest} in {seconds:.2f}s")


def preflight(
    inventory: str | None,
    json: bool,
    strict: bool,
    smoke: bool,
    clock_warn: float,
    clock_fail: float,
    code: str | None,
    deep: bool,
    console: Console,
) -> None:
    """fab preflight: every check on every host (with `deep`, the measures too, kept for fab train
    --health), as a table or JSON; Exit(1) when one fails (or warns, when `strict`)."""
    inv = inventory_file.load(inventory)
    limits = _preflight.Limits(clock_warn=float(clock_warn), clock_fail=float(clock_fail))
    with Session(inv.hosts) as session:
        source, only = cli.code_tree(code)
        inv = hostops.with_free_port(session, inv)
        checks = _preflight.run(
            session, inv, limits=limits, run_job=steps.run_quiet if smoke else None, source=source, only=only
        )
        measured = None
        if deep:
            more, measured = _deep.run_deep(session, inv)
            _deep.save(measured, more)
            checks = checks + more
    if json:
        out = _json.loads(_preflight.to_json(checks, strict))
        if measured is not None:
            out["deep"] = measured
        print(_json.dumps(out, indent=2))
    else:
        _preflight.render(checks, console)
        if measured is not None and len(inv.hosts) > 1:
            console.print(
                "network, Mbit/s (row sends to column):\n" + measured["network"]["matrix"], markup=False
            )
    bad = _preflight.failed(checks, strict)
    if bad:
        raise Exit(code=1)


def cluster_up(nodes: int, spares: int, write_inventory: str | None, slurm: bool, json: bool) -> None:
    """fab cluster.up: the local cluster's hosts started (or reused); with `json`, its hosts and
    inventory as JSON on stdout and the progress on stderr."""
    from orchestrator.testbed import cluster  # the Docker library: only for the local cluster's tasks

    log = (lambda line: print(line, file=sys.stderr, flush=True)) if json else print
    made = cluster.up(int(nodes), write_inventory, spares=int(spares), slurm=slurm, log=log)
    if json:
        count = int(nodes)
        print(
            _json.dumps(
                {
                    "inventory": str(write_inventory or cluster.STATE_DIR / "inventory.yaml"),
                    "hosts": [{"name": n.name, "address": n.address} for n in made[:count]],
                    "spares": [{"name": n.name, "address": n.address} for n in made[count:]],
                },
                indent=2,
            )
        )


def push(inventory: str | None, image: str | None, only: str | None, method: str, console: Console) -> None:
    """fab image.push: a local image copied to the hosts (`only`: some of them, comma-separated) by
    `method` (chain or direct), with progress bars; what each host did, and UserError naming those
    it failed on."""
    if method not in ("chain", "direct"):
        raise UserError(f"--method {hostile.text(str(method))!r}: give chain or direct", exit_code=2)
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    inv = inventory_file.load(inventory)
    image = image or inv.job.image
    selected = inv.select(only.split(",") if only else None)
    with (
        Session(selected) as session,
        Progress(
            "{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console,
            transient=True,
        ) as progress,
    ):
        results = images.push(session, image, progress=progress, method=method)
    for r in results:
        extra = f" ({r.bytes / 1e6:.0f} MB in {r.seconds:.1f}s)" if r.action == "sent" else ""
        print(hostile.text(f"{r.host}: {r.action}{extra}{': ' + r.detail if r.detail else ''}"))
    bad = [r.host for r in results if r.action == "failed"]
    if bad:
        raise UserError(f"image push failed on {', '.join(bad)}")


def build(
    base: str, requirements: str, tag: str, pip_args: str, wheels: str | None, console: Console
) -> None:
    """fab image.build: the job image built on this machine's Docker engine, with its steps shown."""
    from orchestrator.progress import bars

    with bars.bar(console, *bars.step_columns()) as progress:
        image_id = images.build(
            base,
            Path(requirements),
            tag,
            tuple(shlex.split(pip_args)),
            Path(wheels) if wheels else None,
            progress=progress,
        )
    print(f"built {tag} ({image_id[7:19]}); push it with: fab image.push --image {tag}")
