"""A path a container could have touched (hostcmds/touched.py): the scripts run for real with sh on
this machine, against a job directory where a "container" put links, a FIFO and a device node."""

import os
import stat
import subprocess
import time

import pytest

from orchestrator.hostcmds import touched
from orchestrator.hostcmds.sshargs import shell

SECRET = b"host secret: never read\n"


def sh(script: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], capture_output=True, timeout=timeout)


@pytest.fixture
def job(tmp_path):
    """A job's output directory (root), its console directory, and a host file outside it."""
    secret = tmp_path / "host" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    root = tmp_path / "out" / "job-1"
    (root / ".console").mkdir(parents=True)
    return root, secret


def test_a_regular_console_file_is_read_and_followed(job):
    root, _ = job
    (root / ".console" / "node-0.log").write_bytes(b"line 1\nline 2\n")
    r = sh(touched.tail(shell([str(root)]), ".console/node-0.log", 7))
    assert (r.returncode, r.stdout) == (0, b"line 2\n")
    r = sh(touched.read_from(shell([str(root)]), ".console/node-0.log", 8))
    assert r.stdout == b"line 2\n"
    r = sh(touched.head(shell([str(root)]), ".console/node-0.log", 4))
    assert r.stdout == b"line"
    assert sh(touched.is_file(shell([str(root)]), ".console/node-0.log")).returncode == 0
    # A missing file: exit 4, nothing printed, nothing said.
    r = sh(touched.tail(shell([str(root)]), ".console/node-1.log", 10))
    assert (r.returncode, r.stdout, r.stderr) == (4, b"", b"")


def test_a_console_file_linked_to_a_host_file_is_never_read(job):
    root, secret = job
    os.symlink(secret, root / ".console" / "node-0.log")
    for script in (
        touched.tail(shell([str(root)]), ".console/node-0.log", 100),
        touched.read_from(shell([str(root)]), ".console/node-0.log", 1),
        touched.head(shell([str(root)]), ".console/node-0.log", 12),
        touched.follow(shell([str(root)]), ".console/node-0.log", "$$"),
    ):
        r = sh(script)
        assert r.returncode == touched.NOT_SAFE, r
        assert b"secret" not in r.stdout + r.stderr
        assert b"refused: " in r.stderr and b"not a regular file" in r.stderr
    assert sh(touched.is_file(shell([str(root)]), ".console/node-0.log")).returncode != 0
    assert sh(touched.age(shell([str(root)]), ".console/node-0.log")).stdout == b""


def test_a_console_directory_linked_to_a_host_directory_is_never_entered(job):
    root, secret = job
    (root / ".console").rmdir()
    os.symlink(secret.parent, root / ".console")
    (secret.parent / "node-0.log").write_bytes(SECRET)
    r = sh(touched.tail(shell([str(root)]), ".console/node-0.log", 100))
    assert r.returncode == touched.NOT_SAFE and b"secret" not in r.stdout
    assert b"refused: " in r.stderr and b"is not a directory" in r.stderr
    # Nothing is removed through it either...
    r = sh(touched.remove(shell([str(root)]), ".console", ["node-0.log"]))
    assert r.returncode == touched.NOT_SAFE
    assert (secret.parent / "node-0.log").read_bytes() == SECRET
    # ...and the start replaces the link with a directory of its own, the host's untouched.
    assert sh(touched.make_dir(shell([str(root)]), ".console")).returncode == 0
    assert (root / ".console").is_dir() and not (root / ".console").is_symlink()
    assert sorted(p.name for p in secret.parent.iterdir()) == ["node-0.log", "secret"]


def test_a_fifo_or_a_device_node_is_not_opened(job):
    root, _ = job
    os.mkfifo(root / ".console" / "node-0.log")
    start = time.monotonic()
    r = sh(touched.tail(shell([str(root)]), ".console/node-0.log", 100), timeout=5)
    assert r.returncode == touched.NOT_SAFE and time.monotonic() - start < 3
    if os.geteuid() == 0:  # a container holds CAP_MKNOD: a node for a host's disk, read as the host's root
        os.mknod(root / ".console" / "node-1.log", stat.S_IFCHR | 0o644, os.makedev(1, 8))  # /dev/random
        r = sh(touched.head(shell([str(root)]), ".console/node-1.log", 100), timeout=5)
        assert (r.returncode, r.stdout) == (touched.NOT_SAFE, b"")


def test_the_follow_waits_for_the_file_reads_it_whole_and_ends_with_its_process(job):
    root, _ = job
    log = root / ".console" / "node-0.log"
    script = f"sleep 1.5 & w=$!; {touched.follow(shell([str(root)]), '.console/node-0.log', '$w')}"
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE)
    time.sleep(0.3)
    log.touch()  # as the entrypoint makes it: empty first
    time.sleep(0.3)
    log.write_bytes(b"first\n")
    time.sleep(0.3)
    # The container swaps its file for a link after the follow opened it: still the file opened.
    os.rename(log, root / ".console" / "old")
    with open(root / ".console" / "old", "ab") as f:
        f.write(b"second\n")
    out, _ = proc.communicate(timeout=10)
    assert out == b"first\nsecond\n"


def test_remove_never_follows_the_last_name(job):
    root, secret = job
    os.symlink(secret, root / ".console" / "node-0.log")
    (root / ".console" / "node-0.log.end").write_text("0")
    r = sh(touched.remove(shell([str(root)]), ".console", ["node-0.log", "node-0.log.end"]))
    assert r.returncode == 0
    assert list((root / ".console").iterdir()) == [] and secret.read_bytes() == SECRET


def test_a_mount_source_must_be_this_accounts_directory_and_no_link(job, tmp_path):
    root, secret = job
    (root / "work").mkdir()
    check = touched.mount_sources_check([str(root), str(root / "work")])
    assert sh(f"{check} && echo mounted").stdout == b"mounted\n"
    (root / "work").rmdir()
    os.symlink(secret.parent, root / "work")
    r = sh(f"{check} && echo mounted")
    assert r.returncode == touched.NOT_SAFE and r.stdout == b""
    assert f"{root}/work is not a directory of".encode() in r.stderr


def test_the_heartbeat_age_is_the_files_and_none_for_a_link(job):
    root, secret = job
    (root / ".progress").mkdir()
    beat = root / ".progress" / "node-0"
    beat.touch()
    os.utime(beat, (time.time() - 30, time.time() - 30))
    age = sh(touched.age(shell([str(root)]), ".progress/node-0")).stdout
    assert 29 <= int(age) <= 40
    beat.unlink()
    os.symlink(secret, beat)
    assert sh(touched.age(shell([str(root)]), ".progress/node-0")).stdout == b""
