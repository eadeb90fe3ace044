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
    assert script == "echo @@m one; echo 'a b' 2>&1; echo @@mrc $?; echo @@m two; sh -c 'echo x; exit 3' 2>&1; echo @@mrc $?"
    out = "@@m one\na b\n@@mrc 0\n@@m two\nx\n@@mrc 3\n"
    assert pf.parse_probe(out, "@@m") == {"one": (0, "a b"), "two": (3, "x")}


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
