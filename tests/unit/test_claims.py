"""Claims (claims.py): choosing GPUs or CPU slots beside other jobs, the refusal's wording, and the
claim script itself run by a real sh against a directory of claim files, with a stand-in `docker`
on PATH saying which jobs have containers; the hosts' queues (queue.py) the claim script keeps."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import hostfiles
from orchestrator.hosts import claims, queue


def inventory(out: Path | str = "/opt/out"):
    return parse(
        f"""\
job: {{output_dir: {out}}}
hosts:
  - {{name: gpu1, address: 10.0.0.1, interface: eth0, gpus: {{vendor: nvidia, count: 4}}}}
  - {{name: cpu1, address: 10.0.0.2, interface: eth0}}
""",
        Path("inv.yaml"),
    )


INV = inventory()
GPU, CPU = INV.hosts
BOB = claims.Holder(
    "bob-20261123-101500-ab12", "bob@ws2", time.mktime((2026, 11, 23, 10, 15, 0, 0, 0, -1)), (0, 1)
)


def test_defaults_take_every_gpu_or_one_slot_and_counts_take_the_first_free():
    want = claims.want_of(jobspec.JobSpec(job_id="j", script="s"))
    assert want.of(GPU, 4) == 4 and want.of(CPU, 2) == 1 and not want.explicit
    assert claims.choose(GPU, 4, [], want.of(GPU, 4)) == (0, 1, 2, 3)
    assert claims.choose(CPU, 2, [claims.Holder("other", units=(0,))], 1) == (1,)
    # --gpus 2 beside bob's 0,1; --nproc 3 on a CPU host of 2 CPUs takes both slots.
    assert claims.choose(
        GPU, 4, [BOB], claims.want_of(jobspec.JobSpec(job_id="j", script="s", gpus=2)).of(GPU, 4)
    ) == (2, 3)
    assert claims.want_of(jobspec.JobSpec(job_id="j", script="s", nproc_per_node="3")).of(CPU, 2) == 2
    exact = claims.want_of(jobspec.JobSpec(job_id="j", script="s", units="gpu1:3,2"))
    assert exact.of(GPU, 4) == (2, 3) and exact.explicit and claims.choose(GPU, 4, [BOB], (2, 3)) == (2, 3)


def test_a_refusal_names_the_holder_who_since_which_gpus_and_what_is_free():
    with pytest.raises(UserError) as err:
        claims.choose(GPU, 4, [BOB], (1, 2))
    text = str(err.value)
    assert text.startswith(
        "gpu1: this job needs GPUs 1,2, but bob-20261123-101500-ab12 (started by bob@ws2 at "
        "2026-11-23 10:15:00, GPUs 0,1) hold(s) 0,1; free there: 2,3."
    )
    assert "or add --queue: the job waits in line" in text and err.value.exit_code == 1
    # A job running with no claim file (started by an older fabtrain) holds the whole host.
    with pytest.raises(
        UserError,
        match=r"needs 1 slot\(s\), but old-1 \(started by unknown at \?, slots all\) "
        r"hold\(s\) 0,1; free there: none",
    ):
        claims.choose(CPU, 2, [claims.Holder("old-1")], 1)
    with pytest.raises(
        UserError, match=r"--include gpu1:3,4: gpu1 has 4 GPU\(s\) \(0..3\); 4 is not one of them"
    ):
        claims.choose(GPU, 4, [], (3, 4))


def test_hosts_are_claimed_in_one_order_whatever_the_inventory_calls_them():
    other = parse(
        """\
hosts:
  - {name: b, address: 10.0.0.2, interface: eth0}
  - {name: a, address: 10.0.0.1, interface: eth0}
""",
        Path("other.yaml"),
    )
    assert [h.hostname for h in claims.order(INV.hosts)] == [h.hostname for h in claims.order(other.hosts)]


@pytest.fixture
def host(tmp_path):
    """A host for the claim script: its output_dir, and a `docker` that lists the containers of
    the jobs named in tmp_path/running."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "running").write_text("")
    (bin_dir / "docker").write_text(
        f"#!/bin/sh\n# docker ps --quiet --filter label=fabtrain.job=JOB\n"
        f'job=${{4#label=fabtrain.job=}}; grep -qx "$job" {tmp_path}/running && echo 0123abcd; exit 0\n'
    )
    (bin_dir / "docker").chmod(0o755)
    inv = inventory(tmp_path / "out")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def run(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env, timeout=30)

    claim_dir = (
        tmp_path
        / "out"
        / ".claims"
        / subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    )
    return inv, run, claim_dir, tmp_path


def test_the_claim_script_refuses_overlaps_takes_disjoint_units_and_clears_stale_claims(host):
    inv, run, claim_dir, root = host
    a = run(claims.claim_script(inv, "alice-1", (0, 1), "alice@ws1", True))
    assert a.returncode == 0, a.stderr
    assert (claim_dir / "alice-1").read_text().startswith("who=alice@ws1\nsince=")
    assert (root / "out" / ".runtime" / "alice-1" / hostfiles.LEASE).exists()
    # bob overlaps GPU 1 while alice's lease is fresh: refused, alice named, nothing of bob's written.
    b = run(claims.claim_script(inv, "bob-1", (1, 2), "bob@ws2", True))
    assert b.returncode == claims.REFUSED
    held, cleared = claims.parse_claim_output(b.stdout)
    assert [(h.job, h.who, h.units) for h in held] == [("alice-1", "alice@ws1", (0, 1))] and cleared == []
    assert not (claim_dir / "bob-1").exists() and not (root / "out" / ".runtime" / "bob-1").exists()
    # Disjoint GPUs share the host; a claim of the whole host (no units) is refused while any is held.
    assert run(claims.claim_script(inv, "bob-1", (2, 3), "bob@ws2", True)).returncode == 0
    assert run(claims.claim_script(inv, "carol-1", (), "carol@ws3", True)).returncode == claims.REFUSED
    # alice's fabtrain went away: no container, lease old. Her claim is stale and cleared, saying so;
    # bob's stays held while a container of his runs, however old his lease.
    old = time.time() - hostfiles.LEASE_STALE - 5
    for job in ("alice-1", "bob-1"):
        os.utime(root / "out" / ".runtime" / job / hostfiles.LEASE, (old, old))
    (root / "running").write_text("bob-1\n")
    c = run(claims.claim_script(inv, "carol-1", (0, 1), "carol@ws3", True))
    assert c.returncode == 0, c.stderr
    held, cleared = claims.parse_claim_output(c.stdout)
    assert [h.job for h in cleared] == ["alice-1"] and [h.job for h in held] == ["bob-1"]
    assert sorted(p.name for p in claim_dir.iterdir() if p.is_file() and not p.name.startswith(".")) == [
        "bob-1",
        "carol-1",
    ]
    # The survey reads the same files; release removes a job's claim and runtime directory.
    cpus, found, queued = claims.parse_survey(
        run(claims.survey_script(inv)).stdout.partition("@@claims\n")[2]
    )
    assert cpus == os.cpu_count() and {h.job: h.units for h in found} == {"bob-1": (2, 3), "carol-1": (0, 1)}
    assert queued == []
    assert run(claims.release_command(inv, ["carol-1"])).returncode == 0
    assert not (claim_dir / "carol-1").exists() and not (root / "out" / ".runtime" / "carol-1").exists()


def test_an_engine_that_does_not_answer_never_makes_a_claim_stale(host):
    inv, run, claim_dir, root = host
    assert run(claims.claim_script(inv, "alice-1", (0,), "alice@ws1", True)).returncode == 0
    old = time.time() - hostfiles.LEASE_STALE - 5
    os.utime(root / "out" / ".runtime" / "alice-1" / hostfiles.LEASE, (old, old))
    (root / "bin" / "docker").write_text(
        "#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2; exit 1\n"
    )
    b = run(claims.claim_script(inv, "bob-1", (0,), "bob@ws2", True))
    assert b.returncode == claims.REFUSED and (claim_dir / "alice-1").exists()


def test_the_queue_is_first_come_first_served_per_host_and_drops_places_not_kept(host):
    inv, run, claim_dir, root = host
    assert run(claims.claim_script(inv, "alice-1", (0, 1), "alice@ws1", True)).returncode == 0
    (root / "running").write_text("alice-1\n")
    # bob waits for alice's GPUs: refused, and his place taken; carol, queued after him, asks for GPU
    # 3, free: she waits behind bob all the same (the rule: no job starts ahead of an earlier one).
    bob, carol = queue.new_ticket("bob-1"), queue.new_ticket("carol-1")
    assert bob < carol
    b = run(claims.claim_script(inv, "bob-1", (0, 1), "bob@ws2", True, ticket=bob))
    assert b.returncode == claims.REFUSED and (claim_dir / "queue" / "bob-1").exists()
    c = run(claims.claim_script(inv, "carol-1", (3,), "carol@ws3", True, ticket=carol))
    assert c.returncode == queue.QUEUED, c.stderr
    assert [w.job for w in queue.parse_queue_output(c.stdout)[0]] == ["bob-1"]
    assert not (claim_dir / "carol-1").exists() and (claim_dir / "queue" / "carol-1").exists()
    # A job that did not ask to queue is refused while anyone waits, and takes no place.
    d = run(claims.claim_script(inv, "dave-1", (3,), "dave@ws4", True))
    assert d.returncode == queue.QUEUED and not (claim_dir / "queue" / "dave-1").exists()
    # The survey shows the queue in order; alice's job running keeps its claim through a restart.
    survey = run(claims.survey_script(inv)).stdout.partition("@@claims\n")[2]
    queued = queue.queue_order(claims.parse_survey(survey)[2])
    assert [(w.job, w.who, w.wants) for w in queued] == [
        ("bob-1", "bob@ws2", "0,1"),
        ("carol-1", "carol@ws3", "3"),
    ]
    assert run(claims.claim_script(inv, "alice-1", (0, 1), "alice@ws1", False)).returncode == 0
    # alice ends: bob (first) gets the GPUs; carol still waits behind him until he leaves the queue.
    assert run(claims.release_command(inv, ["alice-1"])).returncode == 0
    (root / "running").write_text("")
    assert (
        run(claims.claim_script(inv, "carol-1", (3,), "carol@ws3", True, ticket=carol)).returncode
        == queue.QUEUED
    )
    assert run(claims.claim_script(inv, "bob-1", (0, 1), "bob@ws2", True, ticket=bob)).returncode == 0
    assert run(queue.dequeue_command(inv, "bob-1")).returncode == 0
    assert run(claims.claim_script(inv, "carol-1", (3,), "carol@ws3", True, ticket=carol)).returncode == 0
    assert run(queue.dequeue_command(inv, "carol-1")).returncode == 0
    # A forged place (no real ticket) orders after every real one: it holds nobody up.
    (claim_dir / "queue" / "mallory-1").write_text("who=m\nticket=$(reboot)\n")
    assert (
        run(
            claims.claim_script(inv, "gwen-1", (2,), "gwen@ws7", True, ticket=queue.new_ticket("gwen-1"))
        ).returncode
        == 0
    )
    (claim_dir / "queue" / "mallory-1").unlink()
    assert run(claims.release_command(inv, ["gwen-1"])).returncode == 0
    # A running job's restart (not its first claim) never waits in the queue, onto a spare neither.
    assert (
        run(queue.enqueue_script(inv, "ivan-1", queue.new_ticket("ivan-1"), "ivan@ws9", ())).returncode == 0
    )
    assert run(claims.claim_script(inv, "hal-1", (2,), "hal@ws8", False)).returncode == 0
    assert run(claims.claim_script(inv, "jo-1", (2,), "jo@ws0", True)).returncode == claims.REFUSED
    assert run(claims.release_command(inv, ["ivan-1", "hal-1"])).returncode == 0
    # A place not kept for LEASE_STALE s (its fab train is gone) is dropped by the next one, which says so.
    assert (
        run(queue.enqueue_script(inv, "erin-1", queue.new_ticket("erin-1"), "erin@ws5", ())).returncode == 0
    )
    old = time.time() - hostfiles.LEASE_STALE - 5
    os.utime(claim_dir / "queue" / "erin-1", (old, old))
    f = run(queue.enqueue_script(inv, "frank-1", queue.new_ticket("frank-1"), "frank@ws6", ()))
    ahead, dropped = queue.parse_queue_output(f.stdout)
    assert (
        ahead == []
        and [w.job for w in dropped] == ["erin-1"]
        and not (claim_dir / "queue" / "erin-1").exists()
    )
    # fab stop (release) takes a job out of the queue.
    assert run(claims.release_command(inv, ["frank-1"], runtime=False)).returncode == 0
    assert not (claim_dir / "queue" / "frank-1").exists()


def test_tickets_taken_at_the_same_moment_differ_and_order_the_same_everywhere():
    a, b = queue.new_ticket("a-1"), queue.new_ticket("b-1")
    same_ns = "00000000000000000042"
    x, y = (
        queue.parse_waiting(f"x-1 ticket={same_ns}-x-1"),
        queue.parse_waiting(f"y-1 ticket={same_ns}-y-1"),
    )
    assert a != b and [w.job for w in queue.queue_order([y, x])] == ["x-1", "y-1"]
    assert queue.parse_waiting("z-1 ticket=$(reboot)").ticket == ""  # a forged ticket orders last
