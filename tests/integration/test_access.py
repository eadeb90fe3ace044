"""fab shell and fab forward against the real cluster, in one small job on two hosts: a command in
rank 1's container (its hostname, as docker exec on that host reports it), an exit status and stdin
passed through, words after '--' kept as typed, a python http.server in rank 0's container reached
through fab forward, and the errors for a taken local port, a bad rank, host or job."""

import signal
import subprocess
import time
import urllib.request

from .conftest import FAB, ROOT, Run, fab, free_port, on_host
from .test_sharing import wait_for_job

REPORT = "tests/integration/scripts/report.py"


def shell(inventory_path, job, *args, input=None, timeout=60):
    """`fab shell JOB ARGS...` as typed (the inventory before '--', the command after it)."""
    argv = [FAB, "-r", str(ROOT), "shell", job, "--inventory", str(inventory_path), *args]
    return subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )


def fetch(url: str, timeout: float = 30) -> str:
    """The page at `url`, asked again until it answers (the server in the container may not be up)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_shell_and_forward_into_a_running_job(inventory_path):
    name = f"access-{int(time.time())}"
    job_run = Run(
        inventory_path,
        "train",
        "--script",
        REPORT,
        "--args",
        "--sleep 300",
        "--skip-preflight",
        "--plain",
        "--name",
        name,
    )
    try:
        job = wait_for_job(name, ["node1", "node2"])

        # A command in rank 1's container: the hostname docker exec on node2 reports for it.
        r = shell(inventory_path, job, "--rank", "1", "--", "hostname")
        expected = on_host("node2", f"docker exec fabtrain-{job}-r1 hostname").stdout.strip()
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == expected
        assert expected != on_host("node1", f"docker exec fabtrain-{job}-r0 hostname").stdout.strip()

        # The words after '--' arrive as typed; the command's exit status is fab's.
        r = shell(inventory_path, job, "--", "sh", "-c", 'echo "a  $1"; echo oops >&2; exit 7', "sh", "b  c")
        assert (r.returncode, r.stdout, r.stderr) == (7, "a  b  c\n", "oops\n")
        # stdin reaches the command (the same path a shell without a terminal takes).
        r = shell(inventory_path, job, "--host", "node2", "--", "sh", "-c", "cat; echo rank1", input="hi\n")
        assert (r.returncode, r.stdout) == (0, "hi\nrank1\n")

        # A web server in rank 0's container, reached from here through fab forward.
        port, local = free_port() % 20000 + 20000, free_port()
        serve = (
            f"mkdir -p /tmp/www && echo hello from rank 0 > /tmp/www/index.html && cd /tmp/www && "
            f"nohup python3 -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 &"
        )
        assert shell(inventory_path, job, "--", "sh", "-c", serve).returncode == 0
        tunnel = Run(inventory_path, "forward", job, str(port), "--local", str(local))
        try:
            tunnel.wait_for(f"forwarding http://127.0.0.1:{local} -> node1:{port} (rank 0 of {job})", 60)
            assert fetch(f"http://127.0.0.1:{local}/") == "hello from rank 0\n"
            # A taken local port (this forward's own) is refused at once, before any SSH.
            r = fab(inventory_path, "forward", job, str(port), "--local", str(local), timeout=60)
            assert r.returncode == 2
            assert r.stderr == (
                f"error: LOCAL port {local} on 127.0.0.1 is already in use on this machine; "
                "give another local port (fab forward JOB PORT --local LOCAL)\n"
            )
            tunnel.proc.send_signal(signal.SIGINT)  # Ctrl+C
            assert tunnel.finish(30) == 0, tunnel.text
        finally:
            tunnel.proc.kill()

        # Clear errors, no traceback: a rank, a host and a job that are not there.
        r = shell(inventory_path, job, "--rank", "5", "--", "true")
        assert r.returncode == 2
        assert r.stderr == (
            f"error: job {job} has no running node of rank 5: it runs on node1 (rank 0), node2 (rank 1)\n"
        )
        r = shell(inventory_path, job, "--host", "node9", "--", "true")
        assert r.returncode == 2 and r.stderr.startswith("error: --host 'node9': no such host in ")
        r = shell(inventory_path, "nosuch-20260101-000000-0000", "--", "true")
        assert r.returncode == 2
        assert r.stderr.startswith("error: job nosuch-20260101-000000-0000 is not running on the hosts of ")
    finally:
        fab(inventory_path, "stop", "--job", job_run_id(name) or name, "--grace", "0", timeout=120)
        job_run.finish(120)


def job_run_id(name: str) -> str | None:
    runs = sorted((ROOT / "runs").glob(f"{name}-*"))
    return runs[-1].name if runs else None
