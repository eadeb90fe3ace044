import subprocess
import time
from pathlib import Path

from orchestrator import preflight as pf
from orchestrator.inventory import parse

INV = parse("hosts:\n  - {name: a, address: 10.1.0.1, interface: eth0}\n"
            "  - {name: b, address: 10.1.0.2, interface: ens9}\n", Path("i.yaml"))
ADDR = ("1: lo    inet 127.0.0.1/8 scope host lo\n"
        "2: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\n"
        "9: eth1    inet 10.1.0.2/24 brd 10.1.0.255 scope global eth1\n")
LINK = ("1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\n"
        "9: eth1@if10: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP\n"
        "3: eth2: <BROADCAST,MULTICAST> mtu 9000 qdisc noop state DOWN\n")


def test_probe_script_round_trip():
    cmds = {"one": ["echo", "a b"], "two": ["sh", "-c", "echo x; exit 3"]}
    script = pf.probe_script(cmds, "@@m")
    assert script == ("stuck=0; echo @@m one; echo 'a b' 2>&1; rc=$?; echo @@mrc $rc; "
                      "echo @@m two; sh -c 'echo x; exit 3' 2>&1; rc=$?; echo @@mrc $rc")
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True).stdout
    assert pf.parse_probe(out, "@@m") == {"one": (0, "a b"), "two": (3, "x")}


def test_probe_script_skips_docker_once_the_engine_hangs(tmp_path):
    # A stand-in `docker` on PATH that hangs like a frozen engine: the first Docker fact times out
    # (exit 124), the others are not tried, and the facts after them are still gathered.
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    cmds = {"docker": ["docker", "version"], "image": ["docker", "image", "inspect", "x"], "after": ["echo", "ok"]}
    script = pf.probe_script(cmds, "@@m").replace(f"timeout -k 2 {pf.DOCKER_TIMEOUT} ", "timeout -k 1 1 ")
    start = time.monotonic()
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin"}).stdout
    assert time.monotonic() - start < 5
    facts = pf.parse_probe(out, "@@m")
    assert facts == {"docker": (124, ""), "image": (124, "engine did not answer"), "after": (0, "ok")}
    assert pf.judge_docker(INV.hosts[0], facts) == pf.Check(
        "a", "docker", "fail", f"engine gave no answer within {pf.DOCKER_TIMEOUT}s (docker version hangs)",
        "on a: the Docker engine is stuck; restart it (sudo systemctl restart docker) and check its disk "
        "(journalctl -u docker)")


def test_parse_links_and_addrs():
    assert pf.parse_links(LINK) == {"lo": {"up": True, "mtu": 65536}, "eth1": {"up": True, "mtu": 1500},
                                    "eth2": {"up": False, "mtu": 9000}}
    assert pf.parse_addrs(ADDR)["eth1"] == ["10.1.0.2/24"]


def test_wrong_interface_suggests_the_one_holding_the_master_subnet():
    c = pf.judge_interface(INV, INV.hosts[1], pf.parse_addrs(ADDR), pf.parse_links(LINK))
    assert (c.status, c.detail) == ("fail", "no interface 'ens9'")
    assert c.fix == "set interface: eth1 for b (its subnet holds 10.1.0.1)"


def test_port_taken_names_process():
    facts = {"docker": (0, "24.0"), "image": (0, "sha256:" + "a" * 64), "addr": (0, ""), "link": (0, ""),
             "port": (0, 'LISTEN 0 5 0.0.0.0:29500 0.0.0.0:* users:(("python3",pid=4242,fd=3))')}
    checks = {c.check: c for c in pf.judge_host(INV, INV.hosts[0], facts, "img")}
    assert checks["port"].status == "fail"
    assert checks["port"].detail == "master port 29500 already in use by python3 (pid 4242)"
    assert checks["docker"].status == "ok" and checks["image"].status == "ok"


def test_docker_permission_denied_names_the_fix():
    facts = {"docker": (1, "permission denied while trying to connect to the Docker daemon socket"),
             "image": (1, ""), "addr": (0, ""), "link": (0, "")}
    checks = {c.check: c for c in pf.judge_host(INV, INV.hosts[1], facts, "img")}
    assert checks["docker"].fix == "on b: sudo usermod -aG docker root (then log in again)"
    assert checks["image"].status == "fail"


def test_judge_dirs_names_the_path_and_the_exact_fix():
    host = INV.hosts[1]
    facts = (0, "denied /opt/fabtrain/code /opt root\nok /data/out")
    c = pf.judge_dirs(host, facts)
    assert c.status == "fail"
    assert c.detail == f"{host.ssh.user} cannot write /opt/fabtrain/code (cannot be created: /opt is owned by root)"
    assert c.fix.startswith(f"on b: sudo install -d -o {host.ssh.user} -g $(id -gn {host.ssh.user}) /opt/fabtrain/code  (")
    assert pf.judge_dirs(host, (0, "ok /a\nok /b")).status == "ok"


def test_render_shows_remote_text_as_text():
    import io

    from rich.console import Console
    hostile = "[/x] [bold]b\x1b[2J\x1b]8;;http://example.invalid\x07l\x1b]8;;\x07\rz"
    buf = io.StringIO()
    pf.render([pf.Check("a", "docker", "fail", hostile, f"fix {hostile}")], Console(file=buf, width=200))
    out = buf.getvalue()
    assert "[/x] [bold]b[2J]8;;http://example.invalid" in out  # markup shown, controls gone
    assert not any(ord(ch) < 32 and ch not in "\n" for ch in out)
