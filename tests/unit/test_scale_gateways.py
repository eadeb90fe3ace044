"""Hosts behind a jump host share one connection to it (Gateways), so 64 hosts do not open 64
connections to the bastion at once and run into its sshd's MaxStartups."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from orchestrator.config.inventory import Host
from orchestrator.config.sshconf import SSH
from orchestrator.transport.connect import Gateways


class FakeConn:
    def __init__(self, hop, sock):
        self.hop, self.sock, self.is_connected, self.channels = hop, sock, True, []
        self.transport = self

    def open_channel(self, kind, dest, src, timeout):
        self.channels.append(dest)
        return ("channel", self.hop.hostname, dest)

    def close(self):
        self.is_connected = False


class Opener:
    def __init__(self):
        self.opened, self.lock = [], threading.Lock()

    def __call__(self, hop, label, sock):
        time.sleep(0.01)  # a handshake takes a while: the other hosts arrive meanwhile
        conn = FakeConn(hop, sock)
        with self.lock:
            self.opened.append((hop.hostname, label, sock))
        return conn


def hosts(n, jump):
    return [
        Host(
            name=f"node{i}",
            address=f"10.0.0.{i}",
            rank=i,
            ssh=SSH(hostname=f"10.0.0.{i}", user="root", jump=jump),
            interface="eth0",
        )
        for i in range(n)
    ]


def test_64_hosts_behind_one_jump_host_open_one_connection_to_it():
    bastion = SSH(hostname="bastion", user="me")
    opener = Opener()
    gw = Gateways(opener)
    with ThreadPoolExecutor(64) as pool:
        socks = list(pool.map(lambda h: gw.channel(tuple(h.ssh.jump), h.ssh, h), hosts(64, (bastion,))))
    assert [o[0] for o in opener.opened] == ["bastion"]
    assert opener.opened[0][1].startswith("jump host bastion (for node")
    assert sorted(s[2][0] for s in socks) == sorted(f"10.0.0.{i}" for i in range(64))


def test_a_chain_of_two_jump_hosts_opens_each_once_the_second_through_the_first():
    outer, inner = SSH(hostname="outer", user="me"), SSH(hostname="inner", user="me", port=2222)
    opener = Opener()
    gw = Gateways(opener)
    for h in hosts(5, (outer, inner)):
        gw.channel(tuple(h.ssh.jump), h.ssh, h)
    assert [(o[0], o[2]) for o in opener.opened] == [
        ("outer", None),
        ("inner", ("channel", "outer", ("inner", 2222))),
    ]


def test_no_jump_host_no_channel_and_a_dead_gateway_is_opened_again():
    opener = Opener()
    gw = Gateways(opener)
    h = hosts(1, ())[0]
    assert gw.channel((), h.ssh, h) is None and opener.opened == []
    bastion = SSH(hostname="bastion", user="me")
    gw.channel((bastion,), h.ssh, h)
    gw.get((bastion,), h).close()  # the bastion's link dropped
    gw.channel((bastion,), h.ssh, h)
    assert [o[0] for o in opener.opened] == ["bastion", "bastion"]
    gw.close()
    assert gw._conns == {}
