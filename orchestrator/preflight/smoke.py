"""Phase 4 of a preflight, optional: a collective smoke test, an all_reduce across every host in
the real containers, run through the job lifecycle, reporting the measured bus bandwidth and the
network transport NCCL chose (a warning when it fell back to TCP beside InfiniBand devices)."""
from __future__ import annotations

import re
from pathlib import Path

from .. import codetree, plan
from ..inventory import Host, Inventory
from ..remote import Session
from .checks import FAIL, OK, SKIP, WARN, Check, _last

# Like fabfile.RUNS: runs/ in the current directory (the user's project), never beside the installed code.
RUNS = Path("runs")


def smoke_test(session: Session, inv: Inventory, image: str | None, checks: list[Check], run_job) -> list[Check]:
    """An all_reduce across every host inside the real containers, with the measured bus bandwidth.
    `run_job(session, inv, spec, run_dir)` is the job lifecycle's start -> watch -> clean up."""
    if any(c.status == FAIL for c in checks):
        return [Check(h.name, "smoke", SKIP, "other checks failed") for h in inv.hosts]
    # NCCL says which transport it took (NET/IB or NET/Socket) at INFO level; gloo ignores these.
    # The built-in trainers' tree (smoke.py among them), synced by the short job itself.
    spec = plan.JobSpec(job_id=plan.new_job_id("preflight"), script="trainers/smoke.py", image=image,
                        code_only=codetree.BUILTIN_ONLY,
                        env=(("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET")))
    run_dir = RUNS / spec.job_id
    result = run_job(session, inv, spec, run_dir)
    out = []
    for h in inv.hosts:
        o = result.ends.get(h.name)  # watch.NodeEnd
        log = (run_dir / f"{h.name}.log").read_text(errors="replace") if (run_dir / f"{h.name}.log").exists() else ""
        m = re.search(r"SMOKE ok backend=(\S+) world=(\d+) .*?busbw=([\d.]+) MB/s", log)
        if o and o.exit_code == 0 and m:
            detail = f"all_reduce over {m.group(2)} ranks ({m.group(1)}), bus bw {float(m.group(3)):.0f} MB/s"
            out.append(judge_transport(h, detail, nccl_transport(log) if m.group(1) == "nccl" else None))
        elif o and o.exit_code == 0:
            out.append(Check(h.name, "smoke", OK, "all_reduce ok"))
        else:
            why = (o.summary() if o and o.failure else f"exit {o.exit_code if o else '?'}") + f": {_last(log)}"
            out.append(Check(h.name, "smoke", FAIL, f"collective failed ({why})", f"see {run_dir / (h.name + '.log')}"))
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
        return Check(host.name, "smoke", WARN, f"{detail}, NCCL over TCP sockets although InfiniBand devices "
                     "are mapped", f"on {host.name}: check the IB links (ibstat), NCCL_IB_HCA, and that the "
                     "image has libibverbs (rdma-core); the log has NCCL's NET lines")
    return Check(host.name, "smoke", OK, f"{detail}, NCCL over {'InfiniBand' if transport == 'IB' else 'TCP sockets'}")
