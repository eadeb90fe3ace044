"""A program's own checkpoints as users and attackers write them, on the local cluster: names made
to escape runs/JOB (a newline and a fake `STAMP /tmp/...` line, a hidden '..' name, `$(touch x)`)
write nothing outside it; model.pt + optim.pt written each epoch reach a spare that takes a frozen
rank 0's place as one set, both of the same epoch."""

import re
import secrets
import time
from pathlib import Path

from orchestrator.testbed import faults

from .conftest import QUICK_LOSS, Run, fab, on_host, project_containers, with_ssh

HOSTILE = """\
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    os.makedirs("checkpoints", exist_ok=True)
    with open("checkpoints/model.pt", "w") as fh:
        fh.write("good")
    evil = "checkpoints/x\\n00000000000000000000 " + "PWNED"
    os.makedirs(evil, exist_ok=True)
    with open(evil + "/ckpt.pt", "w") as fh:
        fh.write("evil")
    os.makedirs("checkpoints/..up", exist_ok=True)
    with open("checkpoints/..up/ckpt.pt", "w") as fh:
        fh.write("dots")
    with open("checkpoints/$(touch x)", "w") as fh:
        fh.write("shell")
    print("WROTE", flush=True)
time.sleep(4)
dist.barrier()
dist.destroy_process_group()
"""

# rank 0 writes model.pt and then optim.pt each epoch (6 epochs, 2.5 s apart: a set settles between
# two, and rank 0's host freezes after the first while 4 or more are still to come); every rank
# resumes from both when they are there.
EPOCHS = """\
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
start = 0
if os.path.exists("checkpoints/model.pt") or os.path.exists("checkpoints/optim.pt"):
    m, o = torch.load("checkpoints/model.pt"), torch.load("checkpoints/optim.pt")
    print(f"RESUMED rank {rank} model epoch {m['epoch']} optim epoch {o['epoch']}", flush=True)
    start = m["epoch"] + 1
for epoch in range(start, 6):
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    print(f"rank {rank} epoch {epoch}", flush=True)
    if rank == 0:
        os.makedirs("checkpoints", exist_ok=True)
        torch.save({"epoch": epoch, "w": torch.full((1000,), float(epoch))}, "checkpoints/model.pt")
        torch.save({"epoch": epoch, "m": torch.full((2000,), float(epoch))}, "checkpoints/optim.pt")
    time.sleep(2.5)
dist.destroy_process_group()
"""


def project(tmp_path: Path, source: str) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(source)
    return proj


def test_checkpoint_names_made_to_escape_write_nothing_outside_the_run(inventory_path, tmp_path):
    pwned = f"/tmp/pwned-{secrets.token_hex(4)}"
    proj = project(tmp_path, HOSTILE.replace("PWNED", pwned))
    r = fab(
        inventory_path,
        "train",
        "--script",
        "train.py",
        "--checkpoint",
        "checkpoints/*",
        "--nproc",
        "1",
        "--skip-preflight",
        "--plain",
        cwd=proj,
        timeout=240,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "WROTE" in out
    job = re.search(r"job (train-\S+) finished", r.stdout).group(1)
    # The forged name is refused, named (made printable) with the host it came from, once.
    refused = [line for line in out.splitlines() if "node1: ignored checkpoint" in line]
    assert len(refused) == 1 and "00000000000000000000 " + pwned in refused[0], out[-3000:]
    assert "control characters or a newline" in refused[0]
    # Nothing written outside runs/JOB, here or on the host; the good checkpoint was fetched.
    assert not Path(pwned).exists() and not list(Path("/tmp").glob(pwned.rsplit("/", 1)[1] + "*"))
    assert not (proj / "x").exists() and not Path("x").exists()
    kept = list((proj / "runs" / job / "checkpoints").glob("[0-9]*/work/checkpoints"))
    assert len(kept) == 1, list((proj / "runs" / job).rglob("*"))
    assert (kept[0] / "model.pt").read_text() == "good" and (kept[0] / "$(touch x)").read_text() == "shell"
    assert not (kept[0] / "..up").exists()  # hidden: never part of a checkpoint
    for node in ("node1", "node2"):
        on_host(
            node, f"test ! -e {pwned} && test ! -e ~/x && test ! -e /x && test ! -e /opt/fabtrain/output/x"
        )
        assert project_containers(node) == []


def test_a_spare_resumes_from_model_and_optimizer_of_the_same_epoch(spares_inventory_path, tmp_path):
    proj = project(tmp_path, EPOCHS)
    inv = with_ssh(spares_inventory_path, tmp_path / "inventory.yaml", **QUICK_LOSS)
    run = Run(
        inv,
        "train",
        "--script",
        "train.py",
        "--checkpoint",
        "checkpoints/*",
        "--nproc",
        "1",
        "--restarts",
        "1",
        "--skip-preflight",
        "--plain",
        cwd=proj,
    )
    try:
        # Once a set of both files has been copied here, rank 0's host freezes.
        deadline = time.monotonic() + 90
        while not list(proj.glob("runs/train-*/checkpoints/[0-9]*/work/checkpoints/optim.pt")):
            assert time.monotonic() < deadline and run.proc.poll() is None, run.text[-3000:]
            time.sleep(0.2)
        faults.freeze("node1")
        assert run.finish(timeout=240) == 0, run.text[-4000:]
    finally:
        faults.thaw("node1")
        run.proc.kill()
        fab(inv, "stop", "--grace", "0", cwd=proj)
    out = run.text
    assert "spare node3 takes the place of node1 (lost) as node rank 0" in out, out[-3000:]
    resumed = re.findall(r"(node\d) r(\d) \| RESUMED rank \d model epoch (\d+) optim epoch (\d+)", out)
    assert {(n, r) for n, r, _, _ in resumed} == {("node3", "0"), ("node2", "1")}, out[-3000:]
    # Both files of one epoch, the same on every node: the set was placed whole.
    assert len({(m, o) for _, _, m, o in resumed}) == 1 and all(m == o for _, _, m, o in resumed), resumed
    assert "rank 0 epoch 5" in out
    assert all(project_containers(n) == [] for n in ("node1", "node2", "node3"))
