"""policy.decide, table-driven: (outcome, policy, roster) -> the next roster or why the job ends."""

from pathlib import Path

import pytest

from orchestrator.config.inventory import parse
from orchestrator.core.policy import Failure as F
from orchestrator.core.policy import HostFailure, Outcome, Policy, Roster, backoff, decide

INV = parse(
    """\
hosts:
  - {name: a, address: 10.0.0.1, interface: eth0}
  - {name: b, address: 10.0.0.2, interface: eth0}
  - {name: c, address: 10.0.0.3, interface: eth0}
spares:
  - {name: s1, address: 10.0.0.8, interface: eth0}
  - {name: s2, address: 10.0.0.9, interface: eth0}
""",
    Path("inv.yaml"),
)


def roster(spares=1, failed=(), used=0):
    return Roster(INV.hosts, INV.spares[:spares], tuple(failed), used)


def fails(*pairs):
    return Outcome(tuple(HostFailure(h, k, "x") for h, k in pairs))


CASES = [
    # name, outcome, policy, roster, expected layout (None: the job ends), reason part, restart spent
    ("success ends", Outcome(), Policy(restarts=3), roster(), None, "finished", False),
    ("ctrl-c ends", Outcome(interrupted=2), Policy(restarts=3), roster(), None, "interrupted", False),
    (
        "fab stop ends even with restarts left",
        Outcome(fails(("a", F.EXIT)).failures, stopped=True),
        Policy(restarts=3),
        roster(),
        None,
        "fab stop",
        False,
    ),
    ("no restarts: a failure ends", fails(("b", F.EXIT)), Policy(), roster(), None, "no --restarts", False),
    (
        "budget spent",
        fails(("b", F.EXIT)),
        Policy(restarts=2),
        roster(used=2),
        None,
        "no restarts left",
        False,
    ),
    (
        "first exit: same hosts again",
        fails(("b", F.EXIT)),
        Policy(restarts=1),
        roster(),
        [("a", 0), ("b", 1), ("c", 2)],
        "",
        True,
    ),
    (
        "second exit of a host: the spare takes its rank",
        fails(("b", F.EXIT)),
        Policy(restarts=2),
        roster(failed=(("b", 1),), used=1),
        [("a", 0), ("s1", 1), ("c", 2)],
        "",
        True,
    ),
    (
        "lost rank 0: the spare becomes rank 0",
        fails(("a", F.LOST)),
        Policy(restarts=1),
        roster(),
        [("s1", 0), ("b", 1), ("c", 2)],
        "",
        True,
    ),
    (
        "stuck engine is replaced like a lost host",
        fails(("c", F.ENGINE)),
        Policy(restarts=1),
        roster(),
        [("a", 0), ("b", 1), ("s1", 2)],
        "",
        True,
    ),
    (
        "a hang is not the host's fault: same hosts",
        fails(("a", F.HUNG)),
        Policy(restarts=1),
        roster(),
        [("a", 0), ("b", 1), ("c", 2)],
        "",
        True,
    ),
    (
        "failed start spends a restart",
        fails(("b", F.START)),
        Policy(restarts=1),
        roster(),
        [("a", 0), ("b", 1), ("c", 2)],
        "",
        True,
    ),
    (
        "failed start with none left ends",
        fails(("b", F.START)),
        Policy(restarts=0),
        roster(),
        None,
        "no --restarts",
        False,
    ),
    (
        "preflight failure at a restart: spare, no restart spent",
        fails(("b", F.PREFLIGHT)),
        Policy(restarts=0),
        roster(),
        [("a", 0), ("s1", 1), ("c", 2)],
        "",
        False,
    ),
    (
        "lost without spare, min-nodes allows: ranks close up",
        fails(("a", F.LOST)),
        Policy(restarts=1, min_nodes=2),
        roster(spares=0),
        [("b", 0), ("c", 1)],
        "",
        True,
    ),
    (
        "lost without spare, all nodes needed: ends naming the host",
        fails(("b", F.LOST)),
        Policy(restarts=1),
        roster(spares=0),
        None,
        "no spare host left to replace b (lost)",
        False,
    ),
    (
        "two lost, one spare, min 2",
        fails(("a", F.LOST), ("c", F.LOST)),
        Policy(restarts=1, min_nodes=2),
        roster(),
        [("s1", 0), ("b", 1)],
        "",
        True,
    ),
]


@pytest.mark.parametrize("name,outcome,policy,r,layout,reason,restart", CASES, ids=[c[0] for c in CASES])
def test_decide(name, outcome, policy, r, layout, reason, restart):
    d = decide(outcome, policy, r, target_nodes=3)
    if layout is None:
        assert d.roster is None and reason in d.reason
    else:
        assert [(h.name, h.rank) for h in d.roster.hosts] == layout
        assert d.restart is restart
        assert d.roster.restarts_used == r.restarts_used + (1 if restart else 0)


def test_spares_are_used_once_and_failures_counted():
    d = decide(fails(("a", F.LOST)), Policy(restarts=3), roster(), 3)
    assert d.roster.spares == () and d.notes == ("spare s1 takes the place of a (lost) as node rank 0",)
    d2 = decide(fails(("b", F.EXIT)), Policy(restarts=3), d.roster, 3)
    assert d2.roster.failures_of("b") == 1
    d3 = decide(fails(("b", F.EXIT)), Policy(restarts=3), d2.roster, 3)
    assert d3.roster is None and "no spare host left to replace b (failed twice)" in d3.reason


def test_backoff_doubles_up_to_its_cap_after_an_immediate_first_restart():
    assert [backoff(n) for n in (2, 3, 4, 5, 11)] == [0, 1, 2, 4, 30]


def test_a_failed_node_whose_container_is_gone_gives_its_rank_to_a_hot_spare():
    r = roster(spares=2)
    hot = frozenset({"s1"})
    # b's container is gone (not warm): the hot spare takes rank 1 at once; b is a (cold) spare now.
    d = decide(fails(("b", F.EXIT)), Policy(restarts=3), r, 3, warm=frozenset({"a", "c"}), hot=hot)
    assert [(h.name, h.rank) for h in d.roster.hosts] == [("a", 0), ("s1", 1), ("c", 2)]
    assert [h.name for h in d.roster.spares] == ["s2", "b"] and d.restart
    assert d.notes == (
        "spare s1 takes the place of b (its container is gone; a hot spare is ready) as node rank 1",
    )
    # Its container waits warm: it restarts there, the spare stays hot.
    d = decide(fails(("b", F.EXIT)), Policy(restarts=3), r, 3, warm=frozenset({"a", "b", "c"}), hot=hot)
    assert [h.name for h in d.roster.hosts] == ["a", "b", "c"] and [h.name for h in d.roster.spares] == [
        "s1",
        "s2",
    ]
    # No hot spare: as before, the node restarts in place (a cold spare is not faster).
    d = decide(fails(("b", F.EXIT)), Policy(restarts=3), r, 3)
    assert [h.name for h in d.roster.hosts] == ["a", "b", "c"]
    # A lost host takes the hot spare first; a node that merely failed then restarts in place.
    d = decide(fails(("a", F.LOST), ("b", F.EXIT)), Policy(restarts=3), r, 3, warm=frozenset({"c"}), hot=hot)
    assert [(h.name, h.rank) for h in d.roster.hosts] == [("s1", 0), ("b", 1), ("c", 2)]
    assert [h.name for h in d.roster.spares] == ["s2"]
    # The hot spare goes first even when listed after a cold one.
    d = decide(fails(("c", F.LOST)), Policy(restarts=3), r, 3, hot=frozenset({"s2"}))
    assert [(h.name, h.rank) for h in d.roster.hosts] == [("a", 0), ("b", 1), ("s2", 2)]
