"""The deep check's phases (preflight/deep.py runs them in order): each runs on every host at once,
each step under a deadline, and judges what it measured into checks, keeping the figures in `data`
(for --json and the matrix):

  1. disk (`disk_checks`): free space and write + fsync speed of job.output_dir and job.code_dir;
  2. compute (`compute_checks`): matrix multiplies in the job's image, per host (per GPU), against
     its peers;
  3. network (`network_checks`): every pair of hosts, in rounds, a bulk stream both ways and round
     trips over the job's interface;
  4. GPUs (`gpu_checks`), where present: read by gpucommands, parsed by gpuparse, judged by
     gpuhealth.

The measuring scripts (health) run in the job's image with the host's network (`container`).
"""

from __future__ import annotations

import time
from dataclasses import asdict

from orchestrator.config.inventory import Host, Inventory
from orchestrator.hostcmds import dockerargs, sshargs
from orchestrator.preflight import health
from orchestrator.preflight.checks import FAIL, OK, WARN, Check
from orchestrator.preflight.health import Thresholds
from orchestrator.transport.remote import Result, Session, describe

DISK_TIMEOUT = 60
COMPUTE_SECONDS = 2.0
COMPUTE_START = 5.0  # seconds for every host to start its container and import torch
CONTAINER_TIMEOUT = 90  # a measuring container: start, run, exit


def container(
    inv: Inventory,
    host: Host,
    name: str,
    code: str,
    args: list[str],
    image: str | None,
    access: dockerargs.GpuAccess | None = None,
    gpus: bool = False,
) -> str:
    """`docker run` of a measuring script in the job's image with the host's network, removed after."""
    argv = [
        "docker",
        "run",
        "--rm",
        "--name",
        name,
        "--network",
        "host",
        "--pull",
        "never",
        *(dockerargs.device_args(host, access) if gpus else []),
        "--entrypoint",
        "python3",
        image or inv.image_for(host),
        "-c",
        code,
        *args,
    ]
    # Bounded on the host too: past fab's deadline the client is ended there and the container removed.
    return (
        f"{sshargs.shell(sshargs.bounded(argv, CONTAINER_TIMEOUT))}; rc=$?; "
        f"{sshargs.shell(['docker', 'rm', '-f', name])} >/dev/null 2>&1; exit $rc"
    )


def disk_checks(
    session: Session, inv: Inventory, hosts: list[Host], t: Thresholds, data: dict
) -> list[Check]:
    """1. disk: free space and write + fsync speed of the job's directories on each host."""
    checks: list[Check] = []
    script = health.disk_script([inv.job.output_dir, inv.job.code_dir])
    got = session.fan_out(
        lambda h: session.run(h, script, timeout=DISK_TIMEOUT, what="disk write + fsync"), hosts
    )
    data["disk"] = {}
    for h in hosts:
        error = got.error(h.name)
        if error:
            checks.append(
                Check(
                    h.name,
                    "disk-speed",
                    FAIL,
                    describe(h, error),
                    f"check the disks of {inv.job.output_dir} and {inv.job.code_dir} on {h.name}",
                )
            )
            continue
        found = health.parse_disk(got[h.name].stdout)
        data["disk"][h.name] = {
            d: {"free_gb": f, "write_mb_s": s, "error": e} for d, (f, s, e) in found.items()
        }
        rows = health.judge_disk(h.name, found, t)
        worst = next((c for c in rows if c.status == FAIL), None) or next(
            (c for c in rows if c.status == WARN), None
        )
        checks.append(worst or Check(h.name, "disk-speed", OK, "; ".join(c.detail for c in rows)))
    return checks


def compute_checks(
    session: Session,
    inv: Inventory,
    hosts: list[Host],
    t: Thresholds,
    data: dict,
    image: str | None,
    access: dict,
    tag: str,
) -> list[Check]:
    """2. compute, every host over the same seconds (after all have started their containers). When
    a unit is slow, every host is measured again, together: a unit is named only when it is slow
    both times (a moment's load on a shared machine does not make a host slow), with the second
    round's figures."""
    checks, speed, kind = compute_round(session, inv, hosts, image, access, f"{tag}-1")
    slow = health.compute_outliers(speed, kind, t)
    if slow:
        measured = [h for h in hosts if any(unit_host(k) == h.name for k in speed)]
        _, again, _ = compute_round(session, inv, measured, image, access, f"{tag}-2")
        speed = {**speed, **again}  # a host the second round could not measure keeps its first figure
        slow = {k: why for k, why in health.compute_outliers(speed, kind, t).items() if k in slow}
    data["compute"] = {k: {"gflop_s": v, "kind": kind[k]} for k, v in speed.items()}
    return checks + judge_compute(hosts, speed, slow)


def unit_host(unit: str) -> str:
    """The host of a measured unit ('host' for its CPU, 'host/gpuN')."""
    return unit.split("/", 1)[0]


def compute_round(
    session: Session, inv: Inventory, hosts: list[Host], image: str | None, access: dict, tag: str
) -> tuple[list[Check], dict[str, float], dict[str, str]]:
    """One measurement of every host over the same seconds: the hosts it failed on (checks), and
    each unit's GFLOP/s and kind."""
    checks: list[Check] = []
    start = time.time() + COMPUTE_START + 0.5 * len(hosts)

    def compute(h: Host) -> Result:
        name = f"fabtrain-health-{tag}-{h.name}-compute"
        return session.run(
            h,
            container(
                inv,
                h,
                name,
                health.COMPUTE_PY,
                [str(COMPUTE_SECONDS), f"{start:.3f}"],
                image,
                access.get(h.name),
                gpus=h.gpu_vendor != "none",
            ),
            timeout=CONTAINER_TIMEOUT,
            what="compute benchmark",
        )

    got = session.fan_out(compute, hosts)
    speed, kind = {}, {}
    for h in hosts:
        r = got.value(h.name)
        out = health.parse_line("COMPUTE", r.stdout) if r is not None else None
        if not out:
            error = got.error(h.name)
            why = describe(h, error) if error else f"no result: {(r.stderr or r.stdout).strip()[-200:]}"
            checks.append(
                Check(
                    h.name,
                    "compute",
                    FAIL,
                    why,
                    f"run the image on {h.name}: docker run --rm "
                    f"{image or inv.image_for(h)} python3 -c 'import torch'",
                )
            )
            continue
        for unit, (gflops, model) in out.items():
            key = h.name if unit == "cpu" else f"{h.name}/{unit}"
            speed[key], kind[key] = float(gflops), model
    return checks, speed, kind


def judge_compute(hosts: list[Host], speed: dict[str, float], slow: dict[str, str]) -> list[Check]:
    """Each measured host's units: the slow ones (health.compute_outliers, why) named, or its figures."""
    checks: list[Check] = []
    for h in hosts:
        mine = {k: v for k, v in speed.items() if unit_host(k) == h.name}
        if not mine:
            continue
        bad = {k: why for k, why in slow.items() if k in mine}
        if bad:
            checks.append(
                Check(
                    h.name,
                    "compute",
                    FAIL,
                    "slow: " + "; ".join(f"{k} {why}" for k, why in bad.items()),
                    f"look for throttling or a busy CPU/GPU on {h.name} (nvidia-smi -q -d PERFORMANCE, top)",
                )
            )
        else:
            checks.append(
                Check(
                    h.name,
                    "compute",
                    OK,
                    ", ".join(f"{k.split('/')[-1]} {v:.1f} GFLOP/s" for k, v in mine.items()),
                )
            )
    return checks


def network_checks(
    session: Session,
    inv: Inventory,
    hosts: list[Host],
    t: Thresholds,
    data: dict,
    image: str | None,
    tag: str,
) -> list[Check]:
    """3. network: every pair of hosts measured (measure_network), the slow hosts and links named."""
    checks: list[Check] = []
    names = [h.name for h in hosts]
    by_name = {h.name: h for h in hosts}
    port = inv.job.master_port + health.PORT_OFFSET
    bw, rtt, failed_pairs = measure_network(session, inv, hosts, image, tag, port)
    verdict = health.network_outliers(bw, rtt, names, t)
    data["network"] = {
        "hosts": names,
        "mbit_s": [[a, b, v] for (a, b), v in bw.items()],
        "rtt_ms": [[a, b, v] for (a, b), v in rtt.items()],
        "median_mbit_s": verdict.reference,
        "slow_hosts": verdict.slow_hosts,
        "slow_links": [[a, b, why] for (a, b), why in verdict.slow_links.items()],
        "failed": [[a, b, why] for (a, b), why in failed_pairs.items()],
        "matrix": health.matrix_text(names, bw, rtt),
    }
    for name in names:
        if len(names) < 2:
            break
        if name in verdict.slow_hosts:
            checks.append(
                Check(
                    name,
                    "net",
                    FAIL,
                    verdict.slow_hosts[name],
                    f"check {by_name[name].interface} on {name}: link speed (ethtool), errors (ip -s link), "
                    "traffic shaping (tc qdisc show)",
                )
            )
        else:
            outs = [v for (a, _), v in bw.items() if a == name]
            checks.append(
                Check(
                    name,
                    "net",
                    OK,
                    f"sends {min(outs):.0f}-{max(outs):.0f} Mbit/s to its peers" if outs else "not measured",
                )
            )
    return checks + link_checks(verdict.slow_links, failed_pairs, port)


def link_checks(
    slow_links: dict[tuple[str, str], str], failed_pairs: dict[tuple[str, str], str], port: int
) -> list[Check]:
    """The links network_checks names: each slow one that no slow host explains (the sender's
    check), and each pair not measured (the receiver's: it listens on `port`)."""
    checks: list[Check] = []
    for (a, b), why in slow_links.items():
        checks.append(
            Check(
                a,
                "link",
                FAIL,
                f"link {a} -> {b}: {why}",
                f"the path from {a} to {b} (a switch port, a cable, a route or tc filter); "
                "the hosts themselves are fast with their other peers",
            )
        )
    for (a, b), why in failed_pairs.items():
        checks.append(
            Check(
                b,
                "link",
                FAIL,
                f"link {a} -> {b} not measured: {why}",
                f"can {b} listen on port {port} and {a} reach it? (firewall)",
            )
        )
    return checks


def measure_network(
    session: Session, inv: Inventory, hosts: list[Host], image: str | None, tag: str, port: int
) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float], dict[tuple[str, str], str]]:
    """Every pair of hosts, in rounds (health.rounds): the bandwidth received (sender, receiver), the
    round trip (from, to), and the pairs not measured with why."""
    names = [h.name for h in hosts]
    by_name = {h.name: h for h in hosts}
    bw: dict[tuple[str, str], float] = {}
    rtt: dict[tuple[str, str], float] = {}
    failed_pairs: dict[tuple[str, str], str] = {}
    for rnd in health.rounds(names):
        peer = {a: b for a, b in rnd} | {b: a for a, b in rnd}

        def measure(h: Host, peer: dict[str, str] = peer) -> Result:
            other = by_name[peer[h.name]]
            name = f"fabtrain-health-{tag}-{h.name}-net"
            return session.run(
                h,
                container(
                    inv,
                    h,
                    name,
                    health.NET_PY,
                    [h.hostname, other.hostname, str(port), str(health.NET_SECONDS)],
                    image,
                ),
                timeout=CONTAINER_TIMEOUT,
                what=f"network test with {other.name}",
            )

        got = session.fan_out(measure, tuple(by_name[n] for n in peer))
        for n in peer:
            r = got.value(n)
            out = health.parse_line("NET", r.stdout) if r is not None else None
            if out and "rx_mbit_s" in out:
                bw[(peer[n], n)] = float(out["rx_mbit_s"])
                rtt[(n, peer[n])] = float(out["rtt_ms"])
            else:
                error = got.error(n)
                failed_pairs[(peer[n], n)] = (
                    describe(by_name[n], error)
                    if error
                    else (r.stderr or r.stdout).strip()[-200:] or "no result"
                )
    return bw, rtt, failed_pairs


def gpu_checks(session: Session, inv: Inventory, data: dict) -> list[Check]:
    """ECC, retired/remapped rows, XID, throttling, PCIe and dcgmi on NVIDIA hosts; RAS/ECC and links
    on AMD hosts (gpucommands reads them, gpuparse reads the tools' outputs, gpuhealth judges them;
    its thresholds are one table there)."""
    from orchestrator.preflight import gpucommands, gpuhealth, gpuparse

    gpu_hosts = [h for h in inv.hosts if h.gpu_vendor in ("nvidia", "amd")]
    if not gpu_hosts:
        return []

    def one(h: Host):
        if h.gpu_vendor == "nvidia":
            smi = session.run(h, sshargs.shell(gpucommands.NVIDIA_COMMAND), timeout=60, what="nvidia-smi -q")
            xid = session.run(h, gpucommands.XID_COMMAND, timeout=30, what="kernel log (XID)")
            diag = session.run(h, gpucommands.DCGMI_COMMAND, timeout=300, what="dcgmi diag -r 1")
            found = gpuhealth.judge_nvidia(gpuparse.parse_nvidia_smi_q(smi.stdout), xid.stdout)
            found += gpuhealth.parse_dcgmi_diag(diag.stdout)
        else:
            smi = session.run(h, sshargs.shell(gpucommands.ROCM_COMMAND), timeout=60, what="rocm-smi")
            found = gpuhealth.judge_amd(gpuparse.parse_rocm_smi(smi.stdout))
        return found

    got = session.fan_out(one, tuple(gpu_hosts))
    out = []
    data["gpus"] = {}
    for h in gpu_hosts:
        error = got.error(h.name)
        if error:
            out.append(Check(h.name, "gpu-health", FAIL, describe(h, error), ""))
            continue
        found = got[h.name]
        data["gpus"][h.name] = [asdict(f) for f in found]
        worst = FAIL if any(f.level == "fail" for f in found) else WARN if found else OK
        detail = "; ".join(f.detail for f in found) or "no ECC, XID, throttling or link problems found"
        out.append(
            Check(
                h.name,
                "gpu-health",
                worst,
                detail,
                f"drain {h.name} and check the GPUs named (nvidia-smi -q, dcgmi diag -r 3)" if found else "",
            )
        )
    return out
