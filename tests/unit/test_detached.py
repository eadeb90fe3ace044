"""Detached jobs (backends/ssh/detached.py, submit.py), without a cluster: the job's key added to
and removed from authorized_keys (hosts/keys.py's scripts, exact and run by sh here, HOME a
temporary folder), which jobs' keys `fab stop` removes, the inventory the controller uses, and the
command that starts it (backends/ssh/controller.py)."""
import os
import shlex
import subprocess
from dataclasses import asdict
from pathlib import Path

from orchestrator.backends.ssh import detached, submit
from orchestrator.config.inventory import parse
from orchestrator.core.jobspec import JobSpec
from orchestrator.core.recovery import JobRecord
from orchestrator.hosts import keys
from orchestrator.hosts.survey import HostJobs
from orchestrator.transport.remote import PerHost

JOB = "gpt-20261124-101010-abcd"
OTHER = "gpt-20261124-101010-ef01"


def sh(script: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, env={**os.environ, "HOME": str(home)}
    )


def test_the_jobs_key_is_added_restricted_and_removed_leaving_every_other_line(tmp_path):
    ssh = tmp_path / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "authorized_keys").write_text("ssh-ed25519 AAAAuser ann@ws\n")
    (ssh / "authorized_keys").chmod(0o600)
    private, line = submit.new_key(JOB)
    assert private.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    assert line.startswith("ssh-ed25519 ") and line.endswith(f" fabtrain-controller:{JOB}")
    _, other = submit.new_key(OTHER)
    for entry in (line, other):
        assert sh(keys.authorize_script(entry), tmp_path).returncode == 0
    lines = (ssh / "authorized_keys").read_text().splitlines()
    assert lines[0] == "ssh-ed25519 AAAAuser ann@ws"
    assert lines[1] == "no-agent-forwarding,no-port-forwarding,no-X11-forwarding " + line
    assert sh(keys.revoke_script([JOB]), tmp_path).returncode == 0
    assert (ssh / "authorized_keys").read_text().splitlines() == [lines[0], lines[2]]
    assert oct((ssh / "authorized_keys").stat().st_mode & 0o777) == "0o600"
    assert sh(keys.revoke_script([OTHER, "not a job; rm -rf /"]), tmp_path).returncode == 0
    assert (ssh / "authorized_keys").read_text().splitlines() == [lines[0]]
    assert [p.name for p in ssh.glob(".fabtrain.*")] == [".fabtrain.lock"]  # no temporary file left
    assert sh(keys.revoke_script([JOB]), tmp_path / "nohome").returncode == 0  # no file: nothing to do


def test_the_key_scripts_exactly():
    assert keys.authorize_script(f"ssh-ed25519 AAAA {keys.marker(JOB)}") == (
        "umask 077; mkdir -p ~/.ssh && exec 8>>~/.ssh/.fabtrain.lock && flock -w 10 8 && "
        "printf '%s\\n' 'no-agent-forwarding,no-port-forwarding,no-X11-forwarding ssh-ed25519 AAAA "
        f"fabtrain-controller:{JOB}' >> ~/.ssh/authorized_keys"
    )
    assert keys.revoke_script([JOB, "x.y-1", "not a job; rm -rf /"]) == (
        "[ -f ~/.ssh/authorized_keys ] || exit 0; exec 8>>~/.ssh/.fabtrain.lock && flock -w 10 8 && "
        "t=$(mktemp ~/.ssh/.fabtrain.XXXXXX) && "
        f"{{ grep -Ev ' fabtrain-controller:{JOB}$| fabtrain-controller:x\\.y-1$' ~/.ssh/authorized_keys "
        '> "$t"; [ $? -le 1 ] && cat "$t" > ~/.ssh/authorized_keys; rm -f "$t"; }'
    )
    assert keys.revoke_script(["not a job; rm -rf /"]) == keys.revoke_script([]) == "true"


def test_fab_stop_removes_the_keys_of_jobs_a_controller_or_a_record_shows_unless_it_runs(tmp_path):
    """Only jobs known to be detached, by the survey (a controller container there) or by this
    machine's record, have a key to remove; a controller that still runs keeps its own."""
    ran, gone, recorded, plain, unknown = (f"gpt-20261124-101010-{n:04x}" for n in range(5))
    found = PerHost(
        gpu1=HostJobs({}, frozenset(), {}, controllers={ran: "running", gone: "exited"}),
        gpu2=OSError("no answer"),
    )
    for job, controller in ((recorded, {"host": "gpu2", "dir": "/d", "container": "c"}), (plain, {})):
        (tmp_path / job).mkdir()
        JobRecord(spec=asdict(JobSpec(job_id=job, script="t.py")), inventory="inv.yaml",
                  controller=controller).save(tmp_path / job)
    assert detached.keys_to_revoke(found, [ran, gone, recorded, plain, unknown], tmp_path) == [gone, recorded]
    assert detached.keys_to_revoke(found, [], tmp_path) == []


INV = parse(
    "ssh: {user: ann, key: /home/ann/.ssh/id_ed25519, known_hosts: /home/ann/.ssh/known_hosts,\n"
    "      config: none}\n"
    "job: {output_dir: /data/fabtrain, secret_files: {WANDB_API_KEY: /home/ann/.wandb}}\n"
    "hosts:\n  - {name: gpu1, address: 10.0.0.1, interface: eth0}\n"
    "  - {name: gpu2, address: 10.0.0.2, interface: eth0, ssh: {port: 2222}}\n"
    "controller: {host: gpu2}\n",
    Path("inv.yaml"),
)


def test_the_controller_reaches_every_host_with_the_jobs_key_and_its_copied_files():
    ctl = submit.controller_inventory(INV)
    for h in ctl.all_hosts:
        assert h.ssh.keys == ("/ctl/key",) and h.ssh.keys_only and h.ssh.known_hosts == ("/ctl/known_hosts",)
        assert h.ssh.global_known_hosts == () and h.ssh.jump == ()
    assert [(h.ssh.hostname, h.ssh.port, h.ssh.user) for h in ctl.hosts] == [
        ("10.0.0.1", 22, "ann"), ("10.0.0.2", 2222, "ann")]
    assert ctl.job.secret_files == (("WANDB_API_KEY", "/ctl/secrets/WANDB_API_KEY"),)


def test_the_controller_runs_on_the_named_host_as_the_users_uid_without_capabilities():
    p = detached.place(INV, JOB)
    assert (p.host.name, p.dir, p.container) == (
        "gpu2",
        f"/data/fabtrain/.controllers/{JOB}",
        f"fabtrain-ctl-{JOB}",
    )
    script = submit.start_script(p, "fabtrain/controller:latest", "ann@ws")
    passwd, run = script.split(" && ", 1)
    assert run.startswith('docker run -d --rm --user "$(id -u):$(id -g)" ')
    argv = shlex.split(run.split('"$(id -u):$(id -g)" ', 1)[1])
    assert argv == [
        "--name",
        f"fabtrain-ctl-{JOB}",
        "--label",
        f"fabtrain.controller={JOB}",
        "--label",
        "fabtrain.owner=ann@ws",
        "--network",
        "host",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "-v",
        f"{p.dir}:/ctl",
        "-v",
        f"{p.dir}/passwd:/etc/passwd:ro",
        "-e",
        "PYTHONPATH=/ctl/fabtrain",
        "-e",
        "HOME=/ctl",
        "-w",
        "/ctl",
        "fabtrain/controller:latest",
        "sh",
        "-c",
        "exec python3 -m orchestrator.backends.ssh.controller /ctl >> /ctl/controller.log 2>&1",
    ]
    assert "--privileged" not in script and passwd.endswith(f"> {p.dir}/passwd")
    assert detached.place(INV.__class__(**{**INV.__dict__, "controller": INV.controller.__class__()}), JOB
                          ).host.name == "gpu1"  # the default: the first host


def test_the_controller_image_has_every_runtime_library_a_controller_imports():
    """A detached job's controller runs the orchestrator in fabtrain/controller, whose libraries
    build-controller.sh lists by hand: each runtime dependency of pyproject.toml is there but the
    two only this machine uses (docker: the local cluster; matplotlib: curves drawn here). pathspec,
    new and missing there, stopped every controller at its first import."""
    import re
    import tomllib
    root = Path(__file__).resolve().parents[2]
    script = (root / "docker" / "build-controller.sh").read_text()
    libs = set(re.search(r'^LIBS="([^"]+)"', script, re.M).group(1).split())
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    assert names - {"docker", "matplotlib"} <= libs, sorted(names - {"docker", "matplotlib"} - libs)
