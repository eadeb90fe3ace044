"""Shared directories on hosts (plan.shared_dir_script, claims, hostops) and the preflight's smoke
test sharing hosts like any job (preflight/smoke.py): the exact scripts, the modes they leave when
run by sh on this machine, and the smoke test's choice, claim and release against a stand-in session."""
import os
import stat
import subprocess
from pathlib import Path

import pytest

from orchestrator import claims, hostops, plan
from orchestrator.inventory import parse
from orchestrator.preflight import smoke
from orchestrator.remote import PerHost, Result
from orchestrator.watch import NodeEnd, Watched
from test_job import Recorder

INV = parse("job: {output_dir: /opt/o ut}\nhosts:\n  - {name: n1, address: 10.0.0.1, interface: eth0}\n",
            Path("i.yaml"))


def test_shared_directories_are_made_group_writable_setgid_and_checked_with_the_fix():
    assert plan.shared_dir_script("'/opt/o ut/.claims'") == (
        "mkdir -p '/opt/o ut/.claims' || exit 6; { [ -O '/opt/o ut/.claims' ] && chmod g+rwxs '/opt/o ut/.claims'; } "
        "2>/dev/null; [ -w '/opt/o ut/.claims' ] || { printf '%s is not writable by %s (owner %s): its owner can "
        "share it with the group: chmod g+rwxs %s; chgrp GROUP %s\\n' '/opt/o ut/.claims' \"$(id -un)\" "
        "\"$(stat -c %U '/opt/o ut/.claims')\" '/opt/o ut/.claims' '/opt/o ut/.claims' >&2; exit 6; }; ")
    assert plan.shared_dir_script('"$d"', sticky=True, check=False) == (
        'mkdir -p "$d" || exit 6; { [ -O "$d" ] && chmod g+rwxs,+t "$d"; } 2>/dev/null; ')


def test_the_runtime_directory_is_the_accounts_own_and_the_stop_marker_lies_beside_it():
    rt = "'/opt/o ut/.runtime'"
    own = "'/opt/o ut/.runtime/gpt-1'"
    assert plan.own_runtime_script(INV, "gpt-1") == (
        plan.shared_dir_script(rt, sticky=True) + f"mkdir -m 0711 {own} 2>/dev/null; if [ -L {own} ] || "
        f"[ ! -d {own} ] || [ ! -O {own} ]; then printf '%s is not a directory of %s; another account made it: "
        f"job ids are never reused, so remove it (its owner or root)\\n' {own} \"$(id -un)\" >&2; exit 7; fi; "
        f"chmod 0711 {own} && touch '/opt/o ut/.runtime/gpt-1/lease'")
    assert plan.stopped_marker(INV, "gpt-1") == "/opt/o ut/.runtime/.stopped/gpt-1"
    assert plan.stop_mark_script(INV, ["a-1", "b-2"]) == (
        plan.shared_dir_script(rt, sticky=True, check=False) + plan.shared_dir_script("'/opt/o ut/.runtime/.stopped'")
        + "umask 022; [ -e '/opt/o ut/.runtime/.stopped/a-1' ] || : > '/opt/o ut/.runtime/.stopped/a-1'; "
          "[ -e '/opt/o ut/.runtime/.stopped/b-2' ] || : > '/opt/o ut/.runtime/.stopped/b-2'")
    # A smoke test's own runtime directory (no units): the stop marker cleared, the directory made.
    assert claims.claim_script(INV, "gpt-1", None, "al@ws", True) == (
        "rm -f '/opt/o ut/.runtime/.stopped/gpt-1'; " + plan.own_runtime_script(INV, "gpt-1"))
    assert claims.release_command(INV, ["gpt-1"]) == (
        "d='/opt/o ut/.claims'/\"$(hostname)\"; rm -rf '/opt/o ut/.runtime/gpt-1' '/opt/o ut/.runtime/.stopped/gpt-1'; "
        'rm -f "$d"/gpt-1')


def test_the_claim_script_shares_its_lock_and_files_with_the_group():
    s = claims.claim_script(INV, "gpt-1", (0, 1), "al@ws", True, 29500)
    assert s.startswith("d='/opt/o ut/.claims'/\"$(hostname)\"; " + plan.shared_dir_script("'/opt/o ut/.claims'", check=False)
                        + plan.shared_dir_script('"$d"') + "( umask 022; { command exec 9<>\"$d\"/.lock; } 2>/dev/null "
                        "|| command exec 9<\"$d\"/.lock || exit 6; { [ -O \"$d\"/.lock ] && chmod 0664 \"$d\"/.lock; } "
                        "2>/dev/null; flock -w 10 9 || ")
    assert 'for f in "$d"/*; do [ -f "$f" ] && [ ! -L "$f" ] || continue; ' in s
    assert s.endswith(plan.own_runtime_script(INV, "gpt-1") + ' && rm -f "$d"/.gpt-1.tmp && ( set -C; printf '
                      '"who=%s\\nsince=%s\\nunits=%s\\nport=%s\\n" al@ws "$now" 0,1 29500 > "$d"/.gpt-1.tmp ) && '
                      'chmod 0644 "$d"/.gpt-1.tmp && mv "$d"/.gpt-1.tmp "$d"/gpt-1 )')
    assert claims.survey_script(INV).endswith(
        'for f in "$d"/*; do case "${f##*/}" in *[!A-Za-z0-9._-]*) continue;; esac; '
        '[ -f "$f" ] && [ ! -L "$f" ] && echo "$(basename "$f") $(tr "\\n" " " < "$f")"; done; true')


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_modes_left_by_a_claim_under_a_narrow_umask(tmp_path):
    """Run by sh here (one account): what the other accounts of the group are given, whatever this
    one's umask; an older version's narrow directories of this account are widened."""
    inv = parse(f"job: {{output_dir: {tmp_path}/out}}\nhosts:\n  - {{address: h, interface: eth0}}\n", Path("i.yaml"))
    (tmp_path / "out" / ".runtime").mkdir(parents=True, mode=0o700)  # as an older version left it
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "docker").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "bin" / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}/bin:{os.environ['PATH']}"}
    r = subprocess.run(["sh", "-c", "umask 077; " + claims.claim_script(inv, "gpt-1", (0,), "al@ws", True, 29500)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    host = next((tmp_path / "out" / ".claims").iterdir())
    setgid = stat.S_ISGID
    assert mode(tmp_path / "out" / ".claims") == 0o770 | setgid and mode(host) == 0o770 | setgid
    assert mode(tmp_path / "out" / ".runtime") == 0o770 | setgid | stat.S_ISVTX
    assert mode(host / ".lock") == 0o664 and mode(host / "gpt-1") == 0o644
    assert mode(tmp_path / "out" / ".runtime" / "gpt-1") & 0o777 == 0o711
    m = subprocess.run(["sh", "-c", "umask 077; " + plan.stop_mark_script(inv, ["gpt-1"])], env=env)
    assert m.returncode == 0 and Path(plan.stopped_marker(inv, "gpt-1")).exists()
    assert mode(tmp_path / "out" / ".runtime" / ".stopped") == 0o770 | setgid
    # A link where the job's runtime directory goes is refused, never followed.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out" / ".runtime" / "gpt-2").symlink_to(tmp_path / "elsewhere")
    r = subprocess.run(["sh", "-c", claims.claim_script(inv, "gpt-2", (1,), "al@ws", True)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == plan.NOT_OWN and "is not a directory of" in r.stderr
    assert not (host / "gpt-2").exists() and list((tmp_path / "elsewhere").iterdir()) == []


def test_left_over_runtime_of_another_account_is_kept_and_named():
    assert hostops.clear_stale_script(INV, ["a-1", "../x"]) == (
        "if [ -O '/opt/o ut/.runtime/a-1' ] || [ \"$(id -u)\" = 0 ]; then rm -rf '/opt/o ut/.runtime/a-1' "
        "'/opt/o ut/.runtime/.stopped/a-1' && echo removed a-1; else echo kept a-1 "
        "\"$(stat -c %U '/opt/o ut/.runtime/a-1' 2>/dev/null)\"; fi")
    assert hostops.parse_clear_stale("removed a-1\nkept b-2 alice\nkept ../x bob\nkept c-3 \x1b[2Jeve\n") == (
        ["a-1"], {"b-2": "alice", "c-3": "[2Jeve"})


def test_the_master_port_passes_over_ports_other_jobs_claimed():
    out = ("LISTEN 0 4096 *:29500 *:*\n@@claims\n2\n"
           "job-a who=bob@ws since=1 units=0 port=29501\njob-b who=al@ws since=1 units=1 port=\n")
    assert hostops.parse_ports(out, 29500) == 29502
    assert hostops.port_script(INV).startswith("ss -Htln; echo @@claims; nproc; ")


CPU2 = parse("job: {nproc_per_node: 2}\nhosts:\n  - {name: n1, address: 10.0.0.1, interface: eth0}\n"
             "  - {name: n2, address: 10.0.0.2, interface: eth0}\n", Path("i.yaml"))
GPU = parse("hosts:\n  - {name: g1, address: 10.0.0.1, interface: eth0, gpus: {vendor: nvidia, count: 4}}\n"
            "  - {name: g2, address: 10.0.0.2, interface: eth0, gpus: {vendor: amd, count: 2}}\n", Path("g.yaml"))


def jobs(cpus=2, claimed=(), running=None) -> hostops.HostJobs:
    return hostops.HostJobs(running or {}, frozenset(running or ()), {c.job: 1.0 for c in claimed}, cpus=cpus,
                            claimed=tuple(claimed))


BOB = claims.Holder("bob-1", "bob@ws", 0.0, (0,), 29500)


def test_the_smoke_test_takes_only_free_units_the_same_number_everywhere():
    assert smoke.choose(CPU2, PerHost(n1=jobs(), n2=jobs())) == {"n1": (0, 1), "n2": (0, 1)}
    assert smoke.choose(CPU2, PerHost(n1=jobs(claimed=[BOB]), n2=jobs())) == {"n1": (1,), "n2": (0,)}
    # Every GPU free ones of each host, as many as the host with the fewest has.
    g = PerHost(g1=jobs(claimed=[claims.Holder("bob-1", units=(0, 2))]), g2=jobs())
    assert smoke.choose(GPU, g) == {"g1": (1, 3), "g2": (0, 1)}
    narrowed = smoke.narrow(GPU, {"g1": (1, 3), "g2": (0, 1)}, 29501)
    assert [h.env for h in narrowed.hosts] == [(("CUDA_VISIBLE_DEVICES", "1,3"),), (("HIP_VISIBLE_DEVICES", "0,1"),)]
    assert narrowed.job.master_port == 29501
    # A host with nothing free (a job with no claim file holds the whole host): skipped, naming it.
    rows = smoke.choose(CPU2, PerHost(n1=jobs(running={"old-1": 0}), n2=jobs()))
    assert [(c.host, c.status) for c in rows] == [("n1", smoke.SKIP), ("n2", smoke.SKIP)]
    assert rows[0].detail.startswith("no free slot here: held by old-1 (started by unknown") and \
        rows[1].detail == "not run: n1 has no free GPU/slot"
    # Within a job (fab train --smoke): that job's own units.
    assert smoke.choose(CPU2, PerHost(n1=jobs(claimed=[BOB]), n2=jobs(claimed=[BOB])), within="bob-1") == \
        {"n1": (0,), "n2": (0,)}


class Stand:
    """Session's interface for the smoke test: answers the survey, the port look-up and the claims."""

    def __init__(self, hosts, claim_codes=()):
        self.hosts, self.calls, self.claim_codes = hosts, [], list(claim_codes)

    def run(self, host, command, timeout=60, stdin=None, what=""):
        self.calls.append((host.name, command))
        if command.startswith("ss -Htln"):
            return Result("LISTEN 0 4096 *:29500 *:*\n@@claims\n2\n", "", 0, 0.01)
        if command.startswith("docker ps"):  # hostops.survey_script
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
            (run_dir / f"{h.name}.log").write_text("SMOKE ok backend=gloo world=4 size=8MB time=1ms busbw=70.0 MB/s\n")
        seen.append((inv, spec))
        return Watched(ends={h.name: NodeEnd(h, exit_code=0) for h in inv.hosts})
    rows = smoke.smoke_test(s, CPU2, None, [], ends)
    assert [c.status for c in rows] == [smoke.OK, smoke.OK]
    assert sum(c == smoke.release_script(seen[-1][0], seen[-1][1].job_id) for _, c in s.calls) == 2
