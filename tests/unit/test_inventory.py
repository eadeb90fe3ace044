from pathlib import Path

import pytest

from orchestrator.errors import UserError
from orchestrator.inventory import load, parse

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
    assert [(m.source, m.target, m.read_only) for m in h1.mounts] == [("/data", "/data", True),
                                                                     ("/scratch", "/scratch", False)]


def test_shipped_inventory_is_valid():
    inv = load(Path(__file__).resolve().parents[2] / "inventory.yaml")
    assert [h.address for h in inv.hosts] == ["172.28.5.11", "172.28.5.12"]


def error(text: str) -> str:
    with pytest.raises(UserError) as exc:
        parse(text, Path("inv.yaml"))
    return str(exc.value)


def test_bad_vendor_names_file_line_field_and_fix():
    bad = GOOD.replace("vendor: amd", "vendor: amdgpu")
    assert error(bad) == ("inv.yaml:17: hosts[1].gpus.vendor: 'amdgpu' is not a known GPU vendor; "
                          "use one of: nvidia, amd, none")


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
    assert msg == ("inv.yaml:3: hosts[1]: 'h' is also hosts[0]; list each host once, in hosts: (rank order) "
                   "or spares:")


def test_spares_parse_like_hosts_and_may_not_repeat_one():
    inv = parse(GOOD + "spares:\n  - {name: dgx9, address: 10.0.0.19, interface: ens1f0, "
                "gpus: {vendor: nvidia, count: 8}}\n", Path("inv.yaml"))
    assert [h.name for h in inv.hosts] == ["dgx1", "10.0.0.12"]
    assert [h.name for h in inv.spares] == ["dgx9"] and inv.spares[0].ssh.user == "trainer"
    assert [h.name for h in inv.all_hosts] == ["dgx1", "10.0.0.12", "dgx9"]
    msg = error("hosts:\n  - {address: h, interface: eth0}\nspares:\n  - {address: h, interface: eth0}\n")
    assert msg == ("inv.yaml:4: spares[0]: 'h' is also hosts[0]; list each host once, in hosts: (rank order) "
                   "or spares:")


def test_yaml_syntax_error_has_line():
    msg = error("hosts:\n  - address: h\n   interface: [eth0\n")
    assert msg.startswith("inv.yaml:") and "not valid YAML" in msg


def test_relative_code_dir_refused():
    msg = error("job: {code_dir: code}\nhosts:\n  - {address: h, interface: eth0}\n")
    assert msg == ("inv.yaml:1: job.code_dir: 'code' is not an absolute path; "
                   "write the full path on the hosts, starting with /")


def test_bad_env_name():
    msg = error("job:\n  env: {1BAD: x}\nhosts:\n  - {address: h, interface: eth0}\n")
    assert msg.startswith("inv.yaml:2: job.env.1BAD: is not a valid environment variable name")


def test_missing_file():
    with pytest.raises(UserError, match="nope.yaml: inventory not found; pass --inventory PATH"):
        load("nope.yaml")


def _examples() -> dict[str, str]:
    """The commented inventories at the end of inventory.yaml and the YAML blocks of README.md's
    GPU section, as a user would copy them."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "inventory.yaml").read_text()
    out = {}
    for part in text.split("# --- ")[1:]:
        lines = part.splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith(("# ssh:", "# job:", "# hosts:")))
        body = [line[2:] for line in lines[first:] if line.startswith("# ")]  # the prose above is left out
        out[part.split()[0] + part.split()[1]] = "\n".join(body) + "\n"
    readme = (root / "README.md").read_text()
    gpu = readme[readme.index("**GPU servers.**"):readme.index("Inventory mistakes")]
    for i, block in enumerate(gpu.split("```")[1::2]):
        out[f"readme{i}"] = block
    return out


def test_commented_examples_parse_and_give_the_documented_flags():
    from orchestrator import plan
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
        argv = plan.docker_run_argv(inv, host, plan.JobSpec(job_id="j", script="s.py"))
        if host.gpu_vendor == "nvidia":
            assert inv.job.image == "nvcr.io/nvidia/pytorch:24.01-py3"
            for flag in ("--gpus", "--device", "/dev/infiniband", "--cap-add", "IPC_LOCK", "memlock=-1"):
                assert flag in argv, (name, flag)
        else:
            assert inv.job.image == "rocm/pytorch:latest" and "seccomp=unconfined" in argv and "/dev/kfd" in argv
    assert {i.hosts[0].gpu_vendor for i in ngc_amd} == {"nvidia", "amd"}


def test_container_option_mistakes_name_the_field():
    base = "hosts:\n  - {address: h, interface: eth0, %s}\n"
    for field, problem in (("ulimits: {nofiles: 10}", "hosts[0].ulimits.nofiles: is not a ulimit Docker knows"),
                           ("ulimits: {nofile: lots}", "hosts[0].ulimits.nofile: 'lots' is not a limit"),
                           ("cap_add: ['SYS_ADMIN; id']", "hosts[0].cap_add: 'SYS_ADMIN; id' is not a valid cap_add entry"),
                           ("security_opt: ['seccomp=$(id)']", "is not a valid security_opt entry")):
        with pytest.raises(UserError) as e:
            parse(base % field, Path("i.yaml"))
        assert problem in str(e.value), str(e.value)
