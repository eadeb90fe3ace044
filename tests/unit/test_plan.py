import importlib.util
import shlex
import time
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.config import codetree, inventory
from orchestrator.config.inventory import parse
from orchestrator.core import jobspec
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import dockerargs, hostfiles, node, sshargs, touched
from orchestrator.hosts import claims

ROOT = Path(__file__).resolve().parents[2]
INV = parse(
    """\
ssh: {user: u, key: /k/id, known_hosts: /k/kh}
job:
  image: img:1
  code_dir: /opt/code
  output_dir: /opt/out
  env: {OMP_NUM_THREADS: "1"}
hosts:
  - {name: gpu0, address: 10.0.0.1, interface: ib0, gpus: {vendor: nvidia, count: 8}}
  - {name: rocm1, address: 10.0.0.2, interface: eth1, gpus: {vendor: amd, count: 4}, env: {HSA_X: "1"}}
  - name: cpu2
    address: 10.0.0.3
    interface: eth0
    devices: [/dev/infiniband/uverbs0]
    mounts: ["/data:/data:ro"]
""",
    Path("/i/inv.yaml"),
)
SPEC = jobspec.JobSpec(job_id="gpt-1", script="trainers/gpt.py", args=("--model", "tiny"), code_key="ab12")


def common(rank: int, name: str, ifname: str) -> list[str]:
    return [
        "docker",
        "run",
        "--detach",
        "--name",
        f"fabtrain-gpt-1-r{rank}",
        "--label",
        "fabtrain.managed=1",
        "--label",
        "fabtrain.job=gpt-1",
        "--label",
        f"fabtrain.rank={rank}",
        "--label",
        f"fabtrain.host={name}",
        "--network",
        "host",
        "--ipc",
        "host",
    ]


def env(rank: int, name: str, ifname: str, *extra: str) -> list[str]:
    pairs = [
        "MASTER_ADDR=10.0.0.1",
        "MASTER_PORT=29500",
        "NNODES=3",
        f"NODE_RANK={rank}",
        "NPROC_PER_NODE=auto",
        f"NCCL_SOCKET_IFNAME=={ifname}",
        f"GLOO_SOCKET_IFNAME={ifname}",
        "FABTRAIN_JOB=gpt-1",
        f"FABTRAIN_NODE={name}",
        "FABTRAIN_OUTPUT=/output",
        "FABTRAIN_CODE=/run/fabtrain-code",
        "WANDB_RUN_GROUP=gpt-1",
        "WANDB_RUN_ID=gpt-1",
        "WANDB_RESUME=allow",
        "OMP_NUM_THREADS=1",
        *extra,
        f"FABTRAIN_CONSOLE=/output/.console/node-{rank}.log",
    ]
    return [x for p in pairs for x in ("--env", p)]


# The code read-only under its key, the working directory writable in the job's outputs.
TAIL = [
    "--volume",
    "/opt/code/ab12:/run/fabtrain-code:ro",
    "--volume",
    "/opt/out/gpt-1/work:/workspace",
    "--volume",
    "/opt/out/gpt-1:/output",
    "--volume",
    "/opt/out/gpt-1/work:/output/work",
    "--volume",
    "/opt/out/.runtime/gpt-1:/run/fabtrain:ro",
]
CMD = [
    "--workdir",
    "/workspace",
    "--entrypoint",
    "python3",
    "img:1",
    "/run/fabtrain/entrypoint.py",
    "trainers/gpt.py",
    "--model",
    "tiny",
]
NGC_LIMITS = ["--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]


def test_docker_run_nvidia_with_the_runtime_hook():
    h = INV.hosts[0]
    assert node.docker_run_argv(INV, h, SPEC, dockerargs.GpuAccess(nvidia_runtime=True, cdi=True)) == (
        common(0, "gpu0", "ib0") + ["--gpus", "all"] + NGC_LIMITS + env(0, "gpu0", "ib0") + TAIL + CMD
    )


def test_docker_run_nvidia_cdi_only():
    h = INV.hosts[0]
    access = dockerargs.parse_gpu_probe(
        'runtimes {"io.containerd.runc.v2":{"path":"runc"},"runc":{}}\ncdi 3\n'
    )
    assert access == dockerargs.GpuAccess(nvidia_runtime=False, cdi=True)
    assert node.docker_run_argv(INV, h, SPEC, access) == (
        common(0, "gpu0", "ib0")
        + ["--device", "nvidia.com/gpu=all"]
        + NGC_LIMITS
        + env(0, "gpu0", "ib0")
        + TAIL
        + CMD
    )
    hook = dockerargs.parse_gpu_probe(
        'runtimes {"nvidia":{"path":"nvidia-container-runtime"},"runc":{}}\ncdi 0\n'
    )
    assert hook == dockerargs.GpuAccess(nvidia_runtime=True, cdi=False)


def test_docker_run_amd_groups_by_number_read_on_the_host():
    h = INV.hosts[1]
    # /dev/kfd owned by render (gid 110 on this host), the render nodes too; video (44) on card nodes.
    access = dockerargs.parse_gpu_probe("gids 44 110\n")
    assert node.docker_run_argv(INV, h, SPEC, access) == (
        common(1, "rocm1", "eth1")
        + [
            "--device",
            "/dev/kfd",
            "--device",
            "/dev/dri",
            "--group-add",
            "44",
            "--group-add",
            "110",
            "--security-opt",
            "seccomp=unconfined",
        ]
        + env(1, "rocm1", "eth1", "HSA_X=1")
        + TAIL
        + CMD
    )


def test_docker_run_amd_without_a_render_group():
    # Devices owned by root only (gid 0): no group to add, and never a group name the image lacks.
    h = INV.hosts[1]
    argv = node.docker_run_argv(INV, h, SPEC, dockerargs.parse_gpu_probe("gids 0\n"))
    assert "--group-add" not in argv and argv[argv.index("/dev/dri") + 1] == "--security-opt"


def test_docker_run_cpu_with_infiniband_devices_and_mounts():
    h = INV.hosts[2]
    assert node.docker_run_argv(INV, h, SPEC) == (
        common(2, "cpu2", "eth0")
        + ["--device", "/dev/infiniband/uverbs0", "--cap-add", "IPC_LOCK"]
        + env(2, "cpu2", "eth0")
        + TAIL
        + ["--volume", "/data:/data:ro"]
        + CMD
    )


def test_a_job_on_some_gpus_sees_only_those_and_runs_one_process_each():
    from dataclasses import replace

    spec = replace(SPEC, units="gpu0:2,5", owner="alice@ws1")
    argv = node.docker_run_argv(
        INV, INV.hosts[0], spec, dockerargs.GpuAccess(nvidia_runtime=True), units=(2, 5)
    )
    assert argv[argv.index("fabtrain.host=gpu0") + 1 :][:2] == ["--label", "fabtrain.owner=alice@ws1"]
    assert argv[argv.index("--gpus") + 1] == '"device=2,5"' and "NPROC_PER_NODE=2" in argv
    assert "--gpus '\"device=2,5\"'" in sshargs.shell(argv)  # as the docker CLI wants it on the host
    cdi = node.docker_run_argv(
        INV, INV.hosts[0], spec, dockerargs.GpuAccess(nvidia_runtime=False, cdi=True), units=(2, 5)
    )
    assert cdi[cdi.index("--device") : cdi.index("--device") + 4] == [
        "--device",
        "nvidia.com/gpu=2",
        "--device",
        "nvidia.com/gpu=5",
    ]
    # Every GPU of the host: the same argv as a job that owns the host; --nproc given wins.
    assert node.docker_run_argv(
        INV, INV.hosts[0], SPEC, dockerargs.GpuAccess(), units=tuple(range(8))
    ) == node.docker_run_argv(INV, INV.hosts[0], SPEC, dockerargs.GpuAccess())
    assert "NPROC_PER_NODE=1" in node.docker_run_argv(
        INV, INV.hosts[0], replace(spec, nproc_per_node="1"), dockerargs.GpuAccess(), units=(2, 5)
    )
    # AMD: /dev/kfd and only the chosen GPUs' render nodes, from the KFD topology read on the host.
    access = dockerargs.parse_gpu_probe("gids 44 110\nrender 128 136 144 152\n")
    amd = node.docker_run_argv(INV, INV.hosts[1], spec, access, units=(1, 3))
    assert amd[amd.index("/dev/kfd") - 1 : amd.index("/dev/kfd") + 5] == [
        "--device",
        "/dev/kfd",
        "--device",
        "/dev/dri/renderD136",
        "--device",
        "/dev/dri/renderD152",
    ]


def test_cpu_jobs_pinned_to_their_slots_with_cpuset():
    from dataclasses import replace

    h = INV.hosts[2]
    assert "--cpuset-cpus" not in node.docker_run_argv(INV, h, SPEC, units=(1,))
    argv = node.docker_run_argv(INV, h, replace(SPEC, cpuset=True, units="cpu2:1,3"), units=(1, 3))
    assert argv[argv.index("--cpuset-cpus") + 1] == "1,3" and "NPROC_PER_NODE=2" in argv


def test_inventory_container_options_over_the_vendor_defaults():
    inv = parse(
        """\
job:
  ulimits: {nofile: "4096:8192"}
  cap_add: [SYS_PTRACE]
hosts:
  - name: dgx1
    address: 10.0.0.1
    interface: ens1f0
    gpus: {vendor: nvidia, count: 8}
    devices: [/dev/infiniband]
    ulimits: {memlock: 68719476736, stack: unlimited}
    cap_add: [SYS_NICE]
    security_opt: [apparmor=unconfined]
""",
        Path("i.yaml"),
    )
    n = node.node_spec(inv, inv.hosts[0], SPEC)
    assert (n.ulimits, n.cap_add, n.security_opt) == (
        (("memlock", "68719476736"), ("stack", "-1"), ("nofile", "4096:8192")),
        ("IPC_LOCK", "SYS_PTRACE", "SYS_NICE"),
        ("apparmor=unconfined",),
    )
    argv = dockerargs.docker_options(n)
    at = argv.index("--ulimit")
    assert argv[at : at + 14] == [
        "--ulimit",
        "memlock=68719476736",
        "--ulimit",
        "stack=-1",
        "--ulimit",
        "nofile=4096:8192",
        "--cap-add",
        "IPC_LOCK",
        "--cap-add",
        "SYS_PTRACE",
        "--cap-add",
        "SYS_NICE",
        "--security-opt",
        "apparmor=unconfined",
    ]


def test_module_runs_through_the_entrypoint():
    spec = jobspec.JobSpec(job_id="gpt-1", script="mypkg.train", module=True, args=("--lr", "1"))
    argv = node.docker_run_argv(INV, INV.hosts[2], spec)
    assert argv[argv.index("img:1") :] == [
        "img:1",
        "/run/fabtrain/entrypoint.py",
        "-m",
        "mypkg.train",
        "--lr",
        "1",
    ]


def test_start_script_writes_the_entrypoint_from_stdin():
    script = node.start_script(INV, INV.hosts[2], SPEC)
    # The directories the container writes are made, emptied and checked through touched.py, none
    # followed as a link; the mount sources checked in the same command as the docker run.
    assert script.startswith(
        "mkdir -p /opt/out/gpt-1 /opt/out/.runtime/gpt-1 && "
        "( cd -P /opt/out/gpt-1 && { [ -d work ] && [ ! -L work ] || { rm -f -- work; "
        "mkdir -p -- work; }; } ) && "
        "( cd -P /opt/out/gpt-1 && { [ -d .console ] && [ ! -L .console ] || { rm -f -- .console; "
        "mkdir -p -- .console; }; } ) && "
        f"{touched.remove('/opt/out/gpt-1', '.console', ['node-2.log'])} && "
        f"{touched.mount_sources_check(['/opt/out/gpt-1', '/opt/out/gpt-1/work'])} && "
        # readable by a non-root image user whatever the SSH user's umask
        "(umask 022 && tar -x -o -f - -C /opt/out/.runtime/gpt-1) && docker run --detach "
    )
    assert script.endswith(" >/dev/null")
    assert hostfiles.secrets_file(INV, SPEC) == "/opt/out/.runtime/gpt-1/secrets.env"
    assert claims.release_command(INV, ["gpt-1"]) == (
        'd=/opt/out/.claims/"$(hostname)"; rm -rf /opt/out/.runtime/gpt-1 /opt/out/.runtime/.stopped/gpt-1; '
        'rm -f "$d"/gpt-1 "$d"/queue/gpt-1'
    )


def test_shm_size_or_ipc_private_gives_the_job_its_own_ipc_namespace():
    def ipc(job: str) -> list[str]:
        inv = parse(f"job: {job}\nhosts:\n  - {{address: h, interface: eth0}}\n", Path("i.yaml"))
        argv = node.docker_run_argv(inv, inv.hosts[0], SPEC)
        i = argv.index("--ipc")
        return argv[i : i + (4 if argv[i + 1] == "private" else 2)]

    assert ipc("{}") == ["--ipc", "host"]
    assert ipc("{shm_size: 64g}") == ["--ipc", "private", "--shm-size", "64g"]
    assert ipc("{ipc: private}") == ["--ipc", "private", "--shm-size", "8g"]
    assert ipc("{ipc: private, shm_size: 2g}") == ["--ipc", "private", "--shm-size", "2g"]
    for job, said in (
        (
            "{ipc: host, shm_size: 2g}",
            "i.yaml:1: job.shm_size: sizes a private /dev/shm, but job.ipc is host; set job.ipc: private",
        ),
        ("{ipc: shareable}", "i.yaml:1: job.ipc: 'shareable' is not an IPC mode; use host"),
    ):
        with pytest.raises(UserError) as e:
            ipc(job)
        assert str(e.value).startswith(said), str(e.value)


def test_wandb_run_of_any_script_is_the_jobs_across_attempts_and_the_users_values_win():
    def wandb(inv, spec, host=0):
        return [(k, v) for k, v in node.job_env(inv, inv.hosts[host], spec) if k.startswith("WANDB_")]

    assert wandb(INV, SPEC) == [
        ("WANDB_RUN_GROUP", "gpt-1"),
        ("WANDB_RUN_ID", "gpt-1"),
        ("WANDB_RESUME", "allow"),
    ]
    # A restart (another attempt, port, hosts) and --resume (the same job id) continue the one run.
    again = replace(SPEC, master_port=29517, env=(("FABTRAIN_ATTEMPT", "2"), ("FABTRAIN_TARGET_NODES", "3")))
    assert wandb(INV, again) == wandb(INV, SPEC) == wandb(INV, SPEC, host=2)
    # Each value given wins, in its place: the inventory's job.env, a host's env, the job's own env.
    mine = parse(
        "job: {env: {WANDB_RUN_GROUP: sweep-7}}\nhosts:\n  - {address: h, interface: eth0}\n", Path("i.yaml")
    )
    assert wandb(mine, SPEC) == [
        ("WANDB_RUN_GROUP", "sweep-7"),
        ("WANDB_RUN_ID", "gpt-1"),
        ("WANDB_RESUME", "allow"),
    ]
    host = replace(INV.hosts[1], env=(*INV.hosts[1].env, ("WANDB_RUN_ID", "abc")))
    got = dict(node.job_env(INV, host, replace(SPEC, env=(("WANDB_RESUME", "never"),))))
    assert (got["WANDB_RUN_GROUP"], got["WANDB_RUN_ID"], got["WANDB_RESUME"]) == ("gpt-1", "abc", "never")


def test_wandb_run_id_is_the_job_id_where_wandb_takes_it_else_safe_and_distinct():
    assert node.wandb_run_id("gpt-20261122-192206-1266") == "gpt-20261122-192206-1266"
    assert node.wandb_run_id("a_B-9") == "a_B-9"
    dotted, underscored = node.wandb_run_id("my.job-1"), node.wandb_run_id("my_job-1")
    assert underscored == "my_job-1" and dotted.startswith("my-job-1-") and len(dotted) == 17
    long = "x" * 70
    assert len(node.wandb_run_id(long)) == 64 and node.wandb_run_id(long) != node.wandb_run_id("x" * 71)
    for job_id in ("my.job-1", long, "a" + "." * 127, "x" * 64):
        run_id = node.wandb_run_id(job_id)
        assert node.WANDB_RUN_ID_RE.fullmatch(run_id) and run_id == node.wandb_run_id(job_id), job_id


def test_hostile_values_are_quoted_once():
    spec = jobspec.JobSpec(
        job_id="j",
        script="s.py",
        args=("'; touch /tmp/pwned #", "$(id)", "a b\nc"),
        env=(("X", "`id` $HOME"),),
    )
    argv = node.docker_run_argv(INV, INV.hosts[2], spec)
    assert shlex.split(sshargs.shell(argv)) == argv


def test_rsync_argv():
    h = INV.hosts[1]
    assert sshargs.rsync_argv(h, "/src/proj/", "/opt/code") == [
        "rsync",
        "--archive",
        "--compress",
        "--delete",
        "--mkpath",
        "--timeout=60",
        "--info=progress2",
        "-s",
        "--rsh",
        "ssh -F none -p 22 -l u -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile=/k/kh "
        "-o 'GlobalKnownHostsFile=/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2' "
        "-o ConnectTimeout=10 -o ServerAliveInterval=5 -o ServerAliveCountMax=3 -i /k/id -o "
        "IdentitiesOnly=yes",
        "--exclude=.git",
        "--exclude=__pycache__",
        "--exclude=*.pyc",
        "--exclude=.venv",
        "--exclude=.cache",
        "--exclude=.cluster*",
        "--exclude=runs",
        "--exclude=.fabtrain",
        "--exclude=.pytest_cache",
        "--exclude=*.egg-info",
        "--from0",
        f"--files-from={codetree.list_file('/src/proj/')}",  # the exact files (codetree.select)
        "/src/proj/",
        "10.0.0.2:/opt/code/",
    ]
    # This project's own tree: only its trainers go to the hosts.
    argv = sshargs.rsync_argv(h, str(jobspec.PROJECT_ROOT), "/opt/code", "trainers")
    assert argv[-6:] == [
        "--include=/trainers/***",
        "--exclude=*",
        "--from0",
        f"--files-from={codetree.list_file(jobspec.PROJECT_ROOT, 'trainers')}",
        str(jobspec.PROJECT_ROOT) + "/",
        "10.0.0.2:/opt/code/",
    ]


def test_stop_script_by_label_with_grace():
    assert dockerargs.stop_script("gpt-1", 30) == (
        "docker ps --all --quiet --filter label=fabtrain.managed=1 --filter label=fabtrain.job=gpt-1"
        " | xargs -r docker stop --time 30 >/dev/null; "
        "docker ps --all --quiet --filter label=fabtrain.managed=1 --filter label=fabtrain.job=gpt-1"
        " | xargs -r docker rm --force 2>&1 | awk " + shlex.quote(dockerargs.RM_FILTER)
    )
    assert dockerargs.stop_script() == (
        "docker ps --all --quiet --filter label=fabtrain.managed=1"
        " | xargs -r docker rm --force 2>&1 | awk " + shlex.quote(dockerargs.RM_FILTER)
    )


def test_follow_finish_and_remainder_commands():
    f = "/opt/out/gpt-1/.console/node-1.log"
    assert hostfiles.console_file(INV, SPEC, 1) == f
    root, rel = "/opt/out/gpt-1", ".console/node-1.log"
    assert hostfiles.follow_logs_script(INV, SPEC, 1) == (
        "docker wait fabtrain-gpt-1-r1 >/dev/null 2>&1 & "
        f"w=$!; {touched.follow(root, rel, '$w')} 2>/dev/null; wait"
    )
    assert hostfiles.finish_logs_script(INV, SPEC, 1) == (
        'code=$(docker wait fabtrain-gpt-1-r1 2>/dev/null); echo "${code:-255}"; '
        f"{touched.tail(root, rel, 262144)}; "
        '[ $? = 4 ] && [ -n "$code" ] && docker logs --tail 1000 fabtrain-gpt-1-r1 2>&1 '
        "| tail -c 262144; true"
    )
    assert hostfiles.remainder_logs_script(INV, SPEC, 1, 2346) == (
        f"{touched.read_from(root, rel, 2346)}; [ $? = 4 ] && "
        "docker logs fabtrain-gpt-1-r1 2>&1 | tail -c +2346; true"
    )


def fake_docker(tmp_path, script: str) -> dict:
    (tmp_path / "docker").write_text("#!/bin/sh\n" + script)
    (tmp_path / "docker").chmod(0o755)
    return {"PATH": f"{tmp_path}:/usr/bin:/bin"}


def on_this_machine(tmp_path) -> inventory.Inventory:
    return parse(
        f"job: {{output_dir: {tmp_path}/out}}\nhosts:\n  - {{address: h, interface: eth0}}\n", Path("i.yaml")
    )


def test_follow_reads_the_console_file_to_its_end_once_the_container_exits(tmp_path):
    """The follow script run by sh with `docker wait` stubbed: the file written while it follows
    and just before the container's end all arrives, and the script ends after that end."""
    import subprocess
    import threading

    inv = on_this_machine(tmp_path)
    f = Path(hostfiles.console_file(inv, SPEC, 0))
    f.parent.mkdir(parents=True)
    env = fake_docker(tmp_path, f"while [ ! -e {tmp_path}/exited ]; do sleep 0.05; done\necho 0\n")

    def container():
        with f.open("a") as fh:
            for i in range(3000):
                fh.write(f"line {i}\n")
                if i % 1000 == 0:
                    fh.flush()
                    time.sleep(0.3)
        (tmp_path / "exited").touch()

    t = threading.Thread(target=container)
    t.start()
    r = subprocess.run(
        ["sh", "-c", hostfiles.follow_logs_script(inv, SPEC, 0)],
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
    )
    t.join()
    assert r.stdout == "".join(f"line {i}\n" for i in range(3000))


def test_remainder_script_sends_exactly_the_rest(tmp_path):
    import subprocess

    inv = on_this_machine(tmp_path)
    full = "".join(f"line {i}\n" for i in range(1000))
    (tmp_path / "full").write_text(full)
    env = fake_docker(tmp_path, f"cat {tmp_path}/full\n")  # no console file: Docker's log
    r = subprocess.run(
        ["sh", "-c", hostfiles.remainder_logs_script(inv, SPEC, 1, 2346)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert full[:2345] + r.stdout == full
    f = Path(hostfiles.console_file(inv, SPEC, 1))
    f.parent.mkdir(parents=True)
    f.write_text(full)
    r = subprocess.run(
        ["sh", "-c", hostfiles.remainder_logs_script(inv, SPEC, 1, 2346)],
        capture_output=True,
        text=True,
        env=fake_docker(tmp_path, "echo wrong\n"),
    )
    assert full[:2345] + r.stdout == full


def _entrypoint():
    spec = importlib.util.spec_from_file_location("entrypoint", ROOT / "docker" / "entrypoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_flight_recorder_is_on_under_its_current_name_only():
    """A first run prints no warning caused by our own settings: torch 2.5+ warns once per rank when
    the deprecated TORCH_NCCL_TRACE_BUFFER_SIZE is set."""
    env = {"NNODES": "1", "NODE_RANK": "0", "FABTRAIN_OUTPUT": "/output"}
    child = _entrypoint().plan(env, ["t.py"], 0)[1]
    assert child["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in child


def test_torchrun_argv_from_orchestrator_env():
    ep = _entrypoint()
    env = {
        "NNODES": "2",
        "NODE_RANK": "1",
        "NPROC_PER_NODE": "auto",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    argv, child, banner = ep.plan(env, ["trainers/gpt.py", "--model", "tiny"], gpus=8)
    assert argv[1:] == [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--nproc_per_node",
        "8",
        "--master_addr",
        "10.0.0.1",
        "--master_port",
        "29500",
        "--",
        "trainers/gpt.py",
        "--model",
        "tiny",
    ]
    assert child["FABTRAIN_PG_TIMEOUT"] == "60"
    assert "world_size=16" in banner


def test_torchrun_argv_from_platform_env():
    """A platform sets WORLD_SIZE = nodes and RANK = node rank; workers must not inherit them."""
    ep = _entrypoint()
    env = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    argv, child, _ = ep.plan(env, ["train.py"], gpus=0)
    assert argv[3:] == [
        "--nnodes",
        "4",
        "--node_rank",
        "3",
        "--nproc_per_node",
        "1",
        "--master_addr",
        "job-master-0",
        "--master_port",
        "23456",
        "--",
        "train.py",
    ]
    assert "RANK" not in child and "WORLD_SIZE" not in child


def test_torchrun_argv_from_kubeflow_trainer_env():
    """Kubeflow Trainer's torch-distributed runtime (a TrainJob) gives torchrun's PET_* variables."""
    ep = _entrypoint()
    env = {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_NPROC_PER_NODE": "4",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }
    argv, _, banner = ep.plan(env, ["train.py"], gpus=4)
    assert argv[3:] == [
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--nproc_per_node",
        "4",
        "--master_addr",
        "job-node-0-0.job",
        "--master_port",
        "29400",
        "--",
        "train.py",
    ]
    assert "world_size=8" in banner


def test_entrypoint_reads_secrets_file(tmp_path):
    ep = _entrypoint()
    f = tmp_path / "s.env"
    f.write_text("TOKEN=a=b c'd\nOTHER=1\n")
    assert ep.read_secrets(str(f)) == {"TOKEN": "a=b c'd", "OTHER": "1"}
    assert ep.read_secrets(str(tmp_path / "missing")) == {}


def test_entrypoint_interface_on_master_is_the_card_not_loopback():
    ep = _entrypoint()
    addrs = (
        "1: lo    inet 127.0.0.1/8 scope host lo\n"
        "9: eth0    inet 172.28.5.11/24 brd 172.28.5.255 scope global eth0\n"
    )
    own = "local 172.28.5.11 dev lo table local src 172.28.5.11 uid 0 \\    cache <local> "
    assert ep.pick_interface("172.28.5.11", own, addrs) == "eth0"
    worker = "172.28.5.11 dev eth0 src 172.28.5.12 uid 0 \\    cache "
    assert ep.pick_interface("172.28.5.11", worker, addrs) == "eth0"
    assert ep.pick_interface("127.0.0.1", "local 127.0.0.1 dev lo table local src 127.0.0.1", addrs) == "lo"


def test_entrypoint_runs_a_module_with_torchrun_module_flag():
    ep = _entrypoint()
    argv, _, _ = ep.plan({"NNODES": "1"}, ["-m", "mypkg.train", "--lr", "1"], gpus=0)
    assert argv[-6:] == ["29500", "--module", "--", "mypkg.train", "--lr", "1"]


def test_entrypoint_sends_all_output_to_the_console_file(tmp_path):
    """With FABTRAIN_CONSOLE both streams of the entrypoint and what it starts go to the file;
    Docker's log (stdout here) only says where; the variable does not reach the workers."""
    import subprocess
    import sys

    f = tmp_path / "console" / "node-0.log"
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); import entrypoint as e; env = dict(os.environ); "
        "e.redirect_output(env); print('out', flush=True); "
        "os.system('echo child; echo err >&2'); print('FABTRAIN_CONSOLE' in env, file=sys.stderr)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "docker")],
        capture_output=True,
        text=True,
        env={"FABTRAIN_CONSOLE": str(f), "PATH": "/usr/bin:/bin"},
    )
    assert (
        r.stdout
        == f"[fabtrain] this container's output goes to {f} (in the job's output directory on the host; "
        "`fab logs` follows it)\n"
    )
    assert r.stderr == ""
    assert f.read_text() == "out\nchild\nerr\nFalse\n"


def test_a_warm_start_tells_a_waiting_container_of_the_same_key_or_starts_cold():
    h = INV.hosts[2]
    spec = replace(SPEC, env=(("FABTRAIN_ATTEMPT", "2"),), master_port=29511)
    script = node.start_script(INV, h, spec, None, (0,), 40, warm=True)
    key = node.warm_key(node.node_of(INV, h, spec, None, (0,), warm=True))
    cold = node.start_script(INV, h, spec, None, (0,), 40, warm=False)
    warm_run = shlex.join(node.docker_run_argv(INV, h, spec, None, (0,), warm=True))
    assert script == (
        'if [ "$(docker inspect -f \'{{index .Config.Labels "fabtrain.warm"}} {{.State.Running}}\' '
        f"fabtrain-gpt-1-r2 2>/dev/null)\" = '{key} true' ] && "
        f"{touched.is_file('/opt/out/gpt-1', '.console/node-2.log.end')}; "
        f"then {touched.remove('/opt/out/gpt-1', '.console', ['node-2.log', 'node-2.log.end'])} && "
        "(umask 022 && printf '%s\\n' MASTER_ADDR=10.0.0.1 MASTER_PORT=29511 NNODES=3 NODE_RANK=2 "
        "FABTRAIN_ATTEMPT=2 FABTRAIN_LAUNCH=torchrun > /opt/out/.runtime/gpt-1/warm-2.env.tmp && mv -f "
        "/opt/out/.runtime/gpt-1/warm-2.env.tmp /opt/out/.runtime/gpt-1/warm-2.env) && echo warm; else "
        "docker rm --force fabtrain-gpt-1-r2 >/dev/null 2>&1; "
        + cold.replace(shlex.join(node.docker_run_argv(INV, h, spec, None, (0,))), warm_run)
        + "; fi"
    )
    assert f"--label fabtrain.warm={key}" in warm_run and "--env FABTRAIN_WARM=1" in warm_run
    # What changes between generations keeps the key; anything else about the node changes it.
    later = replace(spec, env=(("FABTRAIN_ATTEMPT", "3"),), master_port=29533)
    assert node.warm_key(node.node_of(INV, h, later, None, (0,), warm=True)) == key
    gpu = INV.hosts[0]  # other GPUs: another container
    assert node.warm_key(node.node_of(INV, gpu, spec, None, (0, 1), warm=True)) != node.warm_key(
        node.node_of(INV, gpu, spec, None, (0,), warm=True)
    )
    assert node.warm_key(node.node_of(INV, h, replace(spec, code_key="cd34"), None, (0,), warm=True)) != key


def test_ending_a_warm_generation_keeps_the_container():
    assert node.end_generation_script(INV, SPEC, 1, wait=2) == (
        "docker kill --signal USR2 fabtrain-gpt-1-r1 >/dev/null 2>&1; "
        "docker wait fabtrain-gpt-1-r1 >/dev/null 2>&1 & w=$!; "
        f"timeout 2 {touched.until('/opt/out/gpt-1', '.console/node-1.log.end', '$w')}; "
        "kill $w 2>/dev/null; true"
    )
