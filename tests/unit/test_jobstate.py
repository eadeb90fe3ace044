"""The job's stages over its frozen state (jobstate.JobState), without a job: what the state says of
its hosts, the transitions the stages make, and the stages' own decisions (DECIDE, the TEARDOWN
after Ctrl+C, an Again that leaves nothing) against a recording stand-in for the job's context."""

from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

from orchestrator.backends.ssh import attempt, attempting, job
from orchestrator.backends.ssh.jobstate import JobState
from orchestrator.backends.ssh.nodefollow import NodeEnd
from orchestrator.backends.ssh.state import Again, Attempted, Ending
from orchestrator.backends.ssh.watch import Watched
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.core.policy import Decision, Failure, HostFailure, Outcome, Policy, Roster

INV = parse(
    "job: {output_dir: /data/out}\nhosts:\n"
    "  - {name: node1, address: 10.0.0.1, interface: eth0}\n"
    "  - {name: node2, address: 10.0.0.2, interface: eth0}\n"
    "spares:\n  - {name: spare1, address: 10.0.1.1, interface: eth0}\n",
    Path("inv.yaml"),
)
SPEC = jobspec.JobSpec(job_id="j-1", script="x.py", code_key="k1")


def plan(number=1, hosts=INV.hosts, warm=False):
    return attempt.build(replace(INV, hosts=hosts), SPEC, number, 29500, warm=warm)


def fresh(**kw) -> JobState:
    return JobState(SPEC, Roster(INV.hosts, INV.spares), **kw)


def lost(a, name):
    return Attempted(a, Outcome((HostFailure(name, Failure.LOST, "gone"),)))


class Context:
    """A JobContext's interface, recording what the stages ask of it, in order: events, the steps
    run (by key and host), the record's changes; `stop_marker`: what `fab stop`'s look answers."""

    def __init__(self, stop_marker=False, policy=None):
        self.said: list[tuple] = []
        self.stop_marker, self.policy, self.target_nodes = stop_marker, policy or Policy(), 2
        self.spec = SPEC

    def emit(self, event, **fields):
        self.said.append((event, fields))

    def note(self, text, level="info"):
        self.said.append(("note", {"level": level, "text": text}))

    def stage(self, stage, number=None):
        self.said.append(("stage", {"stage": stage.value, "attempt": number}))

    def run_steps(self, hosts, steps, transfer=None):
        names = {h.name for h in hosts}
        assert all((s.host or s.where) in names for s in steps), "a step on a host the state does not know"
        self.said.append(("steps", sorted((s.key, s.where) for s in steps)))

    def stopped(self, hosts):
        self.said.append(("stopped?", sorted(h.name for h in hosts)))
        return self.stop_marker

    def record_judged(self, outcome):
        self.said.append(("record", outcome))

    def record_retracted(self):
        self.said.append(("record", "retracted"))

    def took_over(self, hosts):
        self.said.append(("took_over", [h.name for h in hosts]))


def test_the_state_is_frozen_and_knows_its_hosts_from_its_attempts():
    a1, a2 = plan(1), plan(2, hosts=(INV.hosts[0], replace(INV.spares[0], rank=1)))
    s = fresh(recorded=3)
    with pytest.raises(FrozenInstanceError):
        s.current = a1  # type: ignore[misc]
    assert s.number == 4 and s.last is None and s.used == {} and s.lost == frozenset()
    s = s.begun(a1)
    assert s.number == 5 and s.last is a1 and sorted(s.used) == ["node1", "node2"]
    s = s.judged(lost(a1, "node2"), Roster(a2.hosts, ()))
    assert s.current is None and s.last is a1 and s.lost == {"node2"} and s.roster.hosts == a2.hosts
    assert s.answering(INV.all_hosts) == (INV.hosts[0], INV.spares[0])
    s = s.begun(a2)
    assert s.last is a2 and sorted(s.used) == ["node1", "node2", "spare1"]
    assert [h.name for h in s.reach(a2)] == ["node1", "spare1", "node1", "node2", "spare1"]
    assert s.retracted().current is None and s.retracted().number == s.number - 1
    # A judgement that ends the job keeps the roster it had.
    assert s.judged(Attempted(a2, Outcome()), None).roster == s.roster


def test_all_warm_needs_every_host_waiting_at_its_rank_under_the_same_code_key():
    a = plan(1, warm=True)

    def ended(warm_hosts):
        ends = {h.name: NodeEnd(h, 3 if h.name == "node2" else 0, warm=h.name in warm_hosts) for h in a.hosts}
        return Attempted(a, Outcome(), Watched(ends=ends))

    s = fresh().begun(a).judged(ended({"node1", "node2"}), None)
    assert s.all_warm(INV.hosts, warm=True)
    assert not s.all_warm(INV.hosts, warm=False)
    assert not replace(s, spec=replace(SPEC, code_key="k2")).all_warm(INV.hosts, warm=True)  # edited code
    swapped = tuple(replace(h, rank=1 - h.rank) for h in reversed(INV.hosts))
    assert not s.all_warm(swapped, warm=True)  # a container waits warm at its own rank only
    assert not fresh().begun(a).judged(ended({"node1"}), None).all_warm(INV.hosts, warm=True)
    assert not fresh().all_warm(INV.hosts, warm=True)  # no attempt yet


def test_decide_calls_a_failure_a_stop_when_fab_stop_left_its_marker():
    a = plan(1)
    s = fresh().begun(a)
    c = Context(stop_marker=True)
    failed = Attempted(a, Outcome((HostFailure("node2", Failure.EXIT, "exit 3"),)))
    after, d = job.decide(c, s, failed)
    assert d.roster is None and after.current is None and after.history[-1].outcome.stopped
    assert Ending.of(after.history[-1].outcome, d.reason).state == "stopped"
    assert c.said[1] == ("stopped?", ["node1", "node2"])
    assert [e for e, _ in c.said] == ["stage", "stopped?", "record", "attempt_end", "decision"]
    assert c.said[2] == ("record", "node2 exit 3")  # the record keeps the failure; the job ends stopped


def test_decide_spends_a_restart_and_says_when_the_next_attempt_comes(monkeypatch):
    monkeypatch.setattr(job, "backoff", lambda n: 7.0)
    a = plan(1)
    c = Context(policy=Policy(restarts=2))
    failed = Attempted(a, Outcome((HostFailure("node2", Failure.EXIT, "x"),)))
    after, d = job.decide(c, fresh().begun(a), failed)
    assert d.restart and after.roster.restarts_used == 1 and after.number == 2
    event, fields = c.said[-1]
    assert event == "decision" and fields["next"] is True and "restart 1 of 2 in 7s" in fields["reason"]
    assert job.pause_after(d, 1) == 7.0 and job.pause_after(Decision(Roster(()), restart=False), 1) == 0


def test_ctrl_c_before_the_watch_runs_the_interrupt_steps_then_the_fenced_teardown():
    a = plan(1)
    s = fresh().begun(a)
    c = Context()
    fences = []

    def body():
        raise KeyboardInterrupt

    done = attempting.guarded(c, s, a, body, lambda: fences.append(len(c.said)))
    assert isinstance(done, Attempted) and done.outcome.interrupted == 2
    kinds = [e for e, _ in c.said]
    assert kinds == ["steps", "stage", "steps"] and fences == [1]  # after ON_INTERRUPT, before TEARDOWN
    assert c.said[1][1]["stage"] == "teardown"
    assert c.said[2][1] == sorted(("stop", h.name) for h in a.hosts)


def test_a_lost_host_is_not_torn_down_and_an_again_tears_nothing_down():
    a = plan(1)
    s = fresh().begun(a)
    c = Context()
    attempting.guarded(c, s, a, lambda: lost(a, "node2"), lambda: None)
    assert c.said[-1] == ("steps", [("stop", "node1")])
    c, fences = Context(), []
    assert attempting.guarded(c, s, a, lambda: Again(), lambda: fences.append(1)) == Again()
    assert c.said == [] and fences == []


def test_an_attempt_whose_claim_found_the_hosts_taken_is_as_if_it_never_was(monkeypatch):
    a = plan(1)
    s = fresh(recorded=1).begun(a)
    monkeypatch.setattr(attempting, "prepare", lambda job, state, a, may_replan: Again())
    c = Context()
    after, tried = attempting.attempt(c, s, a, True, lambda: None)
    assert tried == Again() and after == fresh(recorded=1) and c.said == [("record", "retracted")]


def test_what_a_failover_found_lost_holds_for_the_first_watch_only(monkeypatch):
    a = plan(2)
    seen = []

    def watch(job, state, a):
        seen.append(dict(state.known_lost))
        return Attempted(a, Outcome(), Watched())

    monkeypatch.setattr(attempting, "watch", watch)
    s = attempting.take_over(Context(), fresh(known_lost=(("node2", "silent"),)), a)
    assert s.current is a and s.started
    after, done = attempting.follow(Context(), s, a, lambda: None)
    assert seen == [{"node2": "silent"}] and after.known_lost == () and after.current is a
