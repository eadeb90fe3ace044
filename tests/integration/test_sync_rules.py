"""`fab sync --code DIR` of a project whose 50 MB data/ is in its .gitignore: the hosts get exactly
the files the rules keep (nested .gitignore, a .fabtrainignore with a negation), the data never
crosses the network, and the output says what was left out, with no progress bar in a pipe."""

import os

from orchestrator.config import codetree

from .conftest import fab, on_host

DATA_BYTES = 50 * 1000 * 1000


def rx_bytes(node: str) -> int:
    return int(on_host(node, "cat /sys/class/net/eth0/statistics/rx_bytes").stdout)


def test_sync_honours_gitignore_and_fabtrainignore(inventory_path, inv, tmp_path):
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "sub").mkdir()
    with open(proj / "data" / "train.bin", "wb") as f:  # random: rsync could compress zeros to nothing
        for _ in range(DATA_BYTES // 1_000_000):
            f.write(os.urandom(1_000_000))
    (proj / ".gitignore").write_text("data/\n")
    (proj / ".fabtrainignore").write_text("*.ckpt\n!best.ckpt\n")
    (proj / "sub" / ".gitignore").write_text("*.tmp\n")
    for name, text in {
        "train.py": "print(1)\n",
        "a.ckpt": "a",
        "best.ckpt": "b",
        "sub/x.tmp": "t",
        "sub/y.py": "y\n",
    }.items():
        (proj / name).write_text(text)
    kept = codetree.files(proj)
    assert kept == [
        "./.fabtrainignore",
        "./.gitignore",
        "./best.ckpt",
        "./sub/.gitignore",
        "./sub/y.py",
        "./train.py",
    ]
    before = {h.name: rx_bytes(h.name) for h in inv.hosts}

    r = fab(inventory_path, "sync", "--code", str(proj), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    received = {h.name: rx_bytes(h.name) - before[h.name] for h in inv.hosts}
    assert all(n < 5 * 1000 * 1000 for n in received.values()), received  # not the 50 MB
    out = r.stdout
    assert f"code: 6 files, {codetree.size_text(codetree.select(proj).bytes)} from {proj}" in out
    assert (
        "left out by .gitignore/.fabtrainignore: 3 files, 50.0 MB (data/ 50.0 MB, a.ckpt 1 B, sub/ 1 B)"
        in out
    )
    assert "\r" not in out and "\x1b" not in out  # no bar when the output is not a terminal
    dest = f"{inv.job.code_dir}/{codetree.key(proj)}"
    for h in inv.hosts:
        assert f"{h.name}: synced to {dest} in " in out
        listed = on_host(h.name, f"cd {dest} && find . -type f -o -type l | LC_ALL=C sort").stdout.split()
        assert listed == kept, (h.name, listed)
        assert on_host(h.name, f"test -e {dest}/data", check=False).returncode != 0
