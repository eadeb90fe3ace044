"""What a job's containers print is hostile input (docs/security.md): ranks that attack the
terminal (escape sequences, OSC-52, rich markup in rank names and log lines), a rank printing
256 MB with no newline, and a second command that tries to continue a job that runs."""

import re
import time
from pathlib import Path

from .conftest import ROOT, Run, fab

SCRIPT = "tests/integration/scripts/hostile_output.py"


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def job_of(text: str, name: str) -> str:
    m = re.search(rf"\b({name}-[\w.-]+?)[ /:;]", text)
    return m.group(1) if m else sorted(p.name for p in (ROOT / "runs").glob(f"{name}-*"))[-1]


def test_a_line_with_no_end_costs_bounded_memory_a_running_job_is_never_continued_and_stop_ends_it(
    inventory_path,
):
    run = Run(
        inventory_path,
        "train",
        "--script",
        SCRIPT,
        "--name",
        "bigline",
        "--nproc",
        "1",
        "--skip-preflight",
        "--plain",
        "--args",
        "--big-mb 256 --wait 300",
    )
    try:
        run.wait_for("log line 1", timeout=180)
        idle = rss_kib(run.proc.pid, "VmRSS")
        run.wait_for("BIG DONE rank 0", timeout=180)
        peak = rss_kib(run.proc.pid, "VmHWM")
        job_id = job_of(run.text, "bigline")
        print(
            f"fab RSS while idle {idle / 1024:.0f} MB, peak after 256 MB without a newline "
            f"{peak / 1024:.0f} MB"
        )
        assert peak - idle < 200 * 1024, f"fab grew by {(peak - idle) / 1024:.0f} MB for one 256 MB line"

        # The job runs: continuing it by name, or resuming it by id, is refused and harms nothing.
        for how in (("--name", "bigline", "--continue"), ("--resume", job_id)):
            r = fab(
                inventory_path,
                "train",
                "--script",
                SCRIPT,
                *how,
                "--nproc",
                "1",
                "--skip-preflight",
                "--plain",
                timeout=120,
            )
            assert r.returncode == 2, (r.stdout + r.stderr)[-2000:]
            assert f"{job_id}: that job is still running on node1, node2" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
        assert run.proc.poll() is None, "the running job was hurt:\n" + run.text[-2000:]

        start = time.monotonic()
        r = fab(inventory_path, "stop", "--job", job_id, "--grace", "2", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert run.finish(timeout=60) == 1, run.text[-3000:]
        print(f"fab stop and the job's end: {time.monotonic() - start:.1f}s")
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    out = run.text
    # (torchrun's own traceback, in node1's last lines, is the node's; none is fab's)
    assert "was ended by 'fab stop'" in out and "orchestrator/" not in out and "fabfile.py" not in out, out[
        -2000:
    ]
    # The 256 MB line was cut at 64 KiB, in the terminal and in the host's log file.
    assert "...[cut]" in out
    log = ROOT / "runs" / job_id / "node1.log"
    assert log.stat().st_size < 1 << 20, log.stat().st_size


def test_escape_sequences_and_markup_from_ranks_reach_no_terminal(inventory_path):
    r = fab(
        inventory_path,
        "train",
        "--script",
        SCRIPT,
        "--name",
        "evil",
        "--nproc",
        "1",
        "--skip-preflight",
        "--plain",
        "--args",
        "--big-mb 0 --wait 0",
        timeout=240,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # Nothing a terminal obeys came through, piped as here: no ESC, no C1, no BEL.
    for bad in ("\x1b", "\x07", "\u009b"):
        assert bad not in out, f"{bad!r} reached the output"
    assert "Traceback" not in out and "MarkupError" not in out
    # The markup was printed as text, in the end-of-run table and the straggler line.
    assert "straggler: ]52;c;cGF5bG9hZA==[2J31m[/red][link=file:///etc/passwd]x[/link]node1 rank1" in out, (
        out[-3000:]
    )
    assert "log line 5 ]52;c;cGF5bG9hZA==[2J31m[/red][link=file:///etc/passwd]x[/link]" in out
