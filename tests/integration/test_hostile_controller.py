"""A detached job's controller on the local cluster's real sshd and Docker engines, as an attacker
meets it: its key copied off its host works from nowhere else, not past the job, not past its expiry
when its controller dies, and renewed while the job lives; a user's authorized_keys without a final
newline keeps the user's key; a record edited on the controller's host runs nothing here."""

import json
import os
import re
import shlex
import time

from orchestrator.config.inventory import load

from .conftest import ROOT, fab, on_host, project_containers
from .test_controller import REPORT

KEYS = "/root/.ssh/authorized_keys"
CONTROLLERS = "/opt/fabtrain/output/.controllers"
MOUNTS = "{{range .Mounts}}{{.Source}} {{end}}"  # docker inspect's format: a container's mount sources


def detach(inventory_path, sleep: float, *more, env=None) -> tuple[str, str]:
    """(job, the controller's host) of a detached run of the report script, sleeping `sleep` s."""
    r = fab(
        inventory_path,
        "train",
        "--script",
        REPORT,
        "--skip-preflight",
        "--args",
        f"--sleep {sleep}",
        *more,
        "--detach",
        env={**os.environ, **(env or {})},
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    m = re.search(r"job (\S+) detached: its controller runs on (\S+) \(", r.stdout)
    assert m, r.stdout
    return m.group(1), m.group(2)


def ssh_argv(key: str) -> list[str]:
    """ssh with `key` alone, any host key taken (a test host's), no chatter but errors."""
    return [
        "ssh",
        "-i",
        key,
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "LogLevel=ERROR",
        "-l",
        "root",
    ]


def ssh_with(node: str, key: str, address: str, command: str = "true") -> tuple[int, str]:
    """`command` run with the key file `key` (on `node`) from `node` to `address`: (status, output)."""
    r = on_host(node, shlex.join([*ssh_argv(key), address, command]) + " 2>&1", check=False)
    return r.returncode, r.stdout


def copy_key(job: str, controller: str, to: str) -> str:
    """The controller's private key, copied off its host (as root there can) to /tmp on `to`."""
    key = on_host(controller, f"cat {CONTROLLERS}/{job}/key").stdout
    assert key.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    path = f"/tmp/ctlkey-{job}"
    on_host(to, f"umask 077; printf '%s' {shlex.quote(key)} > {path}")
    return path


def lines_of(job: str, node: str) -> list[str]:
    return [line for line in on_host(node, f"cat {KEYS}").stdout.splitlines() if line.endswith(f":{job}")]


def wait_for_end(inventory_path, job: str) -> None:
    logs = fab(inventory_path, "logs", "--job", job, "--plain", timeout=400)
    assert logs.returncode == 0 and f"job {job} finished" in logs.stdout, (logs.stdout + logs.stderr)[-3000:]


def test_the_controllers_key_works_only_from_its_host_and_only_while_the_job_lives(spares_inventory_path):
    addresses = {h.name: h.ssh.hostname for h in load(spares_inventory_path).all_hosts}
    # 12 s of life, renewed every 4 s: the key must outlive its first expiry while the job runs
    # (it sleeps 30 s, from after the key was written).
    env = {"FABTRAIN_CONTROLLER_KEY_LIFETIME": "12", "FABTRAIN_CONTROLLER_KEY_RENEW": "4"}
    job, ctl = detach(spares_inventory_path, 30, env=env)
    written = time.monotonic()  # at the latest: fab train --detach returns after writing it
    other, target = [n for n in ("node1", "node2", "node3") if n != ctl][:2]
    keys_here = {}
    try:
        line = lines_of(job, target)
        assert len(line) == 1 and re.fullmatch(
            rf'restrict,from="[0-9a-f.:,/]*{re.escape(addresses[ctl])}[0-9a-f.:,/]*",expiry-time="\d{{14}}" '
            rf"ssh-ed25519 \S+ fabtrain-controller:{re.escape(job)}",
            line[0],
        ), line
        for node in (ctl, other):
            keys_here[node] = copy_key(job, ctl, node)
        # Its directory is the SSH user's alone.
        modes = on_host(ctl, f"stat -c '%a %U' {CONTROLLERS}/{job} {CONTROLLERS}/{job}/key").stdout
        assert modes.splitlines() == ["700 root", "600 root"], modes
        # From its own host: a command, no terminal, no forwarding.
        assert ssh_with(ctl, keys_here[ctl], addresses[target], "echo reached") == (0, "reached\n")
        code, out = ssh_with(ctl, keys_here[ctl], addresses[target], "tty")
        assert "not a tty" in out, out
        # (sshd's reason comes at ssh's INFO level.)
        forwarding = [a.replace("LogLevel=ERROR", "LogLevel=INFO") for a in ssh_argv(keys_here[ctl])]
        forwarded = on_host(
            ctl,
            shlex.join([*forwarding, "-W", "127.0.0.1:22", addresses[target]]) + " </dev/null 2>&1",
            check=False,
        )
        assert forwarded.returncode != 0, forwarded.stdout
        assert "administratively prohibited" in forwarded.stdout, forwarded.stdout
        # From any other host, the same key is refused: to the third host and to the controller's own.
        for to in (target, ctl):
            code, out = ssh_with(other, keys_here[other], addresses[to])
            assert code != 0 and "Permission denied" in out, (to, out)
        # Past its first expiry (12 s after it was written), renewed: still good from its host.
        time.sleep(max(0.0, written + 12 + 2 - time.monotonic()))
        assert ssh_with(ctl, keys_here[ctl], addresses[target]) == (0, "")
        # The job runs (it sleeps 30 s): none of its containers mounts the controller's directory.
        for node in ("node1", "node2"):
            running = project_containers(node)
            assert len(running) == 1, running
            mounts = on_host(node, f"docker inspect -f '{MOUNTS}' {running[0]}").stdout
            assert mounts.split() and ".controllers" not in mounts, mounts
        wait_for_end(spares_inventory_path, job)
        # The job ended: its key is refused everywhere, and no line of it is left on any host.
        for to in (target, other):
            code, out = ssh_with(ctl, keys_here[ctl], addresses[to])
            assert code != 0 and "Permission denied" in out, (to, out)
        for node in ("node1", "node2", "node3"):
            assert lines_of(job, node) == []
    finally:
        fab(spares_inventory_path, "stop", "--job", job, "--grace", "0")
        for node, path in keys_here.items():
            on_host(node, f"rm -f {path}", check=False)


def test_a_dead_controllers_key_expires_by_itself(inventory_path):
    addresses = {h.name: h.ssh.hostname for h in load(inventory_path).all_hosts}
    # 10 s of life (renewed every 3 s): the key is refused within 10 s of the controllers' death.
    env = {"FABTRAIN_CONTROLLER_KEY_LIFETIME": "10", "FABTRAIN_CONTROLLER_KEY_RENEW": "3"}
    job, ctl = detach(inventory_path, 300, env=env)
    target = next(n for n in ("node1", "node2") if n != ctl)
    key = None
    stopped = None
    try:
        key = copy_key(job, ctl, ctl)
        assert ssh_with(ctl, key, addresses[target]) == (0, "")
        # Both controllers killed, the standby first (else it takes the job over and renews the key):
        # nothing takes the key back, its line stays, and expires.
        on_host(target, f"docker kill fabtrain-ctl-{job}")
        on_host(ctl, f"docker kill fabtrain-ctl-{job}")
        killed = time.monotonic()
        while ssh_with(ctl, key, addresses[target])[0] == 0:
            assert time.monotonic() - killed < 20 + 15, "the key still works well past its expiry"
            time.sleep(0.5)
        assert len(lines_of(job, target)) == 1  # refused by its expiry, not removed
        stopped = fab(inventory_path, "stop", "--job", job, "--grace", "0")
        assert stopped.returncode == 0, (stopped.stdout + stopped.stderr)[-2000:]
        for node in ("node1", "node2"):
            assert lines_of(job, node) == [] and project_containers(node) == []
    finally:
        if stopped is None or stopped.returncode != 0:  # the body's own stop did not end it
            fab(inventory_path, "stop", "--job", job, "--grace", "0")
        if key:
            on_host(ctl, f"rm -f {key}", check=False)


def test_a_users_key_without_a_final_newline_survives_a_detached_job(inventory_path):
    before = {n: on_host(n, f"cat {KEYS}").stdout for n in ("node1", "node2")}
    try:
        for node in before:  # the user's last line with no newline after it
            on_host(node, f'k="$(cat {KEYS})" && printf %s "$k" > {KEYS}')
            assert not on_host(node, f"cat {KEYS}").stdout.endswith("\n")
        job, _ = detach(inventory_path, 1)
        try:
            wait_for_end(inventory_path, job)
        finally:
            fab(inventory_path, "stop", "--job", job, "--grace", "0")
        for node, text in before.items():  # every line as it was, the missing newline added once
            assert on_host(node, f"cat {KEYS}").stdout == text.rstrip("\n") + "\n"
        status = fab(inventory_path, "status")
        assert status.returncode == 0 and "hosts: 2 answering" in status.stdout, status.stdout + status.stderr
    finally:
        for node, text in before.items():
            on_host(node, f"printf %s {shlex.quote(text)} > {KEYS}")


def test_a_record_edited_on_the_controllers_host_runs_nothing_here(inventory_path, tmp_path):
    ours, pwned = tmp_path / "ours", tmp_path / "pwned"
    hook = f"touch {ours}"  # sent from where the job's control runs: the controller's host, then here
    job, ctl = detach(inventory_path, 1, "--notify", hook)
    try:
        done = f"{CONTROLLERS}/{job}/done.json"
        deadline = time.monotonic() + 300
        while on_host(ctl, f"test -f {done}", check=False).returncode != 0:
            assert time.monotonic() < deadline, f"job {job}'s controller never ended"
            time.sleep(1)
        # After the end, before any fab fetched it: the controller's copy of the record edited there.
        path = f"{CONTROLLERS}/{job}/runs/{job}/job.json"
        doc = json.loads(on_host(ctl, f"cat {path}").stdout)
        assert doc["notify"] == {"command": hook}
        doc["notify"] = {"command": f"touch {pwned}"}
        doc["inventory"] = "/nonexistent/evil.yaml"
        on_host(ctl, f"printf '%s' {shlex.quote(json.dumps(doc))} > {path}")
        status = fab(inventory_path, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"{job}: ended (finished" in status.stdout, status.stdout
        assert not pwned.exists()
        attach = fab(inventory_path, "attach", job)
        assert attach.returncode == 2 and "nothing to take over" in attach.stderr, attach.stderr[-2000:]
        assert not pwned.exists()
        resumed = fab(
            inventory_path, "train", "--resume", job, "--args", "--sleep 1", "--skip-preflight", "--plain"
        )
        assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
        assert not pwned.exists() and ours.exists()  # this machine's own hook, from its own record
        record = json.loads((ROOT / "runs" / job / "job.json").read_text())
        assert record["notify"] == {"command": hook} and record["inventory"] == str(inventory_path)
    finally:
        fab(inventory_path, "stop", "--job", job, "--grace", "0")
