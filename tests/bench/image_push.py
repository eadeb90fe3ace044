"""Benchmark: `image.push` to 1, 2, 4, 8 hosts, by chain against the direct push, side by side.

    .venv/bin/python tests/bench/image_push.py --hosts 1,2,4,8 --repeat 3 --mb 256

The image is made here from random bytes (`docker import`, one layer), so no host holds any of it
and both methods send all of it; it is removed from the hosts before every push. The methods
alternate within each repeat. Prints medians (seconds, whole push: save, probe, transfer, load,
id check) and writes the raw numbers as JSON. Hosts beyond the running cluster's (node5..8) are
brought up for the run and removed after; the cluster's own files (.cluster/inventory.yaml,
known_hosts) are put back as they were. Only the project's test hosts and loopback are contacted.

    .venv/bin/python tests/bench/image_push.py --uplink 100 --mb 256

--uplink MBIT limits this machine's link to the test hosts to MBIT Mbit/s (a `tc` token bucket on
the cluster bridge's egress, as root; removed after). It stands for the usual case the chain is
for: the machine running fab (a laptop, a login node) reaches the cluster through a link slower
than the cluster's own network. Only traffic from this machine to the hosts is limited; host to
host traffic (the chain's forwarding) is not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from orchestrator.config.inventory import load  # noqa: E402
from orchestrator.images import images
from orchestrator.testbed import cluster  # noqa: E402
from orchestrator.transport.remote import Session  # noqa: E402

IMAGE = "fabtrain/benchpush:latest"


def make_image(mb: int) -> str:
    """A one-layer image of `mb` MB of random bytes (incompressible, held by no host)."""
    with tempfile.TemporaryDirectory() as d:
        blob = Path(d) / "blob"
        with open(blob, "wb") as f:
            for _ in range(mb):
                f.write(os.urandom(1 << 20))
        tar_path = Path(d) / "rootfs.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(blob, arcname="blob")
        with open(tar_path, "rb") as f:
            subprocess.run(["docker", "import", "-", IMAGE], stdin=f, check=True, capture_output=True)
    return images.local_image(IMAGE)[0]


def bridge_device() -> str:
    """The Linux bridge behind the cluster's Docker network: this machine's link to the hosts."""
    net_id = subprocess.run(
        ["docker", "network", "inspect", "--format", "{{.Id}}", cluster.NETWORK],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return "br-" + net_id[:12]


def limit_uplink(mbit: int | None) -> None:
    """Limit (or, with None, stop limiting) what this machine sends to the hosts to `mbit` Mbit/s."""
    dev = bridge_device()
    if mbit is None:
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        return
    subprocess.run(
        [
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            "256kb",
            "latency",
            "100ms",
        ],
        check=True,
    )


def forget(names: list[str]) -> None:
    procs = [
        subprocess.Popen(
            [
                "docker",
                "exec",
                f"fabtrain-{n}",
                "sh",
                "-c",
                f"docker image rm -f {IMAGE} >/dev/null 2>&1; true",
            ]
        )
        for n in names
    ]
    for p in procs:
        p.wait(timeout=120)


def one_push(inv_path: Path, n: int, method: str) -> float:
    inv = load(inv_path)
    hosts = inv.hosts[:n]
    forget([h.name for h in hosts])
    with Session(hosts) as session:
        t = time.perf_counter()
        results = images.push(session, IMAGE, method=method)
        dt = time.perf_counter() - t
    bad = [r for r in results if r.action != "sent"]
    assert not bad, bad
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--json", default=str(ROOT / "runs" / "bench-image-push.json"))
    ap.add_argument(
        "--uplink",
        type=int,
        default=None,
        metavar="MBIT",
        help="limit this machine's link to the hosts to MBIT Mbit/s during the pushes",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.hosts.split(",")]
    most = max(sizes)

    state = {
        p: p.read_text()
        for p in (cluster.STATE_DIR / "inventory.yaml", cluster.STATE_DIR / "known_hosts")
        if p.exists()
    }
    running = {
        c
        for c in subprocess.run(
            ["docker", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True, check=True
        ).stdout.split()
        if c.startswith("fabtrain-node")
    }
    nodes = cluster.node_infos(max(most, len(running)))
    extra = [n for n in nodes if n.container not in running]
    raw: dict = {"mb": args.mb, "uplink_mbit": args.uplink, "runs": {}}
    try:
        cluster.up(len(nodes), images=(), log=lambda *_: None)
        inv_path = Path(tempfile.mkdtemp(prefix="bench-push-")) / "inventory.yaml"
        inv_path.write_text(cluster.render_inventory(nodes[:most]))
        image_id = make_image(args.mb)
        size = images.local_image(IMAGE)[1]
        print(f"image {IMAGE} {image_id[7:19]}, {size / 1e6:.0f} MB, one layer", flush=True)
        if args.uplink:
            limit_uplink(args.uplink)
            print(
                f"link from here to the hosts limited to {args.uplink} Mbit/s ({bridge_device()})", flush=True
            )
        for n in sizes:
            for method in ("direct", "chain"):
                raw["runs"].setdefault(f"{n}/{method}", [])
            for _ in range(args.repeat):
                for method in ("direct", "chain"):
                    dt = one_push(inv_path, n, method)
                    raw["runs"][f"{n}/{method}"].append(dt)
                    print(f"  {n} host(s) {method}: {dt:.1f}s", flush=True)
        forget([n.name for n in nodes[:most]])
    finally:
        if args.uplink:
            limit_uplink(None)
        subprocess.run(["docker", "image", "rm", "-f", IMAGE], capture_output=True)
        for n in extra:  # hosts this run brought up
            subprocess.run(["docker", "rm", "-f", "-v", n.container], capture_output=True)
            subprocess.run(["docker", "volume", "rm", "-f", f"{n.container}-docker"], capture_output=True)
        for p, text in state.items():
            p.write_text(text)

    med = {k: statistics.median(v) for k, v in raw["runs"].items()}
    one = med.get("1/chain")
    link = f", link from here limited to {args.uplink} Mbit/s" if args.uplink else ""
    print(f"\nimage push, {args.mb} MB image held by no host{link}, median of {args.repeat} (s)")
    print(f"{'hosts':>5}  {'direct':>7}  {'chain':>7}  {'chain/direct':>12}  {'chain/chain@1':>13}")
    for n in sizes:
        d, c = med[f"{n}/direct"], med[f"{n}/chain"]
        print(f"{n:>5}  {d:>7.1f}  {c:>7.1f}  {c / d:>12.2f}  {c / one if one else float('nan'):>13.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({**raw, "medians": med}, indent=1))
    print(f"raw numbers: {args.json}")


if __name__ == "__main__":
    main()
