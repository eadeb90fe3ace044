"""Where a job runs: --include/--exclude in DeepSpeed's launcher syntax, --num-nodes."""

from pathlib import Path

import pytest

from orchestrator.commandline import hostselect
from orchestrator.config.inventory import parse
from orchestrator.core.errors import UserError

INV = parse(
    """\
hosts:
  - {name: node1, address: 10.0.0.1, interface: eth0}
  - {name: node2, address: 10.0.0.2, interface: eth0}
  - {name: node3, address: 10.0.0.3, interface: eth0}
spares:
  - {name: node4, address: 10.0.0.4, interface: eth0}
""",
    Path("inv.yaml"),
)


def names(inv):
    return [(h.name, h.rank) for h in inv.hosts], [s.name for s in inv.spares]


def test_include_exclude_and_num_nodes_renumber_the_ranks():
    assert names(hostselect.select_hosts(INV, "node3@node2", None)) == (
        [("node2", 0), ("node3", 1)],
        ["node4"],
    )
    assert names(hostselect.select_hosts(INV, None, "node1")) == ([("node2", 0), ("node3", 1)], ["node4"])
    assert names(hostselect.select_hosts(INV, "node4", None)) == (
        [("node4", 0)],
        [],
    )  # a spare, chosen by name
    assert names(hostselect.select_hosts(INV, None, None, busy={"node1"}, num_nodes="2")) == (
        [("node2", 0), ("node3", 1)],
        ["node4"],
    )
    assert hostselect.select_hosts(INV, None, None).hosts == INV.hosts


def test_gpu_sets_per_host_in_deepspeed_syntax():
    inv = hostselect.select_hosts(INV, "node2:2,3@node1:0,1", None)
    assert names(inv) == ([("node1", 0), ("node2", 1)], ["node4"])
    assert hostselect.host_list("node2:3,2@node1", "--include", INV) == {"node2": (2, 3), "node1": ()}
    assert hostselect.units_asked(INV, "node2:3,2@node1") == "node2:2,3"
    assert hostselect.units_asked(INV, None) == ""


@pytest.mark.parametrize(
    "include, exclude, num, busy, message",
    [
        (
            "node1@nodeX",
            None,
            None,
            set(),
            "--include 'node1@nodeX': no host 'nodeX' in inv.yaml; hosts are node1, node2, node3, node4",
        ),
        (
            "node1@@node2",
            None,
            None,
            set(),
            "an empty host name; write hosts joined by @, e.g. --include node1@node2",
        ),
        (
            "node1:0,x",
            None,
            None,
            set(),
            "'node1:0,x' should list distinct GPU (or CPU slot) indices after the colon, e.g. node1:0,1",
        ),
        ("node1:1,1", None, None, set(), "should list distinct GPU (or CPU slot) indices"),
        ("node1:0@node1:1", None, None, set(), "node1 is named twice"),
        (None, "node1:0", None, set(), "--exclude takes whole hosts; choose GPUs with --include node1:i,j"),
        (None, "node1@node2@node3", None, set(), "--include/--exclude leave no host to run on"),
        (
            None,
            None,
            "3",
            {"node2"},
            "--num-nodes 3: only 2 of node1, node2, node3 are free (node2 run other jobs)",
        ),
        (None, None, "zero", set(), "--num-nodes 'zero': give a whole number, 1 or more"),
    ],
)
def test_bad_selections_say_what_is_wrong(include, exclude, num, busy, message):
    with pytest.raises(UserError) as err:
        hostselect.select_hosts(INV, include, exclude, busy, num)
    assert message in str(err.value) and err.value.exit_code == 2
