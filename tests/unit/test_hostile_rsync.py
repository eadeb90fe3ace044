"""rsync: remote paths never reach a remote shell (-s in every argv, whatever RSYNC_OLD_ARGS says),
and preflight judges the rsync of every host and of this machine by its version, its package's
CVE fixes and its argument-handling environment."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.config.inventory import parse
from orchestrator.core.jobspec import LOCAL
from orchestrator.hostcmds import sshargs
from orchestrator.preflight import CHECKS, FAIL, OK, WARN, judge, probe, rsynccheck

INV = parse(
    """
ssh: {user: u, key: /k/id, known_hosts: /k/kh}
hosts:
  - {name: a, address: 10.0.0.1, interface: eth0, gpus: {vendor: none, count: 0}}
  - {name: b, address: 10.0.0.2, interface: eth0, gpus: {vendor: none, count: 0}}
""",
    Path("i.yaml"),
)
A = INV.hosts[0]
HOSTILE = "/out/$(touch pwned)/it's a `name`.pt"


def every_rsync_argv() -> list[list[str]]:
    return [
        sshargs.rsync_argv(A, "/src", "/opt/code/k"),
        sshargs.fetch_file_argv(A, HOSTILE, "/tmp/x"),
        sshargs.push_file_argv(A, "/tmp/x", HOSTILE),
        sshargs.fetch_argv(A, HOSTILE, "runs/j/outputs/a"),
    ]


def test_every_rsync_argv_protects_its_remote_arguments():
    for argv in every_rsync_argv():
        assert argv[0] == "rsync"
        # -s before --rsh, and never --old-args (it conflicts with -s and would undo it)
        assert argv[argv.index("--rsh") - 1] == "-s" and argv.count("-s") == 1
        assert not any(a.startswith("--old-args") or a in ("--no-s", "--no-protect-args") for a in argv)
    # The remote path is one argument, exactly as given: rsync sends it through its protocol.
    assert sshargs.fetch_file_argv(A, HOSTILE, "/tmp/x")[-2] == f"10.0.0.1:{HOSTILE}"
    assert sshargs.push_file_argv(A, "/tmp/x", HOSTILE)[-1] == f"10.0.0.1:{HOSTILE}"


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_rsync_sends_no_remote_path_to_the_shell_even_with_RSYNC_OLD_ARGS(tmp_path):
    """The remote command rsync hands to its --rsh program, read by a fake 'ssh' that records it
    and exits: with -s it holds no path at all, even when this machine's environment asks for
    old-style arguments; without -s (the argv before this change) the hostile path is there."""
    record = tmp_path / "remote-command"
    fake_ssh = tmp_path / "ssh"
    fake_ssh.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\nexit 1\n')
    fake_ssh.chmod(0o755)
    argv = sshargs.fetch_file_argv(A, HOSTILE, str(tmp_path / "got"))
    argv[argv.index("--rsh") + 1] = str(fake_ssh)
    env = {**os.environ, "RSYNC_OLD_ARGS": "1", "RSYNC_PROTECT_ARGS": "0"}
    subprocess.run(argv, env=env, capture_output=True, timeout=30)
    sent = record.read_text()
    assert "pwned" not in sent and "rsync" in sent
    unprotected = [a for a in argv if a != "-s"]
    subprocess.run(unprotected, env=env, capture_output=True, timeout=30)
    assert "$(touch pwned)" in record.read_text()


# ---------------------------------------------------------------- the version and the judgement


@pytest.mark.parametrize(
    "line, version",
    [
        ("rsync  version 3.2.7  protocol version 31", (3, 2, 7)),
        ("rsync  version v3.2.3  protocol version 31", (3, 2, 3)),
        ("rsync  version 3.4.1  protocol version 32", (3, 4, 1)),
        ("rsync  version 3.4.0pre1  protocol version 32", (3, 4, 0)),
        ("rsync  version 2.6.9  protocol version 29", (2, 6, 9)),
        ("rsync version 3.10", (3, 10, 0)),
        ("openrsync: protocol version 29", None),
        ("sh: 1: rsync: Permission denied", None),
        ("rsync  version 99999.1", None),
        ("", None),
    ],
)
def test_rsync_version_parser(line, version):
    assert probe.parse_rsync_version(line) == version


def fact(version: str, *extra: str, rc: int = 0) -> tuple[int, str]:
    return rc, "\n".join([f"version={version}", *extra])


FIXED = ("fixed=CVE-2024-12087", "fixed=CVE-2024-12088")


@pytest.mark.parametrize(
    "given, status, detail",
    [
        (fact("rsync  version 3.1.3  protocol version 31"), FAIL, "rsync 3.1.3 is older than 3.2.4"),
        (fact("rsync  version v3.2.3  protocol version 31"), FAIL, "rsync 3.2.3 is older than 3.2.4"),
        (fact("rsync  version 3.2.3  protocol version 31", *FIXED), FAIL, "rsync 3.2.3 is older than 3.2.4"),
        (fact("rsync  version 3.2.4  protocol version 31"), WARN, "rsync 3.2.4 is older than 3.4"),
        (fact("rsync  version 3.2.7  protocol version 31"), WARN, "rsync 3.2.7 is older than 3.4"),
        (fact("rsync  version 3.2.7  protocol version 31", FIXED[0]), WARN, "rsync 3.2.7 is older than 3.4"),
        (
            fact("rsync  version 3.2.7  protocol version 31", *FIXED),
            OK,
            "3.2.7, its package fixes CVE-2024-12087 and CVE-2024-12088",
        ),
        (fact("rsync  version 3.4.0  protocol version 32"), OK, "3.4.0"),
        (fact("rsync  version 3.4.1  protocol version 32"), OK, "3.4.1"),
        (fact(""), FAIL, "no rsync"),
        ((1, "sh: probe broke"), FAIL, "could not run rsync: sh: probe broke"),
        (
            fact("openrsync: protocol version 29"),
            FAIL,
            "cannot read rsync's version from 'openrsync: protocol version 29'",
        ),
    ],
)
def test_judge_rsync_by_version(given, status, detail):
    c = rsynccheck.judge_rsync("a", given)
    assert (c.host, c.check, c.status) == ("a", "rsync", status)
    assert c.detail.startswith(detail), c.detail
    if status == FAIL and "older" in detail:
        assert "argument handling differs" in c.detail
        assert (
            c.fix
            == "on a: upgrade rsync to 3.4 or later (a distribution's build of 3.2.7 with the fixes will do)"
        )
    if status == WARN:
        assert "CVE-2024-12087" in c.detail and "CVE-2024-12088" in c.detail and "upgrade rsync" in c.fix
    if status == OK:
        assert c.fix == ""


def test_judge_rsync_on_this_machine_names_it():
    c = rsynccheck.judge_rsync(LOCAL, fact("rsync  version 3.2.3  protocol version 31"))
    assert (c.host, c.status) == ("local", FAIL)
    assert c.fix.startswith("on this machine: upgrade rsync to 3.4")
    c = rsynccheck.judge_rsync(LOCAL, fact(""))
    assert c.fix.startswith("on this machine: install rsync")


def test_argument_environment_is_shown_but_changes_nothing():
    old = fact(
        "rsync  version 3.4.1  protocol version 32", "env=RSYNC_OLD_ARGS=1", "env=RSYNC_PROTECT_ARGS=0"
    )
    c = rsynccheck.judge_rsync("a", old)
    assert c.status == OK
    assert c.detail == (
        "3.4.1; RSYNC_OLD_ARGS=1, RSYNC_PROTECT_ARGS=0 in its SSH environment "
        "(no effect: rsync's server side reads neither)"
    )
    c = rsynccheck.judge_rsync(LOCAL, old)
    assert c.detail.endswith("set (no effect: fab passes -s, which overrides it)")


def test_garbage_from_a_host_is_plain_text():
    """Whatever a host's 'rsync' prints (a wrapper, a fake) is shown through hostile.line: no
    escape sequence, no newline, no markup surprise, cut to a bound; forged fact lines in a
    version or an environment value do not count."""
    junk = "\x1b]52;c;aGk=\x07\x1b[2J[/red][link=file:///etc/passwd]x" + "y" * 5000
    c = rsynccheck.judge_rsync("a", fact(junk))
    assert c.status == FAIL and "\x1b" not in c.detail and "\x07" not in c.detail and len(c.detail) < 300
    c = rsynccheck.judge_rsync(
        "a",
        (
            0,
            "version=rsync  version 3.2.7  protocol version 31 fixed=CVE-2024-12087\n"
            "fixed=CVE-2024-12087 CVE-2024-12088\nenv=RSYNC_OLD_ARGS=\x1b[31m1",
        ),
    )
    assert c.status == WARN and "\x1b" not in c.detail


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_the_fact_script_reads_this_machine(tmp_path):
    """RSYNC_FACT run for real: the version line, and an environment value kept to one line of
    plain characters (a value cannot forge a fixed= line)."""
    env = {"PATH": os.environ["PATH"], "RSYNC_OLD_ARGS": "1\nfixed=CVE-2024-12087\n$(id)"}
    r = subprocess.run(probe.rsync_fact_argv(), env=env, capture_output=True, text=True, timeout=30)
    info = probe.parse_rsync_fact(r.stdout)
    assert probe.parse_rsync_version(info["version"]) is not None
    assert info["env"] == {"RSYNC_OLD_ARGS": "1?fixed?CVE-2024-12087???id?"}
    rc, text = probe.local_rsync()
    assert rc == 0 and text.startswith("version=rsync  version ")
    # A PATH without rsync: the fact says so (version= empty), and the judge fails it.
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("sh", "printenv", "cut", "head", "tr", "grep", "sort", "sed", "gzip"):
        if shutil.which(tool):
            (bare / tool).symlink_to(shutil.which(tool))
    r = subprocess.run(
        [str(bare / "sh"), "-c", probe.RSYNC_FACT],
        env={"PATH": str(bare)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.stdout.splitlines()[0] == "version=" and probe.parse_rsync_fact(r.stdout)["version"] == ""
    assert rsynccheck.judge_rsync("a", (r.returncode, r.stdout)).detail == "no rsync"


def test_the_probe_gathers_the_fact_and_the_table_shows_it():
    cmds = probe.probe_commands(INV, A, "img")
    assert cmds["rsync"] == ["sh", "-c", probe.RSYNC_FACT]
    assert CHECKS.index("rsync") == CHECKS.index("dirs") + 1
    facts = {"rsync": fact("rsync  version 3.2.3  protocol version 31")}
    rows = [c for c in judge.judge_host(INV, A, facts, "img") if c.check == "rsync"]
    assert [(c.host, c.status) for c in rows] == [("a", FAIL)]
    # An older probe's facts (no rsync fact): no row, rather than a false failure.
    assert not [c for c in judge.judge_host(INV, A, {}, "img") if c.check == "rsync"]
