"""A detached job's controller (detached.py): what runs in its container on the controller's host,
started there as `python3 -m orchestrator.backends.ssh.controller /ctl` (submit.start_script).
It runs the job's whole life (job.py, the same stages) from launch.pickle, writes its key's line
again on every host while the job lives (its expiry moved on: hosts/keys.py), writes the end to
done.json, and removes its credentials: its key from every host (checked, tried again, the hosts
where it failed named in done.json and its log), its private key, the pickle and the secrets from
/ctl."""

from __future__ import annotations

import json
import pickle
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.base import Finished, Launch
from orchestrator.backends.ssh import failover
from orchestrator.backends.ssh.detached import DONE, KEY_FILE, Place, revoke_on
from orchestrator.core.errors import UserError
from orchestrator.core.recovery import JobRecord
from orchestrator.hosts import keys
from orchestrator.hosts.keys import renew_script
from orchestrator.transport.remote import Session, failure

if TYPE_CHECKING:
    from orchestrator.config.inventory import Inventory


def revoke_everywhere(inv: Inventory, job_id: str, taken_over: Place | None = None) -> dict[str, str]:
    """The job's key removed from every host, checked there, and the controller taken over gone from
    its host, in the same visit (a frozen host costs one deadline, not two): the hosts where any of
    that failed, with why (the machine that started the job clears them when it fetches the end)."""
    with Session(inv.all_hosts) as session:
        clear = {taken_over.host.name: taken_over} if taken_over else None
        left = revoke_on(session, inv.all_hosts, [job_id], clear=clear)
    for why in left.values():
        print(
            f"warning: {why}: the controller's key may still be there; fab status takes it back",
            file=sys.stderr,
            flush=True,
        )
    return left


class Renewal:
    """A thread that writes the job's line again on every host every `renew` seconds, with an expiry
    `lifetime` seconds on; stopped (and waited for) before the key is removed, so that no renewal
    comes after the removal. A host where the line is gone (fab stop took it back) is left so."""

    def __init__(self, inv: Inventory, job_id: str, grant: dict) -> None:
        self.inv, self.job_id = inv, job_id
        self.public, self.sources = str(grant["public"]), {k: list(v) for k, v in grant["from"].items()}
        self.lifetime, self.renew = int(grant["lifetime"]), int(grant["renew"])
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="key-renewal", daemon=True)

    def start(self) -> Renewal:
        self.thread.start()
        return self

    def run(self) -> None:
        while not self.stopping.wait(self.renew):
            try:
                self.once()
            except Exception as exc:  # noqa: BLE001 - the next round tries again; the job goes on
                print(f"warning: renewing the controller's key failed: {exc!r}", file=sys.stderr, flush=True)

    def once(self) -> dict[str, str]:
        """One round on every host: host -> why, where it failed."""
        hosts = [h for h in self.inv.all_hosts if h.name in self.sources]
        what = "renewing the controller's key"
        with Session(hosts) as session:
            done = session.fan_out(
                lambda h: session.run(
                    h,
                    renew_script(self.job_id, self.public, self.sources[h.name], self.lifetime),
                    timeout=keys.TIMEOUT,
                    what=what,
                ),
                hosts,
            )
        failed = {h.name: why for h in hosts if (why := failure(h, done[h.name], what))}
        for why in failed.values():
            print(f"warning: {why}", file=sys.stderr, flush=True)
        return failed

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()


def main(root: Path, standby: bool = False) -> int:
    """A controller (failover.py says the two roles): the job's life, its end written to done.json
    (and to the standby's mirror), its credentials removed. A standby that never took over ends
    when the active controller's end reaches it, with only its credentials removed."""
    from rich.console import Console

    from orchestrator.backends.ssh import job as job_mod
    from orchestrator.backends.ssh.backend import SshBackend
    from orchestrator.backends.ssh.submit import STARTED

    (root / STARTED).touch()  # its code loaded: what `fab train --detach` waits for (submit.start_script)
    launch: Launch = pickle.loads((root / "launch.pickle").read_bytes())  # noqa: S301 - written by fab train
    launch = replace(launch, console=Console(stderr=True, highlight=False, soft_wrap=True))
    grant = json.loads((root / KEY_FILE).read_text())
    by_name = {h.name: h for h in launch.inv.all_hosts}
    here = str(grant.get("standby" if standby else "active") or "")
    end: dict = {"state": "failed", "error": "", "closing": ""}
    renewal: Renewal | None = None
    mirror: failover.Mirror | None = None
    old: str | None = None  # the controller this one took over from

    def renewing() -> None:
        nonlocal renewal, old
        renewal = Renewal(launch.inv, launch.spec.job_id, grant).start()
        old = str(grant["active"])

    try:
        if standby:
            finished = failover.stand_by(
                root, launch, by_name[grant["active"]], str(root_dir(grant)), here, renewing
            )
            if finished is None:  # the active controller ended the job: its end is in the mirror
                failover.wipe(root)
                return 0
        else:
            renewal = Renewal(launch.inv, launch.spec.job_id, grant).start()
            if grant.get("standby") in by_name:
                mirror = failover.Mirror(
                    by_name[grant["standby"]],
                    root_dir(grant),
                    launch.runs / launch.spec.job_id,
                    lambda: failover.fence(root),
                )
                mirror.start()
                job_mod.FENCE = mirror.check
            finished = SshBackend().run(launch)
        end = outcome(finished)
        rec = JobRecord.load(launch.runs, launch.spec.job_id, "the job's record")
        end["state"] = rec.state
    except UserError as exc:
        end["error"] = str(exc)
    except BaseException as exc:  # noqa: BLE001 - the end is written whatever happened
        end["error"] = f"the controller failed: {exc!r}"
        raise
    finally:
        close(root, launch, grant, end, renewal, mirror, old)
    return 0 if not end["error"] else 1


def outcome(finished: Finished) -> dict:
    """The controller's end as done.json holds it, from how the job's run ended."""
    return {
        "state": "finished" if finished.error is None else "failed",
        "error": str(finished.error or ""),
        "closing": finished.closing,
    }


def close(
    root: Path,
    launch: Launch,
    grant: dict,
    end: dict,
    renewal: Renewal | None,
    mirror: failover.Mirror | None,
    old: str | None,
) -> None:
    """A controller's last acts, whatever happened: its key's renewal stopped, its end handed to the
    standby's mirror, the key removed from every host and the controller it took over from (`old`)
    cleared from its host (`end` says where that failed); then its credentials wiped from /ctl and
    `end` written to done.json."""
    by_name = {h.name: h for h in launch.inv.all_hosts}
    try:
        if renewal is not None:
            renewal.stop()
        if mirror is not None:
            mirror.finish(end)
        job = launch.spec.job_id
        taken_over = Place(job, by_name[old], root_dir(grant), f"fabtrain-ctl-{job}") if old else None
        end["keys_left"] = revoke_everywhere(launch.inv, job, taken_over)
    finally:
        failover.wipe(root)
        (launch.runs / launch.spec.job_id).mkdir(parents=True, exist_ok=True)  # a job refused: its end
        tmp = root / f".{DONE}.tmp"
        tmp.write_text(json.dumps(end))
        tmp.replace(root / DONE)


def root_dir(grant: dict) -> str:
    """The controllers' directory on their hosts (the same path on both)."""
    return str(grant["dir"])


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), standby="--standby" in sys.argv[2:]))
