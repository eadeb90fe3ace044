"""A training script attacks its host through its output directory (docs/security.md): it swaps
/output/work (the host directory mounted at /workspace) for a link to the host's /root, and its
console and heartbeat files for links to a root-only file on the host. A resumed job (a cold
start, as --resume, a restart with warm_restarts: false or a spare make) must find no host file
written, and that file's content must appear nowhere here."""

import secrets

from .conftest import ROOT, fab, on_host

SCRIPT = "tests/integration/scripts/plant_links.py"


def test_links_planted_in_the_output_directory_reach_no_host_file(inventory_path):
    tag = secrets.token_hex(6)
    secret_text = f"host-secret-{tag}"
    secret, marker = f"/root/secret-{tag}", f"escaped-{tag}"
    for node in ("node1", "node2"):
        on_host(node, f"umask 077; printf '%s\\n' {secret_text} > {secret}")
    name = f"links{tag[:4]}"
    args = (
        "--script",
        SCRIPT,
        "--nproc",
        "1",
        "--skip-preflight",
        "--plain",
        "--args",
        f"--secret {secret} --marker {marker}",
    )
    try:
        first = fab(inventory_path, "train", "--name", name, *args, timeout=300)
        out1 = first.stdout + first.stderr
        assert first.returncode == 0, out1[-3000:]
        # The work directory is a mount point in every container of the job: it cannot be swapped.
        assert "node 0: work link refused (Device or resource busy)" in out1, out1[-3000:]
        assert "node 0: /output/.console/node-0.log is a link now" in out1
        assert "node 0: done" in out1 and "node 1: done" in out1, "output after the swap was lost"
        assert "refused: " in out1 and "/.console/node-0.log is not a regular file (a link?)" in out1
        job = next(p.name for p in (ROOT / "runs").glob(f"{name}-*") if (p / "job.json").exists())

        # A cold start of the same job on the same hosts: the attacker's second chance.
        again = fab(inventory_path, "train", "--resume", job, *args[2:], timeout=300)
        out2 = again.stdout + again.stderr
        assert again.returncode == 0, out2[-3000:]
        assert "node 0: marker there: True" in out2, "the resumed job lost its working directory"
        for node in ("node1", "node2"):
            r = on_host(node, f"ls /root; cat {secret}")
            assert marker not in r.stdout, f"{node}: the job wrote into the host's /root: {r.stdout}"
            assert secret_text in r.stdout  # still there, untouched
        # Nothing of the host's file came here: not on the terminal, not in runs/JOB.
        assert secret_text not in out1 + out2
        for path in (ROOT / "runs" / job).rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert secret_text.encode() not in path.read_bytes(), path
    finally:
        for node in ("node1", "node2"):
            on_host(node, f"rm -f {secret} /root/{marker}", check=False)
