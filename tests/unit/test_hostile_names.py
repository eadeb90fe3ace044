"""Names of checkpoints and snapshots read back from hosts are hostile: the NUL-separated listing
parser, checkpoint sets (which files belong together, when one is complete), and the local paths
they become. A real sh, find and rsync on this machine stand in for a host (a folder here)."""

import os
import posixpath
import random
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_snapshots import (
    local_rsync,  # the real rsync, the 'host' a folder here
    push,  # Snapshots.push with the plan's place steps
)

from orchestrator.config.inventory import parse
from orchestrator.core import hostile, jobspec
from orchestrator.core.errors import UserError
from orchestrator.snapshots import checks, commands, listings, store
from orchestrator.transport.remote import Result

PATTERN = "work/checkpoints/*"
NOW = 1_700_000_100 * 10**9


def listing(*records: str, now: str = "1700000100.000000000", end: bool = True) -> str:
    return "".join(r + "\0" for r in (now, *records, *(["end"] if end else [])))


def rec(path: str, size: int = 10, stamp: str = "1700000000.500000000") -> str:
    return f"{stamp} {size} {path}"


# ---------------------------------------------------------------- the parser

FAKE = "work/checkpoints/x\n00000000000000000000 /tmp/pwned-1234"


@pytest.mark.parametrize(
    "name,why",
    [
        (FAKE, "control characters or a newline"),
        ("/abs/ckpt.pt", "an absolute path"),
        ("work/checkpoints/../../../.ssh/authorized_keys", "'..' in"),
        ("work/checkpoints/a/../../b", "'..' in"),
        ("../x", "'..' in"),
        ("work/checkpoints/\x1b]52;c;aGk=\x07", "control characters"),
        ("work/checkpoints/a\rb", "control characters"),
        ("work/checkpoints/bad\x85", "control characters"),
        ("work/checkpoints/\ufffd.pt", "not UTF-8"),
        ("work/checkpoints//x", "not a plain path"),  # not as find writes it: refused, not cleaned
        ("work/other/ckpt.pt", "not a plain path matching"),  # a host naming a file outside the glob
        ("etc/passwd", "not a plain path matching"),
    ],
)
def test_hostile_names_are_refused_with_why(name, why):
    got = listings.parse_listing(listing(rec("work/checkpoints/good.pt"), rec(name)), PATTERN)
    assert [e.path for e in got.entries] == ["work/checkpoints/good.pt"]
    assert len(got.refused) == 1 and got.refused[0][0] == name and why in got.refused[0][1], got.refused
    assert got.whole


def test_a_newline_cannot_forge_a_record():
    """The finding of issue 31: a directory name holding a newline and a fake `STAMP /abs/path` line.
    The old newline-separated parser took the second line as a checkpoint at /tmp/pwned-1234."""
    out = listing(rec(FAKE + "/ckpt.pt"))
    got = listings.parse_listing(out, PATTERN)
    assert got.entries == () and got.refused[0][0] == FAKE + "/ckpt.pt"
    assert commands.Layout(PATTERN).read(out)[0] == []


@pytest.mark.parametrize(
    "name",
    [
        "work/checkpoints/$(touch x)",
        "work/checkpoints/x..",
        "work/checkpoints/ a b ",
        "work/checkpoints/-rf",
        "work/checkpoints/'q\"",
        "work/checkpoints/é/ü.pt",
    ],
)
def test_odd_but_safe_names_are_kept_as_they_are(name):
    got = listings.parse_listing(listing(rec(name)), PATTERN)
    assert [e.path for e in got.entries] == [name] and got.refused == ()


def test_hidden_files_are_skipped_but_dcp_metadata():
    got = listings.parse_listing(
        listing(
            rec("work/checkpoints/.x.pt.tmp"),
            rec("work/checkpoints/.tmp/a.pt"),
            rec("work/checkpoints/..x"),
            rec("work/checkpoints/..d/a.pt"),
            rec("work/checkpoints/s/.metadata"),
        ),
        PATTERN,
    )
    assert [e.path for e in got.entries] == ["work/checkpoints/s/.metadata"] and got.refused == ()


@pytest.mark.parametrize(
    "stdout",
    [
        listing(rec("work/checkpoints/a.pt"), end=False),  # find failed somewhere
        listing(rec("work/checkpoints/a.pt")) + "\n...[cut] (99 more bytes)\n",  # the output cap cut it
        listing(rec("work/checkpoints/a.pt"))[:-3],  # cut inside END
    ],
)
def test_a_listing_without_its_end_is_never_a_set(stdout):
    got = listings.parse_listing(stdout, PATTERN)
    assert not got.whole
    assert commands.Layout(PATTERN).read(stdout)[0] == []


@pytest.mark.parametrize(
    "record",
    [
        "x 10 work/checkpoints/a",
        "1.5 ten work/checkpoints/a",
        "1.5",
        "",
        "999999999999.0 1 work/checkpoints/a",
    ],
)
def test_records_that_are_not_finds_are_refused(record):
    got = listings.parse_listing(listing(record), PATTERN)
    assert got.entries == () and len(got.refused) == 1


def test_no_listing_at_all():
    assert listings.parse_listing("", PATTERN) is None
    assert listings.parse_listing("not a clock\0end\0", PATTERN) is None


def test_our_snapshot_names_are_whole_names_only():
    out = (
        "snapshot-000000010.pt\n../snapshot-000000099.pt\n/tmp/snapshot-000000098.pt\nsnapshot-000000020.pt "
        "\n"
        ".snapshot-000000030.pt.1.tmp\nsnapshot-000000040.pt\x1b\nsnapshot-1.pt\nsnapshot-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661\u0669.pt\n"
    )
    assert listings.parse_names(out) == ["snapshot-000000010.pt"]
    assert commands.Layout().read(out)[0] == ["snapshot-000000010.pt"]


# ---------------------------------------------------------------- fuzzed

ALPHABET = [
    "/",
    ".",
    "..",
    "../",
    "\n",
    "\0",
    "\x1b",
    " ",
    "\\",
    "~",
    "*",
    "$(",
    "\ufffd",
    "\u202e",
    "\x85",
    "work/checkpoints/",
    "00000000000000000000 ",
    "a",
    "é",
    "\U0001f600",
]


def random_name(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.3:  # random bytes, decoded as remote.py decodes a host's output
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))).decode(errors="replace")
    if kind < 0.5:  # random code points
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(1, 30)))
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 12)))


def test_fuzzed_names_are_refused_or_stay_inside_their_root(tmp_path):
    rng = random.Random(31)
    root = tmp_path / "runs" / "j" / "checkpoints" / "00000000000000000001"
    root.mkdir(parents=True)
    kept = refused = 0
    for _ in range(20000):
        name = random_name(rng)
        prefix = "work/checkpoints/" if rng.random() < 0.7 else ""
        out = listing(rec(prefix + name, rng.randrange(10**6)))
        got = listings.parse_listing(out, PATTERN)  # never raises
        names = [e.path for e in got.entries]
        refused += len(got.refused)
        for path in names:
            kept += 1
            assert not path.startswith("/") and ".." not in path.split("/") and "\0" not in path
            assert not any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in path), repr(path)
            assert posixpath.normpath(path) == path and listings.glob_matches(PATTERN, path)
            where = (root / path).resolve()
            assert root.resolve() in where.parents
            assert hostile.relpath(path, root=root) == path
    assert kept > 1000 and refused > 1000  # both kinds were exercised


def test_fuzzed_listings_never_raise_and_never_yield_an_unsafe_path():
    rng = random.Random(1031)
    pieces = ["\0", "end\0", " ", "1700000000.5", "10", "work/checkpoints/a", "/tmp/x", "\n", "..", "/"]
    for _ in range(5000):
        out = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 20)))
        got = listings.parse_listing(out, PATTERN)
        for e in got.entries if got else ():
            assert hostile.relpath(e.path) == e.path and listings.glob_matches(PATTERN, e.path)


# ---------------------------------------------------------------- sets


def entries(*specs) -> tuple:
    return tuple(listings.Entry(p, 1, ns) for p, ns in specs)


def test_a_set_is_every_file_named_by_the_newest():
    s = listings.checkpoint_set(entries(("work/checkpoints/model.pt", 5), ("work/checkpoints/optim.pt", 7)))
    assert s.name == "00000000000000000007" and s.paths == (
        "work/checkpoints/model.pt",
        "work/checkpoints/optim.pt",
    )


def test_a_dcp_directory_counts_once_its_metadata_is_written():
    done = (
        ("work/checkpoints/step_100/__0_0.distcp", 1),
        ("work/checkpoints/step_100/__1_0.distcp", 2),
        ("work/checkpoints/step_100/.metadata", 3),
    )
    writing = (("work/checkpoints/step_200/__0_0.distcp", 9),)
    s = listings.checkpoint_set(entries(*done, *writing))
    assert s.name == f"{3:020d}" and s.partial == ("work/checkpoints/step_200",)
    assert s.paths == tuple(sorted(p for p, _ in done))
    assert listings.checkpoint_set(entries(*writing)) is None
    whole = listings.checkpoint_set(entries(*done, *writing, ("work/checkpoints/step_200/.metadata", 10)))
    assert whole.name == f"{10:020d}" and whole.partial == () and len(whole.files) == 5


def test_settle_needs_two_equal_looks_apart_and_an_old_enough_newest_file():
    settle = listings.Settle(1.0)
    a = listings.Listing(NOW, entries(("work/checkpoints/model.pt", NOW - 5 * 10**9)))
    b = listings.Listing(
        NOW,
        entries(
            ("work/checkpoints/model.pt", NOW - 5 * 10**9), ("work/checkpoints/optim.pt", NOW - 5 * 10**9)
        ),
    )
    assert settle.see(a, 0.0) is None  # first look
    assert settle.see(b, 0.5) is None  # changed (optim.pt came): starts again
    assert settle.see(b, 1.0) is None  # same, but only 0.5 s apart
    got = settle.see(b, 1.6)
    assert got is not None and got.paths == ("work/checkpoints/model.pt", "work/checkpoints/optim.pt")
    fresh = listings.Listing(NOW, entries(("work/checkpoints/model.pt", NOW - 10**8)))
    settle = listings.Settle(1.0)
    settle.see(fresh, 0.0)
    assert settle.see(fresh, 5.0) is None  # by the host's clock it was written 0.1 s ago
    cut = listings.Listing(NOW, b.entries, whole=False)
    settle = listings.Settle(1.0)
    settle.see(b, 0.0)
    assert settle.see(cut, 2.0) is None and settle.see(b, 2.5) is None  # a cut listing starts again


# ---------------------------------------------------------------- local paths


@pytest.mark.parametrize(
    "pattern,name",
    [
        ("", "../x"),
        ("", "/tmp/x"),
        ("", "snapshot-000000001.pt\n"),
        ("", "a/b"),
        (PATTERN, "snapshot-000000001.pt"),
        (PATTERN, "/tmp/pwned"),
        (PATTERN, "../00000000000000000001"),
        (PATTERN, "\u0660" * 20),  # Arabic-Indic digits: \d takes them, a set's name is ASCII
    ],
)
def test_local_paths_only_for_well_formed_names(tmp_path, pattern, name):
    with pytest.raises(hostile.UnsafeName):
        commands.Layout(pattern).local(tmp_path, name)


def test_a_symlink_in_the_local_directory_cannot_lead_out(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    local = tmp_path / "checkpoints"
    local.mkdir()
    os.symlink(tmp_path / "elsewhere", local / "00000000000000000001")
    with pytest.raises(hostile.UnsafeName, match="leads out"):
        commands.Layout(PATTERN).local(local, "00000000000000000001")
    assert commands.Layout(PATTERN).local_names(local) == []


def test_a_plan_placeholder_after_the_stamp_never_reaches_a_path(tmp_path):
    shape = commands.Layout(PATTERN)
    assert shape.local(tmp_path, "00000000000000000000 PATH") == tmp_path / "00000000000000000000"


# ---------------------------------------------------------------- the commands, exactly


def test_set_commands_are_quoted_once():
    inv = parse(
        "job: {output_dir: /out}\nhosts:\n  - {name: a, address: 10.0.0.1, interface: eth0}\n",
        Path("/i/inv.yaml"),
    )
    spec = jobspec.JobSpec(job_id="j", script="main.py", checkpoint=PATTERN)
    assert commands.list_command(inv, spec) == (
        "cd /out/j 2>/dev/null && printf '%s\\0' \"$(date +%s.%N)\" && find . '(' -path "
        "'./work/checkpoints/*' "
        "-o -path './work/checkpoints/*/*' ')' -type f '(' '!' -name '.*' -o -name .metadata ')' "
        "-printf '%T@ %s %P\\0' && printf 'end\\0'; true"
    )
    assert commands.manifest_command("/out/j", ["work/checkpoints/$(touch x)"]).endswith(
        "sh 'work/checkpoints/$(touch x)'"
    )
    push, check, rename = commands.push_commands(
        inv.hosts[0], "runs/j/checkpoints/00000000000000000007", "/out/j", PATTERN
    )
    tmp = ".fabtrain-set-00000000000000000007.tmp"
    assert push[-2:] == ["runs/j/checkpoints/00000000000000000007/", f"10.0.0.1:/out/j/{tmp}/"]
    # The host's rsync starts only once whatever stood at the temporary name is gone (a link itself, not
    # its target: no trailing slash).
    assert push[push.index("--rsync-path") + 1] == f"rm -rf -- /out/j/{tmp} && rsync"
    assert "-s" in push and check.startswith(f"cd /out/j/{tmp} && find . -type f")
    words = shlex.split(rename)
    scripts = [w for w in words if "no()" in w]
    assert [w for w in words if w not in scripts] == [
        "cd",
        "/out/j",
        "&&",
        "sh",
        "-c",
        f"./{tmp}",
        "&&",
        "find",
        ".",
        "(",
        "-path",
        "./work/checkpoints/*",
        "-o",
        "-path",
        "./work/checkpoints/*/*",
        ")",
        "-type",
        "f",
        "-exec",
        "sh",
        "-c",
        f"./{tmp}",
        "{}",
        "+",
        "&&",
        "find",
        ".",
        "-mindepth",
        "2",
        "(",
        "-path",
        "./work/checkpoints/*",
        "-o",
        "-path",
        "./work/checkpoints/*/*",
        ")",
        "-type",
        "d",
        "-empty",
        "-delete",
        "&&",
        "find",
        f"./{tmp}",
        "-type",
        "f",
        "-exec",
        "sh",
        "-c",
        f"./{tmp}",
        "{}",
        "+",
        "&&",
        "rm",
        "-rf",
        "--",
        tmp,
    ]
    check_tmp, aside, move = scripts
    assert check_tmp.endswith(
        '[ -L "$0" ] && no "$0" "is a symbolic link"; [ -d "$0" ] || no "$0" "is not a directory"'
    )
    assert aside.endswith(
        'for f; do [ -e "$0/$f" ] && continue; dir ".fabtrain-replaced/${f%/*}"; '
        'spot ".fabtrain-replaced/$f"; mv -f -- "$f" ".fabtrain-replaced/$f" || exit 1; done'
    )
    assert move.endswith(
        'for f; do d=./${f#"$0"/}; dir "${d%/*}"; spot "$d"; mv -f -- "$f" "$d" || exit 1; done'
    )
    assert "mkdir -p" not in rename  # mkdir -p goes through links; dir() makes one component at a time
    # Without the glob (a caller that does not pass it), nothing is moved aside: "" would match every file.
    bare = commands.push_commands(inv.hosts[0], "runs/j/checkpoints/00000000000000000007", "/out/j")[2]
    assert [w for w in shlex.split(bare) if "no()" not in w] == [
        "cd",
        "/out/j",
        "&&",
        "sh",
        "-c",
        f"./{tmp}",
        "&&",
        "find",
        f"./{tmp}",
        "-type",
        "f",
        "-exec",
        "sh",
        "-c",
        f"./{tmp}",
        "{}",
        "+",
        "&&",
        "rm",
        "-rf",
        "--",
        tmp,
    ]
    assert commands.REPLACED not in bare


# ---------------------------------------------------------------- end to end, on this machine


class LocalSession:
    """Session.run as `sh -c` on this machine: the 'host' is a folder here (its output_dir)."""

    def run(self, host, command, timeout=60, stdin=None, what=""):
        r = subprocess.run(["sh", "-c", command], capture_output=True, timeout=timeout)
        return Result(
            r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"), r.returncode, 0.01
        )


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_a_program_naming_its_checkpoints_as_an_attacker_writes_nothing_outside(tmp_path, monkeypatch):
    """The finding, end to end with the real find, sh and rsync: a checkpoint directory whose name
    holds a newline and a fake line naming /tmp/pwned-*, names starting with '..' and holding
    `$(touch x)`: the good checkpoint and the odd-but-safe names are copied into runs/j, the forged
    one refused (once, naming the host), and nothing is written anywhere else."""
    monkeypatch.chdir(tmp_path)
    pwned = f"/tmp/pwned-{os.getpid()}-{time.time_ns()}"
    inv = parse(
        f"job: {{output_dir: {tmp_path}/host}}\nhosts:\n  - "
        f"{{name: a, address: 10.0.0.1, interface: eth0}}\n",
        Path("/i/inv.yaml"),
    )
    spec = jobspec.JobSpec(
        job_id="j", script="main.py", checkpoint=jobspec.checkpoint_pattern("checkpoints/")
    )
    ck = tmp_path / "host" / "j" / "work" / "checkpoints"
    evil = ck / f"x\n00000000000000000000 {pwned}"
    evil.mkdir(parents=True)
    (evil / "ckpt.pt").write_bytes(b"evil")
    (Path(str(evil) + "2")).write_bytes(b"evil file")
    (ck / "..hidden-ish").write_bytes(b"dots")
    (ck / "$(touch x)").write_bytes(b"shell")
    (ck / "model.pt").write_bytes(b"good")
    old = time.time_ns() - 60 * 10**9
    for p in ck.rglob("*"):
        os.utime(p, ns=(old, old))
    reports = []
    snaps = store.Snapshots(
        tmp_path / "runs" / "j", inv, spec, keep=2, report=reports.append, copy=local_rsync
    )
    session, host = LocalSession(), inv.hosts[0]
    for _ in range(3):  # as the follow thread and the planning look would, again and again
        name = checks.remote_newest(session, host, inv, spec, warn=snaps.warn)
    assert name and snaps.fetch(session, host, name)
    got = {
        p.relative_to(snaps.local_path(name)).as_posix()
        for p in snaps.local_path(name).rglob("*")
        if p.is_file()
    }
    # '..hidden-ish' is a hidden file (a temporary file, as rsync's): never part of a set, never refused.
    assert got == {"work/checkpoints/model.pt", "work/checkpoints/$(touch x)"}
    assert not os.path.exists(pwned) and not (tmp_path / "x").exists() and not Path("x").exists()
    assert len(reports) == 2 and all(r.startswith("a: ignored checkpoint ") for r in reports), reports
    assert all("control characters or a newline" in r and "\n" not in r for r in reports)
    # And back onto a host that lost it: the same names, nothing outside.
    shutil.rmtree(tmp_path / "host" / "j")
    push(snaps, session, host, name)
    assert (ck / "$(touch x)").read_bytes() == b"shell" and (ck / "model.pt").read_bytes() == b"good"
    assert not os.path.exists(pwned) and not (tmp_path / "x").exists()


# ---------------------------------------------------------------- links the container leaves

# Everything under the job's output directory (/output) is the container's: a link it leaves there
# must never have fabtrain write, or read back, through it. Real sh, find, mv and rsync on this
# machine; the 'host' is a folder here, the victim a folder beside it.

SET = f"{1_700_000_000 * 10**9:020d}"
FAKE_SSH = (
    "#!/bin/sh\n# ssh HOST COMMAND...: the command run here by sh, as sshd runs it with the user's shell\n"
    'shift\nexec sh -c "$*"\n'
)


def ssh_rsync(tmp_path: Path):
    """The real rsync through a stand-in for ssh that runs the host's side here with sh: what runs
    there before the host's rsync (--rsync-path) runs too, as on a host."""
    fake = tmp_path / "fake-ssh"
    fake.write_text(FAKE_SSH)
    fake.chmod(0o755)

    def copy(argv, **kw):
        argv = list(argv)
        argv[argv.index("--rsh") + 1] = str(fake)
        return subprocess.run(argv, **kw)

    return copy


def files_under(root: Path) -> dict[str, bytes]:
    """Every file and link under root (links by their target), to tell whether anything changed."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = b"-> " + os.readlink(p).encode()
        elif p.is_file():
            out[rel] = p.read_bytes()
        else:
            out[rel] = b"<dir>"
    return out


def placing(tmp_path: Path, local: dict[str, bytes], copy=None):
    """A job with --checkpoint /output/ckpt/* whose set `local` (paths under the job's output
    directory) is here in runs/j, its host's output directory (empty) and a victim: ~/.ssh."""
    inv = parse(
        f"job: {{output_dir: {tmp_path}/host}}\nhosts:\n  - "
        f"{{name: a, address: 10.0.0.1, interface: eth0}}\n",
        Path("/i/inv.yaml"),
    )
    spec = jobspec.JobSpec(
        job_id="j", script="main.py", checkpoint=jobspec.checkpoint_pattern("/output/ckpt/*")
    )
    root = tmp_path / "host" / "j"
    root.mkdir(parents=True)
    victim = tmp_path / "victim" / ".ssh"
    victim.mkdir(parents=True)
    (victim / "authorized_keys").write_bytes(b"ssh-ed25519 AAAA the user's own key\n")
    (victim / "id_ed25519").write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY----- the user's secret\n")
    reports: list[str] = []
    snaps = store.Snapshots(
        tmp_path / "runs" / "j", inv, spec, keep=2, report=reports.append, copy=copy or ssh_rsync(tmp_path)
    )
    for rel, data in local.items():
        (snaps.local_path(SET) / rel).parent.mkdir(parents=True, exist_ok=True)
        (snaps.local_path(SET) / rel).write_bytes(data)
    return snaps, reports, inv.hosts[0], root, victim


ATTACKER_KEY = b"ssh-ed25519 AAAA the attacker's key\n"


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
@pytest.mark.parametrize(
    "link,target,refused",
    [
        # The review's finding: .fabtrain-replaced/ckpt -> ../../../victim/.ssh and a real
        # ckpt/authorized_keys outside the set: moving it aside wrote it over the victim's.
        (".fabtrain-replaced/ckpt", "../../../victim/.ssh", ".fabtrain-replaced/ckpt is a symbolic link"),
        (".fabtrain-replaced", "../../victim", ".fabtrain-replaced is a symbolic link"),
    ],
)
def test_moving_aside_never_goes_through_a_link(tmp_path, link, target, refused):
    snaps, reports, host, root, victim = placing(tmp_path, {"ckpt/model.pt": b"model 7"})
    (root / "ckpt").mkdir()
    (root / "ckpt" / "authorized_keys").write_bytes(ATTACKER_KEY)
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, root / link)
    before = files_under(tmp_path / "victim")
    with pytest.raises(UserError) as err:
        push(snaps, LocalSession(), host, SET)
    assert files_under(tmp_path / "victim") == before  # nothing written there
    assert (root / "ckpt" / "authorized_keys").read_bytes() == ATTACKER_KEY  # not moved anywhere
    assert not (root / "ckpt" / "model.pt").exists() and not list(root.glob(".fabtrain-set-*"))
    assert str(err.value).startswith(
        f"a: did not place snapshot {SET} in {root}: {refused} in the job output "
        f"directory {root}; nothing is written through it. "
    )
    assert reports == [str(err.value)]  # refused once, not tried COPY_TRIES times


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
@pytest.mark.parametrize(
    "make,refused",
    [
        # The set's own folder a link to ~/.ssh: the set's ckpt/authorized_keys went over the victim's.
        (lambda root, victim: os.symlink(victim, root / "ckpt"), "ckpt is a symbolic link"),
        (
            lambda root, victim: (root / "ckpt").write_bytes(b"a file where the folder goes"),
            "ckpt is not a directory",
        ),
    ],
)
def test_placing_a_set_never_goes_through_a_link_to_its_folder(tmp_path, make, refused):
    snaps, reports, host, root, victim = placing(
        tmp_path, {"ckpt/authorized_keys": ATTACKER_KEY, "ckpt/model.pt": b"model 7"}
    )
    make(root, victim)
    before = files_under(tmp_path / "victim")
    with pytest.raises(UserError, match=f": {refused} in the job output directory"):
        push(snaps, LocalSession(), host, SET)
    assert files_under(tmp_path / "victim") == before
    assert len(reports) == 1 and not list(root.glob(".fabtrain-set-*"))


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_a_link_at_a_files_own_place_is_replaced_and_links_elsewhere_are_left_alone(tmp_path):
    """A link where a file of the set goes is replaced by the file (mv would have moved the file
    into the folder the link points to); the working directory's links into the code, and any
    other link under the job's output directory, are none of placing's business."""
    snaps, reports, host, root, victim = placing(
        tmp_path, {"ckpt/model.pt": b"model 7", "ckpt/sub/optim.pt": b"o"}
    )
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "main.py").write_text("print()")
    (root / "work").mkdir()
    os.symlink(tmp_path / "code" / "main.py", root / "work" / "main.py")
    os.symlink(tmp_path / "code", root / "code-link")
    (root / "ckpt").mkdir()
    os.symlink(victim, root / "ckpt" / "model.pt")
    before = files_under(tmp_path / "victim")
    push(snaps, LocalSession(), host, SET)
    assert files_under(tmp_path / "victim") == before and reports == []
    assert files_under(root) == {
        "ckpt": b"<dir>",
        "ckpt/model.pt": b"model 7",
        "ckpt/sub": b"<dir>",
        "ckpt/sub/optim.pt": b"o",
        "code-link": b"-> " + str(tmp_path / "code").encode(),
        "work": b"<dir>",
        "work/main.py": b"-> " + str(tmp_path / "code" / "main.py").encode(),
    }


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_a_link_at_the_temporary_folders_name_is_removed_before_rsync_writes(tmp_path):
    """The temporary folder's name is predictable (the set's time, which the program sets): made a
    link to the victim beforehand, rsync --mkpath wrote the set into the link's target."""
    snaps, reports, host, root, victim = placing(tmp_path, {"ckpt/model.pt": b"model 7"})
    os.symlink(victim, root / commands.PLACE_TMP.format(SET))
    before = files_under(tmp_path / "victim")
    push(snaps, LocalSession(), host, SET)
    assert files_under(tmp_path / "victim") == before and reports == []
    assert files_under(root) == {"ckpt": b"<dir>", "ckpt/model.pt": b"model 7"}


class SwappingSession(LocalSession):
    """The program's move between fabtrain's looks: just before the host's checksums are taken, the
    set's folder becomes a link to the victim's ~/.ssh; it is put back right after (the failed
    checksums, or the rsync that follows them), before the second listing."""

    def __init__(self, root: Path, victim: Path) -> None:
        self.root, self.victim, self.swapped = root, victim, False

    def swap(self) -> None:
        (self.root / "ckpt").rename(self.root / "ckpt.real")
        os.symlink(self.victim, self.root / "ckpt")
        self.swapped = True

    def back(self) -> None:
        if self.swapped:
            (self.root / "ckpt").unlink()
            (self.root / "ckpt.real").rename(self.root / "ckpt")
            self.swapped = False

    def run(self, host, command, timeout=60, stdin=None, what=""):
        if "sha256sum" in command:
            self.swap()
        r = super().run(host, command, timeout, stdin, what)
        if not r.ok:
            self.back()
        return r


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_a_set_folder_swapped_for_a_link_between_two_looks_is_never_read(tmp_path):
    """_fetch_set compared only the paths of its listing and the host's checksums: the checksums and
    rsync read the victim's files through the link, and the second listing, after the folder was
    put back, matched the first. Now the checksums refuse a file whose real path is not its path."""
    snaps, reports, host, root, victim = placing(tmp_path, {}, copy=None)
    session = SwappingSession(root, victim)
    old = time.time_ns() - 60 * 10**9
    for name in ("id_ed25519", "authorized_keys"):
        (root / "ckpt").mkdir(exist_ok=True)
        (root / "ckpt" / name).write_bytes(b"a decoy of the same name")
        os.utime(root / "ckpt" / name, ns=(old, old))

    def rsync_then_put_back(argv, **kw):
        r = local_rsync(argv, **kw)
        session.back()
        return r

    snaps.copy = rsync_then_put_back
    name = checks.remote_newest(LocalSession(), host, snaps.inv, snaps.spec)
    assert name and not snaps.fetch(session, host, name)
    secret = (victim / "id_ed25519").read_bytes()
    assert not any(p.is_file() and p.read_bytes() == secret for p in (tmp_path / "runs").rglob("*"))
    assert snaps.local_newest() is None
    assert (
        len(reports) == 1
        and "fabtrain: refused: ckpt/authorized_keys is not a plain file at its path in" in reports[0]
        and "\n" not in reports[0]
    ), reports


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_checksums_that_read_other_sizes_than_the_listing_are_not_copied(tmp_path):
    snaps, reports, host, root, victim = placing(tmp_path, {}, copy=None)
    old = time.time_ns() - 60 * 10**9
    (root / "ckpt").mkdir()
    (root / "ckpt" / "model.pt").write_bytes(b"model 1")
    os.utime(root / "ckpt" / "model.pt", ns=(old, old))
    copies = []

    class Growing(LocalSession):  # the file grows between the listing and the checksums, its time kept
        def run(self, host, command, timeout=60, stdin=None, what=""):
            if "sha256sum" in command:
                with open(root / "ckpt" / "model.pt", "ab") as fh:
                    fh.write(b"+")
                os.utime(root / "ckpt" / "model.pt", ns=(old, old))
            return super().run(host, command, timeout, stdin, what)

    snaps.copy = lambda argv, **kw: copies.append(argv) or local_rsync(argv, **kw)
    name = checks.remote_newest(LocalSession(), host, snaps.inv, snaps.spec)
    assert not snaps.fetch(Growing(), host, name)
    assert copies == []  # nothing copied on checksums that do not match the listing
    assert (
        len(reports) == 1
        and "the host's checksums read other sizes than its listing: 'ckpt/model.pt'" in reports[0]
    )
