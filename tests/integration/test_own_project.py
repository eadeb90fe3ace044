"""A user's own project run as it is, from its own directory, with the `fabtrain` command: a
hydra + DDP program with a relative checkpoint (tests/integration/projects/hydra_ddp), its relative
outputs fetched, a killed container resumed from the program's own checkpoint on every node,
`--continue` of a finished named job, and two projects one after the other on the same hosts, each
with its own code."""

import json
import re
import secrets
import shutil
import time
from pathlib import Path

from orchestrator.core import jobspec

from .conftest import Run, fab, on_host, project_containers

PROJECT = Path(__file__).parent / "projects" / "hydra_ddp"


def resumed_epochs(text: str) -> dict[int, int]:
    return {int(r): int(e) for r, e in re.findall(r"RESUMED rank (\d+) epoch (\d+)", text)}


def test_a_hydra_program_runs_unmodified_resumes_from_its_own_checkpoint_and_continues(
    inventory_path, tmp_path
):
    proj = tmp_path / "my-gpt"
    shutil.copytree(PROJECT, proj)
    before = sorted(p.relative_to(proj).as_posix() for p in proj.rglob("*"))
    name = "hydra-" + secrets.token_hex(2)
    common = (
        "--script",
        "main.py",
        "--checkpoint",
        "checkpoints/ckpt.pt",
        "--name",
        name,
        "--nproc",
        "2",
        "--skip-preflight",
        "--plain",
    )
    run = Run(inventory_path, "train", *common, "--restarts", "1", "--args", "epochs=10", cwd=proj)
    # Once the program's checkpoint has been copied here, a node's container is killed mid-run.
    deadline = time.monotonic() + 150
    while not list(proj.glob(f"runs/{name}-*/checkpoints/*/{jobspec.WORK}/checkpoints/ckpt.pt")):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.text[-3000:]
        time.sleep(0.2)
    job = list(proj.glob(f"runs/{name}-*"))[0].name
    on_host("node2", f"docker kill $(docker ps -q --filter label=fabtrain.job={job})")
    assert run.finish(timeout=240) == 0, run.text[-4000:]
    out = run.text
    assert "attempt 2" in out and "exited with code 137" in out
    # Every rank of attempt 2 resumed from the same epoch: the newest checkpoint was on every node.
    resumed = resumed_epochs(out)
    assert sorted(resumed) == [0, 1, 2, 3] and len(set(resumed.values())) == 1, out[-3000:]
    assert "rank 0 step 9 sum 36" in out  # all four ranks reached the last epoch together
    run_dir = proj / "runs" / job
    # Relative outputs (hydra's folder, the program's own files) are fetched; the code's links are not.
    work = run_dir / "outputs" / "node1" / "work"
    assert (work / "outputs" / "done.txt").read_text() == "10\n"
    assert list(work.glob("outputs/*/*/.hydra/config.yaml")), sorted(p.as_posix() for p in work.rglob("*"))
    assert (work / "checkpoints" / "ckpt.pt").is_file() and not (work / "main.py").exists()
    # Kept as a whole set, in a folder named by its time.
    assert list(run_dir.glob("checkpoints/*/work/checkpoints/ckpt.pt"))
    # The project folder holds only what it held, plus runs/.
    assert (
        sorted(p.relative_to(proj).as_posix() for p in proj.rglob("*") if p.parts[len(proj.parts)] != "runs")
        == before
    )
    # The same command with --continue (two more epochs) goes on from the last checkpoint.
    r = fab(inventory_path, "train", *common, "--continue", "--args", "epochs=12", cwd=proj, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"continuing job {job}" in r.stdout and "now args 'epochs=12'" in r.stdout
    assert "resuming from checkpoints/ckpt.pt (written " in r.stdout
    assert set(resumed_epochs(r.stdout).values()) == {9} and "rank 0 step 11 sum 44" in r.stdout
    assert "step 0 " not in r.stdout
    rec = json.loads((run_dir / "job.json").read_text())
    assert rec["state"] == "finished" and rec["resumes"][-1]["changed"] == {"args": ["epochs=12"]}
    assert project_containers("node1") == [] and project_containers("node2") == []


ECHO = """\
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
print("PROJECT", open("which.txt").read().strip(), "rank", dist.get_rank(), flush=True)
dist.destroy_process_group()
"""


def test_two_projects_one_after_the_other_each_run_their_own_code(inventory_path, tmp_path):
    """Run with the `fabtrain` command from each project's own folder, as a user would."""
    keys = {}
    for which in ("alpha", "beta"):
        proj = tmp_path / which
        proj.mkdir()
        (proj / "train.py").write_text(ECHO)
        (proj / "which.txt").write_text(which + "\n")
        if which == "alpha":
            r = fab(inventory_path, "preflight", "--no-smoke", cwd=proj, timeout=240)
            assert r.returncode == 0 and "ssh" in r.stdout, (r.stdout + r.stderr)[-3000:]
        r = fab(
            inventory_path,
            "train",
            "--script",
            "train.py",
            "--nproc",
            "1",
            "--skip-preflight",
            "--plain",
            cwd=proj,
            timeout=240,
        )
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        assert (
            f"PROJECT {which} rank 1" in r.stdout
            and f"PROJECT {'beta' if which == 'alpha' else 'alpha'}" not in r.stdout
        )
        job = re.search(r"job (train-\S+) finished", r.stdout).group(1)
        keys[which] = json.loads((proj / "runs" / job / "job.json").read_text())["spec"]["code_key"]
    # Each tree keeps its own directory on the hosts: the second sync changed nothing of the first.
    assert keys["alpha"] != keys["beta"]
    for which, key in keys.items():
        assert on_host("node2", f"cat /opt/fabtrain/code/{key}/which.txt").stdout.strip() == which
