"""Time from a host is hostile input (docs/security.md): node2's `docker run` comes back only
after its deadline (a `docker` earlier in root's PATH sleeps first, then runs the real one). The job
fails naming node2 and the deadline, and once even the slow `docker run` would have finished, no
container of the job is on node2: the host ended it (GNU timeout), and the teardown and the finish
swept by the job's label."""

import re
import time

from .conftest import ROOT, Run, on_host

START_TIMEOUT = 20  # fab gives up on a start after this; the host ends docker run after 10 s
SLEEP = 27.5  # the slow docker's sleep, longer than START_TIMEOUT (and a name to look for)
WRAPPER = "/usr/local/bin/docker"  # before /usr/bin in the PATH sshd gives a command
MARK = "/tmp/fabtrain-late-docker"  # .started: when the slow docker began; .ran: it got to the real one

SLOW_DOCKER = f"""#!/bin/sh
if [ "$1" = run ]; then date +%s > {MARK}.started; sleep {SLEEP}; : > {MARK}.ran; fi
exec /usr/bin/docker "$@"
"""


def job_containers(node: str, job_id: str) -> list[str]:
    return on_host(node, f"/usr/bin/docker ps -aq --filter label=fabtrain.job={job_id}").stdout.split()


def sleeping(node: str) -> int:
    """How many processes on the host run the slow docker's sleep."""
    script = f"cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c '[s]leep {SLEEP}' || true"
    return int(on_host(node, script).stdout.strip() or 0)


def test_a_docker_run_past_its_deadline_leaves_no_container_on_its_host(inventory_path, inv):
    on_host(
        "node2",
        f"rm -f {MARK}.started {MARK}.ran; cat > {WRAPPER} <<'EOF'\n{SLOW_DOCKER}EOF\nchmod 755 {WRAPPER}",
    )
    job_id = None
    try:
        run = Run(
            inventory_path,
            "train",
            "--model",
            "tiny",
            "--epochs",
            "1",
            "--nproc",
            "1",
            "--name",
            "late",
            "--skip-preflight",
            "--plain",
            env={"FABTRAIN_START_TIMEOUT": str(START_TIMEOUT)},
        )
        code = run.finish(timeout=180)
        out = run.text
        found = re.search(r"runs/(late-[\w.-]+)", out) or re.search(r"job (late-[\w.-]+)", out)
        job_id = found.group(1) if found else sorted(p.name for p in (ROOT / "runs").glob("late-*"))[-1]
        ended = time.time()
        assert code == 1, out[-3000:]
        # Named: the host, and the deadline the host ended docker run at (before fab's own 20 s).
        assert re.search(r"node2\b.*not done within 10s: ended on the host", out), out[-3000:]
        assert "Traceback" not in out
        print(next(line for line in out.splitlines() if "not done within" in line))
        started = float(on_host("node2", f"cat {MARK}.started").stdout)
        print(f"fab exited {ended - started:.1f}s after node2's docker run began")
        assert ended - started < START_TIMEOUT + 15, "the job did not end soon after the start deadline"
        # The slow docker was ended on the host at once: its sleep is gone well before it would end.
        assert sleeping("node2") == 0
        # Wait until the slow docker would have run the real one, and a little more.
        time.sleep(max(0.0, started + SLEEP + 3 - time.time()))
        assert on_host("node2", f"test -e {MARK}.ran", check=False).returncode != 0, (
            "the late docker run went on"
        )
        assert job_containers("node2", job_id) == [] and job_containers("node1", job_id) == []
        # node2 was not skipped as lost: its claim and runtime files are gone too.
        left = on_host("node2", f"ls -d {inv.job.output_dir}/.runtime/{job_id} 2>/dev/null || true").stdout
        assert left.strip() == ""
    finally:
        # A slow docker still sleeping (the test failed early) runs the real one when it wakes:
        # wait for that before removing what it made.
        began = on_host("node2", f"rm -f {WRAPPER}; cat {MARK}.started 2>/dev/null || true").stdout.strip()
        if began and job_id:
            time.sleep(max(0.0, float(began) + SLEEP + 3 - time.time()))
        on_host("node2", f"rm -f {MARK}.started {MARK}.ran")
        if job_id:
            for node in ("node1", "node2"):
                on_host(
                    node,
                    f"/usr/bin/docker ps -aq --filter label=fabtrain.job={job_id} | "
                    f"xargs -r /usr/bin/docker rm -f; rm -rf {inv.job.output_dir}/{job_id}",
                    check=False,
                )
