"""What a job's containers print is hostile input (README: Security): one job whose ranks attack
the terminal (escape sequences, OSC-52, rich markup in rank names and log lines) and print 256 MB
with no newline, while a second command tries to continue it."""
import re
import time
from pathlib import Path

from .conftest import ROOT, Run, fab, on_host

SCRIPT = "tests/integration/scripts/hostile_output.py"


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_hostile_output_is_inert_bounded_and_a_running_job_is_never_continued(inventory_path, inv):
    run = Run(inventory_path, "train", "--script", SCRIPT, "--name", "hostile", "--nproc", "1",
              "--skip-preflight", "--plain", "--args", "--big-mb 256 --wait 120")
    try:
        run.wait_for("log line 1", timeout=180)
        idle = rss_kib(run.proc.pid, "VmRSS")
        run.wait_for("BIG DONE rank 0", timeout=180)
        peak = rss_kib(run.proc.pid, "VmHWM")
        job = re.search(r"runs/(hostile-[\w.-]+)", run.text) or re.search(r"job (hostile-\S+)", run.text)
        job_id = job.group(1) if job else sorted(p.name for p in (ROOT / "runs").glob("hostile-*"))[-1]
        print(f"fab RSS while idle {idle / 1024:.0f} MB, peak after 256 MB without a newline {peak / 1024:.0f} MB")
        assert peak - idle < 200 * 1024, f"fab grew by {(peak - idle) / 1024:.0f} MB for one 256 MB line"

        # The job runs: continuing it by name, or resuming it by id, is refused and harms nothing.
        for how in (("--name", "hostile", "--continue"), ("--resume", job_id)):
            r = fab(inventory_path, "train", "--script", SCRIPT, *how, "--nproc", "1", "--skip-preflight",
                    "--plain", timeout=120)
            assert r.returncode == 2, (r.stdout + r.stderr)[-2000:]
            assert f"{job_id}: that job is still running on node1, node2" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
        assert run.proc.poll() is None, "the running job was hurt:\n" + run.text[-2000:]

        on_host("node1", f"touch {inv.job.output_dir}/{job_id}/release")
        on_host("node2", f"touch {inv.job.output_dir}/{job_id}/release")
        assert run.finish(timeout=180) == 0, run.text[-3000:]
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    out = run.text
    assert "released rank 0: True" in out and "released rank 1: True" in out
    # Nothing a terminal obeys came through, piped as here: no ESC, no C1, no BEL.
    for bad in ("\x1b", "\x07", "\u009b"):
        assert bad not in out, f"{bad!r} reached the output"
    assert "Traceback" not in out and "MarkupError" not in out
    # The markup was printed as text, in the end-of-run table and the straggler line.
    assert "straggler: ]52;c;cGF5bG9hZA==[2J31m[/red][link=file:///etc/passwd]x[/link]node1 rank1" in out, out[-3000:]
    # The 256 MB line was cut at 64 KiB, in the terminal and in the host's log file.
    assert "...[cut]" in out
    log = ROOT / "runs" / job_id / "node1.log"
    assert log.stat().st_size < 1 << 20, log.stat().st_size
