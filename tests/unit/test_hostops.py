"""Finding jobs on a host (survey.py): the survey script run by sh on this machine (docker stubbed), parsed;
and stopping them: `fab stop`'s one command per host, controller keys included."""
import os
import subprocess
import time
from pathlib import Path

from orchestrator.commands import hostfiles
from orchestrator.config.inventory import parse
from orchestrator.hosts import hostops, keys, survey
from orchestrator.transport.remote import PerHost, Result


def test_survey_finds_containers_and_runtime_leases_and_only_stale_ones_are_left_over(tmp_path):
    inv = parse(
        f"job: {{output_dir: {tmp_path}/out}}\nhosts:\n  - {{address: h, interface: eth0}}\n", Path("i.yaml")
    )
    rt = tmp_path / "out" / ".runtime"
    for job, age in (("live-1", 5), ("lost-1", 30), ("old-1", 3600), ("running-1", 3600)):
        (rt / job).mkdir(parents=True)
        (rt / job / hostfiles.LEASE).touch()
        os.utime(rt / job / hostfiles.LEASE, (time.time() - age, time.time() - age))
    (rt / "nolease-1").mkdir()
    (rt / hostfiles.IMAGE_CACHE).mkdir()  # the preflight's image cache: never a job, never removed
    (tmp_path / "docker").write_text(
        "#!/bin/sh\nprintf 'running-1\\t0\\tfabtrain-running-1-r0\\trunning\\tUp 1h\\n'\n"
    )
    (tmp_path / "docker").chmod(0o755)
    r = subprocess.run(["sh", "-c", survey.survey_script(inv)], capture_output=True, text=True,
                       env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    found = survey.parse_survey(r.stdout)
    assert found.running == {"running-1": 0}
    assert (
        found.runtime["live-1"] < hostfiles.LEASE_LIVE <= found.runtime["lost-1"] < hostfiles.LEASE_STALE
        and found.runtime["old-1"] >= 3600
        and found.runtime["nolease-1"] is None
    )
    per = PerHost(h=found)
    assert survey.live_jobs(per) == {"running-1": ["h"], "live-1": ["h"]}
    assert survey.stale_runtime(per) == {"h": ["nolease-1", "old-1"]}


def stop_inventory(tmp_path):
    return parse(f"job: {{output_dir: {tmp_path}/out}}\nhosts:\n  - {{address: h, interface: eth0}}\n",
                 Path("i.yaml"))


def test_fab_stop_removes_controller_keys_in_its_one_command(tmp_path):
    inv = stop_inventory(tmp_path)
    plain = hostops.stop_script(inv, ["gpt-1", "gpt-2"], 30)
    assert hostops.stop_script(inv, ["gpt-1", "gpt-2"], 30, ["gpt-2", "not a job; rm -rf /"]) == (
        f"{plain}; s=$?; ({keys.revoke_script(['gpt-2'])}; rm -rf -- {tmp_path}/out/.controllers/gpt-2) "
        ">/dev/null 2>&1; exit $s"
    )
    assert hostops.stop_script(inv, ["gpt-1"], 30, ["not a job"]) == hostops.stop_script(inv, ["gpt-1"], 30)
    assert hostops.stop_script(inv, [], 30) == "true"


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


def test_the_key_goes_and_the_stops_output_and_status_stay_its_own(tmp_path):
    """The stop's stdout is still the removed container ids and its status its own, whatever the
    revoke prints or however it ends."""
    inv = stop_inventory(tmp_path)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "docker").write_text('#!/bin/sh\ncase "$2" in --all) echo 0a1b2c;; --force) echo "$3";; esac\n')
    (stub / "docker").chmod(0o755)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    keyfile = home / ".ssh" / "authorized_keys"
    env = {"PATH": f"{stub}:/usr/bin:/bin", "HOME": str(home)}
    for flock_works in (True, False):
        keyfile.write_text(f"ssh-ed25519 AAAAuser ann@ws\nssh-ed25519 AAAActl {keys.marker('gpt-2')}\n")
        if not flock_works:
            (stub / "flock").write_text("#!/bin/sh\necho 'flock: timed out' >&2; echo noise; exit 1\n")
            (stub / "flock").chmod(0o755)
        # A controller that died before its end left its directory (key, launch, secrets): it goes.
        left = tmp_path / "out" / ".controllers" / "gpt-2" / "secrets"
        left.mkdir(parents=True, exist_ok=True)
        session = OneCommand(env)
        out = hostops.stop(session, inv, ["gpt-2"], 0, inv.hosts, revoke=["gpt-2"])
        assert not left.parent.exists() and (tmp_path / "out" / ".controllers").is_dir()
        r = out[inv.hosts[0].name]
        assert len(session.commands) == 1  # one round trip per host
        assert (r.stdout, r.stderr, r.exited) == ("0a1b2c\n", "", 0)
        ctl = [] if flock_works else [f"ssh-ed25519 AAAActl {keys.marker('gpt-2')}"]
        assert keyfile.read_text().splitlines() == ["ssh-ed25519 AAAAuser ann@ws", *ctl]
