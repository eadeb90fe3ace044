"""Shared directories on hosts (hostfiles.shared_dir_script, claims, hostops) and the preflight's smoke
test sharing hosts like any job (preflight/smoke.py): the exact scripts, the modes they leave when
run by sh on this machine, and the smoke test's choice, claim and release against a stand-in session.
Also what another account of the group can plant there (links at a lock's, a directory's, a stop
marker's, a secrets file's or an image-cache file's name, a directory swapped while a claim waits for
the lock): run by sh, nothing is followed, read, chmod-ed or written through."""

import fcntl
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from test_job import Recorder

from orchestrator.backends.ssh.nodefollow import NodeEnd
from orchestrator.backends.ssh.watch import Watched
from orchestrator.config.inventory import parse
from orchestrator.hostcmds import hostfiles
from orchestrator.hosts import claims, hostops
from orchestrator.hosts.survey import HostJobs
from orchestrator.preflight import probe, smoke
from orchestrator.transport.remote import PerHost, Result, put_command

INV = parse(
    "job: {output_dir: /opt/o ut}\nhosts:\n  - {name: n1, address: 10.0.0.1, interface: eth0}\n",
    Path("i.yaml"),
)


def test_shared_directories_are_made_group_writable_setgid_and_checked_with_the_fix():
    c = "'/opt/o ut/.claims'"
    assert hostfiles.shared_dir_script(c) == (
        f"if [ -L {c} ]; then printf '%s is a symbolic link, not a directory: another account may have put "
        "it "
        f"there; remove it (rm %s) and run again\\n' {c} {c} >&2; exit 6; fi; mkdir -p {c} || exit 6; "
        f"{{ ( cd -P {c} && [ ! -L {c} ] && [ {c} -ef . ] && [ -O . ] && chmod g+rwxs . ); }} 2>/dev/null; "
        f"[ -w {c} ] || {{ printf '%s is not writable by %s (owner %s): its owner can share it with the "
        "group: "
        f'chmod g+rwxs %s; chgrp GROUP %s\\n\' {c} "$(id -un)" "$(stat -c %U {c})" {c} {c} >&2; exit 6; }}; '
    )
    assert hostfiles.shared_dir_script('"$d"', sticky=True, check=False) == (
        hostfiles.not_link_script('"$d"')
        + 'mkdir -p "$d" || exit 6; { ( cd -P "$d" && [ ! -L "$d" ] && [ "$d" -ef . ] '
        "&& [ -O . ] && chmod g+rwxs,+t . ); } 2>/dev/null; "
    )
    assert hostfiles.enter_script('"$d"') == (
        'cd -P "$d" && [ ! -L "$d" ] && [ "$d" -ef . ] || { printf \'%s changed while this command entered '
        "it "
        '(another account may have put a link there): run again\\n\' "$d" >&2; exit 6; }; '
    )


def test_the_runtime_directory_is_the_accounts_own_and_the_stop_marker_lies_beside_it():
    rt = "'/opt/o ut/.runtime'"
    own = "'/opt/o ut/.runtime/gpt-1'"
    assert hostfiles.own_runtime_script(INV, "gpt-1") == (
        hostfiles.shared_dir_script(rt, sticky=True) + f"mkdir -m 0711 {own} 2>/dev/null; if [ -L {own} ] || "
        f"[ ! -d {own} ] || [ ! -O {own} ]; then printf '%s is not a directory of %s; another account made "
        "it: "
        f'job ids are never reused, so remove it (its owner or root)\\n\' {own} "$(id -un)" >&2; exit 7; fi; '
        f"( cd -P {own} && [ ! -L {own} ] && [ {own} -ef . ] && [ -O . ] && chmod 0711 . && touch lease )"
    )
    assert hostfiles.stopped_marker(INV, "gpt-1") == "/opt/o ut/.runtime/.stopped/gpt-1"
    assert hostfiles.stop_mark_script(INV, ["a-1", "b-2"]) == (
        hostfiles.shared_dir_script(rt, sticky=True, check=False)
        + hostfiles.shared_dir_script("'/opt/o ut/.runtime/.stopped'")
        + "umask 022; [ -e '/opt/o ut/.runtime/.stopped/a-1' ] || ( set -C; : > '/opt/o "
        "ut/.runtime/.stopped/a-1' ); "
        "[ -e '/opt/o ut/.runtime/.stopped/b-2' ] || ( set -C; : > '/opt/o ut/.runtime/.stopped/b-2' )"
    )
    # A smoke test's own runtime directory (no units): the stop marker cleared, the directory made.
    assert claims.claim_script(INV, "gpt-1", None, "al@ws", True) == (
        "rm -f '/opt/o ut/.runtime/.stopped/gpt-1'; " + hostfiles.own_runtime_script(INV, "gpt-1")
    )
    assert claims.release_command(INV, ["gpt-1"]) == (
        "d='/opt/o ut/.claims'/\"$(hostname)\"; rm -rf '/opt/o ut/.runtime/gpt-1' '/opt/o "
        "ut/.runtime/.stopped/gpt-1'; "
        'rm -f "$d"/gpt-1 "$d"/queue/gpt-1'
    )


def test_the_claim_script_shares_its_lock_and_files_with_the_group():
    s = claims.claim_script(INV, "gpt-1", (0, 1), "al@ws", True, 29500)
    assert s.startswith(
        "d='/opt/o ut/.claims'/\"$(hostname)\"; "
        + hostfiles.shared_dir_script("'/opt/o ut/.claims'", check=False)
        + hostfiles.shared_dir_script('"$d"')
        + "( umask 022; "
        + hostfiles.enter_script('"$d"')
        + 'd=.; { [ ! -L "$d"/.lock ] || rm -f "$d"/.lock; }; { command exec 9<>"$d"/.lock; } '
        '2>/dev/null || command exec 9<"$d"/.lock || exit 6; [ -f "$d"/.lock ] && [ ! -L "$d"/.lock ] '
        '&& [ "$d"/.lock -ef /dev/fd/9 ] || { printf \'%s/.lock is not a plain file (another account '
        'may have put a link there): remove it (rm %s/.lock) and run again\\n\' "$PWD" "$PWD" >&2; '
        'exit 6; }; { [ -O /dev/fd/9 ] && [ "$(stat -L -c %h /dev/fd/9)" = 1 ] && chmod 0664 /dev/fd/9; '
        "} 2>/dev/null; flock -w 10 9 || "
    )
    assert 'for f in "$d"/*; do [ "$f" = "$d"/gpt-1 ] && continue; ' in s and 'entry "$f" || continue; ' in s
    assert s.endswith(
        hostfiles.own_runtime_script(INV, "gpt-1") + ' && rm -f "$d"/.gpt-1.tmp && ( set -C; printf '
        '"who=%s\\nsince=%s\\nunits=%s\\nport=%s\\n" al@ws "$now" 0,1 29500 > "$d"/.gpt-1.tmp ) && '
        'mv -T "$d"/.gpt-1.tmp "$d"/gpt-1 )'
    )
    survey = claims.survey_script(INV)
    assert (
        '( cd -P "$d" 2>/dev/null && [ ! -L "$d" ] && [ "$d" -ef . ] && for f in ./*; do case "${f##*/}" in '
        '*[!A-Za-z0-9._-]*) continue;; esac; [ -f "$f" ] && [ ! -L "$f" ] && '
        'echo "$(basename "$f") $(tr "\\n" " " < "$f")"; done ); echo @@queue; '
    ) in survey
    # The queue's directory likewise: entered and checked, links never read.
    assert (
        '( q="$d"/queue; cd -P "$q" 2>/dev/null && [ ! -L "$q" ] && [ "$q" -ef . ] && for f in ./*; do '
        'case "${f##*/}" in *[!A-Za-z0-9._-]*) continue;; esac; [ -f "$f" ] && [ ! -L "$f" ] && '
    ) in survey


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_modes_left_by_a_claim_under_a_narrow_umask(tmp_path):
    """Run by sh here (one account): what the other accounts of the group are given, whatever this
    one's umask; an older version's narrow directories of this account are widened."""
    inv = parse(
        f"job: {{output_dir: {tmp_path}/out}}\nhosts:\n  - {{address: h, interface: eth0}}\n", Path("i.yaml")
    )
    (tmp_path / "out" / ".runtime").mkdir(parents=True, mode=0o700)  # as an older version left it
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "docker").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "bin" / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}/bin:{os.environ['PATH']}"}
    r = subprocess.run(
        ["sh", "-c", "umask 077; " + claims.claim_script(inv, "gpt-1", (0,), "al@ws", True, 29500)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    host = next((tmp_path / "out" / ".claims").iterdir())
    setgid = stat.S_ISGID
    assert mode(tmp_path / "out" / ".claims") == 0o770 | setgid and mode(host) == 0o770 | setgid
    assert mode(tmp_path / "out" / ".runtime") == 0o770 | setgid | stat.S_ISVTX
    assert mode(host / ".lock") == 0o664 and mode(host / "gpt-1") == 0o644
    assert mode(tmp_path / "out" / ".runtime" / "gpt-1") & 0o777 == 0o711
    m = subprocess.run(["sh", "-c", "umask 077; " + hostfiles.stop_mark_script(inv, ["gpt-1"])], env=env)
    assert m.returncode == 0 and Path(hostfiles.stopped_marker(inv, "gpt-1")).exists()
    assert mode(tmp_path / "out" / ".runtime" / ".stopped") == 0o770 | setgid
    # A link where the job's runtime directory goes is refused, never followed.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out" / ".runtime" / "gpt-2").symlink_to(tmp_path / "elsewhere")
    r = subprocess.run(
        ["sh", "-c", claims.claim_script(inv, "gpt-2", (1,), "al@ws", True)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == hostfiles.NOT_OWN and "is not a directory of" in r.stderr
    assert not (host / "gpt-2").exists() and list((tmp_path / "elsewhere").iterdir()) == []


def test_left_over_runtime_of_another_account_is_kept_and_named():
    assert hostops.clear_stale_script(INV, ["a-1", "../x"]) == (
        "if [ -O '/opt/o ut/.runtime/a-1' ] || [ \"$(id -u)\" = 0 ]; then rm -rf '/opt/o ut/.runtime/a-1' "
        "'/opt/o ut/.runtime/.stopped/a-1' && echo removed a-1; else echo kept a-1 "
        "\"$(stat -c %U '/opt/o ut/.runtime/a-1' 2>/dev/null)\"; fi"
    )
    assert hostops.parse_clear_stale("removed a-1\nkept b-2 alice\nkept ../x bob\nkept c-3 \x1b[2Jeve\n") == (
        ["a-1"],
        {"b-2": "alice", "c-3": "[2Jeve"},
    )


def test_the_master_port_passes_over_ports_other_jobs_claimed():
    out = (
        "LISTEN 0 4096 *:29500 *:*\n@@claims\n2\n"
        "job-a who=bob@ws since=1 units=0 port=29501\njob-b who=al@ws since=1 units=1 port=\n"
    )
    assert hostops.parse_ports(out, 29500) == 29502
    assert hostops.port_script(INV).startswith("ss -Htln; echo @@claims; nproc; ")


CPU2 = parse(
    "job: {nproc_per_node: 2}\nhosts:\n  - {name: n1, address: 10.0.0.1, interface: eth0}\n"
    "  - {name: n2, address: 10.0.0.2, interface: eth0}\n",
    Path("i.yaml"),
)
GPU = parse(
    "hosts:\n  - {name: g1, address: 10.0.0.1, interface: eth0, gpus: {vendor: nvidia, count: 4}}\n"
    "  - {name: g2, address: 10.0.0.2, interface: eth0, gpus: {vendor: amd, count: 2}}\n",
    Path("g.yaml"),
)


def jobs(cpus=2, claimed=(), running=None) -> HostJobs:
    return HostJobs(
        running or {},
        frozenset(running or ()),
        {c.job: 1.0 for c in claimed},
        cpus=cpus,
        claimed=tuple(claimed),
    )


BOB = claims.Holder("bob-1", "bob@ws", 0.0, (0,), 29500)


def test_the_smoke_test_takes_only_free_units_the_same_number_everywhere():
    assert smoke.choose(CPU2, PerHost(n1=jobs(), n2=jobs())) == {"n1": (0, 1), "n2": (0, 1)}
    assert smoke.choose(CPU2, PerHost(n1=jobs(claimed=[BOB]), n2=jobs())) == {"n1": (1,), "n2": (0,)}
    # Every GPU free ones of each host, as many as the host with the fewest has.
    g = PerHost(g1=jobs(claimed=[claims.Holder("bob-1", units=(0, 2))]), g2=jobs())
    assert smoke.choose(GPU, g) == {"g1": (1, 3), "g2": (0, 1)}
    narrowed = smoke.narrow(GPU, {"g1": (1, 3), "g2": (0, 1)}, 29501)
    assert [h.env for h in narrowed.hosts] == [
        (("CUDA_VISIBLE_DEVICES", "1,3"),),
        (("HIP_VISIBLE_DEVICES", "0,1"),),
    ]
    assert narrowed.job.master_port == 29501
    # A host with nothing free (a job with no claim file holds the whole host): skipped, naming it.
    rows = smoke.choose(CPU2, PerHost(n1=jobs(running={"old-1": 0}), n2=jobs()))
    assert [(c.host, c.status) for c in rows] == [("n1", smoke.SKIP), ("n2", smoke.SKIP)]
    assert (
        rows[0].detail.startswith("no free slot here: held by old-1 (started by unknown")
        and rows[1].detail == "not run: n1 has no free GPU/slot"
    )
    # Within a job (fab train --smoke): that job's own units.
    assert smoke.choose(CPU2, PerHost(n1=jobs(claimed=[BOB]), n2=jobs(claimed=[BOB])), within="bob-1") == {
        "n1": (0,),
        "n2": (0,),
    }


class Stand:
    """Session's interface for the smoke test: answers the survey, the port look-up and the claims."""

    def __init__(self, hosts, claim_codes=()):
        self.hosts, self.calls, self.claim_codes = hosts, [], list(claim_codes)

    def run(self, host, command, timeout=60, stdin=None, what=""):
        self.calls.append((host.name, command))
        if command.startswith("ss -Htln"):
            return Result("LISTEN 0 4096 *:29500 *:*\n@@claims\n2\n", "", 0, 0.01)
        if command.startswith("docker ps"):  # survey.survey_script
            return Result("@@runtime\n@@claims\n2\n", "", 0, 0.01)
        if "flock" in command:
            return Result("", "", self.claim_codes.pop(0) if self.claim_codes else 0, 0.01)
        return Result("", "", 0, 0.01)

    fan_out = Recorder.fan_out  # as Session.fan_out, one host after the other


def test_the_smoke_test_claims_with_an_owner_and_releases_even_when_interrupted(tmp_path, monkeypatch):
    monkeypatch.setenv("FABTRAIN_USER", "alice")
    monkeypatch.setattr(smoke, "RUNS", tmp_path)
    seen = []

    def run_job(session, inv, spec, run_dir):
        seen.append((inv, spec))
        raise KeyboardInterrupt

    # The first claim on n1 loses to another job planned at the same moment: surveyed and claimed again.
    s = Stand(CPU2.hosts, claim_codes=[claims.REFUSED])
    with pytest.raises(KeyboardInterrupt):
        smoke.smoke_test(s, CPU2, None, [], run_job)
    inv, spec = seen[0]
    assert spec.owner.startswith("alice@") and spec.nproc_per_node == "2" and inv.job.master_port == 29501
    claims_run = [(h, c) for h, c in s.calls if "flock" in c]
    assert [h for h, _ in claims_run] == ["n1", "n1", "n2"]
    assert claims_run[1][1] == claims.claim_script(inv, spec.job_id, (0, 1), spec.owner, True, 29501)
    assert claims_run[2][1] == claims.claim_script(inv, spec.job_id, (0, 1), spec.owner, True, None)
    released = [h for h, c in s.calls if c == smoke.release_script(inv, spec.job_id)]
    assert released == ["n1", "n2"]  # the finished claims, after the interrupt
    # A run that ends: its rows, and the claims released all the same.
    s = Stand(CPU2.hosts)

    def ends(session, inv, spec, run_dir):
        run_dir.mkdir(parents=True)
        for h in inv.hosts:
            (run_dir / f"{h.name}.log").write_text(
                "SMOKE ok backend=gloo world=4 size=8MB time=1ms busbw=70.0 MB/s\n"
            )
        seen.append((inv, spec))
        return Watched(ends={h.name: NodeEnd(h, exit_code=0) for h in inv.hosts})

    rows = smoke.smoke_test(s, CPU2, None, [], ends)
    assert [c.status for c in rows] == [smoke.OK, smoke.OK]
    assert sum(c == smoke.release_script(seen[-1][0], seen[-1][1].job_id) for _, c in s.calls) == 2


# ------------------------------------------------------------------ links and files another account plants
# Run by sh on this machine: the "other account" is played by links and files put where any member of
# the group may put them; what they point at stands for this account's own files.


def cpu_inv(tmp_path):
    return parse(
        f"job: {{output_dir: {tmp_path}/out}}\nhosts:\n  - {{address: h, interface: eth0}}\n", Path("i.yaml")
    )


def sh(tmp_path, script, stdin=None):
    """Run a script by sh with a stand-in docker (no containers) first on PATH."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / "docker").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "bin" / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}/bin:{os.environ['PATH']}"}
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, input=stdin)


def secret(tmp_path, name="id_rsa"):
    """One of this account's private files, and the directory that holds it (as ~/.ssh)."""
    home = tmp_path / "home" / ".ssh"
    home.mkdir(parents=True, mode=0o700, exist_ok=True)
    home.chmod(0o700)
    f = home / name
    f.write_text("PRIVATE KEY\n")
    f.chmod(0o600)
    return home, f


def host_claims(tmp_path) -> Path:
    return (
        tmp_path
        / "out"
        / ".claims"
        / subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    )


def test_a_lock_link_another_account_planted_is_replaced_never_followed(tmp_path):
    inv, (home, key) = cpu_inv(tmp_path), secret(tmp_path)
    d = host_claims(tmp_path)
    d.mkdir(parents=True)
    (d / ".lock").symlink_to(key)
    r = sh(tmp_path, claims.claim_script(inv, "gpt-1", (0,), "al@ws", True, 29500))
    assert r.returncode == 0, r.stderr
    assert mode(key) == 0o600 and key.read_text() == "PRIVATE KEY\n"
    assert not (d / ".lock").is_symlink() and mode(d / ".lock") == 0o664
    # A dangling link makes nothing where it points.
    (d / ".lock").unlink()
    (d / ".lock").symlink_to(home / "planted")
    assert sh(tmp_path, claims.claim_script(inv, "gpt-2", (1,), "al@ws", True)).returncode == 0
    assert not (home / "planted").exists() and not (d / ".lock").is_symlink()


@pytest.mark.parametrize("where", [".claims/HOST", ".claims", ".runtime"])
def test_a_shared_directory_that_is_a_link_is_refused_naming_it_and_the_fix(tmp_path, where):
    inv, (home, _key) = cpu_inv(tmp_path), secret(tmp_path)
    link = host_claims(tmp_path) if where == ".claims/HOST" else tmp_path / "out" / where
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(home)
    r = sh(tmp_path, claims.claim_script(inv, "gpt-1", (0,), "al@ws", True, 29500))
    assert r.returncode == hostfiles.NOT_WRITABLE
    assert f"{link} is a symbolic link" in r.stderr and f"rm {link}" in r.stderr
    assert mode(home) == 0o700 and sorted(p.name for p in home.iterdir()) == ["id_rsa"]
    if where != ".runtime":  # nor does the survey read what the link points at
        (home / "gpt-9").write_text("who=x\nunits=0\n")
        claimed = sh(tmp_path, claims.survey_script(inv)).stdout.split("@@claims\n")[1]
        assert claimed.split("@@queue\n")[0].count("\n") == 1
        (home / "gpt-9").unlink()
    if where == ".runtime":
        m = sh(tmp_path, hostfiles.stop_mark_script(inv, ["gpt-1"]))
        assert m.returncode == hostfiles.NOT_WRITABLE and mode(home) == 0o700
        assert sorted(p.name for p in home.iterdir()) == ["id_rsa"]


def test_the_claim_file_is_left_by_the_umask_not_a_chmod_that_follows_links():
    s = claims.claim_script(INV, "gpt-1", (0,), "al@ws", True)
    assert "chmod 0644" not in s and 'mv -T "$d"/.gpt-1.tmp "$d"/gpt-1' in s


def test_a_stop_marker_link_is_never_written_through(tmp_path):
    inv, (home, key) = cpu_inv(tmp_path), secret(tmp_path)
    stopped = tmp_path / "out" / ".runtime" / ".stopped"
    stopped.mkdir(parents=True)
    (stopped / "gpt-1").symlink_to(home / "planted")  # dangling: `: >` would make it
    (stopped / "gpt-2").symlink_to(key)
    sh(tmp_path, hostfiles.stop_mark_script(inv, ["gpt-1", "gpt-2", "gpt-3"]))
    assert not (home / "planted").exists() and key.read_text() == "PRIVATE KEY\n"
    assert (stopped / "gpt-3").is_file()


def put(path, data="TOKEN=s3cret\n", mode=0o600):
    return subprocess.run(
        ["sh", "-c", put_command(str(path), mode)], input=data, capture_output=True, text=True
    )


def test_put_makes_its_file_new_in_a_directory_of_its_own(tmp_path):
    assert put_command("/o/.runtime/gpt-1/secrets.env") == (
        """sh -c 'd=$(dirname "$1"); case "$d" in /*) ;; *) d="$PWD/$d";; esac; """
        """mkdir -p "$d" && cd -P "$d" && """
        """[ ! -L "$d" ] && [ "$d" -ef . ] && [ -O . ] || """
        """{ printf "%s is not a directory of %s (a link, or one of """
        """another account): %s is not written\\n" "$d" "$(id -un)" "$1" >&2; exit 1; }; """
        """f="./${1##*/}"; umask 077 """
        """&& rm -f "$f" && ( set -C; exec 3> "$f" && cat >&3 && chmod "$2" /dev/fd/3 )' sh """
        """/o/.runtime/gpt-1/secrets.env 600"""
    )
    home, key = secret(tmp_path)
    job = tmp_path / "out" / ".runtime" / "gpt-1"
    assert put(job / "secrets.env").returncode == 0  # the directory made, the file 0600
    assert (job / "secrets.env").read_text() == "TOKEN=s3cret\n" and mode(job / "secrets.env") == 0o600
    assert put(job / "run.sbatch", "#!/bin/sh\n", 0o644).returncode == 0 and mode(job / "run.sbatch") == 0o644
    # A file another account left there, open to all: replaced, never written into.
    (job / "secrets.env").unlink()
    (job / "secrets.env").write_text("")
    (job / "secrets.env").chmod(0o666)
    planted = os.stat(job / "secrets.env").st_ino
    os.link(job / "secrets.env", tmp_path / "what-the-other-reads")
    assert put(job / "secrets.env").returncode == 0
    assert (tmp_path / "what-the-other-reads").read_text() == "" and mode(job / "secrets.env") == 0o600
    assert os.stat(job / "secrets.env").st_ino != planted
    # A link at the file's name: removed, never written through.
    (job / "secrets.env").unlink()
    (job / "secrets.env").symlink_to(key)
    assert put(job / "secrets.env").returncode == 0
    assert key.read_text() == "PRIVATE KEY\n" and not (job / "secrets.env").is_symlink()
    # A link where the directory goes (another account renamed the job's away and put one there).
    (tmp_path / "others").mkdir()
    (tmp_path / "out" / ".runtime" / "gpt-2").symlink_to(tmp_path / "others")
    r = put(tmp_path / "out" / ".runtime" / "gpt-2" / "secrets.env")
    assert (
        r.returncode == 1 and "is not a directory of" in r.stderr and "secrets.env is not written" in r.stderr
    )
    assert list((tmp_path / "others").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another account")
def test_put_never_writes_into_a_directory_of_another_account(tmp_path):
    """The owner of `.runtime` renamed this account's job directory and made its own, with a file
    anyone may write waiting at the secrets' name: nothing is written there."""
    job = tmp_path / "gpt-1"
    job.mkdir(mode=0o777)
    job.chmod(0o777)
    (job / "secrets.env").write_text("")
    (job / "secrets.env").chmod(0o666)
    os.chown(job, 65534, 65534)
    os.chown(job / "secrets.env", 65534, 65534)
    r = put(job / "secrets.env")
    assert r.returncode == 1 and f"{job} is not a directory of root" in r.stderr
    assert (job / "secrets.env").read_text() == ""


def image_cache_run(tmp_path, plant):
    """The CPU host's image probe by sh, with a stand-in docker whose `run` calls `plant` (shell) with
    the probe's own pid as $PPID: the moment another account could put a link at its temporary name."""
    inv = cpu_inv(tmp_path)
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / "docker").write_text(
        '#!/bin/sh\ncase "$1" in image) echo sha256:abc;; run) ' + plant + '; echo "IMAGEINFO {}";; esac\n'
    )
    (tmp_path / "bin" / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}/bin:{os.environ['PATH']}"}
    argv = probe.image_info_argv(inv, inv.hosts[0], "img:1", None)
    return subprocess.run(argv, capture_output=True, text=True, env=env, umask=0o077)


def test_the_image_cache_never_writes_through_a_link_at_its_temporary_name(tmp_path):
    home, key = secret(tmp_path)
    cache = tmp_path / "out" / ".runtime" / hostfiles.IMAGE_CACHE
    cache.mkdir(parents=True)
    r = image_cache_run(tmp_path, f"ln -s {key} {cache}/abc.$PPID")
    assert r.returncode == 0 and "IMAGEINFO" in r.stdout
    assert key.read_text() == "PRIVATE KEY\n"
    assert (cache / "abc").read_text() == "IMAGEINFO {}\n" and not (cache / "abc").is_symlink()
    assert mode(cache / "abc") == 0o644  # every account of the group reads it, whatever this one's umask
    assert list(cache.iterdir()) == [cache / "abc"]
    # Read back from the cache next time; a link there is no answer.
    assert image_cache_run(tmp_path, "echo ran >&2").stderr == ""
    (cache / "abc").unlink()
    (cache / "abc").symlink_to(key)
    assert "PRIVATE KEY" not in image_cache_run(tmp_path, "true").stdout


def test_the_image_cache_directory_as_a_link_is_not_written(tmp_path):
    home, key = secret(tmp_path)
    (tmp_path / "out" / ".runtime").mkdir(parents=True)
    (tmp_path / "out" / ".runtime" / hostfiles.IMAGE_CACHE).symlink_to(home)
    r = image_cache_run(tmp_path, "true")
    assert r.returncode == 0 and "IMAGEINFO" in r.stdout
    assert mode(home) == 0o700 and sorted(p.name for p in home.iterdir()) == ["id_rsa"]


def waiting_on_flock(pid: int) -> bool:
    """Whether a descendant of `pid` is the claim script's `flock -w` (waiting for the lock)."""
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "cmdline").read_bytes().startswith(b"flock\0-w\0"):
                parent = int((p / "stat").read_text().rpartition(")")[2].split()[1])
                grand = int((Path("/proc") / str(parent) / "stat").read_text().rpartition(")")[2].split()[1])
                if pid in (parent, grand):
                    return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def test_a_claims_directory_swapped_for_a_link_while_the_claim_waits_for_the_lock_is_never_listed(tmp_path):
    """Another account holds the lock, renames the host's claims directory away and puts a link to
    this account's ~/.ssh in its place: the claim goes on in the directory it entered, so no file
    of ~/.ssh is read as a claim, cleared as a stale one, or joined by a claim file."""
    inv, (home, _key) = cpu_inv(tmp_path), secret(tmp_path)
    d = host_claims(tmp_path)
    d.mkdir(parents=True)
    (d / ".lock").write_text("")
    holder = open(d / ".lock")
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        sh(tmp_path, ":")  # the stand-in docker
        env = {**os.environ, "PATH": f"{tmp_path}/bin:{os.environ['PATH']}"}
        claim = subprocess.Popen(
            ["sh", "-c", claims.claim_script(inv, "gpt-1", (0,), "al@ws", True)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 10
        while not waiting_on_flock(claim.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        d.rename(d.with_name("away"))
        d.symlink_to(home)
    finally:
        holder.close()
    out, err = claim.communicate(timeout=30)
    assert claim.returncode == 0, err
    assert sorted(p.name for p in home.iterdir()) == ["id_rsa"] and "id_rsa" not in out
    assert (d.with_name("away") / "gpt-1").read_text().startswith("who=al@ws\n")
