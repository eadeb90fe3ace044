"""SSH settings: the inventory over ssh_config over defaults, resolved once for both paramiko and
the OpenSSH client rsync runs. OpenSSH's own resolver (`ssh -G`, which reads the configuration
and prints it without connecting) is the reference both are compared with."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from orchestrator.config.inventory import load, parse
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import sshargs
from orchestrator.transport import connect

CONFIG = """\
Include {d}/more.conf
Host gpu1
  HostName 10.9.0.11
  User alice
  IdentityFile {d}/id_gpu
Host gpu2
  HostName 10.9.0.12
  Port 2222
  ProxyJump bob@bastion:2200
  UserKnownHostsFile {d}/kh_gpu
"""
MORE = """\
Host bastion
  HostName 192.0.2.7
  IdentityFile {d}/id_bastion
Host gpu3
  HostName 10.9.0.13
  ProxyJump bastion,gpu1
"""


@pytest.fixture
def cfg(tmp_path):
    (tmp_path / "ssh_config").write_text(CONFIG.format(d=tmp_path))
    (tmp_path / "more.conf").write_text(MORE.format(d=tmp_path))
    return tmp_path


def inventory(cfg: Path, ssh: str = "", hosts: str = "") -> Path:
    path = cfg / "inv.yaml"
    path.write_text(
        f"ssh:\n  config: {cfg}/ssh_config\n  known_hosts: {cfg}/kh\n{ssh}"
        "hosts:\n"
        + (
            hosts
            or "  - {address: gpu1, interface: eth0}\n"
            "  - {address: gpu2, interface: eth0}\n"
            "  - {address: gpu3, interface: eth0}\n"
        )
    )
    return path


def ssh_g(*args: str) -> dict[str, list[str]]:
    """OpenSSH's resolution of a command line: option -> values."""
    out = subprocess.run(["ssh", "-G", *args], capture_output=True, text=True, check=True).stdout
    got: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        got.setdefault(key, []).append(value)
    return got


def test_aliases_resolve_as_openssh_resolves_them(cfg):
    inv = parse(inventory(cfg).read_text(), cfg / "inv.yaml")
    gpu1, gpu2, gpu3 = (h.ssh for h in inv.hosts)
    assert (gpu1.hostname, gpu1.user, gpu1.port, gpu1.keys) == ("10.9.0.11", "alice", 22, (f"{cfg}/id_gpu",))
    assert (gpu2.hostname, gpu2.port, gpu2.known_hosts) == (
        "10.9.0.12",
        2222,
        (f"{cfg}/kh",),
    )  # inventory wins
    assert [(j.user, j.hostname, j.port, j.keys) for j in gpu2.jump] == [
        ("bob", "192.0.2.7", 2200, (f"{cfg}/id_bastion",))
    ]
    # Two hops from an Include'd file; the second hop (gpu1) takes its own settings.
    assert [(j.hostname, j.user) for j in gpu3.jump] == [("192.0.2.7", gpu3.user), ("10.9.0.11", "alice")]
    for alias, ssh in (("gpu1", gpu1), ("gpu2", gpu2)):
        ref = ssh_g("-F", f"{cfg}/ssh_config", alias)
        assert ref["hostname"] == [ssh.hostname] and ref["port"] == [str(ssh.port)]
    assert ssh_g("-F", f"{cfg}/ssh_config", "gpu1")["user"] == ["alice"]
    assert ssh_g("-F", f"{cfg}/ssh_config", "gpu1")["identityfile"] == [f"{cfg}/id_gpu"]
    assert ssh_g("-F", f"{cfg}/ssh_config", "gpu2")["proxyjump"] == ["bob@bastion:2200"]
    assert ssh_g("-F", f"{cfg}/ssh_config", "gpu3")["proxyjump"] == ["bastion,gpu1"]


def test_rsync_ssh_argv_equals_what_paramiko_is_given(cfg):
    key = cfg / "id"
    key.write_text("")  # ssh -G drops an identity file that does not exist
    inv = parse(inventory(cfg, ssh=f"  user: trainer\n  key: {key}\n").read_text(), cfg / "inv.yaml")
    for host in inv.hosts:
        ssh = host.ssh
        ref = ssh_g(*sshargs.ssh_argv(host)[1:], ssh.hostname)
        kwargs = connect.connect_kwargs(ssh)
        assert ref["hostname"] == [ssh.hostname] and ref["port"] == [str(ssh.port)]
        assert ref["user"] == [ssh.user] == ["trainer"]
        assert ref["identityfile"] == kwargs["key_filename"] == [str(key)]
        assert ref["userknownhostsfile"] == [" ".join(ssh.known_hosts)]
        assert ref["stricthostkeychecking"] == ["true"] and ref["batchmode"] == ["yes"]
        assert ref["identitiesonly"] == ["yes"] and kwargs["look_for_keys"] is False
        proxy = ref.get("proxycommand", ["none"])[0]
        if not ssh.jump:
            assert proxy == "none"
            continue
        # The jump is a ProxyCommand: the last hop's own ssh (checked the same way), which reaches
        # the target with -W and the hops before it through its own ProxyCommand.
        inner = shlex.split(proxy.replace("%%", "%"))
        last = ssh.jump[-1]
        assert inner[-3:] == ["-W", f"[{ssh.hostname}]:{ssh.port}", last.hostname]
        hop = ssh_g(*inner[1:-3], last.hostname)
        assert (hop["hostname"], hop["user"], hop["port"]) == ([last.hostname], [last.user], [str(last.port)])
        assert hop["userknownhostsfile"] == [" ".join(last.known_hosts)]
        assert ("proxycommand" in hop and hop["proxycommand"] != ["none"]) == (len(ssh.jump) > 1)


def test_agent_when_no_key_is_given():
    inv = parse("ssh: {config: none, user: u}\nhosts:\n  - {address: h1, interface: eth0}\n", Path("i.yaml"))
    ssh = inv.hosts[0].ssh
    assert ssh.keys == () and ssh.known_hosts == (os.path.expanduser("~/.ssh/known_hosts"),)
    assert connect.connect_kwargs(ssh) == {
        "banner_timeout": 10.0,
        "auth_timeout": 10.0,
        "allow_agent": True,
        "look_for_keys": True,
    }
    assert "-i" not in sshargs.ssh_argv(inv.hosts[0])


def test_inventory_jump_for_every_host_and_per_host_none(cfg):
    path = inventory(
        cfg,
        ssh="  jump: ops@gw.example.com:2022\n",
        hosts=(
            "  - {address: 10.0.0.1, interface: eth0}\n"
            "  - {address: 10.0.0.2, interface: eth0, ssh: {jump: none}}\n"
        ),
    )
    a, b = parse(path.read_text(), path).hosts
    assert [(j.user, j.hostname, j.port, j.known_hosts) for j in a.ssh.jump] == [
        ("ops", "gw.example.com", 2022, (f"{cfg}/kh",))
    ]  # the jump host is checked against the same file
    assert b.ssh.jump == ()


def error(text: str, path: Path = Path("inv.yaml"), check_files: bool = False) -> str:
    with pytest.raises(UserError) as exc:
        parse(text, path, check_files=check_files)
    return str(exc.value)


def test_bad_addresses_and_empty_fields():
    base = "hosts:\n  - {{address: {a}, interface: {i}}}\n"
    assert error(base.format(a="'/tmp/x'", i="eth0")) == (
        "inv.yaml:2: hosts[0].address: '/tmp/x' is neither a host name, an IP address nor an ssh_config "
        "alias; write e.g. 10.0.0.11, gpu1.example.com or an alias from ~/.ssh/config (user and port go in "
        "ssh:)"
    )
    assert "hosts[0].address: 'root@h' is neither" in error(base.format(a="root@h", i="eth0"))
    assert "hosts[0].address: '-oProxyCommand=x' is neither" in error(
        base.format(a="-oProxyCommand=x", i="eth0")
    )
    assert (
        error(base.format(a="h", i="''"))
        == "inv.yaml:2: hosts[0].interface: is empty; give a value, or remove 'interface:'"
    )
    assert error("ssh: {user: ''}\n" + base.format(a="h", i="eth0")) == (
        "inv.yaml:1: ssh.user: is empty; give a value, or remove 'user:'"
    )
    assert "ssh.jump: 'a b' is not [user@]host[:port]" in error(
        "ssh: {jump: 'a b'}\n" + base.format(a="h", i="e")
    )
    assert (
        parse('hosts:\n  - {name: v6, address: "fe80::1", interface: eth0}\n', Path("i.yaml"))
        .hosts[0]
        .hostname
        == "fe80::1"
    )


def test_missing_files_are_named(tmp_path):
    text = f"ssh: {{key: {tmp_path}/nokey, config: none}}\nhosts:\n  - {{address: h, interface: eth0}}\n"
    assert error(text, check_files=True) == (
        f"inv.yaml:1: ssh.key: {tmp_path}/nokey does not exist; "
        "fix the path (relative paths are relative to the inventory file)"
    )
    text = "ssh:\n  known_hosts: kh\nhosts:\n  - {address: h, interface: eth0}\n"
    assert error(text, tmp_path / "i.yaml", True).startswith(
        f"{tmp_path}/i.yaml:2: ssh.known_hosts: {tmp_path}/kh does not exist"
    )
    text = "ssh:\n  config: nocfg\nhosts:\n  - {address: h, interface: eth0}\n"
    assert f"ssh.config: {tmp_path}/nocfg does not exist" in error(text, tmp_path / "i.yaml", True)
    (tmp_path / "pc").write_text("Host h\n  ProxyCommand nc %h %p\n")
    text = f"ssh:\n  config: {tmp_path}/pc\nhosts:\n  - {{address: h, interface: eth0}}\n"
    assert "ProxyCommand, which fabtrain cannot check or bound; use ProxyJump" in error(
        text, tmp_path / "i.yaml", True
    )


def test_binary_and_non_utf8_inventories(tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x7fELF\x02\x01\x00\x00hosts")
    with pytest.raises(UserError, match=r"bin.yaml: is a binary file, not a YAML inventory"):
        load(binary)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"hosts:\n  - {address: h, interface: caf\xe9}\n")
    with pytest.raises(
        UserError, match=r"latin.yaml:2: not UTF-8 text \(byte 0xe9\); save the inventory as UTF-8"
    ):
        load(latin)


def test_an_include_of_a_directory_is_a_clear_error(tmp_path):
    from orchestrator.config import sshconf

    (tmp_path / "conf.d").mkdir()
    cfg = tmp_path / "config"
    cfg.write_text(f"Include {tmp_path}/conf.d\nHost x\n  HostName 10.0.0.9\n")
    with pytest.raises(UserError, match=r"conf.d: cannot read this ssh_config file \(Is a directory\)"):
        sshconf._inline_includes(cfg, 0)
