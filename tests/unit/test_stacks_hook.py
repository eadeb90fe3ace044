"""The hang watchdog's look at a rank, for real on this machine: the entrypoint's sitecustomize hook
in a Python process and the look's own script (dockerargs.STACKS_PY). A program's own SIGUSR1
handler (PyTorch Lightning's requeue, Slurm's --signal) is never called by a look, and the look
still gets the main thread's stack."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.hostcmds import dockerargs

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("fabtrain_hook", ROOT / "docker" / "fabtrain_hook.py")
hook_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook_module)

PROGRAM = """\
import os, signal, sys, time
def requeue(signum, frame):
    open(sys.argv[1], "w").close()
signal.signal(signal.SIGUSR1, requeue)
print("ready", flush=True)
def tokenizing():
    while True:
        time.sleep(0.01)
tokenizing()
"""


def test_a_look_dumps_the_stacks_and_never_calls_the_programs_own_sigusr1_handler(tmp_path):
    stacks, requeued = tmp_path / "stacks", tmp_path / "requeued"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_module.SITECUSTOMIZE)
    (tmp_path / "program.py").write_text(PROGRAM)
    env = {
        **os.environ,
        "PYTHONPATH": str(hook),
        "RANK": "3",
        "LOCAL_RANK": "1",
        "FABTRAIN_STACKS": str(stacks),
    }
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "program.py"), str(requeued)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        look = dockerargs.STACKS_PY.replace("/tmp/fabtrain-stacks", str(stacks))
        shown = subprocess.run(
            [sys.executable, "-c", look], capture_output=True, text=True, timeout=30
        ).stdout
        assert f"--- rank 3 (local rank 1, pid {proc.pid})" in shown
        assert "in tokenizing" in shown, shown  # the main thread's frame
        assert proc.poll() is None and not requeued.exists()  # the program's handler was not called
        proc.send_signal(signal.SIGUSR1)  # and it is still the program's
        deadline = time.monotonic() + 10
        while not requeued.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()


LINES = """\
import os, sys, time
while not os.path.exists(sys.argv[2]):  # both ranks print at the same time
    time.sleep(0.001)
for i in range(20000):
    print(f"rank {sys.argv[1]} line {i:05d} " + "x" * 60, flush=True)
"""


def test_unbuffered_ranks_sharing_a_console_write_whole_lines(tmp_path):
    """Two ranks run with python -u (as under PYTHONUNBUFFERED), both appending to one console: with
    the hook every line arrives whole (print() alone writes the text and the newline apart)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_module.SITECUSTOMIZE)
    (tmp_path / "lines.py").write_text(LINES)
    console = tmp_path / "console.log"
    with open(console, "ab") as out:
        procs = [
            subprocess.Popen(
                [sys.executable, "-u", str(tmp_path / "lines.py"), str(rank), str(tmp_path / "go")],
                env={**os.environ, "PYTHONPATH": str(hook)},
                stdout=out,
            )
            for rank in (0, 1)
        ]
        time.sleep(0.5)
        (tmp_path / "go").touch()
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = console.read_text().splitlines()
    expected = {f"rank {r} line {i:05d} " + "x" * 60 for r in (0, 1) for i in range(20000)}
    assert len(lines) == 40000 and set(lines) == expected
