"""fab shell and fab forward without a cluster: the exact ssh and docker exec argv, which node a job's
rank or host is (from the hosts' survey), their errors, the command after '--' reaching `shell` as
typed (and refused for every other task), and the forward's loop over real local sockets."""

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import paramiko
import pytest
import yaml

from orchestrator.commandline import access, program
from orchestrator.config.inventory import parse
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import nodeexec
from orchestrator.hosts import survey
from orchestrator.transport import forward
from orchestrator.transport.remote import PerHost

ROOT = Path(__file__).resolve().parents[2]
JOB = "report-20261125-031000-ab12"
INVENTORY = """\
ssh: {{config: none, user: trainer, port: 2222, key: {d}/id, known_hosts: {d}/known_hosts}}
hosts:
  - {{name: node1, address: 10.0.0.1, interface: eth0}}
  - {{name: node2, address: 10.0.0.2, interface: eth0, ssh: {{jump: "ops@bastion:2200"}}}}
spares:
  - {{name: node3, address: 10.0.0.3, interface: eth0}}
"""


@pytest.fixture
def inv_path(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY.format(d=tmp_path))
    (tmp_path / "id").write_text("")
    (tmp_path / "known_hosts").write_text("")
    return path


@pytest.fixture
def inv(inv_path):
    return parse(inv_path.read_text(), inv_path)


def host_jobs(running: dict[str, int]) -> survey.HostJobs:
    return survey.HostJobs(running=running, containers=frozenset(running), runtime={})


def surveyed(monkeypatch, per_host):
    """survey.survey answering with `per_host` (host -> HostJobs or an exception); what it was asked."""
    asked = []

    def fake(session, inv, hosts=None):
        asked.append(tuple(h.name for h in hosts or inv.all_hosts))
        return PerHost({h.name: per_host[h.name] for h in hosts or inv.all_hosts})

    monkeypatch.setattr(survey, "survey", fake)
    return asked


# ---------------------------------------------------------------- argv


def test_docker_exec_argv():
    assert nodeexec.exec_argv(JOB, 1, ["hostname"], tty=False) == [
        "docker",
        "exec",
        "--interactive",
        f"fabtrain-{JOB}-r1",
        "hostname",
    ]
    assert nodeexec.exec_argv(JOB, 0, [], tty=True, term="xterm-256color") == [
        "docker",
        "exec",
        "--interactive",
        "--tty",
        "--env",
        "TERM=xterm-256color",
        f"fabtrain-{JOB}-r0",
        "sh",
        "-c",
        "if command -v bash >/dev/null 2>&1; then exec bash; else exec sh; fi",
    ]


def test_ssh_argv_quotes_the_remote_command_once(inv):
    node1 = inv.hosts[0]
    remote = nodeexec.exec_argv(JOB, 0, ["sh", "-c", "echo 'a b' $HOME; exit 3"], tty=False)
    argv = nodeexec.ssh_command_argv(node1, remote, tty=False)
    assert argv == [
        "ssh",
        "-F",
        "none",
        "-p",
        "2222",
        "-l",
        "trainer",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={inv.path.parent}/known_hosts",
        "-o",
        f"GlobalKnownHostsFile={' '.join(node1.ssh.global_known_hosts) or '/dev/null'}",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
        "-i",
        f"{inv.path.parent}/id",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "LogLevel=ERROR",
        "-T",
        "--",
        "10.0.0.1",
        f"docker exec --interactive fabtrain-{JOB}-r0 sh -c 'echo '\"'\"'a b'\"'\"' $HOME; exit 3'",
    ]
    assert nodeexec.ssh_command_argv(node1, remote, tty=True)[-4:-2] == ["-t", "--"]


def test_ssh_reads_the_argv_as_meant_jump_host_included(inv):
    """OpenSSH's own parser (ssh -G prints the settings without connecting): the address after '--'
    is the destination and the jump host's ProxyCommand is there."""
    node2 = inv.hosts[1]
    argv = nodeexec.ssh_command_argv(node2, ["hostname"], tty=False)
    out = subprocess.run(["ssh", "-G", *argv[1:]], capture_output=True, text=True, check=True).stdout
    settings = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert settings["hostname"] == "10.0.0.2"
    assert settings["user"] == "trainer" and settings["port"] == "2222"
    assert settings["proxycommand"].endswith("-W '[10.0.0.2]:2222' bastion")
    assert settings["stricthostkeychecking"] == "true" and settings["batchmode"] == "yes"


# ---------------------------------------------------------------- which node


def test_rank_and_host_find_the_node_where_its_container_runs(monkeypatch, inv):
    # A restart moved rank 1 to the spare node3.
    asked = surveyed(
        monkeypatch, {"node1": host_jobs({JOB: 0}), "node2": host_jobs({}), "node3": host_jobs({JOB: 1})}
    )
    node = access.find_node(None, inv, JOB)
    assert (node.host.name, node.rank) == ("node1", 0)
    assert asked == [("node1", "node2", "node3")]
    node = access.find_node(None, inv, JOB, rank=1)
    assert (node.host.name, node.rank) == ("node3", 1)
    node = access.find_node(None, inv, JOB, host="node3")
    assert (node.host.name, node.rank) == ("node3", 1)
    assert asked[-1] == ("node3",)  # --host asks that host only


def test_errors_name_what_was_asked_and_what_runs(monkeypatch, inv):
    lost = paramiko.ssh_exception.NoValidConnectionsError({("10.0.0.2", 2222): ConnectionRefusedError()})
    surveyed(monkeypatch, {"node1": host_jobs({JOB: 0}), "node2": lost, "node3": host_jobs({})})

    def error(**kw) -> UserError:
        with pytest.raises(UserError) as exc:
            access.find_node(None, inv, kw.pop("job", JOB), **kw)
        return exc.value

    e = error(rank=1)
    assert str(e) == (
        f"job {JOB} has no running node of rank 1: it runs on node1 (rank 0); not reached: "
        "node2 (trainer@10.0.0.2:2222 via bastion): connection refused; start sshd there or "
        "fix ssh.port in the inventory"
    )
    assert e.exit_code == 2
    assert str(error(host="node9")) == (
        f"--host 'node9': no such host in {inv.path}; its hosts are node1, node2, node3"
    )
    assert str(error(host="node3")) == (
        f"job {JOB} runs no container on node3; 'fab status' shows where it runs"
    )
    assert str(error(job="other-20261125-000000-0000")).startswith(
        f"job other-20261125-000000-0000 is not running on the hosts of {inv.path}; not reached: node2"
    )
    assert str(error(job="../x")) == "'../x' is not a fabtrain job id; 'fab status' lists the jobs"
    assert str(error(rank=0, host="node1")) == "give --rank or --host, not both"


def test_numbers_are_checked_before_anything_is_reached():
    assert access.whole("--rank", 3, 0) == 3
    assert access.whole("--rank", None, 0) is None
    with pytest.raises(UserError, match=r"^--rank '-1': give a whole number 0 or more$"):
        access.whole("--rank", -1, 0)
    with pytest.raises(UserError, match=r"^PORT '70000': give a whole number from 1 to 65535$"):
        access.whole("PORT", 70000, 1, 65535)


def test_shell_execs_ssh_with_the_command(monkeypatch, inv_path, tmp_path):
    surveyed(
        monkeypatch, {"node1": host_jobs({JOB: 0}), "node2": host_jobs({JOB: 1}), "node3": host_jobs({})}
    )
    ran = []
    access.shell(
        str(inv_path),
        JOB,
        1,
        None,
        ["hostname"],
        tmp_path,
        execute=lambda file, argv: ran.append((file, argv)),
        terminal=False,
    )
    ((file, argv),) = ran
    assert file == "ssh" and argv[-3:] == [
        "--",
        "10.0.0.2",
        f"docker exec --interactive fabtrain-{JOB}-r1 hostname",
    ]
    assert "-T" in argv and "ProxyCommand=" in " ".join(argv)


def test_a_job_started_here_uses_its_recorded_inventory(tmp_path, inv_path):
    (tmp_path / "runs" / JOB).mkdir(parents=True)
    record = {"spec": {"job_id": JOB, "script": "x.py"}, "inventory": str(inv_path)}
    (tmp_path / "runs" / JOB / "job.json").write_text(json.dumps(record))
    assert access.job_inventory(None, JOB, tmp_path / "runs").path == inv_path


# ---------------------------------------------------------------- the command after '--'


@pytest.fixture
def called(monkeypatch):
    calls = []
    monkeypatch.setattr(access, "shell", lambda *a, **k: calls.append(a))
    return calls


def test_the_command_after_dashes_reaches_shell_as_typed(called):
    program.make_program().run(
        ["fabtrain", "shell", JOB, "--rank", "1", "--", "sh", "-c", "echo 'a  b'"], exit=False
    )
    ((inventory, job, rank, host, command, _runs),) = called
    assert (job, rank, host, command) == (JOB, 1, None, ["sh", "-c", "echo 'a  b'"])
    called.clear()
    program.make_program().run(["fabtrain", "shell", JOB], exit=False)
    assert called[0][4] == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["train", "--", "--lr", "1"],
            "error: fab train takes no command after '--'; only fab shell does (fab "
            "shell JOB -- CMD runs CMD in a job's container); fab train passes arguments to its script with "
            '--args "..."',
        ),
        (
            ["status", "shell", JOB, "--", "x"],
            "error: fab status shell: a command after '--' is taken only "
            "with fab shell alone (fab shell JOB -- CMD runs CMD in a job's container)",
        ),
        (
            ["--", "hostname"],
            "error: a command after '--' needs a task: fab shell JOB -- CMD runs CMD in a job's container",
        ),
    ],
)
def test_a_command_after_dashes_for_any_other_task_is_refused(called, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        program.make_program().run(["fabtrain", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == message
    assert called == []


def test_fab_in_the_checkout_uses_the_same_executor():
    conf = yaml.safe_load((ROOT / "fabric.yaml").read_text())
    assert conf["tasks"]["executor_class"] == f"{access.Executor.__module__}.{access.Executor.__name__}"
    # Fabric's own `fab` reads it (Invoke's project configuration): no NothingToDo traceback.
    fab = Path(sys.executable).parent / "fab"
    r = subprocess.run(
        [str(fab), "-r", str(ROOT), "status", "--", "x"], capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stderr) == (
        2,
        "error: fab status takes no command after '--'; only fab shell "
        "does (fab shell JOB -- CMD runs CMD in a job's container)\n",
    )


# ---------------------------------------------------------------- the forward


def test_a_taken_local_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError) as exc:
            forward.listen(port)
    assert str(exc.value) == (
        f"LOCAL port {port} on 127.0.0.1 is already in use on this machine; give "
        "another local port (fab forward JOB PORT --local LOCAL)"
    )
    assert exc.value.exit_code == 2


class FakeTransport:
    """open_channel as the host's sshd answers it: a socket to a 'remote' echo server, or a refusal."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.opened = refuse, []

    def open_channel(self, kind, dest, src, timeout=None):
        self.opened.append((kind, dest, timeout))
        if self.refuse:
            raise paramiko.ChannelException(2, "Connect failed")
        mine, theirs = socket.socketpair()
        threading.Thread(target=self.echo, args=(theirs,), daemon=True).start()
        return mine

    @staticmethod
    def echo(sock):
        with sock:
            while data := sock.recv(1024):
                sock.sendall(b"echo:" + data)


class FakeSession:
    def __init__(self, transport):
        self.transport = transport

    def connection(self, host):
        return self

    def alive_since(self, host):
        return None


def forwarded(transport, inv, send: bytes) -> tuple[bytes, list[str]]:
    warnings: list[str] = []
    stop = threading.Event()
    with forward.listen(0) as listener:
        port = listener.getsockname()[1]
        loop = threading.Thread(
            target=forward.serve,
            args=(FakeSession(transport), inv.hosts[0], 6006, listener, stop, warnings.append),
        )
        loop.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                client.sendall(send)
                try:
                    got = client.recv(1024)
                except ConnectionResetError:  # closed with our bytes unread
                    got = b""
        finally:
            stop.set()
            loop.join(5)
    return got, warnings


def test_the_forward_carries_bytes_both_ways(inv):
    transport = FakeTransport()
    got, warnings = forwarded(transport, inv, b"GET /")
    assert got == b"echo:GET /" and warnings == []
    assert transport.opened == [("direct-tcpip", ("127.0.0.1", 6006), 10)]


def test_a_refused_connection_is_named_and_the_forward_goes_on(inv):
    got, warnings = forwarded(FakeTransport(refuse=True), inv, b"GET /")
    assert got == b""
    assert len(warnings) == 1
    assert warnings[0].startswith("node1: port 6006: nothing listens there; connection from ")
