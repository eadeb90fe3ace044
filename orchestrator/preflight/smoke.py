"""Phase 4 of a preflight, optional: a collective smoke test, an all_reduce across every host in
the real containers, run through the job lifecycle, reporting the measured bus bandwidth and the
network transport NCCL chose (a warning when it fell back to TCP beside InfiniBand devices).

The smoke test shares hosts like any job (claims.py): it takes only GPUs (CPU slots) no job's claim
holds, the same number on every host, and a master port no one listens on or claims; it claims
both under its own job id and owner (claims.me(), also its containers' owner label) and releases
them at its end, on failure and Ctrl+C too. Run by a job before it starts (`fab train --smoke`,
`within` that job), it uses that job's own claimed units and port instead of claiming more."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from orchestrator.config import codetree
from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile, jobspec
from orchestrator.hostcmds import dockerargs
from orchestrator.hosts import claims, hostops, survey
from orchestrator.hosts.claimdir import LOCK_WAIT, units_text
from orchestrator.preflight.checks import FAIL, OK, SKIP, WARN, Check, _last
from orchestrator.transport.deadlines import STATUS_TIMEOUT, STOP_MARGIN
from orchestrator.transport.remote import PerHost, Session

# Like fabfile.RUNS: runs/ in the current directory (the user's project), never beside the installed code.
RUNS = Path("runs")


# What restricts a GPU host's processes to the smoke test's GPUs (the container sees every GPU).
VISIBLE = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES"}
CLAIM_TRIES = 3  # surveys and claims again when another job took the units or port meanwhile


class NodeEnding(Protocol):
    """How one node of the smoke test ended, as read here (the lifecycle's nodefollow.NodeEnd)."""

    @property
    def exit_code(self) -> int | None: ...

    @property
    def failure(self) -> object: ...  # None unless the node failed

    def summary(self) -> str: ...


class JobEnding(Protocol):
    """How the smoke test's job ended (the lifecycle's watch.Watched)."""

    @property
    def ends(self) -> Mapping[str, NodeEnding]: ...


# The job lifecycle's one short run: (session, inventory, spec, run directory) -> how it ended.
RunJob = Callable[[Session, Inventory, jobspec.JobSpec, Path], JobEnding]


def smoke_test(
    session: Session,
    inv: Inventory,
    image: str | None,
    checks: list[Check],
    run_job: RunJob,
    within: str = "",
) -> list[Check]:
    """An all_reduce across every host inside the real containers, with the measured bus bandwidth.
    `run_job(session, inv, spec, run_dir)` is the job lifecycle's start -> watch -> clean up. The
    GPUs (slots) and master port are free ones, claimed for the test (see the module's docstring),
    or, `within` a job, that job's."""
    if any(c.status == FAIL for c in checks):
        return [Check(h.name, "smoke", SKIP, "other checks failed") for h in inv.hosts]
    # NCCL says which transport it took (NET/IB or NET/Socket) at INFO level; gloo ignores these.
    # The built-in trainers' tree (smoke.py among them), synced by the short job itself.
    spec = jobspec.JobSpec(
        job_id=jobspec.new_job_id("preflight"),
        script="trainers/smoke.py",
        image=image,
        code_only=codetree.BUILTIN_ONLY,
        owner=claims.me(),
        env=(("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET")),
    )
    run_dir = RUNS / spec.job_id
    claimed: list[Host] = []
    try:
        taken = take(session, inv, spec, within, claimed)
        if isinstance(taken, list):
            return taken
        inv, spec = taken
        result = run_job(session, inv, spec, run_dir)
    finally:
        release(session, inv, spec, claimed)
    return read_ends(inv, result, run_dir)


def take(
    session: Session, inv: Inventory, spec: jobspec.JobSpec, within: str, claimed: list[Host]
) -> tuple[Inventory, jobspec.JobSpec] | list[Check]:
    """The inventory and spec the smoke test runs with (its units and port), claimed on every host
    (each host claimed is added to `claimed` at once, for release), or the rows saying why it
    cannot run now."""
    for _ in range(CLAIM_TRIES):
        found = survey.survey(session, inv, inv.hosts)
        units = choose(inv, found, within)
        if isinstance(units, list):
            return units
        port = inv.job.master_port if within else hostops.free_port(session, inv) or inv.job.master_port
        narrowed = narrow(inv, units, port)
        spec = replace(spec, nproc_per_node=str(len(next(iter(units.values())))))
        if within:  # the job's own claim holds these units and this port
            return narrowed, spec
        raced = False
        for h in claims.order(narrowed.hosts):
            r = session.run(
                h,
                claims.claim_script(
                    narrowed, spec.job_id, units[h.name], spec.owner, True, port if h.rank == 0 else None
                ),
                timeout=STATUS_TIMEOUT + LOCK_WAIT,
                what="claiming the smoke test's units",
            )
            if r.exited in (claims.REFUSED, claims.PORT_TAKEN):
                raced = True
                break
            claimed.append(h)
            if not r.ok:
                why = (
                    f"claiming its {claims.kind(h)}s failed (exit {r.exited}): "
                    f"{hostile.line(r.stderr.strip()[-400:])}"
                )
                return [
                    Check(
                        x.name,
                        "smoke",
                        FAIL if x.name == h.name else SKIP,
                        why if x.name == h.name else f"{h.name}: {why}",
                    )
                    for x in inv.hosts
                ]
        if not raced:
            return narrowed, spec
        release(session, inv, spec, claimed)
        claimed.clear()
    return [
        Check(
            h.name,
            "smoke",
            SKIP,
            "other jobs claimed the free GPUs/slots or the master port meanwhile, "
            f"{CLAIM_TRIES} times; run the preflight again",
        )
        for h in inv.hosts
    ]


def choose(inv: Inventory, found: PerHost, within: str = "") -> dict[str, tuple[int, ...]] | list[Check]:
    """Pure: the units the smoke test takes on each host, the same number everywhere (what the job's
    processes per node ask, job.nproc_per_node; every GPU or one slot for `auto`), at most as many
    as the host with the fewest free ones has; `within` a job, that job's own units. Or SKIP rows
    naming the holders where a host has none free (or did not answer)."""
    want = claims.want_of(jobspec.JobSpec(job_id="", script=""), inv.job.nproc_per_node)
    free: dict[str, list[int]] = {}
    rows = []
    for h in inv.hosts:
        hj = found.value(h.name)
        if not isinstance(hj, survey.HostJobs):
            rows.append(Check(h.name, "smoke", SKIP, "its claims could not be read (see its other checks)"))
            continue
        cap = claims.capacity(h, hj.cpus)
        if within:
            free[h.name] = [u for c in hj.claimed if c.job == within for u in (c.units or range(cap))]
            if not free[h.name]:
                rows.append(Check(h.name, "smoke", SKIP, f"job {within} holds nothing here"))
            continue
        holders = hj.holders()
        taken = claims.held_units(holders, cap)
        asked = want.of(h, cap)
        free[h.name] = [u for u in range(cap) if u not in taken][
            : asked if isinstance(asked, int) else len(asked)
        ]
        if not free[h.name]:
            rows.append(
                Check(
                    h.name,
                    "smoke",
                    SKIP,
                    f"no free {claims.kind(h)} here: held by "
                    + hostile.line("; ".join(c.describe(h) for c in holders)),
                )
            )
    if rows:
        named = {c.host for c in rows}
        return rows + [
            Check(h.name, "smoke", SKIP, f"not run: {', '.join(sorted(named))} has no free GPU/slot")
            for h in inv.hosts
            if h.name not in named
        ]
    n = min(len(u) for u in free.values())
    return {name: tuple(u[:n]) for name, u in free.items()}


def narrow(inv: Inventory, units: dict[str, tuple[int, ...]], port: int) -> Inventory:
    """The inventory the smoke test's containers run with: the master port taken, and each GPU
    host's processes kept to its units (VISIBLE; the container is given every GPU of the host)."""
    hosts = tuple(
        replace(h, env=(*h.env, (VISIBLE[h.gpu_vendor], units_text(units[h.name]))))
        if h.gpu_vendor in VISIBLE
        else h
        for h in inv.hosts
    )
    return replace(inv, hosts=hosts, job=replace(inv.job, master_port=port))


def release_script(inv: Inventory, job_id: str) -> str:
    """The smoke test's containers removed, then its claim and runtime files."""
    return f"{dockerargs.stop_script(job_id, 0)}; {claims.release_command(inv, [job_id])}"


def release(session: Session, inv: Inventory, spec: jobspec.JobSpec, hosts: list[Host]) -> None:
    """Release the smoke test's claims on these hosts (after the job's own clean up, or when it was
    interrupted before it): never leave a claim behind, whatever a host answers."""
    if hosts:
        script = release_script(inv, spec.job_id)
        session.fan_out(
            lambda h: session.run(
                h, script, timeout=STATUS_TIMEOUT + STOP_MARGIN, what="releasing the smoke test's claim"
            ),
            tuple(hosts),
        )


def read_ends(inv: Inventory, result: JobEnding, run_dir: Path) -> list[Check]:
    """One row per host from how its node of the smoke test ended (`result`: watch.Watched) and its log."""
    out = []
    for h in inv.hosts:
        o = result.ends.get(h.name)  # nodefollow.NodeEnd
        log = (
            (run_dir / f"{h.name}.log").read_text(errors="replace")
            if (run_dir / f"{h.name}.log").exists()
            else ""
        )
        m = re.search(r"SMOKE ok backend=(\S+) world=(\d+) .*?busbw=([\d.]+) MB/s", log)
        if o and o.exit_code == 0 and m:
            detail = f"all_reduce over {m.group(2)} ranks ({m.group(1)}), bus bw {float(m.group(3)):.0f} MB/s"
            out.append(judge_transport(h, detail, nccl_transport(log) if m.group(1) == "nccl" else None))
        elif o and o.exit_code == 0:
            out.append(Check(h.name, "smoke", OK, "all_reduce ok"))
        else:
            why = (
                o.summary() if o and o.failure else f"exit {o.exit_code if o else '?'}"
            ) + f": {_last(log)}"
            out.append(
                Check(
                    h.name, "smoke", FAIL, f"collective failed ({why})", f"see {run_dir / (h.name + '.log')}"
                )
            )
    return out


def nccl_transport(log: str) -> str | None:
    """The network transport NCCL chose, from its NCCL_DEBUG=INFO lines: "IB" (InfiniBand or RoCE
    verbs), "Socket" (TCP), or None when it never used the network (one host) or said nothing."""
    if re.search(r"NET/IB ?: Using \[|via NET/IB", log):
        return "IB"
    if re.search(r"NET/Socket ?: Using \[|via NET/Socket", log):
        return "Socket"
    return None


def judge_transport(host: Host, detail: str, transport: str | None) -> Check:
    if transport is None:
        return Check(host.name, "smoke", OK, detail)
    if transport == "Socket" and host.infiniband:
        return Check(
            host.name,
            "smoke",
            WARN,
            f"{detail}, NCCL over TCP sockets although InfiniBand devices are mapped",
            f"on {host.name}: check the IB links (ibstat), NCCL_IB_HCA, and that the "
            "image has libibverbs (rdma-core); the log has NCCL's NET lines",
        )
    return Check(
        host.name, "smoke", OK, f"{detail}, NCCL over {'InfiniBand' if transport == 'IB' else 'TCP sockets'}"
    )
