"""A detached job's controller (detached.py): what runs in its container on the controller's host,
started there as `python3 -m orchestrator.backends.ssh.controller /ctl` (detached.start_script).
It runs the job's whole life (job.py, the same stages) from launch.pickle, writes the end to
done.json, and removes its credentials: its key from every host, its private key, the pickle and
the secrets from /ctl."""
from __future__ import annotations

import json
import pickle
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.base import Launch
from orchestrator.backends.ssh.detached import DONE
from orchestrator.core.errors import UserError
from orchestrator.core.recovery import JobRecord
from orchestrator.hosts.keys import revoke_script
from orchestrator.transport import deadlines
from orchestrator.transport.remote import Session

if TYPE_CHECKING:
    from orchestrator.config.inventory import Inventory


def revoke_everywhere(inv: Inventory, job_id: str) -> None:
    with Session(inv.all_hosts) as session:
        session.fan_out(lambda h: session.run(h, revoke_script([job_id]), timeout=deadlines.STATUS_TIMEOUT,
                                              what="removing the controller's key"), inv.all_hosts)


def main(root: Path) -> int:
    """The controller: the job's life, its end written to done.json, its credentials removed."""
    from rich.console import Console

    from orchestrator.backends.ssh.backend import SshBackend
    launch: Launch = pickle.loads((root / "launch.pickle").read_bytes())  # noqa: S301 - written by fab train
    launch = replace(launch, console=Console(stderr=True, highlight=False, soft_wrap=True))
    end = {"state": "failed", "error": "", "closing": ""}
    try:
        finished = SshBackend().run(launch)
        end = {"state": "finished" if finished.error is None else "failed",
               "error": str(finished.error or ""), "closing": finished.closing}
        rec = JobRecord.load(launch.runs, launch.spec.job_id, "the job's record")
        end["state"] = rec.state
    except UserError as exc:
        end["error"] = str(exc)
    except BaseException as exc:  # noqa: BLE001 - the end is written whatever happened
        end["error"] = f"the controller failed: {exc!r}"
        raise
    finally:
        try:
            revoke_everywhere(launch.inv, launch.spec.job_id)
        finally:
            for name in ("key", "launch.pickle"):
                (root / name).unlink(missing_ok=True)
            for secret in (root / "secrets").glob("*"):
                secret.unlink()
            (launch.runs / launch.spec.job_id).mkdir(parents=True, exist_ok=True)  # a job refused: its end
            tmp = root / f".{DONE}.tmp"
            tmp.write_text(json.dumps(end))
            tmp.replace(root / DONE)
    return 0 if not end["error"] else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
