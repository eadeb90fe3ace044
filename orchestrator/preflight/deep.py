"""The deep check (`fab preflight --deep`): not only that things exist, but that they are fast and
healthy. Each phase runs on every host at once, each step under a deadline (a host that passes it
is named, the others are still measured); the phases are in deepphases:

  1. disk: free space and write + fsync speed of job.output_dir and job.code_dir, on the host;
  2. compute: matrix multiplies in the job's image, per host (per GPU), against its peers;
  3. network: every pair of hosts, in rounds (health.rounds), a bulk stream both ways and round
     trips over the job's interface, in the job's image with the host's network;
  4. GPUs, where present: ECC, retired/remapped rows, XID errors, throttling, PCIe link, dcgmi
     diag -r 1 (NVIDIA) or RAS/ECC and link state (AMD), parsed by gpuparse and judged by gpuhealth.

This module runs them (`run_deep`). What it measured is kept per host with the time, for `fab train
--health` (`gate`), as state rather than a run (`results_path`: $XDG_STATE_HOME/fabtrain/health.json,
else .fabtrain/health.json beside runs/). The collective all_reduce in the job's image is the
ordinary preflight's smoke test, run with it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict
from pathlib import Path

from orchestrator.config.inventory import Inventory
from orchestrator.preflight.checks import FAIL, Check
from orchestrator.preflight.deepphases import compute_checks, disk_checks, gpu_checks, network_checks
from orchestrator.preflight.health import THRESHOLDS, Thresholds
from orchestrator.transport.remote import Session


def results_path() -> Path:
    """Where the deep check's verdicts are kept: under $XDG_STATE_HOME when it is set (shared by every
    project folder of this user), else in .fabtrain/ beside runs/ (the working directory)."""
    base = os.environ.get("XDG_STATE_HOME")
    return (Path(base) / "fabtrain" if base else Path(".fabtrain")) / "health.json"


def run_deep(
    session: Session,
    inv: Inventory,
    image: str | None = None,
    t: Thresholds = THRESHOLDS,
    access: dict | None = None,
) -> tuple[list[Check], dict]:
    """Every phase on every host of `inv`: the checks, and what was measured (for --json and the
    matrix)."""
    hosts = list(inv.hosts)
    tag = secrets.token_hex(3)
    access = access or {}
    data: dict = {"time": time.time()}
    checks = disk_checks(session, inv, hosts, t, data)
    checks += compute_checks(session, inv, hosts, t, data, image, access, tag)
    checks += network_checks(session, inv, hosts, t, data, image, tag)
    checks += gpu_checks(session, inv, data)
    return checks, data


def save(data: dict, checks: list[Check], path: Path | None = None) -> None:
    """Keep each host's verdict with its time (merged with earlier ones), for fab train --health."""
    path = path or results_path()
    kept = load(path)
    for host in {c.host for c in checks}:
        mine = [asdict(c) for c in checks if c.host == host]
        kept[host] = {"time": data["time"], "ok": not any(c["status"] == FAIL for c in mine), "checks": mine}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(kept, indent=2) + "\n")
    tmp.replace(path)


def load(path: Path | None = None) -> dict:
    try:
        return json.loads((path or results_path()).read_text())
    except (OSError, ValueError):
        return {}


def gate(
    session: Session,
    inv: Inventory,
    t: Thresholds = THRESHOLDS,
    path: Path | None = None,
    now: float | None = None,
) -> tuple[Inventory, list[str]]:
    """fab train --health: the job's hosts and spares judged by the deep check (results younger than
    t.fresh_s are reused; otherwise every one is measured again, together, so that the network is
    measured between them). Unhealthy hosts are left out and spares, healthy ones, take their places
    in order; UserError naming them when too few are left. Returns the inventory to run on and
    what was done, one line each."""
    from dataclasses import replace

    from orchestrator.core.errors import UserError

    now = time.time() if now is None else now
    path = path or results_path()
    everyone = (*inv.hosts, *inv.spares)
    kept = load(path)
    lines = []
    if any(h.name not in kept or now - kept[h.name]["time"] > t.fresh_s for h in everyone):
        checks, data = run_deep(session, replace(inv, hosts=everyone, spares=()), t=t)
        save(data, checks, path)
        kept = load(path)
        lines.append(f"deep check of {len(everyone)} host(s) done")
    else:
        lines.append(f"deep check results from the last hour reused ({path})")

    def why(name: str) -> str:
        return "; ".join(f"{c['check']}: {c['detail']}" for c in kept[name]["checks"] if c["status"] == FAIL)

    sick = [h for h in everyone if not kept.get(h.name, {}).get("ok", False)]
    healthy_spares = [s for s in inv.spares if s not in sick]
    hosts, taken = [], []
    for h in inv.hosts:
        if h not in sick:
            hosts.append(h)
        elif healthy_spares:
            spare = healthy_spares.pop(0)
            hosts.append(spare)
            lines.append(f"{h.name} left out ({why(h.name)}); spare {spare.name} takes its place")
            taken.append(f"; spare {spare.name} took the place of {h.name} ({why(h.name)})")
        else:
            spares = "".join(taken) + "".join(
                f"; spare {s.name} is not healthy either ({why(s.name)})" for s in inv.spares if s in sick
            )
            raise UserError(
                f"{h.name} is not healthy ({why(h.name)}) and no healthy spare is left{spares}; "
                f"fix it, add a spare to the inventory, or leave it out with --exclude {h.name}"
            )
    for s in inv.spares:
        if s in sick:
            lines.append(f"spare {s.name} is not healthy either ({why(s.name)})")
    used = {h.name for h in hosts}
    return replace(
        inv,
        hosts=tuple(replace(h, rank=i) for i, h in enumerate(hosts)),
        spares=tuple(s for s in healthy_spares if s.name not in used),
    ), lines
