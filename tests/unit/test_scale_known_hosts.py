"""A known_hosts file is parsed once, not once per connection: N hosts each reading a file of N
(or, in a user's ~/.ssh/known_hosts, thousands of) entries grew as N squared."""

import os

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from orchestrator.transport.hostkeys import known_hosts


def public_key() -> str:
    return (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


def test_parsed_once_and_again_after_a_change(tmp_path):
    path = tmp_path / "known_hosts"
    first, other = public_key(), public_key()
    path.write_text(f"10.0.0.1 {first}\n[10.0.0.2]:2222 {other}\n")
    keys = known_hosts(str(path))
    assert known_hosts(str(path)) is keys
    assert keys.lookup("10.0.0.1")["ssh-ed25519"].get_base64() == first.split()[1]
    assert keys.lookup("[10.0.0.2]:2222")["ssh-ed25519"].get_base64() == other.split()[1]
    assert keys.lookup("10.0.0.2") is None  # port 2222's key is not port 22's

    changed = public_key()
    path.write_text(f"10.0.0.1 {changed}\n")
    os.utime(path, ns=(1, 1))  # a new stamp even within one clock tick
    again = known_hosts(str(path))
    assert again is not keys and again.lookup("10.0.0.1")["ssh-ed25519"].get_base64() == changed.split()[1]


def test_a_missing_file_knows_no_host(tmp_path):
    keys = known_hosts(str(tmp_path / "absent"))
    assert isinstance(keys, paramiko.HostKeys) and keys.lookup("10.0.0.1") is None
