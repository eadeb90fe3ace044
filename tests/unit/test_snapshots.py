"""Snapshots copied off the hosts and placed back, each copy checked by size and SHA-256: against a
recording stand-in for Session (files on the hosts held in memory) and real local files, with
rsync replaced by a scripted copy that can write wrong bytes or fail."""

import hashlib
import os
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import sshargs
from orchestrator.snapshots import checks, commands, listings, store
from orchestrator.transport.remote import CommandTimedOut, PerHost, Result

INV = parse(
    """\
ssh: {user: u, key: /k/id, known_hosts: /k/kh}
job: {output_dir: /out}
hosts:
  - {name: a, address: 10.0.0.1, interface: eth0}
  - {name: b, address: 10.0.0.2, interface: eth0}
""",
    Path("/i/inv.yaml"),
)
SPEC = jobspec.JobSpec(job_id="gpt-1", script="trainers/gpt.py")
A, B = INV.hosts
DIR = "/out/gpt-1/snapshots"
S10, S20, S30 = (f"snapshot-{s:09d}.pt" for s in (10, 20, 30))
DATA = {S10: b"step 10 " * 500, S20: b"step 20 " * 500, S30: b"step 30 " * 500}
LS = commands.list_command(INV, SPEC)
RSYNC_ERROR = "rsync: connection unexpectedly closed (0 bytes received so far) [Receiver]"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def corrupt(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def ok(stdout: str = "") -> Result:
    return Result(stdout, "", 0, 0.01)


class FakeSession:
    """Session.run and fan_out over files held in memory per host: records (host, command,
    deadline) and answers the commands snapshots/commands.py builds (ls, stat && sha256sum, mv, rm); an
    answer scripted in `script` for a (host, command) comes first."""

    def __init__(self, files: dict[str, dict[str, bytes]] | None = None) -> None:
        self.files = {h.name: {} for h in INV.hosts}
        for host, fs in (files or {}).items():
            self.files[host].update(fs)
        self.calls: list[tuple[str, str, float]] = []
        self.script: dict[tuple[str, str], list] = {}

    def run(self, host, command, timeout=60, stdin=None, what=""):
        assert timeout, f"no deadline: {command}"
        self.calls.append((host.name, command, timeout))
        scripted = self.script.get((host.name, command))
        if scripted:
            answer = scripted.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer
        fs = self.files[host.name]
        argv = shlex.split(command)
        if argv[:4] == ["{", "[", "!", "-L"]:  # commands.no_link_command: no links here
            argv = argv[argv.index("&&") + 1 :]
        if argv[:2] == ["ls", "-1"]:
            return ok(
                "".join(f"{p.rsplit('/', 1)[1]}\n" for p in sorted(fs) if p.rsplit("/", 1)[0] == argv[2])
            )
        if argv[0] == "stat":
            path = argv[3]
            if path not in fs:
                return Result("", f"stat: cannot statx '{path}': No such file or directory\n", 1, 0.01)
            return ok(f"{len(fs[path])}\n{sha(fs[path])}  {path}\n")
        if argv[:2] == ["mv", "-fT"]:
            fs[argv[3]] = fs.pop(argv[2])
            return ok()
        if argv[:2] == ["rm", "-f"]:
            fs.pop(argv[2], None)
            return ok()
        raise AssertionError(f"unexpected command {command!r}")

    def fan_out(self, fn, hosts=None):
        out = PerHost()
        for h in hosts:
            try:
                out[h.name] = fn(h)
            except BaseException as exc:  # noqa: BLE001 - as Session.fan_out collects them
                out[h.name] = exc
        return out

    def of(self, host: str) -> list[tuple[str, float]]:
        return [(c, t) for h, c, t in self.calls if h == host]


class FakeRsync:
    """subprocess.run for sshargs.fetch_file_argv / push_file_argv: copies between real local files and
    the session's host files. `plan` scripts the calls per host: "ok", "corrupt" (wrong bytes
    written, exit 0) or "fail" (nothing written, exit 12); "ok" once the script runs out."""

    def __init__(self, session: FakeSession, plan_by_host: dict[str, list[str]] | None = None) -> None:
        self.session = session
        self.plan = {h: list(p) for h, p in (plan_by_host or {}).items()}
        self.calls: list[list[str]] = []
        self.hosts = {h.ssh.hostname: h.name for h in INV.hosts}

    def _side(self, arg: str):
        if ":" in arg and not arg.startswith("/"):
            address, path = arg.split(":", 1)
            return self.hosts[address], path
        return None, arg

    def __call__(self, argv, capture_output=False, text=False):
        assert capture_output and text
        self.calls.append(argv)
        (src_host, src), (dst_host, dst) = self._side(argv[-2]), self._side(argv[-1])
        steps = self.plan.get(src_host or dst_host, [])
        what = steps.pop(0) if steps else "ok"
        if what == "fail":
            return subprocess.CompletedProcess(argv, 12, "", RSYNC_ERROR + "\n")
        data = self.session.files[src_host][src] if src_host else Path(src).read_bytes()
        if what == "corrupt":
            data = corrupt(data)
        if dst_host:
            self.session.files[dst_host][dst] = data
        else:
            Path(dst).write_bytes(data)
        return subprocess.CompletedProcess(argv, 0, "", "")


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(store, "RETRY_PAUSE", 0)


def make(tmp_path, session, plan_by_host=None, keep=2, local=()):
    reports: list[str] = []
    rsync = FakeRsync(session, plan_by_host)
    snaps = store.Snapshots(tmp_path / "gpt-1", INV, SPEC, keep=keep, report=reports.append, copy=rsync)
    for name in local:
        (snaps.dir / name).write_bytes(DATA[name])
    return snaps, reports, rsync


def digest(data: bytes) -> str:
    return str(listings.Digest(len(data), sha(data)))


# ---------------------------------------------------------------- the commands


@pytest.mark.parametrize(
    "command,expected",
    [
        (commands.list_command(INV, SPEC), "ls -1 /out/gpt-1/snapshots 2>/dev/null; true"),
        (commands.checksum_command(f"{DIR}/{S20}"), f"stat -c %s {DIR}/{S20} && sha256sum {DIR}/{S20}"),
        (
            commands.checksum_command("/o u t/it's.pt"),
            "stat -c %s '/o u t/it'\"'\"'s.pt' && sha256sum '/o u t/it'\"'\"'s.pt'",
        ),
        (
            commands.rename_command(f"{DIR}/.{S20}.copy.tmp", f"{DIR}/{S20}"),
            f"{{ [ ! -L {DIR} ] || {{ echo '{DIR} is a symbolic link; nothing is written through it' >&2; "
            "exit 1; }; } "
            f"&& mv -fT {DIR}/.{S20}.copy.tmp {DIR}/{S20}",
        ),
        (commands.remove_command(f"{DIR}/.{S20}.copy.tmp"), f"rm -f {DIR}/.{S20}.copy.tmp"),
    ],
)
def test_commands_are_quoted_once(command, expected):
    assert command == expected


def test_temp_name_is_never_taken_for_a_snapshot_and_the_trainer_clears_it():
    tmp = commands.temp_name(S20)
    assert tmp == f".{S20}.copy.tmp"
    assert listings.newest([tmp]) is None
    assert Path(tmp).match(".snapshot-*.tmp")  # trainers/snapshot.write removes these before each write


@pytest.mark.parametrize(
    "stdout,expected",
    [
        (f"4000\n{sha(b'x')}  {DIR}/{S20}\n", listings.Digest(4000, sha(b"x"))),
        (f"12\n\\{sha(b'x').upper()}  /o\\nut/x\n", listings.Digest(12, sha(b"x"))),  # escaped name
        ("", ValueError),
        (f"{sha(b'x')}  /f\n", ValueError),
        ("12\nnot-a-hash  /f\n", ValueError),
        ("12\n\n", ValueError),
    ],
)
def test_parse_checksum(stdout, expected):
    if expected is ValueError:
        with pytest.raises(ValueError):
            listings.parse_checksum(stdout)
    else:
        assert listings.parse_checksum(stdout) == expected


def test_local_digest(tmp_path):
    (tmp_path / "f").write_bytes(b"abc" * 1000000)
    assert checks.local_digest(tmp_path / "f") == listings.Digest(3000000, sha(b"abc" * 1000000))


# ---------------------------------------------------------------- fetch: host -> this machine

REMOTE20 = f"{DIR}/{S20}"
GONE = f"stat/sha256sum on the host exited 1: stat: cannot statx '{REMOTE20}': No such file or directory"
TIMED_OUT = CommandTimedOut(A, f"checksumming {REMOTE20}", checks.CHECKSUM_TIMEOUT)


@pytest.mark.parametrize(
    "copies,checksum_answers,n_copies,why",
    [
        (["ok"], [], 1, None),
        (["corrupt", "ok"], [], 2, None),
        (["fail", "ok"], [], 2, None),
        (
            ["corrupt"] * 3,
            [],
            3,
            f"the copy ({digest(corrupt(DATA[S20]))}) differs from the host's file ({digest(DATA[S20])})",
        ),
        (["fail"] * 3, [], 3, f"rsync exited 12: {RSYNC_ERROR}"),
        (
            [],
            [Result("", f"stat: cannot statx '{REMOTE20}': No such file or directory\n", 1, 0.01)] * 3,
            0,
            GONE,
        ),
        ([], [TIMED_OUT] * 3, 0, f"no checksum from the host: {TIMED_OUT}"),
    ],
    ids=[
        "first-try",
        "corrupt-then-ok",
        "fail-then-ok",
        "always-corrupt",
        "always-fail",
        "gone",
        "checksum-hangs",
    ],
)
def test_fetch_checks_each_copy_and_retries(tmp_path, copies, checksum_answers, n_copies, why, capsys):
    session = FakeSession({"a": {REMOTE20: DATA[S20]}})
    session.script[("a", commands.checksum_command(REMOTE20))] = list(checksum_answers)
    snaps, reports, rsync = make(tmp_path, session, {"a": copies}, local=[S10])

    fetched = snaps.fetch(session, A, S20)

    tries = n_copies if not checksum_answers else store.COPY_TRIES
    # Every try asks the host for the file's size and hash again, under its deadline.
    check = (commands.checksum_command(REMOTE20), checks.CHECKSUM_TIMEOUT)
    assert session.of("a") == [check] * tries
    tmp = snaps.dir / commands.local_temp_name(S20)
    assert rsync.calls == [sshargs.fetch_file_argv(A, REMOTE20, str(tmp))] * n_copies
    assert not tmp.exists()
    if why is None:
        assert fetched and reports == []
        assert (snaps.dir / S20).read_bytes() == DATA[S20]
    else:
        assert not fetched and not (snaps.dir / S20).exists()
        assert reports == [
            f"a: could not copy snapshot {S20} to {snaps.dir} in 3 tries (last: {why}); "
            f"still {S10} here to resume from. Check a's disk and the network if this repeats"
        ]
    assert capsys.readouterr() == ("", "")  # nothing printed: the caller's callback says it


def test_fetch_of_a_snapshot_not_newer_than_the_local_one_copies_nothing(tmp_path):
    session = FakeSession({"a": {f"{DIR}/{S10}": DATA[S10]}})
    snaps, reports, rsync = make(tmp_path, session, local=[S20])
    assert snaps.fetch(session, A, S10)
    assert session.calls == [] and rsync.calls == [] and reports == []


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_the_newest_keep_snapshots_are_kept_here(tmp_path, keep):
    names = [f"snapshot-{s:09d}.pt" for s in range(1, 8)]
    session = FakeSession({"a": {f"{DIR}/{n}": n.encode() * 10 for n in names}})
    snaps, reports, _ = make(tmp_path, session, keep=keep)
    (snaps.dir / "notes.txt").write_text("not a snapshot: left alone")
    for n in names:
        assert snaps.fetch(session, A, n)
    assert sorted(p.name for p in snaps.dir.iterdir()) == ["notes.txt", *names[-keep:]]
    assert snaps.local_newest() == names[-1] and reports == []


def test_keep_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep=0"):
        store.Snapshots(tmp_path, INV, SPEC, keep=0, report=print)


# ---------------------------------------------------------------- push: this machine -> hosts

REMOTE_TMP = f"{DIR}/{commands.temp_name(S20)}"
CHECK_TMP = (commands.checksum_command(REMOTE_TMP), checks.CHECKSUM_TIMEOUT)
MOVE = (commands.rename_command(REMOTE_TMP, REMOTE20), checks.LIST_TIMEOUT)
REMOVE = (commands.remove_command(REMOTE_TMP), checks.LIST_TIMEOUT)


def push(snaps, session, host, name) -> None:
    """Snapshots.push with the plan's place, place-check and place-rename steps for `host`
    (Layout.push_commands, as attempt.py renders them)."""
    argv, check, rename = snaps.layout.push_commands(host, snaps.inv, snaps.spec, name, snaps.dir)
    snaps.push(
        session,
        host,
        name,
        checks.local_digest(snaps.local_path(name)),
        argv=argv,
        check=check,
        rename=rename,
    )


def test_the_plans_check_is_what_the_push_reads():
    """The place-check step the plan shows is the command the push's own check would run: the
    checksum of the temporary copy (a set: the manifest of its temporary directory)."""
    here = Path("/runs/gpt-1/snapshots")
    argv, check, rename = commands.layout(SPEC).push_commands(B, INV, SPEC, S20, here)
    assert check == commands.checksum_command(REMOTE_TMP)
    assert rename == commands.rename_command(REMOTE_TMP, REMOTE20)
    assert argv == sshargs.push_file_argv(
        B, f"/runs/gpt-1/snapshots/{S20}", REMOTE_TMP, commands.no_link_command(DIR)
    )
    ckpt = jobspec.JobSpec(job_id="gpt-1", script="main.py", checkpoint=jobspec.checkpoint_pattern("ckpt/*"))
    name = "0" * 19 + "7"
    _, check, _ = commands.layout(ckpt).push_commands(B, INV, ckpt, name, Path("/runs/gpt-1/checkpoints"))
    assert check == commands.manifest_command(f"/out/gpt-1/{commands.PLACE_TMP.format(name)}")


@pytest.mark.parametrize(
    "copies,b_commands,why",
    [
        (["ok"], [CHECK_TMP, MOVE], None),
        (["corrupt", "ok"], [CHECK_TMP, REMOVE, CHECK_TMP, MOVE], None),
        (["fail", "ok"], [REMOVE, CHECK_TMP, MOVE], None),
        (
            ["corrupt"] * 3,
            [CHECK_TMP, REMOVE] * 3,
            f"the host's copy ({digest(corrupt(DATA[S20]))}) "
            f"differs from this machine's ({digest(DATA[S20])})",
        ),
        (["fail"] * 3, [REMOVE, REMOVE, REMOVE], f"rsync exited 12: {RSYNC_ERROR}"),
    ],
    ids=["first-try", "corrupt-then-ok", "fail-then-ok", "always-corrupt", "always-fail"],
)
def test_push_checks_each_copy_and_retries(tmp_path, copies, b_commands, why, capsys):
    session = FakeSession()
    snaps, reports, rsync = make(tmp_path, session, {"b": copies}, local=[S20])

    if why is None:
        push(snaps, session, B, S20)
        assert session.files["b"] == {REMOTE20: DATA[S20]}
        assert reports == []
    else:
        line = (
            f"b: could not place snapshot {S20} in {DIR} in 3 tries (last: {why}); check the host's disk "
            "space and SSH access, or leave it out so a spare takes its place"
        )
        with pytest.raises(UserError) as err:
            push(snaps, session, B, S20)
        assert str(err.value) == line and reports == [line]
        assert session.files["b"] == {}  # neither the snapshot's name nor a bad copy is left there
    assert session.of("b") == b_commands
    assert rsync.calls == [
        sshargs.push_file_argv(B, str(snaps.dir / S20), REMOTE_TMP, commands.no_link_command(DIR))
    ] * len(copies)
    assert capsys.readouterr() == ("", "")


def test_push_runs_exactly_the_commands_it_is_given(tmp_path):
    """What runs is the plan's steps, not commands the push builds again."""
    session = FakeSession()
    snaps, reports, rsync = make(tmp_path, session, local=[S20])
    session.script[("b", "the plan's check")] = [ok(f"{len(DATA[S20])}\n{sha(DATA[S20])}  -\n")]
    session.script[("b", "the plan's rename")] = [ok()]
    argv = ["rsync", "--the-plans", str(snaps.dir / S20), f"10.0.0.2:{REMOTE_TMP}"]
    snaps.push(
        session,
        B,
        S20,
        checks.local_digest(snaps.dir / S20),
        argv=argv,
        check="the plan's check",
        rename="the plan's rename",
    )
    assert rsync.calls == [argv]
    assert session.of("b") == [
        ("the plan's check", checks.CHECKSUM_TIMEOUT),
        ("the plan's rename", checks.LIST_TIMEOUT),
    ]
    assert reports == []


def test_holds_tells_the_same_bytes_from_the_same_name(tmp_path):
    """A host whose file has the name but not the bytes does not hold the snapshot: it is pushed
    again, and then holds it."""
    session = FakeSession({"a": {REMOTE20: b"something else"}, "b": {REMOTE20: DATA[S20]}})
    snaps, reports, rsync = make(tmp_path, session, local=[S20])
    want = checks.local_digest(snaps.dir / S20)
    assert not snaps.holds(session, A, REMOTE20, want) and snaps.holds(session, B, REMOTE20, want)
    push(snaps, session, A, S20)
    assert session.files["a"] == {REMOTE20: DATA[S20]} and session.files["b"] == {REMOTE20: DATA[S20]}
    assert snaps.holds(session, A, REMOTE20, want)
    assert [c[-1] for c in rsync.calls] == [f"10.0.0.1:{REMOTE_TMP}"] and reports == []


def test_a_copy_that_fails_from_one_holder_is_made_from_another(tmp_path):
    r30 = f"{DIR}/{S30}"
    session = FakeSession({"a": {r30: DATA[S30]}, "b": {r30: DATA[S30], REMOTE20: DATA[S20]}})
    snaps, reports, rsync = make(tmp_path, session, {"b": ["corrupt"] * 3}, local=[S10])
    assert [checks.remote_newest(session, h, INV, SPEC) for h in (A, B)] == [S30, S30]
    # b's copies of snapshot 30 are all bad; a's is good: 30 is here, and b's failure was told.
    assert not snaps.fetch(session, B, S30)
    assert snaps.fetch(session, A, S30)
    assert (snaps.dir / S30).read_bytes() == DATA[S30]
    assert sorted(p.name for p in snaps.dir.iterdir()) == [S10, S30]
    assert len(reports) == 1 and reports[0].startswith(f"b: could not copy snapshot {S30} to ")
    assert rsync.calls == [
        sshargs.fetch_file_argv(B, r30, str(snaps.dir / commands.local_temp_name(S30)))
    ] * 3 + [sshargs.fetch_file_argv(A, r30, str(snaps.dir / commands.local_temp_name(S30)))]


def test_no_snapshot_anywhere(tmp_path):
    session = FakeSession()
    snaps, reports, rsync = make(tmp_path, session)
    assert checks.remote_newest(session, A, INV, SPEC) is None
    assert checks.remote_newest(session, B, INV, SPEC) is None and snaps.local_newest() is None
    assert [c for _, c, _ in session.calls] == [LS, LS] and rsync.calls == [] and reports == []


def test_a_host_that_does_not_answer_is_skipped_when_looking(tmp_path):
    session = FakeSession({"b": {REMOTE20: DATA[S20]}})
    session.script[("a", LS)] = [CommandTimedOut(A, "listing snapshots", checks.LIST_TIMEOUT)]
    snaps, _, _ = make(tmp_path, session)
    assert checks.remote_newest(session, A, INV, SPEC) is None
    assert checks.remote_newest(session, B, INV, SPEC) == S20


# ---------------------------------------------------------------- follow


def wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_follow_reports_a_snapshot_that_fails_every_try_once(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "SNAPSHOT_POLL", 0.01)
    session = FakeSession({"a": {REMOTE20: DATA[S20]}})
    snaps, reports, rsync = make(tmp_path, session, {"a": ["fail"] * 3})
    stop = threading.Event()
    t = snaps.follow(session, A, stop)
    wait_for(lambda: reports)
    looks = len(session.calls)
    wait_for(lambda: len(session.calls) > looks + 5)  # later looks see the same name: not tried again
    stop.set()
    t.join(10)
    assert not t.is_alive()
    assert (
        len(rsync.calls) == 3
        and len(reports) == 1
        and reports[0].startswith(f"a: could not copy snapshot {S20}")
    )


def test_follow_looks_once_more_after_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "SNAPSHOT_POLL", 3600)  # no periodic look during the test
    session = FakeSession()
    snaps, reports, _ = make(tmp_path, session)
    stop = threading.Event()
    t = snaps.follow(session, A, stop)
    # The job writes its last snapshot and ends before the next periodic look.
    session.files["a"][REMOTE20] = DATA[S20]
    stop.set()
    t.join(10)
    assert not t.is_alive()
    assert (snaps.dir / S20).read_bytes() == DATA[S20] and reports == []
    assert [c for _, c, _ in session.calls] == [LS, commands.checksum_command(REMOTE20)]


# ---------------------------------------------------------------- the end-of-job fetch


def test_fetch_argv_leaves_the_snapshots_out():
    h = INV.hosts[1]
    assert sshargs.fetch_argv(h, "/out/gpt-1", "runs/gpt-1/outputs/b") == [
        "rsync",
        "--recursive",
        "--times",
        "--links",
        "--safe-links",
        "--timeout=60",
        "--exclude=/.console/",
        "--exclude=/snapshots/snapshot-[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9].pt",
        "--exclude=/snapshots/.snapshot-*",
        "-s",
        "--rsh",
        shell_ssh(),
        "10.0.0.2:/out/gpt-1/",
        "runs/gpt-1/outputs/b",
    ]


def shell_ssh() -> str:
    return (
        "ssh -F none -p 22 -l u -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile=/k/kh "
        "-o 'GlobalKnownHostsFile=/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2' "
        "-o ConnectTimeout=10 -o ServerAliveInterval=5 -o ServerAliveCountMax=3 -i /k/id -o "
        "IdentitiesOnly=yes"
    )


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")
def test_fetch_argv_filters_with_a_real_rsync(tmp_path):
    """The same filter rules, run by rsync on local directories: what the end-of-job fetch copies."""
    src, dest = tmp_path / "out", tmp_path / "fetched"
    files = {
        "metrics.jsonl": "m",
        ".console/node-0.log": "log",
        f"snapshots/{S10}": "s10",
        f"snapshots/{S20}": "s20",
        f"snapshots/.{S30}.123.tmp": "partial",
        f"snapshots/{commands.temp_name(S30)}": "copy",
        "snapshots/tokenizer.json": "mine",
        "sub/snapshots/snapshot-000000001.pt": "not the job's",
    }
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    argv = sshargs.fetch_argv(INV.hosts[0], str(src), str(dest))
    i = argv.index("--rsh")
    subprocess.run([*argv[:i], str(src) + "/", str(dest)], check=True)
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["metrics.jsonl", "snapshots/tokenizer.json", "sub/snapshots/snapshot-000000001.pt"]


# ---------------------------------------------------------------- a program's own checkpoints


class LocalSession:
    """Session.run as `sh -c` on this machine: the 'host' is a folder here (its output_dir)."""

    def run(self, host, command, timeout=60, stdin=None, what=""):
        r = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=timeout)
        return Result(r.stdout, r.stderr, r.returncode, 0.01)


def local_rsync(argv, **kw):
    """The real rsync with the host part of its paths dropped (the 'host' is a folder here)."""
    argv = list(argv)
    i = argv.index("--rsh")
    del argv[i : i + 2]
    argv[-2:] = [a.split(":", 1)[1] if a.startswith("10.0.0.") else a for a in argv[-2:]]
    return subprocess.run(argv, **kw)


def checkpoint_job(tmp_path, pattern="checkpoints/*"):
    inv = parse(
        f"job: {{output_dir: {tmp_path}/host}}\nhosts:\n  - "
        f"{{name: a, address: 10.0.0.1, interface: eth0}}\n",
        Path("/i/inv.yaml"),
    )
    spec = jobspec.JobSpec(job_id="j", script="main.py", checkpoint=jobspec.checkpoint_pattern(pattern))
    return inv, spec, tmp_path / "host" / "j" / "work" / "checkpoints"


def write_at(path: Path, data: bytes, ns: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, ns=(ns, ns))


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_programs_checkpoint_set_is_listed_copied_whole_and_put_back_whole(tmp_path):
    """model.pt + optim.pt of one epoch and a DCP directory: one set, copied here whole (real sh,
    find and rsync; the 'host' is a folder here), then placed whole on a host that lost it and holds
    an older, partial checkpoint instead."""
    inv, spec, work = checkpoint_job(tmp_path)
    old = time.time_ns() - 60 * 10**9
    write_at(work / "model.pt", b"model 9 " * 100, old)
    write_at(work / "optim.pt", b"optim 9 " * 100, old + 10**6)
    write_at(work / "dcp" / "__0_0.distcp", b"shard 0", old)
    write_at(work / "dcp" / ".metadata", b"meta", old + 2 * 10**6)
    write_at(work / "half" / "__0_0.distcp", b"being written", old)  # no .metadata yet: left out
    write_at(work / ".optim.pt.tmp", b"partial", old)  # hidden: never part of a set
    session, host = LocalSession(), inv.hosts[0]
    shape = commands.layout(spec)
    name = f"{old + 2 * 10**6:020d}"
    assert shape.read(session.run(host, shape.list_command(inv, spec)).stdout)[0] == [name]
    assert checks.remote_newest(session, host, inv, spec) == name
    assert shape.describe(name).startswith("checkpoints/* (written ")
    reports = []
    snaps = store.Snapshots(
        tmp_path / "runs" / "j", inv, spec, keep=1, report=reports.append, copy=local_rsync
    )
    assert snaps.fetch(session, host, name) and reports == []
    here = tmp_path / "runs" / "j" / "checkpoints" / name
    assert tree(here) == {
        "work/checkpoints/dcp/.metadata": b"meta",
        "work/checkpoints/dcp/__0_0.distcp": b"shard 0",
        "work/checkpoints/model.pt": b"model 9 " * 100,
        "work/checkpoints/optim.pt": b"optim 9 " * 100,
    }
    assert snaps.local_newest() == name and sorted(p.name for p in here.parent.iterdir()) == [name]
    assert snaps.fetch(session, host, name)  # already here: nothing copied
    # A host that lost it and holds another epoch's model.pt alone and a stray file: after the push
    # it holds exactly the set; the stray file is kept aside, not deleted.
    shutil.rmtree(tmp_path / "host" / "j")
    write_at(work / "model.pt", b"model 10", old + 10**9)
    write_at(work / "stray.pt", b"stray", old)
    digest = checks.local_digest(here)
    assert not snaps.holds(session, host, snaps.remote_path(name), digest)
    push(snaps, session, host, name)
    assert tree(tmp_path / "host" / "j" / "work") == {
        k.removeprefix("work/"): v for k, v in tree(here).items()
    }
    assert tree(tmp_path / "host" / "j" / commands.REPLACED) == {"work/checkpoints/stray.pt": b"stray"}
    assert snaps.holds(session, host, snaps.remote_path(name), digest)
    assert checks.remote_newest(session, host, inv, spec) == name  # the copies keep their times
    assert not list((tmp_path / "host" / "j").glob(".fabtrain-set-*"))  # no temporary copy left
    assert reports == []


def test_a_set_that_changes_while_it_is_copied_is_dropped_quietly(tmp_path):
    inv, spec, work = checkpoint_job(tmp_path)
    old = time.time_ns() - 60 * 10**9
    write_at(work / "model.pt", b"model 1", old)
    write_at(work / "optim.pt", b"optim 1", old)
    session, host = LocalSession(), inv.hosts[0]
    name = checks.remote_newest(session, host, inv, spec)

    def rsync_then_the_program_writes(argv, **kw):
        r = local_rsync(argv, **kw)
        write_at(work / "model.pt", b"model 2", old + 10**9)  # epoch 2 starts being written
        return r

    reports = []
    snaps = store.Snapshots(
        tmp_path / "runs" / "j", inv, spec, keep=2, report=reports.append, copy=rsync_then_the_program_writes
    )
    assert not snaps.fetch(session, host, name)
    assert snaps.local_newest() is None and list(snaps.dir.iterdir()) == [] and reports == []
    # Asked for a name that is no longer the host's set: nothing copied, nothing reported.
    assert not snaps.fetch(session, host, name) and reports == []


def test_keep_one_removes_the_only_copy_here_only_after_its_successor_is_checked(tmp_path):
    inv, spec, work = checkpoint_job(tmp_path, "checkpoints/ckpt.pt")
    old = time.time_ns() - 60 * 10**9
    write_at(work / "ckpt.pt", b"epoch 1", old)
    session, host = LocalSession(), inv.hosts[0]
    first = checks.remote_newest(session, host, inv, spec)
    copies = {"n": 0}

    def corrupting(argv, **kw):
        copies["n"] += 1
        r = local_rsync(argv, **kw)
        if copies["n"] > 1:  # every copy of the second checkpoint arrives with wrong bytes
            for p in Path(argv[-1]).rglob("ckpt.pt"):
                p.write_bytes(b"garbage")
        return r

    reports = []
    snaps = store.Snapshots(
        tmp_path / "runs" / "j", inv, spec, keep=1, report=reports.append, copy=corrupting
    )
    assert snaps.fetch(session, host, first)
    write_at(work / "ckpt.pt", b"epoch 2", old + 10**9)
    second = checks.remote_newest(session, host, inv, spec)
    assert not snaps.fetch(session, host, second)
    assert snaps.local_newest() == first  # the one complete copy is still here
    assert tree(snaps.local_path(first)) == {"work/checkpoints/ckpt.pt": b"epoch 1"}
    assert (
        len(reports) == 1
        and "differs from the host's files" in reports[0]
        and f"still {first} here" in reports[0]
    )


def test_a_copy_that_hangs_never_holds_the_lock_the_next_attempts_placement_needs(tmp_path):
    """A host frozen mid-copy: the follower's copy waits out its deadlines, while the next attempt
    places its snapshot (under the lock) at once."""
    import threading
    import time

    session = FakeSession({"a": {REMOTE20: DATA[S20]}})
    snaps, _, rsync = make(tmp_path, session, local=[S10])
    release, entered = threading.Event(), threading.Event()

    def frozen(argv, **kw):
        entered.set()
        release.wait(60)
        return rsync(argv, **kw)

    snaps.copy = frozen
    copier = threading.Thread(target=snaps.fetch, args=(session, A, S20), daemon=True)
    copier.start()
    assert entered.wait(5)
    start = time.monotonic()
    with snaps.lock:
        took = time.monotonic() - start
    release.set()
    copier.join(60)
    assert took < 30 and (snaps.dir / S20).read_bytes() == DATA[S20]  # not the frozen copy's 60 s


# ---------------------------------------------------------------- what an attempt places where


def test_our_snapshot_is_placed_on_rank_0s_host_only(tmp_path):
    """Our trainers read a snapshot on rank 0's host and send its bytes to the other ranks (load_agreed):
    a restart places it only where rank 0 runs, and checks only that host's copy."""
    from dataclasses import replace

    from orchestrator.backends.ssh import facts

    session = FakeSession({"a": {REMOTE20: DATA[S20]}})
    snaps, reports, rsync = make(tmp_path, session, local=[S20])
    ours = facts.newest_snapshot(session, snaps, INV, SPEC, INV.hosts, fetch=True)
    assert (ours.name, ours.missing) == (S20, ())  # b lacks it: its ranks get rank 0's bytes
    assert [(h, c.split()[0]) for h, c, _ in session.calls if not c.startswith("ls")] == [("a", "stat")]
    swapped = replace(INV, hosts=(B, A))  # rank 0 on b, which lacks it
    assert facts.newest_snapshot(session, snaps, swapped, SPEC, INV.hosts, fetch=True).missing == ("b",)
    assert rsync.calls == [] and reports == []
    # The job's end asks for the newest only: no attempt follows, no host reads it.
    done = facts.newest_snapshot(session, snaps, replace(INV, hosts=()), SPEC, INV.hosts, fetch=True)
    assert (done.name, done.missing) == (S20, ())
