"""The deep check's pure parts: which pairs of hosts measure each other in which round, what the
measurements say about a host or a link, and the scripts that measure (run in the job's image by
preflight/deepphases.py).

Network: every pair of hosts exchanges a bulk TCP stream in both directions at once, and a train of
1-byte round trips, over the job's interface. Pairs are scheduled in rounds with the circle method
(`rounds`), so each host is in one pair per round: N-1 rounds for an even N, N for an odd one (one
host rests each round). A host whose every outgoing (or every incoming) link is slow is a slow host;
a slow link that no slow host explains is a slow link (`network_outliers`).

Compute: a matrix multiply per host (per GPU on a GPU host), compared with the median of its peers
of the same kind (CPU, or the same GPU model). Disk: free space and write + fsync throughput of
job.output_dir and job.code_dir.

Thresholds are data, in THRESHOLDS; nothing else holds a limit.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.preflight.checks import FAIL, OK, WARN, Check


@dataclass(frozen=True)
class Thresholds:
    net_slow: float = 0.5  # a link below this share of a typical link's bandwidth is slow
    rtt_slow: float = 5.0  # ... or with a round trip above this many times a typical one (and 1 ms more)
    compute_slow: float = 0.8  # a host (GPU) below this share of its peers' median speed is slow
    disk_min_free_gb: float = 1.0
    disk_min_write_mb_s: float = 20.0  # sequential write + fsync of DISK_PROBE_MB
    fresh_s: float = 3600.0  # a host's result younger than this is reused by fab train --health


THRESHOLDS = Thresholds()
NET_SECONDS = 2.0  # the bulk stream of each pair, each direction
DISK_PROBE_MB = 16
PORT_OFFSET = 150  # the deep check listens on job.master_port + this (outside the master ports)


def rounds(hosts: list[str]) -> list[list[tuple[str, str]]]:
    """Every pair exactly once, each host in at most one pair per round (circle method): N-1 rounds
    for an even N, N rounds for an odd N (a bye, None, takes the odd one out)."""
    ring: list[str | None] = list(hosts) + ([None] if len(hosts) % 2 else [])
    n = len(ring)
    out = []
    for _ in range(n - 1):
        pairs = [(ring[i], ring[n - 1 - i]) for i in range(n // 2)]
        out.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ring = [ring[0], ring[-1], *ring[1:-1]]  # hold the first, turn the rest
    return out


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def quantile(values: Iterable[float], q: float) -> float:
    """The q-quantile by linear interpolation between the sorted values (0.5: the median)."""
    v = sorted(values)
    if not v:
        return 0.0
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


@dataclass(frozen=True)
class NetVerdict:
    slow_hosts: dict[str, str]  # host -> why
    slow_links: dict[tuple[str, str], str]  # (from, to) -> why
    reference: float  # a typical good link (upper quartile), Mbit/s


def network_outliers(
    bw: dict[tuple[str, str], float],
    rtt: dict[tuple[str, str], float],
    hosts: list[str],
    t: Thresholds = THRESHOLDS,
) -> NetVerdict:
    """bw[(a, b)]: Mbit/s from a to b; rtt[(a, b)]: ms between them, as a measured it. A host is
    slow when it is slow with every peer in one direction (with at least two peers); the slow links
    that do not touch a slow host are named as links."""
    # The reference is a typical good link: the upper quartile of bandwidths (the lower one of round
    # trips), so that one host slow both ways (2/N of the links) does not drag it down.
    ref = quantile(bw.values(), 0.75)
    ref_rtt = quantile(rtt.values(), 0.25)
    slow = {k for k, v in bw.items() if v < t.net_slow * ref}
    laggy = {k for k, v in rtt.items() if v > t.rtt_slow * ref_rtt and v > ref_rtt + 1.0}
    hosts_bad: dict[str, str] = {}
    for h in hosts:
        peers = [p for p in hosts if p != h]
        if len(peers) < 2:
            continue
        out = [(h, p) for p in peers if (h, p) in bw]
        into = [(p, h) for p in peers if (p, h) in bw]
        if out and all(k in slow for k in out):
            hosts_bad[h] = f"sends slowly to every peer ({fmt_links(bw, out)}; typical link {ref:.0f} Mbit/s)"
        elif into and all(k in slow for k in into):
            hosts_bad[h] = (
                f"receives slowly from every peer ({fmt_links(bw, into)}; typical link {ref:.0f} Mbit/s)"
            )
        else:
            pairs = [k for k in rtt if h in k]
            if len(pairs) >= 2 and all(k in laggy for k in pairs):
                hosts_bad[h] = f"slow round trips with every peer (typical {ref_rtt:.2f} ms)"
    links: dict[tuple[str, str], str] = {}
    # A round trip crosses both directions: one made slow by a slow link (its queue) is that link's.
    laggy = {k for k in laggy if (k[1], k[0]) not in slow}
    for k in sorted(slow | laggy):
        if k[0] in hosts_bad or k[1] in hosts_bad:  # a slow host slows the round trips through it too
            continue
        back = (k[1], k[0])
        if k in slow and back in slow and bw[back] < bw[k]:
            continue  # the slower direction names the link (its queue also holds the other's ACKs)
        why = []
        if k in slow:
            why.append(
                f"{bw[k]:.0f} Mbit/s (typical link {ref:.0f})"
                + (f"; back {bw[back]:.0f}" if back in slow else "")
            )
        if k in laggy:
            why.append(f"round trip {rtt[k]:.2f} ms (typical {ref_rtt:.2f})")
        links[k] = ", ".join(why)
    return NetVerdict(hosts_bad, links, ref)


def fmt_links(bw: dict[tuple[str, str], float], keys: list[tuple[str, str]]) -> str:
    return ", ".join(
        f"to {b} {bw[(a, b)]:.0f}" if a == keys[0][0] else f"from {a} {bw[(a, b)]:.0f}" for a, b in keys
    )


def compute_outliers(
    speed: dict[str, float], kind: dict[str, str], t: Thresholds = THRESHOLDS
) -> dict[str, str]:
    """speed[unit]: GFLOP/s of a host (or 'host/gpuN'); kind[unit]: what it is compared with (CPU,
    or the GPU model). A unit below compute_slow of its peers' median is named; one alone is not
    judged."""
    out = {}
    for unit, v in speed.items():
        peers = [speed[u] for u in speed if u != unit and kind.get(u) == kind.get(unit)]
        if not peers:
            continue
        ref = median(peers)
        if ref > 0 and v < t.compute_slow * ref:
            out[unit] = f"{v:.1f} GFLOP/s, {v / ref:.0%} of its peers' median {ref:.1f} ({kind.get(unit)})"
    return out


# ---------------------------------------------------------------- what runs on the hosts

# In the job's image, with the host's network: this host and its peer each listen and send. argv:
# MY_ADDRESS PEER_ADDRESS PORT SECONDS. Prints one JSON line: the peer's bulk stream as received
# here (Mbit/s) and the median round trip to the peer (ms). The peer may start a little later: the
# connects retry for 20 s.
NET_PY = r"""
import json, socket, statistics, sys, threading, time
me, peer, port, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
got = {}
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((me, port))
srv.listen(4)
srv.settimeout(secs + 40)
def serve():
    for _ in range(2):
        c, _ = srv.accept()
        c.settimeout(secs + 40)
        kind = c.recv(1)
        if kind == b"P":
            while True:
                d = c.recv(1)
                if not d:
                    break
                c.sendall(d)
        else:
            buf, n, t0 = bytearray(1 << 20), 0, None
            while True:
                k = c.recv_into(buf)
                if not k:
                    break
                t0 = t0 or time.perf_counter()
                n += k
            got["rx_mbit_s"] = n * 8 / 1e6 / max(time.perf_counter() - t0, 1e-6) if t0 else 0.0
        c.close()
threading.Thread(target=serve, daemon=True).start()
def connect():
    deadline = time.monotonic() + 20
    while True:
        try:
            return socket.create_connection((peer, port), timeout=10)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
s = connect()
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.sendall(b"P")
rtts = []
for _ in range(30):
    t = time.perf_counter()
    s.sendall(b"x")
    s.recv(1)
    rtts.append((time.perf_counter() - t) * 1000)
s.close()
b = connect()
b.sendall(b"B")
data, end = bytes(1 << 20), time.perf_counter() + secs
while time.perf_counter() < end:
    b.sendall(data)
b.close()
deadline = time.monotonic() + secs + 40
while "rx_mbit_s" not in got and time.monotonic() < deadline:
    time.sleep(0.05)
print("NET " + json.dumps({"rtt_ms": statistics.median(rtts[5:]), **got}), flush=True)
"""

# In the job's image: float32 matrix multiplies for about SECONDS on the CPU (one thread: what a
# host gives each process) or on each GPU, from START (an epoch time: every host measures over the
# same seconds, none while another is still starting its container and importing torch). Prints one
# JSON line: GFLOP/s per unit, and GPU names.
COMPUTE_PY = r"""
import json, sys, time
import torch
secs, start = float(sys.argv[1]), float(sys.argv[2])
def bench(dev, n):
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    (a @ b).sum().item()
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < secs:
        c = a @ b
        done += 1
        if dev != "cpu":
            torch.cuda.synchronize(dev)
    return 2 * n ** 3 * done / (time.perf_counter() - t0) / 1e9
torch.randn(64, 64) @ torch.randn(64, 64)
time.sleep(max(0.0, start - time.time()))
out = {}
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        out[f"gpu{i}"] = [bench(f"cuda:{i}", 4096), torch.cuda.get_device_name(i)]
else:
    torch.set_num_threads(1)
    out["cpu"] = [bench("cpu", 256), "CPU"]
print("COMPUTE " + json.dumps(out), flush=True)
"""


def disk_script(dirs: list[str]) -> str:
    """On the host: per directory, its free space (df -Pk) and the time of a DISK_PROBE_MB write
    with fsync (dd conv=fsync), the probe file removed. One 'DISK<tab>dir<tab>free_kb<tab>dd's last
    line' line each."""
    import shlex

    parts = []
    for d in dirs:
        q = shlex.quote(d)
        probe = shlex.quote(f"{d}/.fabtrain-disk-probe")
        parts.append(
            f"mkdir -p {q} 2>/dev/null; free=$(df -Pk {q} 2>/dev/null | tail -n 1 | awk '{{print $4}}'); "
            f"out=$(dd if=/dev/zero of={probe} bs=1M count={DISK_PROBE_MB} conv=fsync 2>&1 | tail -n 1); "
            f'rm -f {probe}; printf \'DISK\\t%s\\t%s\\t%s\\n\' {q} "${{free:-?}}" "$out"'
        )
    return "; ".join(parts)


DD_RE = re.compile(r"(\d+) bytes .*copied, ([\d.]+) s")


def parse_disk(text: str) -> dict[str, tuple[float | None, float | None, str]]:
    """dir -> (free GB, write MB/s, what dd said when it failed) from disk_script's output."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("DISK\t"):
            continue
        _, d, free, said = (line.split("\t", 3) + ["", "", ""])[:4]
        said = said.strip()
        m = DD_RE.search(said)
        speed = int(m.group(1)) / 1e6 / max(float(m.group(2)), 1e-6) if m else None
        out[d] = (int(free) / 1024**2 if free.isdigit() else None, speed, "" if m else said)
    return out


def judge_disk(
    host: str, found: dict[str, tuple[float | None, float | None, str]], t: Thresholds = THRESHOLDS
) -> list[Check]:
    checks = []
    for d, (free, speed, said) in found.items():
        free_txt = (
            f"{free * 1024:.1f} MB free"
            if free is not None and free < 1
            else (f"{free:.1f} GB free" if free is not None else "free space unknown")
        )
        if speed is None:
            checks.append(
                Check(
                    host,
                    "disk-speed",
                    FAIL,
                    f"{d}: {free_txt}; a {DISK_PROBE_MB} MB write failed: {said or 'no answer'}",
                    f"free space in {d} on {host}, or move it",
                )
            )
        elif free is not None and free < t.disk_min_free_gb:
            checks.append(
                Check(
                    host,
                    "disk-speed",
                    FAIL,
                    f"{d}: {free_txt} (below {t.disk_min_free_gb:g} GB)",
                    f"free space in {d} on {host}, or move it",
                )
            )
        elif speed < t.disk_min_write_mb_s:
            checks.append(
                Check(
                    host,
                    "disk-speed",
                    WARN,
                    f"{d}: write + fsync {speed:.0f} MB/s (below {t.disk_min_write_mb_s:g}), {free_txt}",
                    f"check the disk under {d} on {host}",
                )
            )
        else:
            checks.append(Check(host, "disk-speed", OK, f"{d}: write + fsync {speed:.0f} MB/s, {free_txt}"))
    return checks


def parse_line(prefix: str, text: str) -> dict | None:
    """The JSON after PREFIX on the last line that starts with it."""
    for line in reversed(text.splitlines()):
        if line.startswith(prefix + " "):
            try:
                return json.loads(line[len(prefix) + 1 :])
            except ValueError:
                return None
    return None


def matrix_text(hosts: list[str], bw: dict[tuple[str, str], float], rtt: dict[tuple[str, str], float]) -> str:
    """The bandwidth matrix (Mbit/s, row sends to column) and round trips (ms), as plain text."""
    w = max(8, *(len(h) + 1 for h in hosts))
    head = "from \\ to".ljust(w) + "".join(h.rjust(w) for h in hosts)
    rows = [head]
    for a in hosts:
        rows.append(
            a.ljust(w)
            + "".join(
                ("-" if a == b else f"{bw[(a, b)]:.0f}" if (a, b) in bw else "?").rjust(w) for b in hosts
            )
        )
    rows.append("")
    rows.append("round trip, ms".ljust(w) + "".join(h.rjust(w) for h in hosts))
    for a in hosts:
        rows.append(
            a.ljust(w)
            + "".join(
                ("-" if a == b else f"{rtt[(a, b)]:.2f}" if (a, b) in rtt else "?").rjust(w) for b in hosts
            )
        )
    return "\n".join(rows)
