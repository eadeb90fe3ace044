"""Shared directories on a real host: two Unix accounts of one group (alice, bob) run the exact
claim, survey, stop and clean-up scripts fabtrain sends (su on the test host: real permissions, a
real filesystem), and the preflight's smoke test shares hosts like any job: beside another owner's
job holding node1's slot 0 and the master port, it takes only free slots and the next port, carries
its owner, and leaves the other job as it was. A place in node1's queue dated a day ahead of its
clock, which once refused every later job there for ever, is dropped by the next plain job, which
runs and says so."""

import json
import os
import re
import secrets
import shlex
import subprocess
import threading
import time
from pathlib import Path

from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.hostcmds import hostfiles
from orchestrator.hosts import claims, hostops, queue
from orchestrator.hosts.survey import parse_survey, survey_script
from orchestrator.transport.remote import put_command

from .conftest import CONTAINER, fab, on_host

NODE = "node1"


def as_user(user: str, script: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`script` run by sh as `user` on the test host (as fabtrain's SSH session would run it)."""
    return subprocess.run(
        ["docker", "exec", "-i", CONTAINER[NODE], "su", user, "-s", "/bin/sh", "-c", script],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_two_accounts_of_one_group_share_claims_and_never_read_each_others_secrets():
    tag = secrets.token_hex(3)
    group, alice, bob = f"ft{tag}", f"alice{tag}", f"bob{tag}"
    out = f"/tmp/fabshare-{tag}/out"
    inv = parse(
        f"job: {{output_dir: {out}}}\nhosts:\n  - {{name: {NODE}, address: 10.0.0.1, interface: eth0}}\n",
        Path("i.yaml"),
    )
    rt = f"{out}/.runtime"
    # The admin's part: the group, its accounts (with Docker access), an output directory for the group.
    on_host(
        NODE,
        f"groupadd {group} && useradd -M -g {group} -G docker {alice} && useradd -M -g {group} -G docker "
        f"{bob} "
        f"&& mkdir -p {out} && chgrp {group} {out} && chmod 2775 {out}",
    )
    try:
        # alice claims slot 0 (with a narrow umask), writes her secrets and the entrypoint as a job does.
        spec = jobspec.JobSpec(job_id=f"alice-{tag}", script="s")
        r = as_user(
            alice, "umask 077; " + claims.claim_script(inv, spec.job_id, (0,), "alice@ws", True, 29500)
        )
        assert r.returncode == 0, r.stderr
        assert (
            as_user(
                alice, put_command(hostfiles.secrets_file(inv, spec), 0o600), "TOKEN=s3cret-of-alice\n"
            ).returncode
            == 0
        )
        assert (
            as_user(
                alice,
                f"cat > {shlex.quote(hostfiles.runtime_dir(inv, spec) + '/entrypoint.py')}",
                "print('entrypoint ok')\n",
            ).returncode
            == 0
        )
        # bob sees her claim and her lease's age, is refused her slot, and takes the other one.
        survey = parse_survey(as_user(bob, survey_script(inv)).stdout)
        assert {c.job: (c.who, c.units) for c in survey.claimed} == {spec.job_id: ("alice@ws", (0,))}
        assert survey.runtime[spec.job_id] is not None and survey.runtime[spec.job_id] < hostfiles.LEASE_LIVE
        r = as_user(bob, claims.claim_script(inv, f"bob-{tag}", (0,), "bob@ws", True))
        assert r.returncode == claims.REFUSED and claims.parse_claim_output(r.stdout)[0][0].job == spec.job_id
        r = as_user(bob, claims.claim_script(inv, f"bob-{tag}", (1,), "bob@ws", True, 29501))
        assert r.returncode == 0, r.stderr
        # bob never reads, lists, writes or moves alice's runtime files; her secrets stay hers.
        secret = hostfiles.secrets_file(inv, spec)
        for attempt in (
            f"cat {secret}",
            f"ls {hostfiles.runtime_dir(inv, spec)}",
            f"touch {hostfiles.runtime_dir(inv, spec)}/x",
            f"rm -f {secret}",
            f"mv {hostfiles.runtime_dir(inv, spec)} {rt}/moved",
        ):
            r = as_user(bob, attempt)
            assert r.returncode != 0 and ("Permission denied" in r.stderr or "not permitted" in r.stderr), (
                attempt,
                r,
            )
        # bob stops alice's job: his marker lands beside her runtime directory.
        assert as_user(bob, hostfiles.stop_mark_script(inv, [spec.job_id])).returncode == 0
        # alice's fabtrain went away (lease old, no container): bob's next claim clears her stale claim;
        # her runtime files are not his to remove, and are kept, named.
        on_host(NODE, f"touch -d '-1 hour' {hostfiles.runtime_dir(inv, spec)}/{hostfiles.LEASE}")
        r = as_user(bob, claims.claim_script(inv, f"bob2-{tag}", (0,), "bob@ws", True))
        assert r.returncode == 0 and [c.job for c in claims.parse_claim_output(r.stdout)[1]] == [
            spec.job_id
        ], r
        r = as_user(bob, hostops.clear_stale_script(inv, [spec.job_id]))
        assert hostops.parse_clear_stale(r.stdout) == ([], {spec.job_id: alice})
        assert as_user(bob, f"cat {secret}").returncode != 0
        # In alice's container the entrypoint runs from the read-only mount, as root and as a
        # non-root image user; only root there reads the secrets.
        mount = f"{hostfiles.runtime_dir(inv, spec)}:{jobspec.RUNTIME_MOUNT}:ro"
        read = (
            f"python3 {jobspec.ENTRYPOINT_PATH} && "
            f"python3 -c \"open('{jobspec.SECRETS_PATH}').read(); print('secrets read')\""
        )
        for user, want in (("0", "entrypoint ok\nsecrets read"), ("65534", "entrypoint ok")):
            c = on_host(
                NODE,
                f"docker run --rm --user {user} --network none -v {mount} --entrypoint sh "
                f"fabtrain/trainer:latest -c {shlex.quote(read)}",
                check=False,
            )
            assert c.stdout.strip() == want, (user, c.stdout, c.stderr)
        # alice's own clean up removes her runtime files and bob's stop marker.
        assert (
            as_user(alice, hostops.clear_stale_script(inv, [spec.job_id])).stdout.strip()
            == f"removed {spec.job_id}"
        )
        left = on_host(NODE, f"ls -A {rt} {rt}/.stopped").stdout
        assert spec.job_id not in left and f"bob-{tag}" in left, left
        modes = on_host(
            NODE,
            f"stat -c '%a %G %n' {out}/.claims {out}/.claims/* {rt} {rt}/bob-{tag} {out}/.claims/*/bob-{tag}",
        ).stdout.split("\n")
        # alice's umask 077 kept others out of the claims she made; the group got in all the same.
        assert [m.split()[:2] for m in modes if m] == [
            ["2770", group],
            ["2770", group],
            ["3775", group],
            ["2711", group],
            ["644", group],
        ], modes
    finally:
        on_host(
            NODE, f"rm -rf /tmp/fabshare-{tag}; userdel {alice}; userdel {bob}; groupdel {group}", check=False
        )


def test_the_smoke_test_takes_free_slots_and_a_claimed_port_beside_another_owners_job(inventory_path, inv):
    tag = secrets.token_hex(3)
    other, port = f"other-{tag}", inv.job.master_port
    # Another owner's job on node1: its container, and its claim of slot 0 and the master port.
    on_host(
        NODE,
        f"docker run -d --name {other} --label {jobspec.LABEL_MANAGED}=1 --label {jobspec.LABEL_JOB}={other} "
        f"--label {jobspec.LABEL_OWNER}=bob@elsewhere --entrypoint sleep fabtrain/trainer:latest 300",
    )
    r = on_host(NODE, claims.claim_script(inv, other, (0,), "bob@elsewhere", True, port), check=False)
    assert r.returncode == 0, r.stderr
    claim = f"{inv.job.output_dir}/.claims/*/{other}"
    before = on_host(NODE, f"cat {claim}; docker ps -q --filter name={other}").stdout
    seen: set[str] = set()
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.update(
                on_host(
                    NODE,
                    "docker ps --filter label=fabtrain.managed=1 --format "
                    '\'{{.Label "fabtrain.job"}} {{.Label "fabtrain.owner"}}\'; '
                    f"cat {inv.job.output_dir}/.claims/*/preflight-* 2>/dev/null",
                    check=False,
                ).stdout.splitlines()
            )
            time.sleep(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        t0 = time.monotonic()
        p = fab(inventory_path, "preflight", "--json", env={**os.environ, "FABTRAIN_USER": "carol"})
        took = time.monotonic() - t0
        done.set()
        watcher.join(10)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr
        checks = {(c["host"], c["check"]): c for c in json.loads(p.stdout)["checks"]}
        assert checks[(NODE, "port")]["detail"] == f"master port {port + 1} free"
        # One free slot on node1: one process per node, on both hosts.
        assert all(
            "all_reduce over 2 ranks (gloo)" in checks[(h, "smoke")]["detail"] for h in ("node1", "node2")
        )
        owners = {
            line.split()[1] for line in seen if line.startswith("preflight-") and len(line.split()) == 2
        }
        assert owners and all(o.startswith("carol@") for o in owners), seen
        assert "units=1" in seen and f"port={port + 1}" in seen and "who=carol@" in " ".join(seen), seen
        # The other job is as it was; nothing of the smoke test is left.
        assert on_host(NODE, f"cat {claim}; docker ps -q --filter name={other}").stdout == before
        left = on_host(
            NODE,
            f"ls {inv.job.output_dir}/.claims/*/ {inv.job.output_dir}/.runtime/; "
            "docker ps -aq --filter label=fabtrain.managed=1",
        ).stdout.split()
        assert not [x for x in left if x.startswith("preflight-")], left
        print(f"preflight with the smoke test beside another job: {took:.1f}s")
    finally:
        done.set()
        on_host(
            NODE, f"docker rm -f {other} >/dev/null; " + claims.release_command(inv, [other]), check=False
        )


def test_a_queue_place_dated_ahead_blocks_no_job_and_is_dropped_naming_it_and_its_owner(inventory_path, inv):
    """Anyone of the group can write the queue: a place dated a day ahead of node1's clock would stay
    fresh (and every plain job there refused, 'jobs queued before this one wait for it') for a day.
    The next job's claim drops it by node1's own clock and runs, naming the file and its owner."""
    tag = secrets.token_hex(3)
    ghost = f"x-{tag}"
    where = on_host(
        NODE,
        f'd={shlex.quote(inv.job.output_dir)}/.claims/"$(hostname)"; '
        'mkdir -p "$d"/queue && cd -P "$d" && pwd',
    ).stdout.strip()
    place = f"{where}/queue/{ghost}"
    on_host(
        NODE,
        f"printf 'who=bob@vm\\nsince=1\\nticket=%s\\nwants=all\\n' {queue.new_ticket(ghost)} "
        f"> {shlex.quote(place)} && touch -d @$(( $(date +%s) + 100000 )) {shlex.quote(place)}",
    )
    try:
        r = fab(
            inventory_path,
            "train",
            "--script",
            "tests/integration/scripts/report.py",
            "--skip-preflight",
            "--plain",
            "--nproc",
            "1",
            "--include",
            NODE,
            "--name",
            f"ahead-{tag}",
            timeout=240,
            env={**os.environ, "COLUMNS": "1000"},
        )
        out = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 0, out[-3000:]
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1))
        said = f"{NODE}: dropped {place} from the queue, the place of {ghost} (queued by bob@vm at {since}): "
        assert said + "future-dated by " in out, out[-3000:]
        # 100000 s, less the seconds between the touch and the claim.
        assert re.search(rf"future-dated by (999[0-9][0-9]|100000) s on {NODE}'s clock", out), out[-3000:]
        assert on_host(NODE, f"[ -e {shlex.quote(place)} ] || echo gone").stdout.strip() == "gone"
    finally:
        on_host(NODE, f"rm -f {shlex.quote(place)}", check=False)
