"""`fab metrics --job JOB`: a job's newest figures, read from runs/JOB while it runs (or after): every
rank's newest step line (the `progress` events of events.jsonl) and every host's newest telemetry
sample (telemetry.jsonl). Only the files' tails are read (TAIL bytes), so a week-long job answers
as fast as a short one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.core import hostile
from orchestrator.progress.notify import EVENTS_FILE, TELEMETRY_FILE

TAIL = 4 * 1024 * 1024  # bytes read from the end of each file


def tail_bytes(path: Path, size: int) -> tuple[bytes, bool] | None:
    """The last `size` bytes of a file and whether it holds more before them; None when there is
    no file to read."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            end = fh.tell()
            fh.seek(max(0, end - size))
            return fh.read(size), end > size
    except OSError:
        return None


def tail_records(path: Path, size: int = TAIL) -> list[dict]:
    """The JSON objects of the last `size` bytes of a JSON-lines file (the first, cut, line and any
    unreadable one skipped); [] when there is no file."""
    got = tail_bytes(path, size)
    if got is None:
        return []
    data, cut = got
    lines = data.split(b"\n")
    if cut:
        lines = lines[1:]
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def latest(run_dir: Path, size: int = TAIL) -> dict[str, Any]:
    """{"job", "attempt", "state", "ranks": [{host, rank, step, loss, ...}], "hosts": {host: sample},
    "updated": time of the newest record read}, from each file's last `size` bytes."""
    ranks: dict[tuple[str, int], dict] = {}
    attempt, state, updated = None, "running", None
    for rec in tail_records(run_dir / EVENTS_FILE, size):
        kind = rec.get("event")
        updated = rec.get("time", updated)
        if kind == "attempt":
            attempt, ranks = rec.get("attempt"), {}
        elif kind == "progress":
            for r in rec.get("ranks") or ():
                if isinstance(r, dict) and isinstance(r.get("rank"), int):
                    ranks[(hostile.text(str(rec.get("host"))), r["rank"])] = r
        elif kind == "finished":
            state = hostile.text(str(rec.get("state")))
    hosts: dict[str, dict] = {}
    for rec in tail_records(run_dir / TELEMETRY_FILE, size):
        if isinstance(rec.get("sample"), dict):
            hosts[hostile.text(str(rec.get("host")))] = {"time": rec.get("time"), **rec["sample"]}
    return {
        "job": run_dir.name,
        "attempt": attempt,
        "state": state,
        "updated": updated,
        "ranks": [{"host": h, **r} for (h, _), r in sorted(ranks.items(), key=lambda kv: kv[0][1])],
        "hosts": hosts,
    }


def lines(doc: dict[str, Any]) -> list[str]:
    """The figures as lines for a person."""
    out = [f"job {doc['job']}: {doc['state']}, attempt {doc['attempt'] or '-'}"]
    for r in doc["ranks"]:
        times = (
            f" | step {r['step_ms']:.1f} ms | compute {r['compute_ms']:.1f} ms"
            if r.get("step_ms") is not None and r.get("compute_ms") is not None
            else ""
        )
        out.append(
            f"  {r['host']} rank {r['rank']}: step {r['step']} | loss {r['loss']:.4f} | "
            f"{r['tokens_per_s']:,.0f} tok/s{times}"
        )
    if not doc["ranks"]:
        out.append("  no step lines yet (a script of your own shows none; its telemetry is below)")
    for host, s in sorted(doc["hosts"].items()):
        gpus = ", ".join(
            f"GPU {g['index']} {100 * g['util']:.0f}%" for g in s.get("gpus", ()) if g.get("util") is not None
        )
        conts = ", ".join(
            f"{c['name']} {c['cpu']:.1f} cores {c['mem'] / 2**30:.2f} GiB"
            for c in s.get("containers", ())
            if c.get("cpu") is not None and c.get("mem") is not None
        )
        load = (s.get("host") or {}).get("load1")
        parts = (gpus, conts, f"load {load:.2f}" if load is not None else "")
        out.append(f"  {host}: " + "; ".join(p for p in parts if p))
    return out
