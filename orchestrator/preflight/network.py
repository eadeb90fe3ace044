"""Preflight over the network itself: the clock offset of a host, sampled over its already open
connection (no handshake in the measurement), and reachability: rank 0 opens a short-lived
listener on the master port and every worker connects to it from its own interface, which is what
finds a firewall."""

from __future__ import annotations

import time

from orchestrator.config.inventory import Host, Inventory
from orchestrator.hostcmds.sshargs import shell
from orchestrator.preflight.checks import FAIL, OK, Check, _last
from orchestrator.transport.remote import Command, Session, describe

CLOCK_TIMEOUT = 10


def measure_clock(session: Session, host: Host, samples: int = 7) -> tuple[float, float]:
    """(offset of the host's clock from ours, round trip) in seconds, from the sample with the
    lowest round trip over one already open channel, so the SSH handshake is not measured."""
    with session.command(host, "while read -r _; do date +%s.%N; done", CLOCK_TIMEOUT, "clock") as cmd:
        best = (float("inf"), 0.0)
        buf = b""
        for _ in range(samples):
            t0 = time.time()
            cmd.send(b"\n")
            while b"\n" not in buf:
                data = cmd.recv(256)
                if not data:
                    raise ConnectionError("clock probe ended early")
                buf += data
            t1 = time.time()
            line, buf = buf.split(b"\n", 1)
            rtt = t1 - t0
            if rtt < best[0]:
                best = (rtt, float(line) - (t0 + t1) / 2)
        cmd.close_stdin()
        return best[1], best[0]


# Lives until its stdin closes (the orchestrator is done) or its time is up, so the master port
# is free again before anything else uses it.
LISTENER = r"""
import select, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(64)
print("listening", flush=True)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    ready, _, _ = select.select([s, sys.stdin], [], [], 0.2)
    if s in ready:
        c, a = s.accept(); c.close()
    if sys.stdin in ready and not sys.stdin.read(1):
        break
s.close()
"""
CONNECT = r"""
import socket, sys
src, dst, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(); s.settimeout(float(sys.argv[4]))
try:
    s.bind((src, 0)); s.connect((dst, port)); print("connected")
except socket.timeout:
    print("timed out (packets dropped: a firewall?)"); sys.exit(3)
except OSError as e:
    print(e.strerror or e); sys.exit(4)
"""


def reachability(
    session: Session, inv: Inventory, sources: dict[str, str], timeout: float = 2.0
) -> list[Check]:
    """Open a listener on rank 0's master port for a few seconds; connect from each worker's own
    interface address. A dropped SYN (firewall) times out; a rejected one is refused."""
    master, port = inv.master, inv.job.master_port
    with session.command(
        master,
        shell(["python3", "-c", LISTENER, str(port), str(timeout + 10)]),
        timeout + 15,
        "test listener",
    ) as listener:
        ready = b""
        while b"listening" not in ready:
            data = listener.recv(1024)
            if not data:
                return [
                    Check(
                        master.name,
                        "reach",
                        FAIL,
                        "could not open a test listener on the master port",
                        f"check python3 and port {port} on {master.name}",
                    )
                ]
            ready += data
        return _connect_workers(session, inv, sources, listener, timeout)


def _connect_workers(
    session: Session, inv: Inventory, sources: dict[str, str], listener: Command, timeout: float
) -> list[Check]:
    master, port = inv.master, inv.job.master_port

    def connect(host: Host) -> Check:
        src = sources.get(host.name, "0.0.0.0")
        r = session.run(
            host,
            shell(["python3", "-c", CONNECT, src, master.hostname, str(port), str(timeout)]),
            timeout=timeout + 10,
        )
        if r.ok:
            return Check(host.name, "reach", OK, f"{master.hostname}:{port} from {src}")
        return Check(
            host.name,
            "reach",
            FAIL,
            f"cannot reach {master.name} {master.hostname}:{port} from {src}: {_last(r.stdout + r.stderr)}",
            f"open TCP {port} on {master.name} for {src} (firewall: iptables/nftables/ufw), "
            f"and check the route between the hosts",
        )

    workers = tuple(h for h in inv.hosts if h.rank > 0 and h.name in sources)
    results = session.fan_out(connect, workers)
    listener.close_stdin()  # the listener exits on EOF; wait for it so the port is free again
    listener.exit_status()
    out = [Check(master.name, "reach", OK, f"listening on {port}")]
    for h in workers:
        r = results[h.name]
        out.append(r if isinstance(r, Check) else Check(h.name, "reach", FAIL, describe(h, r), ""))
    return out
