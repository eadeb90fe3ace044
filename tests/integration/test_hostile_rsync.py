"""rsync on the local cluster: file names and remote paths never reach a shell, and preflight
judges every host's rsync.

`fab sync --code DIR` runs with RSYNC_OLD_ARGS=1 in its environment (rsync's switch back to
old-style arguments, which a user may have exported) to a job.code_dir holding spaces, quotes
and a `$(...)`: without -s in rsync's argv the remote shell splits the path and runs the
substitution; with it the path and the tree's odd file names arrive exactly."""

import json
import os
import subprocess

from orchestrator.core import hostile
from orchestrator.preflight import probe, rsynccheck

from .conftest import CONTAINER, fab

CODE_DIR = '/tmp/fabtrain rsync "q" $(touch pwned-dir)'
NAMES = ("$(touch pwned)", "it's a file.txt")


def host_exec(node: str, *argv: str, check=True) -> subprocess.CompletedProcess:
    """A command on a test host, as an argv (no shell of ours reads the odd names)."""
    return subprocess.run(
        ["docker", "exec", CONTAINER[node], *argv], capture_output=True, text=True, check=check, timeout=60
    )


def pwned(node: str) -> list[str]:
    """Files named pwned* in the SSH user's home, /tmp (the hostile code_dir's parent) and the
    default code_dir, where a substitution run by rsync's remote shell would have made one."""
    out = host_exec(
        node, "find", "/root", "/tmp", "/opt/fabtrain/code", "-maxdepth", "3", "-name", "pwned*", check=False
    ).stdout
    return [line for line in out.splitlines() if line and not line.startswith(CODE_DIR + "/")]


def test_odd_names_arrive_exactly_and_preflight_judges_rsync(inventory_path, inv, tmp_path):
    tree = tmp_path / "tree"
    (tree / "sub dir").mkdir(parents=True)
    for name in NAMES:
        (tree / name).write_text(name)
    (tree / "sub dir" / "train.py").write_text("print('ok')\n")
    text = inventory_path.read_text()
    edited = tmp_path / "odd-code-dir.yaml"
    edited.write_text(
        text.replace(
            "  nproc_per_node: 2\n",
            '  nproc_per_node: 2\n  code_dir: "' + CODE_DIR.replace('"', '\\"') + '"\n',
            1,
        )
    )
    nodes = [h.name for h in inv.hosts]
    assert all(pwned(n) == [] for n in nodes)
    try:
        r = fab(edited, "sync", "--code", str(tree), env={**os.environ, "RSYNC_OLD_ARGS": "1"})
        assert r.returncode == 0, r.stdout + r.stderr
        dest = r.stdout.split("synced to ", 1)[1].split(" in ")[0]
        assert dest.startswith(CODE_DIR + "/") and len(dest.rsplit("/", 1)[1]) == 16
        for node in nodes:
            assert pwned(node) == [], node
            listed = host_exec(node, "find", dest, "-type", "f", "-printf", "%P\\0").stdout
            assert sorted(listed.split("\0")[:-1]) == sorted([*NAMES, "sub dir/train.py"]), node
            for name in NAMES:
                assert host_exec(node, "cat", f"{dest}/{name}").stdout == name
    finally:
        for node in nodes:  # what a shell-run substitution would have made goes too
            host_exec(node, "rm", "-rf", "--", CODE_DIR, *pwned(node), check=False)
            # and where a shell split the path ('/tmp/fabtrain' ...), when it holds this tree
            host_exec(
                node,
                "sh",
                "-c",
                '[ -e "$1/$2" ] && rm -rf -- "$1"',
                "sh",
                "/tmp/fabtrain",
                NAMES[1],
                check=False,
            )
    assert all(host_exec(n, "test", "-e", CODE_DIR, check=False).returncode == 1 for n in nodes)

    # Preflight's rsync row per host, as judged from the host's own rsync (read here directly).
    p = fab(inventory_path, "preflight", "--json", "--no-smoke")
    data = json.loads(p.stdout)
    checks = {(c["host"], c["check"]): c for c in data["checks"]}
    for node in nodes:
        seen = host_exec(node, "sh", "-c", probe.RSYNC_FACT)
        want = rsynccheck.judge_rsync(node, (seen.returncode, seen.stdout))
        got = checks[(node, "rsync")]
        assert (got["status"], got["detail"], got["fix"]) == (want.status, want.detail, want.fix)
        version = probe.parse_rsync_version(probe.parse_rsync_fact(seen.stdout)["version"])
        assert version is not None and got["detail"].startswith(".".join(map(str, version))), got
        # Debian 12's rsync 3.2.7 with the CVE fixes backported (3.2.7-1+deb12u1 and later): no
        # warning on the README's main command, so `fab preflight --strict` stays clean here.
        assert got["status"] == "ok", hostile.line(got["detail"])
    assert p.returncode == 0 and data["ok"], p.stdout[-3000:] + p.stderr
