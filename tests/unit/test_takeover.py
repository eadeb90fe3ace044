"""fab attach: what a job taken over goes on from (takeover.running_attempt), from its record and a
survey of its hosts; and the refusals when there is nothing to take over or someone looks after it."""

from pathlib import Path

import pytest

from orchestrator.backends.ssh import takeover
from orchestrator.config.inventory import parse
from orchestrator.core.errors import UserError
from orchestrator.core.jobspec import JobSpec
from orchestrator.core.record import Resume
from orchestrator.core.recovery import Attempt, JobRecord
from orchestrator.hosts import claims
from orchestrator.hosts.survey import HostJobs
from orchestrator.transport.remote import PerHost

INV = parse(
    "hosts:\n"
    + "".join(f"  - {{name: node{i}, address: 10.0.0.{i}, interface: eth0}}\n" for i in (1, 2))
    + "spares:\n  - {name: node3, address: 10.0.0.3, interface: eth0}\n",
    Path("inv.yaml"),
)
JOB = "gpt-20261124-101010-abcd"


def record(state="running", hosts=("node3", "node2"), attempts=2, resumes=()):
    r = JobRecord(spec=JobSpec(job_id=JOB, script="x.py"), inventory="inv.yaml", state=state, restarts=3)
    r.attempts = [Attempt(n, list(hosts), 0.0) for n in range(1, attempts + 1)]
    r.resumes = [Resume(time=0.0, state="failed", **entry) for entry in resumes]
    return r


def host(job_rank=None, lease=40.0, units=(0, 1), port=None, state="running"):
    jobs = {JOB: job_rank} if job_rank is not None else {}
    return HostJobs(
        running=jobs if state == "running" else {},
        containers=frozenset(jobs),
        runtime={JOB: lease},
        claimed=(claims.Holder(JOB, "ann@ws", 1.0, units, port),),
        ranks=jobs,
        states={JOB: state} if jobs else {},
    )


def test_the_running_attempt_from_the_record_and_the_claims():
    found = PerHost(
        node3=host(0, port=29511, units=(2, 3)),
        node2=host(1, state="exited"),
        node1=RuntimeError("no answer"),
    )
    got = takeover.running_attempt(found, INV, record(resumes=[{"after_attempt": 0}]))
    assert got.number == 2 and [(h.name, h.rank) for h in got.hosts] == [("node3", 0), ("node2", 1)]
    assert got.port == 29511 and got.units == {"node3": (2, 3), "node2": (0, 1)}
    assert got.restarts_used == 1  # attempt 1 failed and was restarted since the last start
    again = takeover.running_attempt(found, INV, record(attempts=3, resumes=[{"after_attempt": 1}]))
    assert again.restarts_used == 1


@pytest.mark.parametrize(
    "rec, found, says",
    [
        (record(state="finished"), PerHost(node3=host(0)), "is finished (runs/"),
        (record(), PerHost(node3=host(0, lease=3.0), node2=host(1)), "lease on node3 was renewed 3s ago"),
        (record(), PerHost(node3=host(), node2=host()), "has no container on its hosts (node3, node2)"),
        (record(hosts=("node9",)), PerHost(), "runs on node9, which inv.yaml does not name"),
    ],
)
def test_nothing_to_take_over_or_looked_after_is_refused(rec, found, says):
    with pytest.raises(UserError) as err:
        takeover.running_attempt(found, INV, rec)
    assert says in str(err.value) and err.value.exit_code == 2
