"""Preflight: named checks per host, each with a status, what was seen, and the fix.

Phases, each over every host at once:
  1. one probe script per host (one SSH round trip) gathers raw facts (probe), and the clock
     offset is sampled over the already open connection (no handshake in the measurement) (network);
  2. pure functions judge each host's facts, then the hosts against each other (same image id,
     same MTU, same code as this machine) (judge, compare);
  3. rank 0 opens a short-lived listener on the master port and every worker connects to it from
     its own interface: this is what finds a firewall (network);
  4. optionally, a collective smoke test: an all_reduce across every host in the real containers
     (smoke).
The judging functions take plain data, so they are unit-tested without a network. Check, Limits
and the statuses are in checks, the table and the JSON in render. This module runs the phases in
order (`run`) and re-exports the names used as `preflight.NAME` elsewhere.
"""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orchestrator.config import codetree
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import jobspec
from orchestrator.core.jobspec import LOCAL
from orchestrator.hosts import hostops, survey
from orchestrator.preflight.checks import (
    CHECKS,
    DEFAULT_LIMITS,
    FAIL,
    NA,
    OK,
    SKIP,
    WARN,
    Check,
    Limits,
    failed,
)
from orchestrator.preflight.compare import judge_across
from orchestrator.preflight.judge import (
    describe_image,
    judge_docker,
    judge_gpus,
    judge_host,
    judge_image,
    judge_interface,
    judge_port,
    judge_route,
    judge_time,
    suggest_interface,
)
from orchestrator.preflight.network import CLOCK_TIMEOUT, CONNECT, LISTENER, measure_clock, reachability
from orchestrator.preflight.probe import (
    DOCKER_FACTS,
    DOCKER_TIMEOUT,
    GPU_CONTAINER_TIMEOUT,
    IMAGE_INFO_PY,
    PROBE_TIMEOUT,
    TIMED_OUT,
    Facts,
    count_gpus,
    gpu_access,
    image_info,
    image_info_argv,
    local_code_hash,
    local_rsync,
    parse_addrs,
    parse_links,
    parse_probe,
    probe_commands,
    probe_script,
)
from orchestrator.preflight.render import render, to_json
from orchestrator.preflight.rsynccheck import judge_rsync
from orchestrator.preflight.smoke import RunJob, judge_transport, nccl_transport, read_ends, smoke_test
from orchestrator.preflight.storagecheck import judge_dirs, judge_disk, judge_shm
from orchestrator.transport.hostkeys import HostKeyError
from orchestrator.transport.remote import Session, describe

__all__ = [
    "CHECKS",
    "CLOCK_TIMEOUT",
    "CONNECT",
    "DOCKER_FACTS",
    "DOCKER_TIMEOUT",
    "FAIL",
    "GPU_CONTAINER_TIMEOUT",
    "IMAGE_INFO_PY",
    "LISTENER",
    "NA",
    "OK",
    "PROBE_TIMEOUT",
    "SKIP",
    "TIMED_OUT",
    "WARN",
    "Check",
    "Limits",
    "count_gpus",
    "describe_image",
    "failed",
    "gpu_access",
    "image_info",
    "image_info_argv",
    "judge_across",
    "judge_dirs",
    "judge_disk",
    "judge_docker",
    "judge_gpus",
    "judge_host",
    "judge_image",
    "judge_interface",
    "judge_port",
    "judge_route",
    "judge_shm",
    "judge_time",
    "judge_transport",
    "local_code_hash",
    "measure_clock",
    "nccl_transport",
    "parse_addrs",
    "parse_links",
    "parse_probe",
    "plan",
    "probe_commands",
    "probe_script",
    "reachability",
    "read_ends",
    "render",
    "run",
    "smoke_test",
    "suggest_interface",
    "to_json",
]


def run(
    session: Session,
    inv: Inventory,
    image: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    run_job: RunJob | None = None,
    code: bool = True,
    source: Path = jobspec.PROJECT_ROOT,
    only: str = "trainers",
) -> list[Check]:
    """Every check on every host of `inv`. With `run_job` (job.run_quiet: the job lifecycle's one
    short run), the collective smoke test too."""
    marker = "@@fabtrain-" + secrets.token_hex(4)
    code_path = f"{inv.job.code_dir}/{codetree.key(source, only)}"
    with ThreadPoolExecutor(max_workers=1) as pool:
        local_code = pool.submit(local_code_hash, source, only) if code else None
        results = session.fan_out(
            lambda h: _probe_host(session, inv, h, image, limits, code_path, marker), inv.hosts
        )
        checks: list[Check] = []
        per_host: dict[str, dict] = {}
        for host in inv.hosts:
            err, r = results.error(host.name), results.value(host.name)
            if err:
                checks.append(Check(host.name, "ssh", FAIL, describe(host, err), _ssh_fix(host, err)))
                continue
            checks += r[0]
            if r[1]:
                per_host[host.name] = r[1]
        local = local_code.result() if local_code else None
    across = judge_across(inv, per_host, local) if per_host else []
    if not code:
        across = [c for c in across if c.check != "code"]
    # A per-host image "ok" is replaced by the cross-host verdict when the ids differ.
    replaced = {(c.host, c.check) for c in across if c.check == "image"}
    checks = [c for c in checks if (c.host, c.check) not in replaced] + across
    checks += _reach(session, inv, checks, per_host)
    checks += left_over_runtime(session, inv, checks)
    checks.append(judge_rsync(LOCAL, local_rsync()))  # this machine's rsync: the other end of every copy
    if run_job:
        checks += smoke_test(session, inv, image, checks, run_job)
    order = {name: i for i, name in enumerate(CHECKS)}
    ranks = {h.name: h.rank for h in inv.hosts}
    return sorted(checks, key=lambda c: (ranks.get(c.host, -1), order.get(c.check, 99)))


def _probe_host(
    session: Session,
    inv: Inventory,
    host: Host,
    image: str | None,
    limits: Limits,
    code_path: str,
    marker: str,
) -> tuple[list[Check], dict]:
    """One host's probe (one SSH round trip) and clock offset, judged: its checks, and what the hosts
    are compared on (judge_across; empty when it could not be reached)."""
    img = image or inv.image_for(host)
    start = time.monotonic()
    try:
        session.connection(host)
    except BaseException as exc:  # noqa: BLE001 - reported as the host's ssh check
        return [Check(host.name, "ssh", FAIL, describe(host, exc), _ssh_fix(host, exc))], {}
    connect = time.monotonic() - start
    access = gpu_access(session, host)
    cmds = probe_commands(inv, host, img, access, code_path)
    res = session.run(
        host,
        probe_script(cmds, marker),
        what="preflight probe",
        timeout=PROBE_TIMEOUT + GPU_CONTAINER_TIMEOUT,
    )
    facts = parse_probe(res.stdout, marker)
    offset, rtt = measure_clock(session, host)
    checks = [Check(host.name, "ssh", OK, f"connect {connect * 1000:.0f} ms, rtt {rtt * 1000:.1f} ms")]
    checks += judge_host(inv, host, facts, img, limits, access)
    checks.append(judge_time(host, offset, rtt, facts.get("ntp", (1, ""))[1], limits))
    return checks, _summary(host, facts)


def _summary(host: Host, facts: Facts) -> dict:
    """A probed host's facts the hosts are compared on: image id, code, python3, the image's info, the
    MTU and address of its interface."""
    addrs = parse_addrs(facts.get("addr", (1, ""))[1])
    links = parse_links(facts.get("link", (1, ""))[1])
    summary = {
        "image_id": facts.get("image", (1, ""))[1] if facts.get("image", (1, ""))[0] == 0 else None,
        "code": (
            facts["code"][1].split()[0] if facts.get("code", (1, ""))[0] == 0 and facts["code"][1] else None
        ),
        "python": facts.get("python", (1, ""))[0] == 0,
        "image_info": image_info(facts),
    }
    if host.interface in links:
        summary["mtu"] = links[host.interface]["mtu"]
    if addrs.get(host.interface):
        summary["source"] = addrs[host.interface][0].split("/")[0]
    return summary


def _reach(session: Session, inv: Inventory, checks: list[Check], per_host: dict[str, dict]) -> list[Check]:
    if len(inv.hosts) < 2:
        return []
    bad = {(c.host, c.check) for c in checks if c.status == FAIL}
    master = inv.master.name
    if master not in per_host or (master, "port") in bad or not per_host[master].get("python"):
        why = "master port busy" if (master, "port") in bad else "rank 0 not probed or has no python3"
        return [Check(h.name, "reach", SKIP, why) for h in inv.hosts if h.rank > 0]
    sources = {
        n: f["source"] for n, f in per_host.items() if f.get("source") and f.get("python") and n != master
    }
    skipped = [
        Check(h.name, "reach", SKIP, "no usable interface address or python3")
        for h in inv.hosts
        if h.rank > 0 and h.name not in sources and h.name in per_host
    ]
    return reachability(session, inv, sources) + skipped


def _ssh_fix(host: Host, exc: BaseException) -> str:
    if isinstance(exc, HostKeyError) or "host key" in str(exc):
        return "compare the fingerprint with the host's own, then add it to known_hosts (see detail)"
    return (
        f"check that {host.ssh.hostname}:{host.ssh.port} runs sshd and accepts the key "
        f"{host.ssh.key or '(agent)'}"
    )


def left_over_runtime(session: Session, inv: Inventory, checks: list[Check]) -> list[Check]:
    """Runtime directories (secrets files included) of jobs that no `fab train` looks after any
    more, on hosts that answer: removed, one row per host saying so (hostops). A host whose ssh or
    docker check failed is not asked (its survey, `docker ps`, would only wait out its deadline)."""
    failed = {c.host for c in checks if c.check in ("ssh", "docker") and c.status == FAIL}
    hosts = tuple(h for h in inv.hosts if h.name not in failed)
    if not hosts:
        return []
    try:
        found = survey.survey(session, inv, hosts)
        lines = hostops.clear_stale(session, inv, found)
    except Exception:  # noqa: BLE001 - the ssh and docker checks already name a host that fails here
        return []
    return [Check(line.split(":", 1)[0], "runtime", OK, line.split(": ", 1)[1]) for line in lines]
