import subprocess
import time
from pathlib import Path

from orchestrator import preflight as pf
from orchestrator.config.inventory import parse
from orchestrator.hostcmds import dockerargs
from orchestrator.transport.remote import PerHost, Result

INV = parse(
    "hosts:\n  - {name: a, address: 10.1.0.1, interface: eth0}\n"
    "  - {name: b, address: 10.1.0.2, interface: ens9}\n",
    Path("i.yaml"),
)
ADDR = (
    "1: lo    inet 127.0.0.1/8 scope host lo\n"
    "2: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\n"
    "9: eth1    inet 10.1.0.2/24 brd 10.1.0.255 scope global eth1\n"
)
LINK = (
    "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\n"
    "9: eth1@if10: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP\n"
    "3: eth2: <BROADCAST,MULTICAST> mtu 9000 qdisc noop state DOWN\n"
)


def test_probe_script_round_trip():
    cmds = {"one": ["echo", "a b"], "two": ["sh", "-c", "echo x; exit 3"]}
    script = pf.probe_script(cmds, "@@m")
    assert script == (
        "stuck=0; echo @@m one; echo 'a b' 2>&1; rc=$?; echo @@mrc $rc; "
        "echo @@m two; sh -c 'echo x; exit 3' 2>&1; rc=$?; echo @@mrc $rc"
    )
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True).stdout
    assert pf.parse_probe(out, "@@m") == {"one": (0, "a b"), "two": (3, "x")}


def test_probe_script_skips_docker_once_the_engine_hangs(tmp_path):
    # A stand-in `docker` on PATH that hangs like a frozen engine: the first Docker fact times out
    # (exit 124), the others are not tried, and the facts after them are still gathered.
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    cmds = {
        "docker": ["docker", "version"],
        "image": ["docker", "image", "inspect", "x"],
        "after": ["echo", "ok"],
    }
    script = pf.probe_script(cmds, "@@m").replace(f"timeout -k 2 {pf.DOCKER_TIMEOUT} ", "timeout -k 1 1 ")
    start = time.monotonic()
    out = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, env={"PATH": f"{tmp_path}:/usr/bin:/bin"}
    ).stdout
    assert time.monotonic() - start < 5
    facts = pf.parse_probe(out, "@@m")
    assert facts == {"docker": (124, ""), "image": (124, "engine did not answer"), "after": (0, "ok")}
    assert pf.judge_docker(INV.hosts[0], facts) == pf.Check(
        "a",
        "docker",
        "fail",
        f"engine gave no answer within {pf.DOCKER_TIMEOUT}s (docker version hangs)",
        "on a: the Docker engine is stuck; restart it (sudo systemctl restart docker) and check its disk "
        "(journalctl -u docker)",
    )


def test_parse_links_and_addrs():
    assert pf.parse_links(LINK) == {
        "lo": {"up": True, "mtu": 65536},
        "eth1": {"up": True, "mtu": 1500},
        "eth2": {"up": False, "mtu": 9000},
    }
    assert pf.parse_addrs(ADDR)["eth1"] == ["10.1.0.2/24"]


def test_wrong_interface_suggests_the_one_holding_the_master_subnet():
    c = pf.judge_interface(INV, INV.hosts[1], pf.parse_addrs(ADDR), pf.parse_links(LINK))
    assert (c.status, c.detail) == ("fail", "no interface 'ens9'")
    assert c.fix == "set interface: eth1 for b (its subnet holds 10.1.0.1)"


IMAGE_OK = (0, 'IMAGEINFO {"python": "3.11.2", "torch": "2.5.1+cpu", "cuda": null, "hip": null, "gpus": 0}')


def test_port_taken_names_process():
    facts = {
        "docker": (0, "24.0"),
        "image": (0, "sha256:" + "a" * 64),
        "addr": (0, ""),
        "link": (0, ""),
        "image_info": IMAGE_OK,
        "port": (0, 'LISTEN 0 5 0.0.0.0:29500 0.0.0.0:* users:(("python3",pid=4242,fd=3))'),
    }
    checks = {c.check: c for c in pf.judge_host(INV, INV.hosts[0], facts, "img")}
    assert checks["port"].status == "fail"
    assert checks["port"].detail == "master port 29500 already in use by python3 (pid 4242)"
    assert checks["docker"].status == "ok" and checks["image"].status == "ok"


def test_docker_permission_denied_names_the_fix():
    facts = {
        "docker": (1, "permission denied while trying to connect to the Docker daemon socket"),
        "image": (1, ""),
        "addr": (0, ""),
        "link": (0, ""),
    }
    checks = {c.check: c for c in pf.judge_host(INV, INV.hosts[1], facts, "img")}
    assert checks["docker"].fix == "on b: sudo usermod -aG docker root (then log in again)"
    assert checks["image"].status == "fail"


def test_judge_dirs_names_the_path_and_the_exact_fix():
    host = INV.hosts[1]
    facts = (0, "denied /opt/fabtrain/code /opt root\nok /data/out")
    c = pf.judge_dirs(host, facts)
    assert c.status == "fail"
    assert (
        c.detail
        == f"{host.ssh.user} cannot write /opt/fabtrain/code (cannot be created: /opt is owned by root)"
    )
    assert c.fix.startswith(
        f"on b: sudo install -d -o {host.ssh.user} -g $(id -gn {host.ssh.user}) /opt/fabtrain/code  ("
    )
    assert pf.judge_dirs(host, (0, "ok /a\nok /b")).status == "ok"
    # A directory above it the user cannot enter (mode 0700, say): named, and opened by the fix.
    closed = "denied /opt/f/code /opt/f root closed\ndenied /opt/f/out /opt/f root closed"
    c = pf.judge_dirs(host, (0, closed))
    user = host.ssh.user
    assert c.detail == (
        f"{user} cannot write /opt/f/code (/opt/f is closed to {user} (owner root)), "
        f"/opt/f/out (/opt/f is closed to {user} (owner root))"
    )
    assert c.fix.startswith(f"on b: sudo chmod a+x /opt/f; sudo install -d -o {user} -g $(id -gn {user}) ")


def test_render_shows_remote_text_as_text():
    import io

    from rich.console import Console

    hostile = "[/x] [bold]b\x1b[2J\x1b]8;;http://example.invalid\x07l\x1b]8;;\x07\rz"
    buf = io.StringIO()
    pf.render([pf.Check("a", "docker", "fail", hostile, f"fix {hostile}")], Console(file=buf, width=200))
    out = buf.getvalue()
    assert "[/x] [bold]b[2J]8;;http://example.invalid" in out  # markup shown, controls gone
    assert not any(ord(ch) < 32 and ch not in "\n" for ch in out)


def test_image_check_reports_versions_and_names_what_is_missing():
    host = INV.hosts[0]
    present = {"image": (0, "sha256:" + "b" * 64)}
    ok = pf.judge_image(host, {**present, "image_info": IMAGE_OK}, "img:1")
    assert (ok.status, ok.detail) == ("ok", "img:1 bbbbbbbbbbbb: python 3.11.2, torch 2.5.1+cpu")
    ngc = pf.judge_image(
        host,
        {
            **present,
            "image_info": (
                0,
                'IMAGEINFO {"python": "3.10.12", "torch": '
                '"2.2.0a0+81ea7a4", "cuda": "12.3", "hip": null, "gpus": 8}',
            ),
        },
        "ngc",
    )
    assert ngc.detail.endswith("python 3.10.12, torch 2.2.0a0+81ea7a4, CUDA 12.3")
    no_torch = pf.judge_image(
        host,
        {
            **present,
            "image_info": (
                0,
                'IMAGEINFO {"python": "3.11.2", "error": "ModuleNotFoundError: No module named \'torch\'"}',
            ),
        },
        "img:1",
    )
    assert no_torch.status == "fail" and "python 3.11.2 but no torch (ModuleNotFoundError" in no_torch.detail
    assert no_torch.fix.startswith("fab image.build --base img:1 ")
    # What Docker prints when the image has no python3 at all.
    no_python = pf.judge_image(
        host,
        {
            **present,
            "image_info": (
                127,
                "docker: Error response from daemon: failed to "
                'create task: exec: "python3": executable file not found in $PATH',
            ),
        },
        "img:1",
    )
    assert (no_python.status, no_python.detail) == ("fail", "img:1 bbbbbbbbbbbb has no python3")
    missing = pf.judge_image(host, {"image": (1, "Error: No such image: img:1")}, "img:1")
    assert (missing.status, missing.detail) == ("fail", "img:1 not present")


NVIDIA_SMI = "NVIDIA H100 80GB HBM3\n" * 8
ROCM_SMI = (
    "device,Card series,Card model,Card vendor,Card SKU,Subsystem ID,Device Rev,Node ID,GUID,GFX Version\n"
    + "".join(
        f"card{i},AMD Instinct MI250X,0x740c,Advanced Micro Devices Inc. [AMD/ATI],D65209,0x0b0c,"
        f"0x01,{i + 2},1234,gfx90a\n"
        for i in range(8)
    )
)
# KFD topology of a 2-socket MI250X server without rocm-smi: two CPU nodes (gpu_id 0), 8 GCDs.
SYSFS = "0\n0\n" + "".join(f"{40000 + i}\n" for i in range(8))


def test_gpu_count_from_captured_tool_output():
    assert pf.count_gpus("nvidia", NVIDIA_SMI) == (8, "NVIDIA H100 80GB HBM3")
    assert pf.count_gpus("amd", ROCM_SMI + "@@sysfs\n" + SYSFS) == (8, "AMD Instinct MI250X")
    assert pf.count_gpus("amd", "@@sysfs\n" + SYSFS) == (8, "AMD GPU")  # CPU nodes not counted
    assert pf.count_gpus("amd", "@@sysfs\n") == (0, "AMD GPU")


def test_nvidia_host_without_hook_or_cdi_fails_docker_check():
    gpu = parse(
        "hosts:\n  - {name: g, address: 10.1.0.9, interface: eth0, gpus: {vendor: nvidia, count: 8}}\n",
        Path("i.yaml"),
    ).hosts[0]
    facts = {"docker": (0, "27.1")}
    none = pf.judge_docker(gpu, facts, dockerargs.parse_gpu_probe('runtimes {"runc":{}}\ncdi 0\n'))
    assert none.status == "fail" and "no nvidia runtime and no CDI specs" in none.detail
    cdi = pf.judge_docker(gpu, facts, dockerargs.parse_gpu_probe('runtimes {"runc":{}}\ncdi 2\n'))
    assert cdi.status == "ok"


# Captured NCCL_DEBUG=INFO lines (NCCL 2.19): an IB fabric, and a host where IB init failed.
NCCL_IB = """dgx1:1234:1250 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ens1f0:10.0.0.11<0>
dgx1:1234:1250 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
"""
NCCL_SOCKET = """dgx1:1234:1250 [0] NCCL INFO NET/IB : No device found.
dgx1:1234:1250 [0] NCCL INFO NET/Socket : Using [0]ens1f0:10.0.0.11<0>
dgx1:1234:1250 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Socket/0
"""


def test_nccl_transport_from_debug_lines():
    assert pf.nccl_transport(NCCL_IB) == "IB"
    assert pf.nccl_transport(NCCL_SOCKET) == "Socket"
    assert pf.nccl_transport("SMOKE ok backend=gloo world=4") is None
    ib_host = parse(
        "hosts:\n  - {name: d, address: 10.0.0.11, interface: ens1f0, devices: [/dev/infiniband]}\n",
        Path("i.yaml"),
    ).hosts[0]
    warn = pf.judge_transport(ib_host, "all_reduce over 16 ranks (nccl)", "Socket")
    assert (
        warn.status == "warn"
        and "NCCL over TCP sockets although InfiniBand devices are mapped" in warn.detail
    )
    assert pf.judge_transport(ib_host, "x", "IB") == pf.Check("d", "smoke", "ok", "x, NCCL over InfiniBand")
    assert pf.judge_transport(INV.hosts[0], "x", "Socket").status == "ok"


def test_hosts_whose_images_hold_different_versions_are_warned():
    a = {"python": "3.11.2", "torch": "2.5.1", "cuda": "12.4", "hip": None, "gpus": 8}
    per_host = {
        "a": {"image_id": "sha256:1", "image_info": a},
        "b": {"image_id": "sha256:1", "image_info": a},
        "c": {"image_id": "sha256:1", "image_info": {**a, "torch": "2.4.0"}},
    }
    checks = [c for c in pf.judge_across(INV, per_host, None) if c.check == "image"]
    assert checks == [
        pf.Check(
            "c",
            "image",
            "warn",
            "python 3.11.2, torch 2.4.0, CUDA 12.4 here, python 3.11.2, torch 2.5.1, CUDA 12.4 on the others",
            "run one image everywhere (job.image), or the same versions in each",
        )
    ]


def test_smoke_test_reads_how_each_node_of_the_quiet_job_ended(tmp_path):
    from orchestrator.backends.ssh.nodefollow import NodeEnd
    from orchestrator.backends.ssh.watch import Watched
    from orchestrator.core.policy import Failure

    inv = parse(
        "hosts:\n  - {name: a, address: 10.0.0.1, interface: eth0}\n"
        "  - {name: b, address: 10.0.0.2, interface: eth0}\n",
        Path("i.yaml"),
    )

    def run_job(session, inv_, spec, run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "a.log").write_text("SMOKE ok backend=gloo world=4 size=8MB time=1ms busbw=700.0 MB/s\n")
        (run_dir / "b.log").write_text("boom\n")
        return Watched(
            ends={
                "a": NodeEnd(inv.hosts[0], exit_code=0),
                "b": NodeEnd(inv.hosts[1], exit_code=3, failure=Failure.EXIT, detail="exited with code 3"),
            }
        )

    checks = pf.read_ends(inv, run_job(None, inv, None, tmp_path), tmp_path)
    assert [(c.host, c.status) for c in checks] == [("a", pf.OK), ("b", pf.FAIL)]
    assert "all_reduce over 4 ranks (gloo), bus bw 700 MB/s" in checks[0].detail
    assert checks[1].detail == "collective failed (exited with code 3: boom)"


def test_left_over_runtime_asks_only_the_hosts_whose_ssh_and_engine_answered():
    """A host whose docker check failed (a frozen engine) is not surveyed: `docker ps` there would
    only wait out its deadline again (10 s more on every preflight and fab train it fails)."""

    class Recording:
        def __init__(self):
            self.asked = []

        def run(self, host, command, timeout=None, what=""):
            self.asked.append(host.name)
            return Result("@@runtime\n@@controllers\n@@claims\n", "", 0, 0.01)

        def fan_out(self, fn, hosts):
            return PerHost({h.name: fn(h) for h in hosts})

    session = Recording()
    names = [h.name for h in INV.hosts]
    stuck = pf.Check(names[1], "docker", pf.FAIL, "engine gave no answer within 8s (docker version hangs)")
    assert pf.left_over_runtime(session, INV, [stuck]) == [] and session.asked == names[:1]
    session.asked.clear()
    lost = [pf.Check(n, "ssh", pf.FAIL, "no answer") for n in names]
    assert pf.left_over_runtime(session, INV, lost) == [] and session.asked == []
    pf.left_over_runtime(session, INV, [pf.Check(names[1], "docker", pf.OK, "engine 20.10")])
    assert session.asked == names
