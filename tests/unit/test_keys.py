"""A detached job's controller key in authorized_keys (hosts/keys.py): the scripts run by sh here on
a temporary HOME, the resulting file checked byte for byte (every other line as it was: no final
newline, CRLF, comments, blank lines, lines with options, bytes that are not UTF-8); the line's
options; the controller's host's addresses read from hostile output; fab stop's removal, named
when it fails (hostops.stop_script)."""

import calendar
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.config.inventory import parse
from orchestrator.core.errors import UserError
from orchestrator.hosts import hostops, keys
from orchestrator.transport.remote import PerHost, Result

JOB = "gpt-20261124-101010-ab.cd"
OTHER = "gpt-20261124-101010-ab"  # a prefix of JOB's id: its line is another's
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFtPTYnYmOPCTMbyHOfaa6Rgq4C4HyQk0u1A4mVZ9xAA"
PUBLIC = f"{KEY} fabtrain-controller:{JOB}"
OTHER_LINE = f'restrict,from="10.9.9.9",expiry-time="20991231000000" {KEY} fabtrain-controller:{OTHER}'
FROM = ["10.0.0.5", "fe80::1"]


def sh(script: str, home: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", "-c", script], capture_output=True, env={**os.environ, "HOME": str(home), "TZ": "UTC", **env}
    )


def keyfile(home: Path, content: bytes | None) -> Path:
    (home / ".ssh").mkdir(mode=0o700, parents=True, exist_ok=True)
    f = home / ".ssh" / "authorized_keys"
    if content is not None:
        f.write_bytes(content)
        f.chmod(0o600)
    return f


def ours(text: bytes) -> tuple[bytes, bytes, int]:
    """(the file without our line, our line, its expiry as seconds since 1970 read as UTC)."""
    m = re.search(
        rb'^restrict,from="[^"]*",expiry-time="(\d{14})" ' + re.escape(PUBLIC.encode()) + rb"\n", text, re.M
    )
    assert m, text
    return text[: m.start()] + text[m.end() :], m.group(0), stamp(m.group(1))


def stamp(text: bytes) -> int:
    """An expiry-time written with TZ=UTC, as seconds since 1970."""
    return calendar.timegm(time.strptime(text.decode(), "%Y%m%d%H%M%S"))


CASES = {
    "plain": b"ssh-ed25519 AAAAuser ann@ws\n",
    "no final newline": b"ssh-ed25519 AAAAuser ann@ws",
    "CRLF": b"ssh-ed25519 AAAAuser ann@ws\r\nssh-rsa AAAAB3 bob@lap\r\n",
    "CRLF, no final newline": b"ssh-ed25519 AAAAuser ann@ws\r\nssh-rsa AAAAB3 bob@lap",
    "comments, blanks, options, another job": (
        b"# keys for the team\n\n   \n"
        b'command="/usr/bin/backup",no-pty,from="10.1.0.0/16" ssh-ed25519 AAAAbackup backup@nas\n'
        b"# a note about fabtrain-controller:"
        + JOB.encode()
        + b" in the middle of a comment\n"
        + OTHER_LINE.encode()
        + b"\n"
        b"\tssh-ed25519 AAAAtab tab@ws\n"
    ),
    "not UTF-8, a NUL": b"ssh-ed25519 AAAA\xff\xfe odd@ws\n# \x00 nul\nssh-ed25519 AAAAlast last@ws",
    "empty": b"",
}


@pytest.mark.parametrize("case", list(CASES))
def test_added_renewed_and_removed_leaving_every_other_byte(tmp_path, case):
    before = CASES[case]
    f = keyfile(tmp_path, before)
    # What the file holds with our line taken out again: a missing final newline added once.
    kept = before + (b"\n" if before and not before.endswith(b"\n") else b"")
    now = int(time.time())
    r = sh(keys.authorize_script(JOB, PUBLIC, FROM, 7200), tmp_path)
    assert r.returncode == 0, r.stderr
    rest, line, expiry = ours(f.read_bytes())
    assert rest == kept and f.read_bytes() == kept + line
    assert re.fullmatch(
        rb'restrict,from="10\.0\.0\.5,fe80::1",expiry-time="\d{14}" ' + re.escape(PUBLIC.encode()) + rb"\n",
        line,
    )
    assert now + 7200 - 2 <= expiry <= int(time.time()) + 7200 + 2
    # Renewed: the same place at the end, a later expiry, a new from= list, nothing else changed.
    r = sh(keys.renew_script(JOB, PUBLIC, ["10.0.0.6"], 9000), tmp_path)
    assert r.returncode == 0, r.stderr
    rest, line, expiry2 = ours(f.read_bytes())
    assert rest == kept and f.read_bytes() == kept + line and b'from="10.0.0.6"' in line
    assert expiry2 >= expiry + 1800 - 2
    # Added again (a second --detach of the same id cannot happen; a re-run of the script can): once.
    assert sh(keys.authorize_script(JOB, PUBLIC, FROM, 7200), tmp_path).returncode == 0
    assert f.read_bytes().count(PUBLIC.encode()) == 1
    r = sh(keys.revoke_script([JOB]), tmp_path)
    assert (r.returncode, r.stderr) == (0, b"")
    assert f.read_bytes() == kept
    assert oct(f.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in (tmp_path / ".ssh").iterdir() if p.name.startswith(".fabtrain.")] == [
        ".fabtrain.lock"
    ]  # no temporary file left
    # Renewing a line that is gone (fab stop took it) adds nothing.
    r = sh(keys.renew_script(JOB, PUBLIC, FROM, 7200), tmp_path)
    assert r.returncode == keys.GONE and b"no line of job" in r.stderr and f.read_bytes() == kept


def test_no_file_is_made_private_and_no_home_is_nothing_to_revoke(tmp_path):
    home = tmp_path / "home"
    assert sh(keys.authorize_script(JOB, PUBLIC, FROM, 60), home).returncode == 0
    f = home / ".ssh" / "authorized_keys"
    assert oct(f.stat().st_mode & 0o777) == "0o600" and oct((home / ".ssh").stat().st_mode & 0o777) == "0o700"
    assert f.read_bytes().endswith(f" {PUBLIC}\n".encode()) and f.read_bytes().count(b"\n") == 1
    assert sh(keys.revoke_script([JOB]), home).returncode == 0 and f.read_bytes() == b""
    assert sh(keys.revoke_script([JOB]), tmp_path / "nohome").returncode == 0
    assert not (tmp_path / "nohome").exists()  # nothing made where there was nothing to remove


def test_the_file_keeps_its_mode_and_a_link_stays_a_link(tmp_path):
    target = tmp_path / "managed_keys"
    target.write_bytes(b"ssh-ed25519 AAAAuser ann@ws\n")
    target.chmod(0o644)
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "authorized_keys").symlink_to(target)
    assert sh(keys.authorize_script(JOB, PUBLIC, FROM, 60), tmp_path).returncode == 0
    assert sh(keys.renew_script(JOB, PUBLIC, FROM, 60), tmp_path).returncode == 0
    assert (tmp_path / ".ssh" / "authorized_keys").is_symlink() and PUBLIC.encode() in target.read_bytes()
    assert sh(keys.revoke_script([JOB]), tmp_path).returncode == 0
    assert target.read_bytes() == b"ssh-ed25519 AAAAuser ann@ws\n"
    assert oct(target.stat().st_mode & 0o777) == "0o644"


def test_two_jobs_removed_at_once_and_a_job_whose_id_is_a_prefix_kept(tmp_path):
    third = "gpt-20261124-101010-ef01"
    f = keyfile(tmp_path, b"ssh-ed25519 AAAAuser ann@ws\n" + OTHER_LINE.encode() + b"\n")
    for job in (JOB, third):
        script = keys.authorize_script(job, f"{KEY} fabtrain-controller:{job}", FROM, 60)
        assert sh(script, tmp_path).returncode == 0
    assert sh(keys.revoke_script([JOB, third, "not a job; rm -rf /"]), tmp_path).returncode == 0
    assert f.read_bytes() == b"ssh-ed25519 AAAAuser ann@ws\n" + OTHER_LINE.encode() + b"\n"
    assert keys.revoke_script(["not a job; rm -rf /"]) == keys.revoke_script([]) == "true"
    assert keys.revoke_script([JOB, "x; y"]) == keys.revoke_script([JOB])


def test_a_line_an_older_version_glued_onto_the_users_is_taken_off_it(tmp_path):
    """Before the final newline was added, a controller's line could be glued onto the user's last
    line; removing the whole line locked the user out. Only the controller's part goes now."""
    old = f"{keys.OLD_OPTIONS} {PUBLIC}".encode()
    f = keyfile(tmp_path, b"ssh-ed25519 AAAAuser ann@ws\nssh-rsa AAAAB3 bob@lap" + old + b"\n" + old + b"\n")
    assert sh(keys.revoke_script([JOB]), tmp_path).returncode == 0
    assert f.read_bytes() == b"ssh-ed25519 AAAAuser ann@ws\nssh-rsa AAAAB3 bob@lap\n"
    f.write_bytes(b"ssh-rsa AAAAB3 bob@lap\r" + old + b"\r\n")
    assert sh(keys.revoke_script([JOB]), tmp_path).returncode == 0
    assert f.read_bytes() == b"ssh-rsa AAAAB3 bob@lap\r\n"


def test_a_line_an_editor_turned_crlf_is_removed_too(tmp_path):
    line = f'restrict,from="10.0.0.5",expiry-time="20991231000000" {PUBLIC}'.encode()
    f = keyfile(tmp_path, b"ssh-ed25519 AAAAuser ann@ws\r\n" + line + b"\r\n")
    assert sh(keys.revoke_script([JOB]), tmp_path).returncode == 0
    assert f.read_bytes() == b"ssh-ed25519 AAAAuser ann@ws\r\n"


def test_a_removal_that_did_not_take_is_said_and_the_file_kept(tmp_path):
    f = keyfile(tmp_path, f"ssh-ed25519 AAAAuser ann@ws\nrestrict {PUBLIC}\n".encode())
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "sed").write_text('#!/bin/sh\nfor a; do :; done; cat "$a"\n')  # a rewrite that changes nothing
    (stub / "sed").chmod(0o755)
    r = sh(keys.revoke_script([JOB]), tmp_path, PATH=f"{stub}:{os.environ['PATH']}")
    assert r.returncode == keys.LEFT
    assert r.stderr.decode() == f"{f}: the key of {JOB} is still there after its removal\n"
    (stub / "sed").write_text("#!/bin/sh\nexit 2\n")  # a rewrite that fails: the file is left whole
    r = sh(keys.revoke_script([JOB]), tmp_path, PATH=f"{stub}:{os.environ['PATH']}")
    assert r.returncode == 1 and b"could not be rewritten to remove the key of" in r.stderr
    assert f.read_bytes() == f"ssh-ed25519 AAAAuser ann@ws\nrestrict {PUBLIC}\n".encode()
    f.chmod(0)
    if os.geteuid() != 0:  # root reads it anyway
        r = sh(keys.revoke_script([JOB]), tmp_path)
        assert r.returncode == 1 and b"could not be read" in r.stderr


def test_the_expiry_is_the_hosts_local_time_as_its_sshd_reads_it(tmp_path):
    """Without a `Z` (which sshd before 9.1 refuses), expiry-time is read in the host's time zone:
    the same moment is written as Tokyo's wall clock on a host set to Tokyo."""
    stamps = {}
    for tz in ("UTC", "Asia/Tokyo"):
        home = tmp_path / tz.replace("/", "-")
        assert sh(keys.authorize_script(JOB, PUBLIC, FROM, 3600), home, TZ=tz).returncode == 0
        written = re.search(rb'expiry-time="(\d{14})"', (home / ".ssh" / "authorized_keys").read_bytes())
        stamps[tz] = stamp(written.group(1))
    assert abs(stamps["Asia/Tokyo"] - stamps["UTC"] - 9 * 3600) <= 5


def test_the_lines_options_take_addresses_only():
    assert keys.entry_options(["10.0.0.5", "fe80::1", "127.0.0.0/8", "::1"]) == (
        'restrict,from="10.0.0.5,fe80::1,127.0.0.0/8,::1",expiry-time="',
        '" ',
    )
    for bad in ('10.0.0.5",command="touch /tmp/x', "*", "node1", "10.0.0.5 ", ""):
        with pytest.raises(ValueError, match="from= takes IP addresses"):
            keys.entry_options([bad])
    with pytest.raises(ValueError, match="at least one"):
        keys.entry_options([])
    for public in (
        f"{KEY} fabtrain-controller:{OTHER}",
        f'command="x" {PUBLIC}',
        f"{KEY}\n{PUBLIC}",
        f"{KEY} x fabtrain-controller:{JOB}",
    ):
        with pytest.raises(ValueError, match="not this job's public key line"):
            keys.authorize_script(JOB, public, FROM, 60)
    with pytest.raises(ValueError, match="not a job id"):
        keys.authorize_script("a;b", PUBLIC, FROM, 60)
    with pytest.raises(ValueError, match="positive number of seconds"):
        keys.renew_script(JOB, PUBLIC, FROM, 0)


IP_ADDR = """1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
2: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\\       valid_lft forever
9: eth0    inet 172.28.5.11/24 brd 172.28.5.255 scope global eth0\\       valid_lft forever
9: eth0    inet6 fe80::42:acff:fe1c:50b/64 scope link \\       valid_lft forever preferred_lft forever
9: eth0    inet 172.28.5.11/24 brd 172.28.5.255 scope global secondary eth0:1
"""


def test_the_controllers_host_addresses_from_ip_or_hostname():
    assert keys.parse_addresses(IP_ADDR + "@@resolved\n172.28.5.11     STREAM node1\n", "node1") == (
        ("172.17.0.1", "172.28.5.11", "fe80::42:acff:fe1c:50b"),
        False,
    )
    assert keys.parse_addresses("10.0.0.5 10.1.0.5 \n@@resolved\n127.0.1.1       STREAM gpu1\n", "gpu1") == (
        ("10.0.0.5", "10.1.0.5"),
        True,
    )
    # Hostile output: only words that are IP addresses are taken.
    hostile_out = (
        '2: eth0 inet $(touch /tmp/x)/24\n3: eth1 inet 10.0.0.7"/24\n4: x inet 10.0.0.8/24\n@@resolved\n'
    )
    assert keys.parse_addresses(hostile_out, "gpu1") == (("10.0.0.8",), False)
    with pytest.raises(
        UserError,
        match=r"gpu1, the controller's host, shows no address but loopback .*"
        r"said '1: lo inet 127.0.0.1/8'",
    ):
        keys.parse_addresses("1: lo inet 127.0.0.1/8\n@@resolved\n", "gpu1")
    many = " ".join(f"10.0.{i // 250}.{i % 250 + 1}" for i in range(keys.MAX_SOURCES + 1))
    with pytest.raises(UserError, match="more than 64: its key's from= would be too wide"):
        keys.parse_addresses(many + "\n@@resolved\n", "gpu1")
    assert keys.addresses_script("gpu 1") == (
        "{ ip -o addr show 2>/dev/null || hostname -I; }; echo @@resolved; "
        "getent ahosts 'gpu 1' 2>/dev/null; true"
    )


def test_loopback_only_on_the_controllers_own_line_and_only_when_it_reaches_itself_so():
    assert keys.sources_by_host(["a", "b"], "a", ["10.0.0.5"], True) == {
        "a": ("10.0.0.5", "127.0.0.0/8", "::1"),
        "b": ("10.0.0.5",),
    }
    assert keys.sources_by_host(["a", "b"], "a", ["10.0.0.5"], False) == {
        "a": ("10.0.0.5",),
        "b": ("10.0.0.5",),
    }


def test_the_lifetimes_and_their_overrides():
    assert keys.lifetimes({}) == (7200, 1200)
    assert keys.lifetimes({keys.LIFETIME_ENV: "90", keys.RENEW_ENV: "20"}) == (90, 20)
    with pytest.raises(UserError, match=f"{keys.LIFETIME_ENV}='2h' is not a whole number of seconds"):
        keys.lifetimes({keys.LIFETIME_ENV: "2h"})
    with pytest.raises(UserError, match=f"{keys.RENEW_ENV} \\(7200 s\\) must be above 0 and below"):
        keys.lifetimes({keys.RENEW_ENV: "7200"})


# ---------------------------------------------------------------- fab stop (hostops.stop_script)


class OneCommand:
    """Session.run and fan_out as `sh -c` here, recording each command."""

    def __init__(self, env):
        self.env, self.commands = env, []

    def run(self, host, command, timeout=60, what=""):
        self.commands.append(command)
        r = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=self.env)
        return Result(r.stdout, r.stderr, r.returncode, 0.01)

    def fan_out(self, fn, hosts=None):
        return PerHost({h.name: fn(h) for h in hosts})


def test_fab_stop_takes_the_key_back_in_its_one_command_and_names_a_failure(tmp_path):
    """The stop's stdout stays the removed container ids; its status is its own, or keys.LEFT with
    the reason on stderr when the key could still be there after three tries (fab stop then names
    the host), and the controller's directory goes either way."""
    inv = parse(
        f"job: {{output_dir: {tmp_path}/out}}\nhosts:\n  - {{address: h, interface: eth0}}\n", Path("i.yaml")
    )
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "docker").write_text('#!/bin/sh\ncase "$2" in --all) echo 0a1b2c;; --force) echo "$3";; esac\n')
    (stub / "docker").chmod(0o755)
    home = tmp_path / "home"
    f = keyfile(home, None)
    env = {"PATH": f"{stub}:/usr/bin:/bin", "HOME": str(home)}
    job = "gpt-2"
    for flock_works in (True, False):
        f.write_text(f"ssh-ed25519 AAAAuser ann@ws\nrestrict ssh-ed25519 AAAActl {keys.marker(job)}\n")
        if not flock_works:
            (stub / "flock").write_text("#!/bin/sh\necho 'flock: timed out' >&2; echo noise; exit 1\n")
            (stub / "flock").chmod(0o755)
            (stub / "sleep").write_text("#!/bin/sh\n")  # the pauses between tries
            (stub / "sleep").chmod(0o755)
        left = tmp_path / "out" / ".controllers" / job / "secrets"
        left.mkdir(parents=True, exist_ok=True)
        session = OneCommand(env)
        out = hostops.stop(session, inv, [job], 0, inv.hosts, revoke=[job])
        assert not left.parent.exists() and (tmp_path / "out" / ".controllers").is_dir()
        r = out[inv.hosts[0].name]
        assert len(session.commands) == 1  # one round trip per host
        assert r.stdout == "0a1b2c\n"
        if flock_works:
            assert (r.stderr, r.exited) == ("", 0)
            assert f.read_text() == "ssh-ed25519 AAAAuser ann@ws\n"
        else:
            assert r.exited == keys.LEFT
            assert r.stderr.count("could not make ~/.ssh or lock ~/.ssh/.fabtrain.lock within 2 s") == 3
            assert f.read_text().count(keys.marker(job)) == 1
    # With the key taken back, the status is the stop's own, whatever it is.
    (stub / "flock").unlink()
    (stub / "docker").write_text('#!/bin/sh\ncase "$2" in --all) echo 0a1b2c;; --force) echo stuck;; esac\n')
    assert (
        OneCommand(env).run(None, hostops.stop_script(inv, [job], 0, [job])).exited
        == OneCommand(env).run(None, hostops.stop_script(inv, [job], 0)).exited
    )


def test_fab_stops_script_exactly(tmp_path):
    inv = parse(
        f"job: {{output_dir: {tmp_path}/out}}\nhosts:\n  - {{address: h, interface: eth0}}\n", Path("i.yaml")
    )
    plain = hostops.stop_script(inv, ["gpt-1", "gpt-2"], 30)
    revoke = keys.revoke_script(["gpt-2"], lock_wait=2)
    assert hostops.stop_script(inv, ["gpt-1", "gpt-2"], 30, ["gpt-2", "not a job; rm -rf /"]) == (
        f"{plain}; s=$?; k=1; for i in 1 2 3; do {revoke} >/dev/null && "
        "{ k=0; break; }; [ $i = 3 ] || sleep $i; done; [ $k = 0 ] || [ $s != 0 ] || s=4; "
        f"rm -rf -- {tmp_path}/out/.controllers/gpt-2 >/dev/null 2>&1; exit $s"
    )
    assert hostops.stop_script(inv, ["gpt-1"], 30, ["not a job"]) == hostops.stop_script(inv, ["gpt-1"], 30)
