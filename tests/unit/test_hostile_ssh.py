"""Host keys and the SSH transport's sizes and text, as hostile input (issue 31).

known_hosts is read line by line as OpenSSH reads it: `@revoked` keys refused, `@cert-authority`
lines never breaking other hosts, hashed names, wildcards, negations and [host]:port forms matched,
garbage lines skipped one by one. paramiko and the ssh that rsync runs trust the same files (the
user's and the system-wide ones). What a server sends back (its banner, error text) reaches a
message only through hostile.line, and a command's buffered output is capped.
"""

import base64
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import tracemalloc

import paramiko
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from orchestrator.config.inventory import Host
from orchestrator.config.sshconf import DEFAULT_GLOBAL_KNOWN_HOSTS, SSH, Settings, resolve
from orchestrator.core import hostile
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import sshargs
from orchestrator.transport import capture, connect, hostkeys, remote
from orchestrator.transport.hostkeys import KnownHosts, hosts_match, pattern_matches


def ed_key() -> str:
    return (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


def ec_key() -> str:
    return (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


def pkey(line: str) -> paramiko.PKey:
    kind, data = line.split()[:2]
    return paramiko.PKey.from_type_string(kind, base64.b64decode(data))


# ---------------------------------------------------------------- matching (pure)


@pytest.mark.parametrize(
    "name, pattern, want",
    [
        ("gpu1.example.com", "*.example.com", True),
        ("example.com", "*.example.com", False),
        ("GPU1.Example.COM", "gpu?.example.com", True),  # no case, as ssh
        ("gpu10.example.com", "gpu?.example.com", False),  # '?' is one character
        ("[10.0.0.2]:2222", "[10.0.0.2]:2222", True),  # '[' is literal, not a character class
        ("1", "[10.0.0.2]:2222", False),
        ("[gpu1.example.com]:2222", "[*.example.com]:2222", True),
        ("[gpu1.example.com]:22", "[*.example.com]:2222", False),
        ("a.b", "a?b", True),  # '.' is literal, '?' any one
        ("axb", "a.b", False),
        ("anything", "*", True),
    ],
)
def test_pattern_matches_as_ssh(name, pattern, want):
    assert pattern_matches(name, pattern) is want


def test_hosts_field_negation_lists_and_hashes():
    field = "*.example.com,!bad.example.com,10.0.0.1"
    assert hosts_match("gpu1.example.com", field)
    assert hosts_match("10.0.0.1", field)
    assert not hosts_match("bad.example.com", field)  # a matching negation vetoes the line
    assert not hosts_match("other.org", field)
    assert not hosts_match("bad.example.com", "!bad.example.com")  # a negation alone matches nothing
    assert not hosts_match("x", "!y")
    hashed = paramiko.HostKeys.hash_host("[10.0.0.2]:2222")
    assert hosts_match("[10.0.0.2]:2222", hashed)
    assert not hosts_match("10.0.0.2", hashed)
    assert hosts_match("gpu1", paramiko.HostKeys.hash_host("gpu1"))
    for bad in ("|1|", "|1|!!!|@@@", "|1|c2FsdA==|", "|1|a|b|c", "|2|x|y"):  # never raises
        assert not hosts_match("gpu1", bad)


# ---------------------------------------------------------------- parsing a hostile file


def test_a_file_with_every_kind_of_line(tmp_path):
    node1, node2, wild, port, ca, revoked, hashed = (ed_key() for _ in range(7))
    ecdsa = ec_key()
    lines = [
        "# a comment",  # 1
        "",  # 2
        f"10.0.0.1,gpu1 {node1}",  # 3
        f"@cert-authority *.example.com {ca}",  # 4: broke paramiko.HostKeys
        f"@revoked * {revoked}",  # 5
        f"*.example.com,!bad.example.com {wild}",  # 6
        f"[10.0.0.2]:2222 {port}",  # 7
        f"{paramiko.HostKeys.hash_host('10.0.0.3')} {hashed}",  # 8
        "10.0.0.4 ssh-ed25519 !!!not-base64!!!",  # 9: bad base64
        "10.0.0.4 ssh-ed25519",  # 10: too few fields
        "10.0.0.4 ssh-ed25519 AAAA",  # 11: truncated key data
        f"@bogus 10.0.0.4 {node1}",  # 12: unknown marker
        "10.0.0.4 ssh-unknown AAAAB3NzaC1yc2E=",  # 13: unknown key type
        "\x1b]52;c;aGk=\x07 \x00\xff junk",  # 14: binary junk
        "@revoked",  # 15: marker alone
        f"10.0.0.2\t  {node2}   # trailing comment",  # 16: tabs and spaces
        f"10.0.0.2 {ecdsa}",  # 17
        f"@revoked 10.0.0.2 {ecdsa}",  # 18: node2's ecdsa revoked
    ]
    path = tmp_path / "known_hosts"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(paramiko.hostkeys.InvalidHostKey):  # what every host got before
        paramiko.HostKeys(str(path))
    kh = hostkeys.known_hosts(str(path))
    assert isinstance(kh, KnownHosts)
    assert kh.skipped == [9, 10, 11, 12, 13, 14, 15]
    assert [(e.line, e.marker) for e in kh.lines] == [
        (3, ""),
        (4, "@cert-authority"),
        (5, "@revoked"),
        (6, ""),
        (7, ""),
        (8, ""),
        (16, ""),
        (17, ""),
        (18, "@revoked"),
    ]

    def plain(name):
        return {t: k.get_base64() for t, k in (kh.lookup(name) or {}).items()}

    assert plain("gpu1") == plain("10.0.0.1") == {"ssh-ed25519": node1.split()[1]}
    assert plain("gpu7.example.com") == {"ssh-ed25519": wild.split()[1]}
    assert plain("bad.example.com") == {}  # negated
    assert plain("[10.0.0.2]:2222") == {"ssh-ed25519": port.split()[1]}
    assert plain("10.0.0.3") == {"ssh-ed25519": hashed.split()[1]}
    assert plain("10.0.0.2") == {"ssh-ed25519": node2.split()[1]}  # its ecdsa key is revoked
    assert plain("10.0.0.4") == {}
    assert [e.line for e in kh.matching("gpu7.example.com")] == [4, 5, 6]  # CA, revoked '*', plain


def test_parsed_once_per_file_version(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text(f"gpu1 {ed_key()}\n")
    first = hostkeys.known_hosts(str(path))
    assert hostkeys.known_hosts(str(path)) is first
    path.write_text(f"gpu1 {ed_key()}\n@revoked * {ed_key()}\n")
    again = hostkeys.known_hosts(str(path))
    assert again is not first and [e.marker for e in again.lines] == ["", "@revoked"]
    assert hostkeys.known_hosts(str(tmp_path)).lines == []  # a directory: no keys, no crash
    assert hostkeys.known_hosts(str(tmp_path / "absent")).lines == []


# ---------------------------------------------------------------- trust across user and global files


def files(tmp_path, user: str, system: str = "") -> SSH:
    (tmp_path / "kh").write_text(user)
    (tmp_path / "global").write_text(system)
    return SSH(
        hostname="10.0.0.2",
        user="root",
        known_hosts=(str(tmp_path / "kh"),),
        global_known_hosts=(str(tmp_path / "global"),),
    )


def test_a_key_revoked_in_the_global_file_is_refused_naming_host_file_and_line(tmp_path):
    key = ed_key()
    ssh = files(tmp_path, f"10.0.0.2 {key}\n", f"# fleet\n@revoked 10.0.0.* {key}\n")
    trust = hostkeys.host_trust(ssh)
    assert trust.keys == () and [e.line for e in trust.revoked] == [2]
    policy = hostkeys.RejectUnknown("node2", ssh)
    with pytest.raises(hostkeys.HostKeyError) as err:
        policy.missing_host_key(None, "10.0.0.2", pkey(key))
    msg = str(err.value)
    assert msg.startswith(
        f"node2 (10.0.0.2): host key ssh-ed25519 {pkey(key).fingerprint} is REVOKED "
        f"(@revoked line {tmp_path}/global:2)"
    )
    assert (
        f"ssh-keyscan -p 22 10.0.0.2 >> {tmp_path}/kh" in msg and f"remove line 2 of {tmp_path}/global" in msg
    )


def test_known_only_through_a_ca_says_so_and_how_to_add_the_plain_key(tmp_path):
    ca, shown = ed_key(), ed_key()
    ssh = files(tmp_path, f"@cert-authority 10.0.0.* {ca}\n")
    with pytest.raises(hostkeys.HostKeyError) as err:
        hostkeys.RejectUnknown("node2", ssh).missing_host_key(None, "10.0.0.2", pkey(shown))
    assert str(err.value) == (
        f"node2 (10.0.0.2): known only through the @cert-authority line {tmp_path}/kh:1; fabtrain checks "
        "host keys with paramiko, which does not verify host certificates, so it does not accept CA-signed "
        "host keys. Add the host's plain key: Check that fingerprint on the host (ssh-keygen -lf "
        "/etc/ssh/ssh_host_ed25519_key.pub), then accept it deliberately: ssh-keyscan -p 22 10.0.0.2 >> "
        f"{tmp_path}/kh"
    )


def test_ca_and_unrelated_revoked_lines_leave_other_hosts_alone(tmp_path):
    key, other = ed_key(), ed_key()
    ssh = files(tmp_path, f"@cert-authority * {ed_key()}\n@revoked * {other}\n10.0.0.2 {key}\n")
    trust = hostkeys.host_trust(ssh)
    assert [e.key for e in trust.keys] == [pkey(key)] and trust.known(pkey(key))
    hostkeys.RejectUnknown("node2", ssh).missing_host_key(None, "10.0.0.2", pkey(key))  # accepted
    with pytest.raises(hostkeys.HostKeyError, match="host key unknown"):
        hostkeys.RejectUnknown("node2", ssh).missing_host_key(None, "10.0.0.2", pkey(ed_key()))


def test_the_global_file_counts_like_the_users(tmp_path):
    key = ed_key()
    ssh = files(tmp_path, "", f"10.0.0.2 {key}\n")
    hostkeys.RejectUnknown("node2", ssh).missing_host_key(None, "10.0.0.2", pkey(key))
    with pytest.raises(hostkeys.HostKeyError) as err:
        hostkeys.RejectUnknown("node2", ssh).missing_host_key(None, "10.0.0.2", pkey(ed_key()))
    assert f"not in {tmp_path}/kh, {tmp_path}/global." in str(err.value)


# ---------------------------------------------------------------- the same files for OpenSSH


def test_ssh_argv_passes_the_global_files_explicitly():
    ssh = SSH(hostname="10.0.0.2", user="u", known_hosts=("/k/kh",), keys=("/k/id",), keys_only=True)
    assert sshargs.ssh_options(ssh) == [
        "ssh",
        "-F",
        "none",
        "-p",
        "22",
        "-l",
        "u",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "UserKnownHostsFile=/k/kh",
        "-o",
        "GlobalKnownHostsFile=/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
        "-i",
        "/k/id",
        "-o",
        "IdentitiesOnly=yes",
    ]
    none = sshargs.ssh_options(SSH(hostname="h", user="u", known_hosts=("/k/kh",), global_known_hosts=()))
    assert none[13:15] == ["-o", "GlobalKnownHostsFile=/dev/null"]
    odd = sshargs.ssh_options(
        SSH(hostname="h", user="u", known_hosts=("/a b/%h",), global_known_hosts=("/g 1/%h", "/g2"))
    )
    assert odd[12] == 'UserKnownHostsFile="/a b/%%h"'  # ssh expands '%' there
    assert odd[14] == 'GlobalKnownHostsFile="/g 1/%h" /g2'  # and not there


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client")
def test_openssh_reads_exactly_the_files_paramiko_reads(tmp_path):
    odd = ("/x/a%b", "/x/c d", '/x/e"f', "/x/g\\h", "/x/i'j", "/x/plain")
    jump = SSH(hostname="bastion", user="j", known_hosts=odd[:2], global_known_hosts=odd[2:])
    for ssh in (
        SSH(hostname="10.0.0.2", user="u", known_hosts=odd, global_known_hosts=odd[::-1], jump=(jump,)),
        SSH(hostname="10.0.0.2", user="u", known_hosts=odd[:1], global_known_hosts=()),
        SSH(hostname="10.0.0.2", user="u", known_hosts=("/k/kh",)),
    ):
        argv = sshargs.ssh_options(ssh)
        out = subprocess.run(
            ["ssh", "-G", *argv[1:], ssh.hostname], capture_output=True, text=True, check=True
        ).stdout
        got = dict(line.partition(" ")[::2] for line in out.splitlines())
        assert got["userknownhostsfile"] == " ".join(ssh.known_hosts)
        assert got["globalknownhostsfile"] == (" ".join(ssh.global_known_hosts) or "/dev/null")
        if ssh.jump:  # the hop's own ssh, inside the ProxyCommand, is told its files the same way
            inner = shlex.split(got["proxycommand"].replace("%%", "%"))
            hop = subprocess.run(
                ["ssh", "-G", *inner[1:-3], "bastion"], capture_output=True, text=True, check=True
            ).stdout
            hop_got = dict(line.partition(" ")[::2] for line in hop.splitlines())
            assert hop_got["globalknownhostsfile"] == " ".join(jump.global_known_hosts)


def test_ssh_config_global_known_hosts_file_is_honoured(tmp_path):
    config = paramiko.SSHConfig.from_text(
        f"Host gpu1\n  GlobalKnownHostsFile {tmp_path}/g1 ~/g2\nHost gpu2\n  GlobalKnownHostsFile none\n"
    )
    assert resolve("gpu1", Settings(), config).global_known_hosts == (
        f"{tmp_path}/g1",
        os.path.expanduser("~/g2"),
    )
    assert resolve("gpu2", Settings(), config).global_known_hosts == ()
    assert resolve("gpu3", Settings(), config).global_known_hosts == DEFAULT_GLOBAL_KNOWN_HOSTS
    assert resolve("gpu3", Settings(), None).global_known_hosts == DEFAULT_GLOBAL_KNOWN_HOSTS


# ---------------------------------------------------------------- text from a server

EVIL = "\x1b]52;c;aGk=\x07\x1b[2J\x9b31m[/red][link=file:///etc/passwd]"


def host(port: int = 22, known_hosts: tuple[str, ...] = ()) -> Host:
    return Host(
        name="node2",
        address="127.0.0.1",
        rank=1,
        interface="lo",
        ssh=SSH(hostname="127.0.0.1", user="root", port=port, connect_timeout=5, known_hosts=known_hosts),
    )


def assert_clean(text: str) -> None:
    assert not any(c in text for c in "\x1b\x07\x9b\x00\n\r"), repr(text)


def test_describe_of_a_server_whose_banner_carries_escapes(tmp_path):
    """A real paramiko connection to a loopback server answering with an escape-laden banner."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer():
        conn, _ = server.accept()
        conn.sendall(f"SSH-{EVIL}-x\r\n".encode())
        conn.recv(1024)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    (tmp_path / "kh").write_text("")
    h = host(server.getsockname()[1], (str(tmp_path / "kh"),))
    with pytest.raises(paramiko.SSHException) as err:
        connect._open(h.ssh, h.name)
    server.close()
    assert "\x1b" in str(err.value)  # paramiko passes the banner on as it came
    msg = remote.describe(h, err.value)
    assert_clean(msg)
    assert msg.startswith(f"node2 (root@127.0.0.1:{h.ssh.port}): IncompatiblePeer: Incompatible version (")
    assert "]52;c;aGk=[2J31m[/red][link=file:///etc/passwd]" in msg


@pytest.mark.parametrize(
    "exc",
    [
        paramiko.SSHException(f'Indecipherable protocol version "{EVIL}\nsecond line"'),
        paramiko.ChannelException(2, f"refused {EVIL}"),
        OSError(5, f"I/O {EVIL}"),
        UserError(f"node2: cannot write x: {EVIL}\nmore"),
        RuntimeError(EVIL * 100),
    ],
)
def test_describe_makes_every_remote_text_safe(exc):
    msg = remote.describe(host(), exc)
    assert_clean(msg)
    assert "]52;c;aGk=" in msg  # the text is still there, its controls gone
    assert len(msg) < 2200


def test_failure_keeps_the_end_of_stderr_as_one_safe_line():
    r = remote.Result("", "warning\n" * 5000 + f"docker: Error response: {EVIL}\n", 125, 0.1)
    msg = remote.failure(host(), r, "docker run")
    assert_clean(msg)
    assert msg.startswith("node2: docker run failed (exit 125): ")
    assert msg.endswith("docker: Error response: ]52;c;aGk=[2J31m[/red][link=file:///etc/passwd]")
    assert len(msg) <= len("node2: docker run failed (exit 125): ") + 200


# ---------------------------------------------------------------- sizes


class Flood:
    """A stand-in for a paramiko Channel whose command prints `total` bytes to stdout and a
    little to stderr, then exits (what drain reads: its buffers, events and flags)."""

    class Buffer:
        def set_event(self, event):
            self.event = event

    def __init__(self, total: int, stderr: bytes, chunk: int = 1 << 16) -> None:
        self.left, self.chunk, self.stderr, self.at = total, chunk, stderr, 0
        self.in_buffer, self.in_stderr_buffer = self.Buffer(), self.Buffer()
        self.status_event = threading.Event()
        self.closed = False
        self.read = 0

    @property
    def eof_received(self) -> bool:
        return self.left == 0 and self.at == len(self.stderr)

    def recv_ready(self) -> bool:
        return self.left > 0

    def recv(self, n: int) -> bytes:
        n = min(n, self.left, self.chunk)
        self.left -= n
        self.read += n
        return b"x" * n

    def recv_stderr_ready(self) -> bool:
        return self.at < len(self.stderr)

    def recv_stderr(self, n: int) -> bytes:
        start, self.at = self.at, min(self.at + n, len(self.stderr))
        return self.stderr[start : self.at]

    def exit_status_ready(self) -> bool:
        return self.eof_received


def test_drain_keeps_a_bounded_part_of_a_flood():
    total = 128 * 1024 * 1024
    chan = Flood(total, b"e" * (hostile.OUTPUT_MAX + 10))
    tracemalloc.start()
    try:
        out, err = capture.drain(chan)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert chan.read == total  # everything was read (the command is not left blocked on a full pipe)
    assert out == b"x" * hostile.OUTPUT_MAX + b"\n...[cut] (%d more bytes)\n" % (total - hostile.OUTPUT_MAX)
    assert err == b"e" * hostile.OUTPUT_MAX + b"\n...[cut] (10 more bytes)\n"
    assert peak < 8 * hostile.OUTPUT_MAX, peak  # not the 128 MB printed


def test_drain_passes_small_output_whole():
    out, err = capture.drain(Flood(1000, b"oops\n"))
    assert (out, err) == (b"x" * 1000, b"oops\n")


def test_a_local_command_flooding_its_output_is_capped(tmp_path):
    """rsync's output can be a host's (its shell's stderr): Session.local keeps a bounded part."""
    flood = (
        "import os; os.write(1, b'o' * (20 << 20)); os.write(2, b'e' * (9 << 20)); print('end', flush=True)"
    )
    session = remote.Session(())
    try:
        r = session.local([sys.executable, "-c", flood], timeout=60)
        assert r.exited == 0
        more_out, more_err = (20 << 20) - hostile.OUTPUT_MAX + 4, (9 << 20) - hostile.OUTPUT_MAX
        assert r.stdout == "o" * hostile.OUTPUT_MAX + f"\n...[cut] ({more_out} more bytes)\n"
        assert r.stderr == "e" * hostile.OUTPUT_MAX + f"\n...[cut] ({more_err} more bytes)\n"
        r = session.local(
            [
                sys.executable,
                "-c",
                "import sys, time; sys.stderr.write('partial'); sys.stderr.flush(); time.sleep(30)",
            ],
            timeout=1,
        )
        assert (
            r.exited == 124
            and r.stderr == f"partial\n{sys.executable} did not finish within 1s"
            and r.seconds < 10
        )
    finally:
        session.close()


@pytest.mark.parametrize(
    "errors, said",
    [
        (
            {("10.0.0.9", 22): ConnectionRefusedError(111, "Connection refused")},
            "connection refused; start sshd",
        ),
        # Unreachable is not refused: starting sshd would not help.
        ({("10.0.0.9", 22): OSError(113, "No route to host")}, "cannot connect: No route to host; check"),
        (
            {
                ("10.0.0.9", 22): ConnectionRefusedError(111, "Connection refused"),
                ("fd00::9", 22, 0, 0): OSError(101, "Network is unreachable"),
            },
            "cannot connect: Network is unreachable; check",
        ),
    ],
)
def test_no_valid_connection_is_named_by_what_failed(errors, said):
    msg = remote.describe(host(), paramiko.ssh_exception.NoValidConnectionsError(errors))
    assert said in msg, msg
