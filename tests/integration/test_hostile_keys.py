"""known_hosts as users have them, on the local cluster's real sshd: a `@cert-authority` line, a
`@revoked` line, a line that is no key at all, and a system-wide file (ssh_config's
GlobalKnownHostsFile) next to the user's. paramiko (fab status) and the ssh that rsync runs
(fab sync) must agree: other hosts unharmed, a revoked key refused by both."""

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from .conftest import ADDRESS, fab, on_host

P = ADDRESS["node1"].rsplit(".", 1)[0]  # the cluster's /24: node1..4 are P.11..P.14


def new_key() -> str:
    return (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


def host_key(node: str) -> str:
    return " ".join(on_host(node, "cat /etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[:2])


def test_ca_and_revoked_lines_in_the_users_and_the_global_known_hosts(inventory_path, tmp_path):
    text = inventory_path.read_text()
    kh_line = next(line for line in text.splitlines() if "known_hosts:" in line)
    real = open(kh_line.split(":", 1)[1].strip()).read()
    # The user's file: the hosts' plain keys between a CA line that names them too (paramiko's own
    # reader failed every host on it) and a line that is no key; first, node1's key under a pattern
    # that names node2 too (two keys of one type for node2: either is its key, as ssh reads it).
    user = tmp_path / "known_hosts"
    user.write_text(
        f"{P}.1?,!{P}.13 {host_key('node1')}\n"
        f"@cert-authority {P}.*,*.example.com {new_key()}\n{real}this line is no key\n"
    )
    # The system-wide file, named by ssh_config as OpenSSH reads it: a revoked key of another host.
    system = tmp_path / "ssh_known_hosts"
    system.write_text(f"@revoked * {new_key()}\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host *\n  GlobalKnownHostsFile {system}\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        text.replace(kh_line, f"  known_hosts: {user}").replace("  config: none", f"  config: {config}")
    )
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    dest = None
    try:
        r = fab(inv, "status", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "hosts: 2 answering" in r.stdout
        r = fab(inv, "sync", "--code", str(code), timeout=120)  # OpenSSH, through rsync
        assert r.returncode == 0, r.stdout + r.stderr
        assert "node1: synced to " in r.stdout and "node2: synced to " in r.stdout
        dest = r.stdout.split("node1: synced to ", 1)[1].split()[0]
        assert dest.startswith("/") and dest.count("/") >= 3, dest  # removed at the end

        # node2's own key revoked in the system-wide file: refused by both, node1 still answers.
        with open(system, "a") as f:
            f.write(f"@revoked {P}.12 {host_key('node2')}\n")
        r = fab(inv, "status", timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        assert "hosts: 1 answering; unreachable: node2" in out
        assert f"node2 ({P}.12): host key ssh-ed25519 SHA256:" in out
        assert f"is REVOKED (@revoked line {system}:2)" in out
        assert f"remove line 2 of {system}" in out
        r = fab(inv, "sync", "--code", str(code), timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        assert f"sync to node2 (root@{P}.12:22) failed" in out and "is marked as revoked" in out
        assert "sync to node1" not in out

        # node2 known only through the CA line: refused, saying why and how to add its plain key.
        user.write_text(f"{P}.11 {host_key('node1')}\n@cert-authority {P}.* {new_key()}\n")
        system.write_text("")
        r = fab(inv, "status", timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 1 and "hosts: 1 answering; unreachable: node2" in out, out
        assert (
            f"node2 ({P}.12): known only through the @cert-authority line {user}:2; fabtrain checks "
            "host keys with paramiko, which does not verify host certificates, so it does not accept "
            "CA-signed host keys"
        ) in out
        assert f"ssh-keyscan -p 22 {P}.12 >> {user}" in out
    finally:
        if dest:
            for node in ("node1", "node2"):
                on_host(node, f"rm -rf {dest}", check=False)
