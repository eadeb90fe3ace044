"""fab train --detach on this machine: the controller's files staged (controllerfiles.py;
detached.py's docstring says what is copied where), the controller's host's addresses found, its key
added on every host (usable only from those addresses, for a while the controller keeps moving on:
hosts/keys.py), the files and the image copied to the controller's host, and the controller started
there (it runs backends/ssh/controller.py)."""

from __future__ import annotations

import json
import posixpath
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.base import Finished, Launch
from orchestrator.backends.ssh.controllerfiles import stage_files, write
from orchestrator.backends.ssh.detached import KEY_FILE, MOUNT, keys_line, remove
from orchestrator.backends.ssh.placement import Place, Placement, placement
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.core.recovery import JobRecord
from orchestrator.hostcmds import hostfiles, sshargs
from orchestrator.hosts import keys
from orchestrator.hosts.keys import authorize_script
from orchestrator.hosts.survey import CONTROLLER_LABEL
from orchestrator.transport import deadlines
from orchestrator.transport.remote import Session, describe

if TYPE_CHECKING:
    from orchestrator.config.inventory import Inventory

LOG = "controller.log"  # the controller's own output (events as JSON lines, then its end)
STARTED = "started"  # written by the controller once its code has loaded (start_script waits)
START_WAIT = 30  # seconds start_script waits for it
START_TIMEOUT = 60.0


def start_script(p: Place, image: str, owner: str, standby: bool = False) -> str:
    """Run the controller (or its standby: failover.py): the SSH user's uid (a passwd line made
    for it: ssh insists on one), no capabilities, the host's network, its directory at /ctl;
    removed when it exits."""
    d = sshargs.shell([p.dir])
    passwd = (
        f'printf \'root:x:0:0::/root:/bin/sh\\n%s:x:%s:%s::{MOUNT}:/bin/sh\\n\' "$(id -un)" "$(id -u)" '
        f'"$(id -g)" > {d}/passwd'
    )
    rest = sshargs.shell(
        [
            "--name",
            p.container,
            "--label",
            f"{CONTROLLER_LABEL}={p.job}",
            "--label",
            f"{jobspec.LABEL_OWNER}={owner}",
            "--network",
            "host",
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
            "-v",
            f"{p.dir}:{MOUNT}",
            "-v",
            f"{p.dir}/passwd:/etc/passwd:ro",
            "-e",
            f"PYTHONPATH={MOUNT}/fabtrain",
            "-e",
            f"HOME={MOUNT}",
            "-w",
            MOUNT,
            image,
            "sh",
            "-c",
            f"exec python3 -m orchestrator.backends.ssh.controller {MOUNT}"
            + (" --standby" if standby else "")
            + f" >> {MOUNT}/{LOG} 2>&1",
        ]
    )
    name = sshargs.shell([p.container])
    # Until it says it runs (STARTED, once its code has loaded), or at most START_WAIT s: one that
    # exits at once (its code broken, its image wrong) is named here, its log's end on stderr, rather
    # than leaving a "detached" job that nothing runs.
    started = (
        f"i=0; while [ ! -e {d}/{STARTED} ]; do if ! docker inspect {name} >/dev/null 2>&1; then "
        f"echo 'it exited at once; the end of its log:' >&2; tail -n 12 {d}/{LOG} >&2; exit 1; fi; "
        f"i=$((i+1)); [ $i -ge {START_WAIT * 10} ] && break; sleep 0.1; done"
    )
    return f'{passwd} && docker run -d --rm --user "$(id -u):$(id -g)" {rest} >/dev/null && {started}'


def prepare_script(p: Place) -> str:
    """The controller's directory, this account's own and mode 700 (its parent shared, sticky)."""
    parent, d = sshargs.shell([p.dir.rsplit("/", 1)[0]]), sshargs.shell([p.dir])
    return (
        hostfiles.shared_dir_script(parent, sticky=True)
        + f"umask 077; mkdir -p {d}/runs && "
        + hostfiles.own_dir_chmod(d, "700")
    )


def submit(launch: Launch, job_record: JobRecord) -> Finished:
    """Copy what the controller needs (module docstring), start it, and return: the job's id said.
    A failure on the way takes back what was placed (the key on every host, the directory)."""
    inv, spec = launch.inv, launch.spec
    jumps = [h.name for h in inv.all_hosts if h.ssh.jump]
    if jumps:
        raise UserError(
            f"--detach: {', '.join(jumps)} are reached through a jump host, which a controller "
            "cannot use yet; run the job without --detach",
            exit_code=2,
        )
    pl = placement(inv, spec.job_id)
    for p in (pl.active, *([pl.standby] if pl.standby else [])):
        refuse_exposing_mounts(p)
    lifetime, renew = keys.lifetimes()
    from orchestrator.images import images

    try:
        images.controller_image(inv.controller.image)
    except UserError as exc:
        raise UserError(
            f"--detach: {exc}; or name in the inventory one the controller's host has "
            "(controller: {image: ...})",
            exit_code=2,
        ) from None
    with tempfile.TemporaryDirectory(prefix="fabtrain-ctl-") as tmp, Session(inv.all_hosts) as session:
        stage = Path(tmp) / "stage"
        public = stage_files(stage, launch)
        try:
            failed = start(session, pl, stage, launch, public, lifetime, renew)
        except BaseException as exc:
            left = remove(session, *[p for p in (pl.active, pl.standby) if p is not None])
            if left and isinstance(exc, UserError):
                more = keys_line(spec.job_id, left, "; ")
                raise UserError(f"{exc}{more}", exit_code=exc.exit_code) from None
            raise
    # Every host may hold the key until this machine sees it gone (detached.fetch, status_lines).
    job_record.controller = pl.record(keys=(h.name for h in inv.all_hosts))
    run_dir = launch.runs / spec.job_id
    run_dir.mkdir(parents=True, exist_ok=True)
    job_record.save(run_dir)
    warn = "".join(
        f"\n  warning: {n} did not take the controller's key ({why}): the job cannot use it"
        for n, why in failed.items()
    )
    return Finished(
        spec.job_id,
        None,
        None,
        f"job {spec.job_id} detached: its controller runs on {pl.active.host.name} "
        f"({pl.active.container}): {pl.said()}. "
        f"Follow it with 'fab logs --job {spec.job_id}'; 'fab status' lists it; 'fab stop --job "
        f"{spec.job_id}' ends it{warn}",
    )


def refuse_exposing_mounts(p: Place) -> None:
    """UserError when a host directory the inventory mounts into the job's containers on the
    controller's host holds the controller's directory (its key, secrets and launch): the job's code,
    which anyone may have written, would read them there."""
    for m in p.host.mounts:
        source = posixpath.normpath(m.source)
        if source == "/" or p.dir == source or p.dir.startswith(source.rstrip("/") + "/"):
            raise UserError(
                f"--detach: {p.host.name}'s mount {m.source}:{m.target} (the inventory's hosts: mounts) "
                f"holds {p.dir}, where the controller keeps its SSH key and the job's secrets: every "
                "container of the job there could read them. Mount a narrower directory, set "
                "job.output_dir outside it, or name another host under controller:",
                exit_code=2,
            )


def start(
    session: Session, pl: Placement, stage: Path, launch: Launch, public: str, lifetime: int, renew: int
) -> dict[str, str]:
    """The controllers' hosts' addresses found, then the key on every host (the controllers'
    directories made in the same round trip), then at once the image placed and the files copied
    on both, then the controller run, then its standby; the hosts that did not take the key (or run
    the standby), with why: the job goes on without them."""
    places = [pl.active, *([pl.standby] if pl.standby else [])]
    failed = authorize(session, pl, places, stage, launch, public, lifetime, renew)
    if pl.standby is not None and pl.standby.host.name in failed:
        places = places[:1]
    place_files(session, pl, places, stage, launch, failed)
    run_controllers(session, pl, places, launch, failed)
    return {n: why for n, why in failed.items() if n != pl.active.host.name}


def authorize(
    session: Session,
    pl: Placement,
    places: list[Place],
    stage: Path,
    launch: Launch,
    public: str,
    lifetime: int,
    renew: int,
) -> dict[str, str]:
    """The key's grant staged (KEY_FILE: what the controller renews its line with), then the key
    added on every host, usable only from the controllers' hosts' addresses, and the controllers'
    directories made in the same round trip: the hosts where that failed, with why. UserError when
    the active controller's host is one of them."""
    inv, spec = launch.inv, launch.spec
    sources = controller_sources(session, places, inv)
    write(
        stage / KEY_FILE,
        json.dumps(
            {
                "public": public,
                "from": sources,
                "lifetime": lifetime,
                "renew": renew,
                "dir": pl.active.dir,
                "active": pl.active.host.name,
                "standby": pl.standby.host.name if pl.standby else None,
            }
        ).encode(),
    )
    first = {h.name: authorize_script(spec.job_id, public, sources[h.name], lifetime) for h in inv.all_hosts}
    for p in places:
        first[p.host.name] += " && " + prepare_script(p)
    ok = session.fan_out(
        lambda h: session.run(h, first[h.name], timeout=keys.TIMEOUT, what="adding the controller's key"),
        inv.all_hosts,
    )
    failed = {}
    for h in inv.all_hosts:
        r, error = ok.value(h.name), ok.error(h.name)
        if error is not None or r is None or not r.ok:
            failed[h.name] = (
                describe(h, error)
                if error is not None
                else hostile.line((r.stderr if r else "").strip() or f"exit {r.exited if r else '?'}", 300)
            )
    if pl.active.host.name in failed:
        raise UserError(
            f"--detach: the controller's host {pl.active.host.name} did not take its key or make "
            f"{pl.active.dir}: {failed[pl.active.host.name]}",
            exit_code=1,
        )
    return failed


def place_files(
    session: Session, pl: Placement, places: list[Place], stage: Path, launch: Launch, failed: dict[str, str]
) -> None:
    """At once on every controller's host: the controller image placed, its staged files and the
    job's code copied. A failure on the active one's host is raised; on the standby's it is added
    to `failed` (the standby is then not run)."""
    spec, image = launch.spec, launch.inv.controller.image
    from orchestrator.images import images

    def copy(p: Place, argv: list[str]) -> None:
        done = session.local([a for a in argv if a != "--delete"], START_TIMEOUT)
        if not done.ok:
            raise UserError(
                f"{p.host.name}: copying to {p.dir} failed: {hostile.line(done.stderr.strip(), 300)}"
            )

    def place_image(p: Place) -> None:
        pushed = images.push(session, image, (p.host,))
        if pushed[0].action == "failed":
            raise UserError(
                f"{p.host.name}: the controller image {image} could not be placed: {pushed[0].detail}"
            )

    with ThreadPoolExecutor(max_workers=6) as pool:
        work = {
            p.host.name: [
                pool.submit(place_image, p),
                # The controller's own files, whole (its empty secrets/ too): not a code tree.
                pool.submit(copy, p, sshargs.rsync_argv(p.host, str(stage), p.dir, listed=False)),
                pool.submit(
                    copy, p, sshargs.rsync_argv(p.host, spec.code, f"{p.dir}/code", only=spec.code_only)
                ),
            ]
            for p in places
        }
        for p in places:
            for f in work[p.host.name]:
                try:
                    f.result()
                except UserError as exc:
                    if p is pl.active:
                        raise
                    failed[p.host.name] = f"the standby was not placed: {exc}"


def run_controllers(
    session: Session, pl: Placement, places: list[Place], launch: Launch, failed: dict[str, str]
) -> None:
    """The controller run, then its standby (unless `failed` names its host): UserError when the
    controller does not start; the standby's failure to start is added to `failed`."""
    spec, image = launch.spec, launch.inv.controller.image
    for p in places:
        if p.host.name in failed:
            continue
        r = session.run(
            p.host,
            start_script(p, image, spec.owner, standby=p is not pl.active),
            timeout=START_TIMEOUT,
            what="starting the controller",
        )
        if not r.ok and p is pl.active:
            raise UserError(
                f"{p.host.name}: the controller did not start: {hostile.line(r.stderr.strip()[-600:], 600)}"
            )  # its log's end: the cause
        if not r.ok:
            failed[p.host.name] = f"its standby did not start: {hostile.line(r.stderr.strip(), 300)}"


def controller_sources(session: Session, places: list[Place], inv: Inventory) -> dict[str, list[str]]:
    """Each host's from= list for the key: the controllers' hosts' addresses as those hosts show
    them (keys.addresses_script), loopback too on their own lines when their address resolves there
    to them."""
    out: dict[str, list[str]] = {h.name: [] for h in inv.all_hosts}
    for p in places:
        r = session.run(
            p.host,
            keys.addresses_script(p.host.ssh.hostname),
            timeout=deadlines.STATUS_TIMEOUT,
            what="listing its addresses",
        )
        if not r.ok:
            raise UserError(
                f"--detach: listing the addresses of {p.host.name}, a controller's host, failed: "
                f"{hostile.line(r.stderr.strip() or f'exit {r.exited}', 300)}",
                exit_code=1,
            )
        addresses, via_loopback = keys.parse_addresses(r.stdout, p.host.name)
        by_host = keys.sources_by_host([h.name for h in inv.all_hosts], p.host.name, addresses, via_loopback)
        for n, v in by_host.items():
            out[n] += [a for a in v if a not in out[n]]
    return out
