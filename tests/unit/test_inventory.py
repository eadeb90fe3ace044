import copy
import datetime
import random
import re
from pathlib import Path

import pytest
import yaml

from orchestrator.config.inventory import load, parse
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import node as nodes

GOOD = """\
ssh:
  user: trainer
  key: keys/id_ed25519
  known_hosts: /etc/fabtrain/known_hosts
job:
  image: nvcr.io/nvidia/pytorch:24.01-py3
  master_port: 29400
  nproc_per_node: auto
  env: {NCCL_DEBUG: INFO, RETRIES: 3, FAST: true}
hosts:
  - name: dgx1
    address: 10.0.0.11
    interface: ens1f0
    gpus: {vendor: nvidia, count: 8}
  - address: 10.0.0.12
    interface: ens1f0
    gpus: {vendor: amd, count: 4}
    ssh: {port: 2222}
    mounts: ["/data:/data:ro", {source: /scratch, target: /scratch}]
"""


def test_good_inventory_in_rank_order():
    inv = parse(GOOD, Path("/etc/fabtrain/inv.yaml"))
    assert [h.name for h in inv.hosts] == ["dgx1", "10.0.0.12"]
    assert [h.rank for h in inv.hosts] == [0, 1]
    assert inv.master.address == "10.0.0.11"
    h0, h1 = inv.hosts
    assert h0.ssh.key == "/etc/fabtrain/keys/id_ed25519"  # relative to the inventory file
    assert h1.ssh.port == 2222 and h1.ssh.user == "trainer"  # per-host override keeps the rest
    assert (h0.gpu_vendor, h0.gpu_count, h1.gpu_vendor, h1.gpu_count) == ("nvidia", 8, "amd", 4)
    assert inv.job.env == (("NCCL_DEBUG", "INFO"), ("RETRIES", "3"), ("FAST", "true"))
    assert inv.job.nproc_per_node == "auto" and inv.job.master_port == 29400
    assert [(m.source, m.target, m.read_only) for m in h1.mounts] == [
        ("/data", "/data", True),
        ("/scratch", "/scratch", False),
    ]


def test_shipped_inventory_is_valid():
    # Parsed without the file checks: its key and known_hosts appear with `fab cluster.up`, which a
    # unit test must not need (load() checks them; the integration tests use it).
    path = Path(__file__).resolve().parents[2] / "inventory.yaml"
    inv = parse(path.read_text(), path)
    assert [h.address for h in inv.hosts] == ["172.28.5.11", "172.28.5.12"]


def error(text: str) -> str:
    with pytest.raises(UserError) as exc:
        parse(text, Path("inv.yaml"))
    return str(exc.value)


def test_bad_vendor_names_file_line_field_and_fix():
    bad = GOOD.replace("vendor: amd", "vendor: amdgpu")
    assert error(bad) == (
        "inv.yaml:17: hosts[1].gpus.vendor: 'amdgpu' is not a known GPU vendor; use one of: nvidia, amd, none"
    )


def test_missing_address():
    msg = error("hosts:\n  - name: a\n    interface: eth0\n")
    assert msg == "inv.yaml:2: hosts[0].address: is missing; add 'address:' to hosts[0]"


def test_unknown_field_is_named():
    msg = error("hosts:\n  - address: h\n    interface: eth0\n    gpu: {vendor: none}\n")
    assert msg.startswith("inv.yaml:4: hosts[0].gpu: unknown field; use one of: name, address,")


def test_port_out_of_range():
    msg = error("job: {master_port: 70000}\nhosts:\n  - {address: h, interface: eth0}\n")
    assert msg == "inv.yaml:1: job.master_port: 70000 is not a TCP port; use a number from 1 to 65535"


def test_wrong_type():
    msg = error("job:\n  master_port: high\nhosts:\n  - {address: h, interface: eth0}\n")
    assert msg == "inv.yaml:2: job.master_port: must be int, got 'high'; write an int value"


def test_gpu_count_must_match_vendor():
    msg = error("hosts:\n  - address: h\n    interface: eth0\n    gpus: {vendor: nvidia, count: 0}\n")
    assert "hosts[0].gpus.count: count 0 does not fit vendor 'nvidia'" in msg


def test_duplicate_host():
    msg = error("hosts:\n  - {address: h, interface: eth0}\n  - {address: h, interface: eth0}\n")
    assert msg == (
        "inv.yaml:3: hosts[1]: 'h' is also hosts[0]; list each host once, in hosts: (rank order) or spares:"
    )


def test_spares_parse_like_hosts_and_may_not_repeat_one():
    inv = parse(
        GOOD + "spares:\n  - {name: dgx9, address: 10.0.0.19, interface: ens1f0, "
        "gpus: {vendor: nvidia, count: 8}}\n",
        Path("inv.yaml"),
    )
    assert [h.name for h in inv.hosts] == ["dgx1", "10.0.0.12"]
    assert [h.name for h in inv.spares] == ["dgx9"] and inv.spares[0].ssh.user == "trainer"
    assert [h.name for h in inv.all_hosts] == ["dgx1", "10.0.0.12", "dgx9"]
    msg = error("hosts:\n  - {address: h, interface: eth0}\nspares:\n  - {address: h, interface: eth0}\n")
    assert msg == (
        "inv.yaml:4: spares[0]: 'h' is also hosts[0]; list each host once, in hosts: (rank order) or spares:"
    )


def test_yaml_syntax_error_has_line():
    msg = error("hosts:\n  - address: h\n   interface: [eth0\n")
    assert msg.startswith("inv.yaml:") and "not valid YAML" in msg


def test_relative_code_dir_refused():
    msg = error("job: {code_dir: code}\nhosts:\n  - {address: h, interface: eth0}\n")
    assert msg == (
        "inv.yaml:1: job.code_dir: 'code' is not an absolute path; "
        "write the full path on the hosts, starting with /"
    )


def test_bad_env_name():
    msg = error("job:\n  env: {1BAD: x}\nhosts:\n  - {address: h, interface: eth0}\n")
    assert msg.startswith("inv.yaml:2: job.env.1BAD: is not a valid environment variable name")


def test_missing_file():
    with pytest.raises(UserError, match="nope.yaml: inventory not found; pass --inventory PATH"):
        load("nope.yaml")


def _examples() -> dict[str, str]:
    """The commented inventories at the end of inventory.yaml and the YAML blocks of the docs' GPU
    section (README.md or a page of docs/, wherever it is), as a user would copy them."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "inventory.yaml").read_text()
    out = {}
    for part in text.split("# --- ")[1:]:
        lines = part.splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith(("# ssh:", "# job:", "# hosts:")))
        body = [line[2:] for line in lines[first:] if line.startswith("# ")]  # the prose above is left out
        out[part.split()[0] + part.split()[1]] = "\n".join(body) + "\n"
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    sections = [
        doc[doc.index("## GPU servers") : doc.index("Inventory mistakes")]
        for doc in (page.read_text() for page in pages)
        if "## GPU servers" in doc
    ]
    assert len(sections) == 1, "one '## GPU servers' section, then 'Inventory mistakes', in README or docs/"
    for i, block in enumerate(sections[0].split("```")[1::2]):
        out[f"readme{i}"] = block
    return out


def test_commented_examples_parse_and_give_the_documented_flags():
    from orchestrator.core import jobspec

    examples = _examples()
    assert len(examples) == 4, list(examples)
    ngc_amd = []
    for name, text in examples.items():
        if name.startswith("TwoAMD"):  # the AMD example reuses the global ssh: of the file above it
            text = "ssh: {user: me}\n" + text
        inv = parse(text, Path(f"{name}.yaml"))
        assert len(inv.hosts) == 2, name
        ngc_amd.append(inv)
        host = inv.hosts[0]
        argv = nodes.docker_run_argv(inv, host, jobspec.JobSpec(job_id="j", script="s.py"))
        if host.gpu_vendor == "nvidia":
            assert inv.job.image == "nvcr.io/nvidia/pytorch:24.01-py3"
            for flag in ("--gpus", "--device", "/dev/infiniband", "--cap-add", "IPC_LOCK", "memlock=-1"):
                assert flag in argv, (name, flag)
        else:
            assert (
                inv.job.image == "rocm/pytorch:latest" and "seccomp=unconfined" in argv and "/dev/kfd" in argv
            )
    assert {i.hosts[0].gpu_vendor for i in ngc_amd} == {"nvidia", "amd"}


def test_container_option_mistakes_name_the_field():
    base = "hosts:\n  - {address: h, interface: eth0, %s}\n"
    for field, problem in (
        ("ulimits: {nofiles: 10}", "hosts[0].ulimits.nofiles: is not a ulimit Docker knows"),
        ("ulimits: {nofile: lots}", "hosts[0].ulimits.nofile: 'lots' is not a limit"),
        ("cap_add: ['SYS_ADMIN; id']", "hosts[0].cap_add[0]: 'SYS_ADMIN; id' is not a valid cap_add entry"),
        ("security_opt: ['seccomp=$(id)']", "is not a valid security_opt entry"),
    ):
        with pytest.raises(UserError) as e:
            parse(base % field, Path("i.yaml"))
        assert problem in str(e.value), str(e.value)


# ---------------------------------------------------------------- empty values


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A HOME of the test's own: no ~/.ssh/config of the machine's user is read, ~ is predictable."""
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


# Slots where one line is added: {ssh} in the global ssh:, {job} in job:, {host} in hosts[0],
# {host_ssh} in hosts[0].ssh: (an empty job: or ssh: is itself one of the cases).
TEMPLATE = """\
ssh:
  config: none
{ssh}job:
{job}hosts:
  - address: 10.0.0.1
    interface: eth0
{host}    ssh:
{host_ssh}"""

# A key with nothing after it (or ~, or an empty list / mapping where one goes) is as if the line
# were not there: the field takes its default (for a host's ssh: field, the global ssh: value).
EMPTY_MEANS_DEFAULT = [
    ("ssh", "  port:"),
    ("ssh", "  port: ~"),
    ("ssh", "  user:"),
    ("ssh", "  key:"),
    ("ssh", "  known_hosts:"),
    ("ssh", "  connect_timeout:"),
    ("ssh", "  keepalive: null"),
    ("ssh", "  jump:"),
    ("ssh", "  jump: []"),
    ("job", "  image:"),
    ("job", "  master_port:"),
    ("job", "  nproc_per_node:"),
    ("job", "  code_dir:"),
    ("job", "  output_dir:"),
    ("job", "  shm_size:"),
    ("job", "  env:"),
    ("job", "  env: {}"),
    ("job", "  secret_files:"),
    ("job", "  stop_grace:"),
    ("job", "  keep_snapshots:"),
    ("job", "  ulimits:"),
    ("job", "  cap_add:"),
    ("job", "  cap_add: []"),
    ("job", "  security_opt:"),
    ("host", "    name:"),
    ("host", "    image:"),
    ("host", "    gpus:"),
    ("host", "    gpus: {}"),
    ("host", "    gpus: {vendor: , count: }"),
    ("host", "    env:"),
    ("host", "    mounts:"),
    ("host", "    mounts: []"),
    ("host", "    devices:"),
    ("host", "    ulimits:"),
    ("host", "    cap_add:"),
    ("host", "    security_opt:"),
    ("host_ssh", "      port:"),
    ("host_ssh", "      user:"),
    ("host_ssh", "      key:"),
    ("host_ssh", "      jump:"),
    ("host_ssh", "      keepalive:"),
    ("host_ssh", "      config:"),
]


def _text(slot: str = "", line: str = "") -> str:
    slots = {s: "" for s in ("ssh", "job", "host", "host_ssh")}
    if slot:
        slots[slot] = line + "\n"
    return TEMPLATE.format(**slots)


@pytest.mark.parametrize(
    "slot, line", EMPTY_MEANS_DEFAULT, ids=[f"{s}:{ln.strip()}" for s, ln in EMPTY_MEANS_DEFAULT]
)
def test_an_empty_optional_field_is_its_default(home, slot, line):
    assert parse(_text(slot, line), Path("inv.yaml")) == parse(_text(), Path("inv.yaml"))


def test_empty_sections_and_the_documented_defaults(home):
    minimal = "hosts:\n  - {address: h, interface: eth0}\n"
    for empty in ("ssh:\n", "ssh: {}\n", "job:\n", "job: ~\n", "spares:\n", "spares: []\n"):
        assert parse(empty + minimal, Path("i.yaml")) == parse(minimal, Path("i.yaml")), empty
    inv = parse(
        "job:\n  keep_snapshots:\n  stop_grace:\nssh:\n  port:\n  connect_timeout:\n" + minimal,
        Path("i.yaml"),
    )
    assert (
        inv.job.keep_snapshots,
        inv.job.stop_grace,
        inv.hosts[0].ssh.port,
        inv.hosts[0].ssh.connect_timeout,
    ) == (2, 30.0, 22, 10.0)
    # A host's empty ssh port is not set: the global one applies.
    inv = parse(
        "ssh: {port: 2222}\nhosts:\n  - {address: h, interface: eth0, ssh: {port: }}\n", Path("i.yaml")
    )
    assert inv.hosts[0].ssh.port == 2222
    inv = parse("hosts:\n  - address: h\n    interface: eth0\n    ssh: {port: }\n", Path("i.yaml"))
    assert inv.hosts[0].ssh.port == 22


EMPTY_IS_AN_ERROR = [
    # Required values: nothing to default to.
    ("hosts:\n", "inv.yaml:1: hosts: is empty; list at least one host; the first is rank 0"),
    ("hosts: []\n", "inv.yaml:1: hosts: is empty; list at least one host; the first is rank 0"),
    (
        "hosts:\n  - {address: a, interface: eth0}\n  -\n",
        "inv.yaml:3: hosts[1]: is empty; write the host's address: and interface: (indented under it) after "
        "the '-', "
        "or remove that line",
    ),
    (
        "hosts:\n  - {address: a, interface: eth0}\nspares:\n  - {}\n",
        "inv.yaml:4: spares[0]: is empty; write the host's address: and interface: (indented under it) "
        "after the '-', "
        "or remove that line",
    ),
    (
        "hosts:\n  - interface: eth0\n    address:\n",
        "inv.yaml:3: hosts[0].address: is empty; give the host's name or IP address, e.g. 10.0.0.11",
    ),
    (
        "hosts:\n  - address: fe80::1\n    interface: eth0\n    name:\n",
        "inv.yaml:4: hosts[0].name: is empty, and the address 'fe80::1' cannot be the host's name; add "
        "name: with "
        "letters, digits, '.', '_' and '-'",
    ),
    (
        "hosts:\n  - address: a\n    interface: ~\n",
        "inv.yaml:3: hosts[0].interface: is empty; give the network interface that reaches the other hosts, "
        "e.g. eth0",
    ),
    (
        "hosts:\n  - address: a\n    interface: eth0\n    mounts:\n      - {source: , target: /d}\n",
        "inv.yaml:5: hosts[0].mounts[0].source: is empty; give the path on the host, e.g. /data/corpus",
    ),
    (
        "hosts:\n  - address: a\n    interface: eth0\n    mounts:\n      - source: /d\n        target:\n",
        "inv.yaml:6: hosts[0].mounts[0].target: is empty; give the path in the container, e.g. /data",
    ),
    # List entries that are only '-'.
    (
        "hosts:\n  - address: a\n    interface: eth0\n    mounts:\n      - /a:/b\n      -\n",
        "inv.yaml:6: hosts[0].mounts[1]: is empty; write SOURCE:TARGET[:ro] (e.g. /data/corpus:/data:ro) "
        "after the "
        "'-', or remove that line",
    ),
    (
        "hosts:\n  - address: a\n    interface: eth0\n    devices:\n      -\n",
        "inv.yaml:5: hosts[0].devices[0]: is empty; write a device path such as /dev/infiniband after the "
        "'-', "
        "or remove that line",
    ),
    (
        "job:\n  cap_add:\n    - IPC_LOCK\n    - ''\nhosts:\n  - {address: a, interface: eth0}\n",
        "inv.yaml:4: job.cap_add[1]: is empty; write an entry such as IPC_LOCK after the '-', or remove "
        "that line",
    ),
    (
        "job:\n  security_opt: [~]\nhosts:\n  - {address: a, interface: eth0}\n",
        "inv.yaml:2: job.security_opt[0]: is empty; write an entry such as seccomp=unconfined after the '-', "
        "or remove that line",
    ),
    (
        "ssh:\n  jump:\n    - gw\n    -\nhosts:\n  - {address: a, interface: eth0}\n",
        "inv.yaml:4: ssh.jump[1]: is empty; write [user@]host[:port] after the '-', or remove that line",
    ),
    # Values of a mapping of names: a variable, limit or secret with nothing after it.
    (
        "job:\n  env:\n    A: 1\n    FOO:\nhosts:\n  - {address: a, interface: eth0}\n",
        'inv.yaml:4: job.env.FOO: is empty; write FOO: "" for an empty variable, or remove the line',
    ),
    (
        "hosts:\n  - address: a\n    interface: eth0\n    ulimits: {nofile: }\n",
        "inv.yaml:4: hosts[0].ulimits.nofile: is empty; write a number, SOFT:HARD, or -1 / unlimited, "
        "or remove the line",
    ),
    (
        "job:\n  secret_files:\n    TOKEN:\nhosts:\n  - {address: a, interface: eth0}\n",
        "inv.yaml:3: job.secret_files.TOKEN: is empty; give the local file whose contents become TOKEN, "
        "or remove the line",
    ),
    # A blank string is a value, and not a valid one, for every kind of field.
    (
        "ssh: {port: ''}\nhosts:\n  - {address: a, interface: eth0}\n",
        "inv.yaml:1: ssh.port: is empty; give a value, or remove 'port:'",
    ),
    (
        "job:\n  stop_grace: ' '\nhosts:\n  - {address: a, interface: eth0}\n",
        "inv.yaml:2: job.stop_grace: is empty; give a value, or remove 'stop_grace:'",
    ),
    (
        "job:\n  image: ''\nhosts:\n  - {address: a, interface: eth0}\n",
        "inv.yaml:2: job.image: is empty; give a value, or remove 'image:'",
    ),
    (
        "hosts:\n  - address: a\n    interface: eth0\n    devices: ''\n",
        "inv.yaml:4: hosts[0].devices: is empty; give a value, or remove 'devices:'",
    ),
    (
        "hosts:\n  - address: a\n    interface: eth0\n    env: ''\n",
        "inv.yaml:4: hosts[0].env: is empty; give its fields, or remove 'env:'",
    ),
]


@pytest.mark.parametrize("text, message", EMPTY_IS_AN_ERROR)
def test_an_empty_required_value_is_named(home, text, message):
    assert error(text) == message


# ---------------------------------------------------------------- job.keep_snapshots


def test_keep_snapshots():
    minimal = "hosts:\n  - {address: h, interface: eth0}\n"
    assert parse(minimal, Path("i.yaml")).job.keep_snapshots == 2
    assert parse("job: {keep_snapshots: 5}\n" + minimal, Path("i.yaml")).job.keep_snapshots == 5
    for value, problem in (
        ("0", "0 is not a number of snapshots to keep; use a number from 1 to 1000000"),
        ("-3", "-3 is not a number of snapshots to keep; use a number from 1 to 1000000"),
        ("10000000", "10000000 is not a number of snapshots to keep; use a number from 1 to 1000000"),
        ("1.5", "must be int, got 1.5; write an int value"),
        ("two", "must be int, got 'two'; write an int value"),
        ("true", "must be int, got True; write an int value"),
    ):
        assert (
            error(f"job:\n  keep_snapshots: {value}\n" + minimal)
            == f"inv.yaml:2: job.keep_snapshots: {problem}"
        )


# ---------------------------------------------------------------- hostile input

HOSTILE = [
    # Scalars PyYAML's own constructors choke on.
    (
        "job:\n  image: 2024-13-45\n",
        "inv.yaml:2: not valid YAML: '2024-13-45' is not a valid timestamp; check",
    ),
    ("job:\n  shm_size: !!bool maybe\n", "inv.yaml:2: not valid YAML: 'maybe' is not a valid bool; check"),
    ("job:\n  master_port: " + "9" * 5000 + "\n", "inv.yaml:2: not valid YAML: '999"),
    ("job:\n  stop_grace: 0x" + "f" * 400 + "\n", "inv.yaml:2: not valid YAML: '0xfff"),
    (
        "job:\n  env:\n    ? [a]\n    : 1\n",
        "inv.yaml:3: not valid YAML: a list or mapping used as a key; check",
    ),
    (
        "job:\n  image: a\x07b\n",
        "inv.yaml:2: not valid YAML: the control character U+0007 is not allowed; remove it",
    ),
    (
        "job:\n  env:\n    A: " + "[" * 400 + "]" * 400 + "\n",
        "inv.yaml:3: not valid YAML: lists or mappings nested more than 64 deep",
    ),
    # Values that would fail later, in int(), float(), ssh or the OS.
    ("job: {nproc_per_node: '²'}\n", "inv.yaml:1: job.nproc_per_node: '²' is not a process count;"),
    (
        "job: {stop_grace: .inf}\n",
        "inv.yaml:1: job.stop_grace: inf is not a number of seconds; use a number from 0 to 86400",
    ),
    ("job: {stop_grace: .nan}\n", "inv.yaml:1: job.stop_grace: nan is not a number of seconds;"),
    (
        "ssh: {keepalive: 0.5}\n",
        "inv.yaml:1: ssh.keepalive: 0.5 is not a number of seconds; use a number from 1 to 86400",
    ),
    (
        "ssh: {key: ~nosuchuser/id}\n",
        "inv.yaml:1: ssh.key: '~nosuchuser/id': no home directory for ~nosuchuser; write the full path",
    ),
    ("ssh: {known_hosts: " + "k" * 300 + "}\n", "inv.yaml:1: ssh.known_hosts: "),
    # Text a pattern's '$' would let through before a trailing newline, and a jump host ssh would read
    # as an option.
    ('ssh: {user: "me\\n"}\n', "inv.yaml:1: ssh.user: contains the control character U+000A; remove it"),
    ('job: {env: {"A\\n": x}}\n', "inv.yaml:1: job.env.'A\\n': is not a valid environment variable name"),
    (
        'spares:\n  - {address: s, interface: "\\u200b"}\n',
        "inv.yaml:2: spares[0].interface: '\\u200b' is not a network interface name; write it as 'ip link' "
        "shows it",
    ),
    (
        "ssh: {jump: -oProxyCommand=id}\n",
        "inv.yaml:1: ssh.jump: '-oProxyCommand=id' is neither a host name, an IP "
        "address nor an ssh_config alias;",
    ),
    ("job: {ulimits: {nofile: '٣'}}\n", "inv.yaml:1: job.ulimits.nofile: '٣' is not a limit;"),
]


@pytest.mark.parametrize("text, start", HOSTILE)
def test_hostile_values_are_named_not_raised(home, text, start):
    path = home / "inv.yaml"
    path.write_text(text + "hosts:\n  - {address: h, interface: eth0}\n")
    with pytest.raises(UserError) as exc:
        load(path)
    message = str(exc.value).replace(f"{home}/", "")
    assert message.startswith(start), message
    assert len(message) < 1000  # a huge value is shown shortened


def test_an_alias_bomb_is_shown_short():
    # 8**9 strings if expanded: a message must not print (or even build) the whole value.
    levels = ["&a [x, x, x, x, x, x, x, x]"] + [
        f"&{n} [{', '.join([f'*{p}'] * 8)}]" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
    ]
    msg = error(f"job:\n  cap_add: [[{', '.join(levels)}]]\nhosts:\n  - {{address: h, interface: eth0}}\n")
    assert msg.startswith(
        "inv.yaml:2: job.cap_add[0]: [['x', 'x', 'x', 'x', ...], [[...], [...], [...], [...], ...],"
    )
    assert msg.endswith("is not a valid cap_add entry; write e.g. IPC_LOCK or SYS_PTRACE") and len(msg) < 300


# ---------------------------------------------------------------- fuzzing

FUZZ_DOC = {
    "ssh": {
        "user": "trainer",
        "port": 22,
        "key": "id",
        "known_hosts": "kh",
        "connect_timeout": 10,
        "keepalive": 5,
        "jump": ["ops@bastion:2222"],
        "config": "none",
    },
    "job": {
        "image": "img:1",
        "master_port": 29500,
        "nproc_per_node": 2,
        "code_dir": "/opt/code",
        "output_dir": "/opt/out",
        "shm_size": "8g",
        "stop_grace": 30,
        "keep_snapshots": 3,
        "env": {"A": "1", "N": 3, "ON": True},
        "secret_files": {"TOKEN": "token"},
        "ulimits": {"nofile": "1024:2048", "memlock": "unlimited"},
        "cap_add": ["IPC_LOCK"],
        "security_opt": ["seccomp=unconfined"],
    },
    "hosts": [
        {
            "name": "n1",
            "address": "10.0.0.1",
            "interface": "eth0",
            "gpus": {"vendor": "nvidia", "count": 8},
            "ssh": {"port": 2222, "user": "u", "jump": "none"},
            "image": "img:2",
            "env": {"B": "b"},
            "mounts": ["/data:/data:ro", {"source": "/s", "target": "/t", "read_only": True}],
            "devices": ["/dev/infiniband"],
            "ulimits": {"memlock": -1},
            "cap_add": ["SYS_PTRACE"],
            "security_opt": ["apparmor=unconfined"],
        },
        {"address": "gpu2.example.com", "interface": "eth0"},
    ],
    "spares": [{"address": "10.0.0.3", "interface": "eth0", "gpus": {"vendor": "amd", "count": 4}}],
}
FUZZ_KEEP = ("hosts", "address", "interface", "source", "target", "vendor", "count")
GARBAGE = [
    None,
    "",
    " ",
    "\t",
    [],
    {},
    0,
    1,
    -1,
    2**63,
    -(2**63),
    2**64 + 1,
    10**30,
    1.5,
    -0.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    True,
    False,
    "x",
    "none",
    "auto",
    "unlimited",
    "/",
    "~",
    "~nosuchuser/k",
    "-oProxyCommand=x",
    "a b",
    "a\nb",
    "a:b:c",
    "@",
    "[::1]",
    "0",
    "-5",
    "1e9",
    "2024-13-45",
    "ü",
    "日本語",
    "٣",
    "²",
    "\u200b",
    "🙂" * 3,
    "x" * 300,
    "/dev/x",
    datetime.date(2024, 1, 1),
    ["a"],
    [None],
    [[]],
    {"a": None},
]
KEYS = ["zz", "port", "address", "hosts", 1, None, True, 1.5, "", "日本", "a\nb"]


def _garbage(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 2 or roll < 0.7:
        return copy.deepcopy(rng.choice(GARBAGE))
    if roll < 0.85:
        return [_garbage(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KEYS): _garbage(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _containers(node) -> list:
    if isinstance(node, dict):
        return [node, *(c for v in node.values() for c in _containers(v))]
    if isinstance(node, list):
        return [node, *(c for v in node for c in _containers(v))]
    return []


def _mutant(rng: random.Random) -> dict:
    doc = copy.deepcopy(FUZZ_DOC)
    # Thinned first, keeping what is required: each field missing is a case of its own, and
    # smaller documents parse faster (YAML parsing is most of this test's time).
    for node in _containers(doc):
        if isinstance(node, dict):
            for key in [k for k in node if k not in FUZZ_KEEP and rng.random() < 0.4]:
                del node[key]
    for _ in range(rng.randint(1, 3)):
        node = rng.choice([c for c in _containers(doc) if c])
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        op = rng.random()
        if op < 0.2:
            del node[key]
        elif op < 0.3 and isinstance(node, dict):
            node[rng.choice(KEYS)] = _garbage(rng)  # an unknown field, or a known one in the wrong place
        elif op < 0.35 and isinstance(node, list):
            node.append(copy.deepcopy(node[key]))
        else:
            node[key] = _garbage(rng)
        if not _containers(doc)[1:]:
            break
    return doc


def test_fuzzed_inventories_parse_or_fail_with_a_located_message(home):
    for name, text in (("id", "key"), ("kh", ""), ("token", "secret")):
        (home / name).write_text(text)
    # parse with check_files is load without the file read (decode has tests of its own), and
    # twice as fast here.
    path = home / "inventory.yaml"
    located = re.compile(re.escape(str(path)) + r":\d+: \S")
    rng = random.Random(29)  # a run that includes an empty ssh port, a ~user path and an over-long file name
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    outcomes = {"valid": 0, "error": 0}
    for i in range(2000):
        text = yaml.dump(_mutant(rng), Dumper=dumper, allow_unicode=bool(i % 2), sort_keys=False)
        try:
            inv = parse(text, path, check_files=True)
        except UserError as exc:
            assert located.match(str(exc)), (i, str(exc), text)
            outcomes["error"] += 1
        except Exception as exc:  # noqa: BLE001 - what this test looks for
            pytest.fail(f"case {i}: {type(exc).__name__}: {exc}\n{text}")
        else:
            # What loads is usable: numbers in range, one-line text.
            assert 1 <= inv.job.keep_snapshots and 1 <= inv.job.master_port <= 65535, (i, text)
            for h in inv.all_hosts:
                assert 1 <= h.ssh.port <= 65535 and 1 <= h.ssh.keepalive <= 86400, (i, text)
                assert h.interface.isprintable() and h.name.isprintable(), (i, text)
            outcomes["valid"] += 1
    # Both kinds of outcome in numbers: mutations that keep the document valid, and ones that break it.
    assert outcomes["valid"] > 100 and outcomes["error"] > 1000, outcomes


def test_warm_restarts_are_on_unless_the_inventory_turns_them_off(tmp_path):
    hosts = "hosts:\n  - {name: n1, address: 10.0.0.1, interface: eth0}\n"
    assert parse(hosts, tmp_path / "i.yaml").job.warm_restarts is True
    assert parse("job: {warm_restarts: false}\n" + hosts, tmp_path / "i.yaml").job.warm_restarts is False
    with pytest.raises(UserError, match=r"warm_restarts"):
        parse("job: {warm_restarts: maybe}\n" + hosts, tmp_path / "i.yaml")


def test_hot_spares_are_off_unless_the_inventory_turns_them_on(tmp_path):
    hosts = "hosts:\n  - {name: n1, address: 10.0.0.1, interface: eth0}\n"
    assert parse(hosts, tmp_path / "i.yaml").job.hot_spares is False
    assert parse("job: {hot_spares: true}\n" + hosts, tmp_path / "i.yaml").job.hot_spares is True
    with pytest.raises(UserError, match=r"hot_spares"):
        parse("job: {hot_spares: 2}\n" + hosts, tmp_path / "i.yaml")
