"""Preflight: named checks per host, each with a status, what was seen, and the fix.

Phases, each over every host at once:
  1. one probe script per host (one SSH round trip) gathers raw facts, and the clock offset is
     sampled over the already open connection (no handshake in the measurement);
  2. pure functions judge each host's facts, then the hosts against each other (same image id,
     same MTU, same code as this machine);
  3. rank 0 opens a short-lived listener on the master port and every worker connects to it from
     its own interface: this is what finds a firewall;
  4. optionally, a collective smoke test: an all_reduce across every host in the real containers.
The judging functions take plain data, so they are unit-tested without a network.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import secrets
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from . import plan
from .inventory import Host, Inventory
from .plan import shell
from .logs import sanitize
from .remote import HostKeyError, Session, describe

OK, WARN, FAIL, NA, SKIP = "ok", "warn", "fail", "n/a", "skipped"
CHECKS = ("ssh", "docker", "image", "gpus", "interface", "route", "port", "reach", "mtu", "time",
          "shm", "disk", "dirs", "code", "smoke")


@dataclass(frozen=True)
class Check:
    host: str
    check: str
    status: str
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Limits:
    clock_warn: float = 0.050  # seconds of clock offset
    clock_fail: float = 0.500
    shm_warn_mb: int = 1024
    disk_warn_gb: float = 5.0
    disk_fail_gb: float = 1.0


# ---------------------------------------------------------------- phase 1: facts

# Seconds a Docker command of the probe may take: a stuck engine answers SSH but never this. The
# whole probe of a host is bounded by PROBE_TIMEOUT; a GPU container start gets longer.
DOCKER_TIMEOUT = 8
GPU_CONTAINER_TIMEOUT = 60
PROBE_TIMEOUT = 30
CLOCK_TIMEOUT = 10
# Probe facts that need the Docker engine: skipped once it has not answered.
DOCKER_FACTS = ("docker", "image", "image_info")
# Run in the image with its python3 (not its ENTRYPOINT, which we never use): what the job needs.
IMAGE_INFO_PY = """import json, platform
info = {"python": platform.python_version()}
try:
    import torch
except Exception as exc:
    info["error"] = type(exc).__name__ + ": " + str(exc)
else:
    info.update(torch=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
                gpus=torch.cuda.device_count())
print("IMAGEINFO " + json.dumps(info))
"""
# Exit code of coreutils' timeout when it had to stop the command.
TIMED_OUT = 124


def probe_commands(inv: Inventory, host: Host, image: str, access: plan.GpuAccess | None = None
                   ) -> dict[str, list[str]]:
    """The raw facts gathered on one host, as name -> argv (run in one script). `access`: how the
    host gives containers its GPUs (plan.gpu_probe_argv, read before this probe)."""
    cmds = {
        "docker": ["docker", "version", "--format", "{{.Server.Version}}"],
        "image": ["docker", "image", "inspect", "--format", "{{.Id}}", image],
        "image_info": image_info_argv(inv, host, image, access),
        # Per job directory, from its nearest existing directory (code_dir may not exist before the
        # first sync): the free space there (judge_disk), and whether the SSH user can create and
        # write it (judge_dirs; sync and the job need to).
        "dirs": ["sh", "-c", 'for p in "$@"; do q=$p; while [ ! -e "$q" ]; do q=$(dirname "$q"); done; '
                 'df -Pk "$q" | tail -n 1; '
                 'if [ -d "$q" ] && [ -w "$q" ] && [ -x "$q" ]; then echo "ok $p"; '
                 'else echo "denied $p $q $(stat -c %U "$q")"; fi; done', "sh",
                 inv.job.code_dir, inv.job.output_dir],
        "addr": ["ip", "-o", "-4", "addr", "show"],
        "link": ["ip", "-o", "link", "show"],
        "route": ["ip", "-o", "route", "get", inv.master.hostname],
        "shm": ["df", "-Pk", "/dev/shm"],
        "code": ["sh", "-c", 'cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0r sha256sum '
                 '| sha256sum', "sh", inv.job.code_dir],
        "ntp": ["sh", "-c", "timedatectl show -p NTPSynchronized --value 2>/dev/null "
                "|| chronyc -n tracking 2>/dev/null | grep -i 'leap status' || echo unknown"],
        "python": ["python3", "-c", "print('ok')"],
    }
    if host.rank == 0:
        cmds["port"] = ["ss", "-Htlnp", f"sport = :{inv.job.master_port}"]
    if host.gpu_vendor == "nvidia":
        cmds["gpu"] = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    elif host.gpu_vendor == "amd":
        # rocm-smi lists one "card" line per GPU (per GCD on an MI250X); without it, the KFD topology
        # has a node per CPU socket too, whose gpu_id is 0 (count_gpus skips those).
        cmds["gpu"] = ["sh", "-c", "rocm-smi --showproductname --csv 2>/dev/null; echo @@sysfs; "
                       "cat /sys/class/kfd/kfd/topology/nodes/*/gpu_id 2>/dev/null"]
        cmds["runtime"] = ["ls", "-d", "/dev/kfd", "/dev/dri"]
    return cmds


def image_info_argv(inv: Inventory, host: Host, image: str, access: plan.GpuAccess | None) -> list[str]:
    """The image as the job runs it: its python3, torch and CUDA/ROCm, and the GPUs a container
    started with the job's device flags sees. Never pulled here (--pull never).

    Starting a container and importing torch takes seconds, so on a CPU host the answer is kept
    on the host under the image id (an id names one immutable image); a GPU host always looks
    again, since what it must show is that the GPUs work now."""
    run = ["docker", "run", "--rm", "--pull", "never", "--network", "none", *plan.device_args(host, access),
           "--entrypoint", "python3", image, "-c", IMAGE_INFO_PY]
    if host.gpu_vendor != "none":
        return run
    script = ('id=$(docker image inspect --format "{{.Id}}" "$1") || exit 1; f="$2/${id#sha256:}"; '
              'if [ -s "$f" ]; then cat "$f"; exit 0; fi; shift 2; out=$("$@"); rc=$?; printf "%s\\n" "$out"; '
              'case "$out" in *IMAGEINFO*) [ $rc = 0 ] && mkdir -p "${f%/*}" && printf "%s\\n" "$out" > "$f.$$" '
              '&& mv "$f.$$" "$f";; esac 2>/dev/null; exit $rc')
    return ["sh", "-c", script, "sh", image, f"{inv.job.output_dir}/.runtime/images", *run]


def count_gpus(vendor: str, text: str) -> tuple[int, str]:
    """(GPU count, model) from `nvidia-smi --query-gpu=name` or the AMD probe (rocm-smi's CSV, then
    the KFD topology's gpu_id per node, 0 for a CPU node)."""
    if vendor == "nvidia":
        names = [line.strip() for line in text.splitlines() if line.strip()]
        return len(names), names[0] if names else "none"
    smi, _, sysfs = text.partition("@@sysfs")
    cards = [line.split(",") for line in smi.splitlines() if line.startswith("card")]
    if cards:
        return len(cards), cards[0][1].strip() if len(cards[0]) > 1 and cards[0][1].strip() else "AMD GPU"
    ids = [line.strip() for line in sysfs.splitlines() if line.strip().isdigit()]
    return sum(1 for i in ids if int(i) != 0), "AMD GPU"


def gpu_access(session: Session, host: Host) -> plan.GpuAccess | None:
    """How this GPU host gives containers its GPUs (None for a CPU host), read on the host; the
    same flags serve the preflight's GPU container and the job's."""
    probe = plan.gpu_probe_argv(host)
    if probe is None:
        return None
    return plan.parse_gpu_probe(session.run(host, shell(probe), timeout=DOCKER_TIMEOUT + 5,
                                            what="reading the GPU runtime").stdout)


def probe_script(cmds: dict[str, list[str]], marker: str) -> str:
    """One shell script printing each command's output between markers, with its exit code.

    Docker commands run under `timeout`, and once the engine has not answered the rest of them are
    not tried (exit 124 each), so a stuck engine costs DOCKER_TIMEOUT once and every other fact is
    still gathered."""
    parts = ["stuck=0"]
    for name, argv in cmds.items():
        if name in DOCKER_FACTS:
            limit = GPU_CONTAINER_TIMEOUT if name == "image_info" else DOCKER_TIMEOUT
            cmd = (f'if [ $stuck = 1 ]; then echo "engine did not answer"; (exit {TIMED_OUT}); else '
                   f"{shell(['timeout', '-k', '2', str(limit), *argv])} 2>&1; fi; "
                   f"rc=$?; [ $rc = {TIMED_OUT} ] && stuck=1")
        else:
            cmd = f"{shell(argv)} 2>&1; rc=$?"
        parts.append(f"echo {marker} {name}; {cmd}; echo {marker}rc $rc")
    return "; ".join(parts)


def parse_probe(output: str, marker: str) -> dict[str, tuple[int, str]]:
    facts: dict[str, tuple[int, str]] = {}
    pattern = re.compile(rf"^{marker} (\S+)\n(.*?)^{marker}rc (\d+)$", re.S | re.M)
    for m in pattern.finditer(output):
        facts[m.group(1)] = (int(m.group(3)), m.group(2).strip())
    return facts


def parse_addrs(text: str) -> dict[str, list[str]]:
    """`ip -o -4 addr show` -> interface -> ['10.0.0.5/24', ...]."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4 and f[2] == "inet":
            out.setdefault(f[1], []).append(f[3])
    return out


def parse_links(text: str) -> dict[str, dict]:
    """`ip -o link show` -> interface -> {'up': bool, 'mtu': int}."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        m = re.match(r"\d+: ([^:@]+)(?:@\S+)?: <([^>]*)>.*? mtu (\d+)", line)
        if m:
            out[m.group(1)] = {"up": "UP" in m.group(2).split(","), "mtu": int(m.group(3))}
    return out


def measure_clock(session: Session, host: Host, samples: int = 7) -> tuple[float, float]:
    """(offset of the host's clock from ours, round trip) in seconds, from the sample with the
    lowest round trip over one already open channel, so the SSH handshake is not measured."""
    with session.command(host, "while read -r _; do date +%s.%N; done", CLOCK_TIMEOUT, "clock") as cmd:
        best = (float("inf"), 0.0)
        buf = b""
        for _ in range(samples):
            t0 = time.time()
            cmd.send(b"\n")
            while b"\n" not in buf:
                data = cmd.recv(256)
                if not data:
                    raise ConnectionError("clock probe ended early")
                buf += data
            t1 = time.time()
            line, buf = buf.split(b"\n", 1)
            rtt = t1 - t0
            if rtt < best[0]:
                best = (rtt, float(line) - (t0 + t1) / 2)
        cmd.close_stdin()
        return best[1], best[0]


# ---------------------------------------------------------------- phase 2: judging

def judge_host(inv: Inventory, host: Host, facts: dict[str, tuple[int, str]], image: str,
               limits: Limits = Limits(), access: plan.GpuAccess | None = None) -> list[Check]:
    n = host.name
    out = [judge_docker(host, facts, access), judge_image(host, facts, image)]
    out.append(judge_gpus(host, facts))
    addrs = parse_addrs(facts.get("addr", (1, ""))[1])
    links = parse_links(facts.get("link", (1, ""))[1])
    iface = judge_interface(inv, host, addrs, links)
    out.append(iface)
    out.append(judge_route(inv, host, facts.get("route", (1, ""))))
    if "port" in facts:
        out.append(judge_port(inv, host, facts["port"]))
    out.append(judge_shm(inv, host, facts.get("shm", (1, "")), limits))
    out.append(judge_disk(inv, host, facts.get("dirs", (1, "")), limits))
    out.append(judge_dirs(host, facts.get("dirs", (1, ""))))
    return out


def image_info(facts) -> dict | None:
    """What IMAGE_INFO_PY printed in the image, or None."""
    m = re.search(r"^IMAGEINFO (\{.*\})$", facts.get("image_info", (1, ""))[1], re.M)
    try:
        return json.loads(m.group(1)) if m else None
    except ValueError:
        return None


def describe_image(info: dict) -> str:
    parts = [f"python {info.get('python', '?')}", f"torch {info.get('torch', '?')}"]
    if info.get("cuda"):
        parts.append(f"CUDA {info['cuda']}")
    if info.get("hip"):
        parts.append(f"ROCm {info['hip']}")
    return ", ".join(parts)


def judge_image(host: Host, facts, image: str) -> Check:
    """The image is on the host and runs the job: python3 and an importable torch."""
    n = host.name
    rc, text = facts.get("image", (1, ""))
    if rc == TIMED_OUT:
        return Check(n, "image", SKIP, "the Docker engine did not answer")
    if not (rc == 0 and text.startswith("sha256:")):
        return Check(n, "image", FAIL, f"{image} not present",
                     f"fab image.push --image {image} (or docker pull it on {n})")
    ident = f"{image} {text[7:19]}"
    build = (f"fab image.build --base {image} --requirements REQS --tag NEW (REQS naming torch), then "
             "fab image.push --image NEW")
    rc, out = facts.get("image_info", (1, ""))
    info = image_info(facts)
    if info is None:
        if rc == TIMED_OUT:
            return Check(n, "image", FAIL, f"{ident}: a container of it did not start within "
                         f"{GPU_CONTAINER_TIMEOUT}s", f"on {n}: check the Docker engine (docker run --rm {image} true)")
        if "python3" in out and ("not found" in out or "no such file" in out.lower()):
            return Check(n, "image", FAIL, f"{ident} has no python3",
                         "use an image with python3 and torch (e.g. nvcr.io/nvidia/pytorch, rocm/pytorch)")
        return Check(n, "image", FAIL, f"{ident}: python3 in it failed: {_last(out)}",
                     f"on {n}: docker run --rm --entrypoint python3 {image} -c 'import torch'")
    if "error" in info:
        return Check(n, "image", FAIL, f"{ident}: python {info.get('python')} but no torch ({info['error'][:120]})",
                     build)
    return Check(n, "image", OK, f"{ident}: {describe_image(info)}")


def judge_dirs(host: Host, fact: tuple[int, str]) -> Check:
    """job.code_dir and job.output_dir must exist or be creatable, and be writable, by the SSH user."""
    n, user = host.name, host.ssh.user
    rc, text = fact
    denied = [line.split() for line in text.splitlines() if line.startswith("denied ")]
    if rc != 0 or not any(line.startswith(("ok ", "denied ")) for line in text.splitlines()):
        return Check(n, "dirs", WARN, f"could not check the job directories: {_last(text)}", "")
    if not denied:
        return Check(n, "dirs", OK, "code and output dirs writable by " + user)
    parts = []
    for fields in denied:
        path, blocker, owner = fields[1], fields[2], fields[3] if len(fields) > 3 else "?"
        parts.append(f"{path} ({'not writable' if blocker == path else f'cannot be created: {blocker} is owned by {owner}'})")
    paths = " ".join(f[1] for f in denied)
    return Check(n, "dirs", FAIL, f"{user} cannot write " + ", ".join(parts),
                 f"on {n}: sudo install -d -o {user} -g $(id -gn {user}) {paths}  (or set job.code_dir / "
                 f"job.output_dir to directories {user} owns)")


def judge_docker(host: Host, facts, access: plan.GpuAccess | None = None) -> Check:
    n = host.name
    rc, text = facts.get("docker", (127, "no answer"))
    if rc == 0 and text:
        detail = f"engine {text}"
        if host.gpu_vendor == "nvidia":
            if access is None or not (access.nvidia_runtime or access.cdi):
                return Check(n, "docker", FAIL, f"{detail}, but no nvidia runtime and no CDI specs",
                             f"on {n}: install nvidia-container-toolkit and run "
                             "'nvidia-ctk runtime configure --runtime=docker' (or generate CDI specs)")
        if host.gpu_vendor == "amd" and facts.get("runtime", (1, ""))[0] != 0:
            return Check(n, "docker", FAIL, f"{detail}, but /dev/kfd or /dev/dri is missing",
                         f"on {n}: install the ROCm kernel driver (amdgpu-dkms) and reboot")
        return Check(n, "docker", OK, detail)
    if rc == TIMED_OUT:
        return Check(n, "docker", FAIL, f"engine gave no answer within {DOCKER_TIMEOUT}s (docker version hangs)",
                     f"on {n}: the Docker engine is stuck; restart it (sudo systemctl restart docker) "
                     f"and check its disk (journalctl -u docker)")
    if "permission denied" in text.lower():
        return Check(n, "docker", FAIL, f"{host.ssh.user} may not use the Docker socket",
                     f"on {n}: sudo usermod -aG docker {host.ssh.user} (then log in again)")
    return Check(n, "docker", FAIL, f"engine not reachable: {_last(text)}",
                 f"on {n}: start the engine (sudo systemctl start docker)")


def judge_gpus(host: Host, facts) -> Check:
    n = host.name
    if host.gpu_vendor == "none":
        return Check(n, "gpus", NA, "CPU host")
    rc, text = facts.get("gpu", (1, ""))
    tool = "nvidia-smi" if host.gpu_vendor == "nvidia" else "rocm-smi"
    if rc != 0:
        return Check(n, "gpus", FAIL, f"{tool} failed: {_last(text)}", f"on {n}: install or repair the GPU driver")
    count, model = count_gpus(host.gpu_vendor, text)
    if count != host.gpu_count:
        return Check(n, "gpus", FAIL, f"{count} x {model} found, inventory says {host.gpu_count}",
                     f"set gpus.count: {count} for {n}, or find the missing GPUs ({tool})")
    info = image_info(facts)
    rc, text = facts.get("image_info", (1, ""))
    if info is None or "gpus" not in info:
        if rc == TIMED_OUT:
            return Check(n, "gpus", FAIL, f"{count} x {model} on the host; a GPU container did not start in time",
                         f"on {n}: check the Docker engine and the container toolkit")
        return Check(n, "gpus", FAIL, f"{count} x {model} on the host, but a container cannot use them: {_last(text)}",
                     f"on {n}: check the container toolkit (docker run {' '.join(plan.device_args(host))} ...)")
    seen = int(info["gpus"])
    if seen != count:
        return Check(n, "gpus", FAIL, f"{count} on the host, {seen} visible in the container",
                     "check CUDA_VISIBLE_DEVICES / device flags and the image's CUDA or ROCm version")
    return Check(n, "gpus", OK, f"{count} x {model}, {seen} visible in container")


def judge_interface(inv: Inventory, host: Host, addrs: dict[str, list[str]], links: dict[str, dict]) -> Check:
    n, iface = host.name, host.interface
    if iface not in links:
        hint = suggest_interface(inv.master.hostname, addrs)
        fix = (f"set interface: {hint} for {n} (its subnet holds {inv.master.hostname})" if hint
               else f"set interface to one of: {', '.join(sorted(addrs))}")
        return Check(n, "interface", FAIL, f"no interface {iface!r}", fix)
    if iface == "lo" or iface.startswith(("docker", "br-", "veth", "virbr")):
        hint = suggest_interface(inv.master.hostname, addrs)
        return Check(n, "interface", FAIL, f"{iface} is a loopback or container bridge, not a network card",
                     f"set interface: {hint or 'the NIC that links the hosts'} for {n}")
    if not links[iface]["up"]:
        return Check(n, "interface", FAIL, f"{iface} is down", f"on {n}: sudo ip link set {iface} up")
    if iface not in addrs:
        return Check(n, "interface", FAIL, f"{iface} has no IPv4 address",
                     f"give {iface} an address, or pick another interface")
    if host.rank == 0 and _is_ip(host.hostname) and not any(
            ipaddress.ip_interface(c).ip == ipaddress.ip_address(host.hostname) for c in addrs[iface]):
        owner = next((i for i, cs in addrs.items() for c in cs
                      if ipaddress.ip_interface(c).ip == ipaddress.ip_address(host.hostname)), None)
        return Check(n, "interface", FAIL,
                     f"MASTER_ADDR {host.hostname} is not on {iface} ({', '.join(addrs[iface])})",
                     f"set interface: {owner} for {n}" if owner else
                     f"use an address of {iface} as rank 0's address")
    return Check(n, "interface", OK, f"{iface} {addrs[iface][0]} mtu {links[iface]['mtu']}")


def judge_route(inv: Inventory, host: Host, fact: tuple[int, str]) -> Check:
    """Workers must reach MASTER_ADDR through the interface NCCL and gloo are told to use."""
    n = host.name
    if host.rank == 0:
        return Check(n, "route", NA, "rank 0")
    rc, text = fact
    m = re.search(r"\bdev (\S+)", text)
    if rc != 0 or not m:
        return Check(n, "route", FAIL, f"no route to MASTER_ADDR {inv.master.hostname}: {_last(text)}",
                     f"on {n}: add a route to {inv.master.hostname} via {host.interface}")
    if m.group(1) != host.interface and not m.group(1) == "lo":
        return Check(n, "route", FAIL, f"{inv.master.hostname} is reached via {m.group(1)}, not {host.interface}",
                     f"set interface: {m.group(1)} for {n}, or route {inv.master.hostname} via {host.interface}")
    return Check(n, "route", OK, f"to {inv.master.hostname} via {m.group(1)}")


def judge_port(inv: Inventory, host: Host, fact: tuple[int, str]) -> Check:
    n, port = host.name, inv.job.master_port
    rc, text = fact
    if rc != 0:
        return Check(n, "port", WARN, f"could not list listeners: {_last(text)}", "install iproute2 (ss) on the host")
    if text:
        holder = re.search(r'users:\(\("([^"]+)",pid=(\d+)', text)
        who = f" by {holder.group(1)} (pid {holder.group(2)})" if holder else ""
        return Check(n, "port", FAIL, f"master port {port} already in use{who}",
                     f"stop it (fab stop, or kill the process on {n}) or set job.master_port")
    return Check(n, "port", OK, f"master port {port} free")


def judge_shm(inv: Inventory, host: Host, fact: tuple[int, str], limits: Limits) -> Check:
    n = host.name
    if inv.job.shm_size:
        return Check(n, "shm", OK, f"--shm-size {inv.job.shm_size}")
    rc, text = fact
    fields = text.splitlines()[-1].split() if rc == 0 and text else []
    if len(fields) < 4 or not fields[1].isdigit():
        return Check(n, "shm", WARN, f"could not read /dev/shm: {_last(text)}", "check that /dev/shm is mounted")
    mb = int(fields[1]) // 1024
    if mb < limits.shm_warn_mb:
        return Check(n, "shm", WARN, f"/dev/shm is {mb} MB (--ipc host)",
                     f"enlarge /dev/shm on {n}, or set job.shm_size (e.g. 16g)")
    return Check(n, "shm", OK, f"{mb} MB (--ipc host)")


def judge_disk(inv: Inventory, host: Host, fact: tuple[int, str], limits: Limits) -> Check:
    n = host.name
    rc, text = fact
    rows = [line.split() for line in text.splitlines() if len(line.split()) >= 6]
    if rc != 0 or len(rows) < 2:
        return Check(n, "disk", WARN, f"could not read free space: {_last(text)}", "")
    worst = min(int(r[3]) for r in rows[:2]) / 1024 ** 2
    paths = f"{inv.job.code_dir}, {inv.job.output_dir}"
    if worst < limits.disk_fail_gb:
        return Check(n, "disk", FAIL, f"{worst:.1f} GB free at {paths}", f"free space on {n} or move output_dir")
    if worst < limits.disk_warn_gb:
        return Check(n, "disk", WARN, f"{worst:.1f} GB free at {paths}", f"snapshots may not fit; free space on {n}")
    return Check(n, "disk", OK, f"{worst:.0f} GB free")


def judge_time(host: Host, offset: float, rtt: float, ntp: str, limits: Limits) -> Check:
    n = host.name
    synced = {"yes": "NTP synced", "no": "NTP not synced"}.get(ntp.strip().lower(), "")
    if "leap status" in ntp.lower():
        synced = "NTP synced" if "normal" in ntp.lower() else "NTP not synced"
    detail = f"offset {offset * 1000:+.0f} ms (rtt {rtt * 1000:.0f} ms)" + (f", {synced}" if synced else "")
    fix = f"on {n}: enable time sync (sudo timedatectl set-ntp true, or start chrony)"
    if abs(offset) > limits.clock_fail:
        return Check(n, "time", FAIL, detail, fix)
    if abs(offset) > limits.clock_warn or synced == "NTP not synced":
        return Check(n, "time", WARN, detail, fix)
    return Check(n, "time", OK, detail)


def judge_across(inv: Inventory, per_host: dict[str, dict], local_code: str | None) -> list[Check]:
    """Checks that compare hosts: same image id, same MTU, the same code as this machine."""
    out: list[Check] = []
    ids = {n: f["image_id"] for n, f in per_host.items() if f.get("image_id")}
    if len(set(ids.values())) > 1:
        groups: dict[str, list[str]] = {}
        for n, i in ids.items():
            groups.setdefault(i, []).append(n)
        majority = max(groups.values(), key=len)
        for n, i in ids.items():
            if n not in majority:
                out.append(Check(n, "image", FAIL, f"image id {i[7:19]} differs from {majority[0]}'s "
                                 f"{ids[majority[0]][7:19]} (same tag, other image)",
                                 f"fab image.push to {n}, so every host runs the same image"))
    if not out:  # same image everywhere, or per-host images: their contents must still agree
        versions = {n: describe_image(f["image_info"]) for n, f in per_host.items()
                    if f.get("image_info") and "error" not in f["image_info"]}
        if len(set(versions.values())) > 1:
            common = Counter(versions.values()).most_common(1)[0][0]
            for n, v in versions.items():
                if v != common:
                    out.append(Check(n, "image", WARN, f"{v} here, {common} on the others",
                                     "run one image everywhere (job.image), or the same versions in each"))
    mtus = {n: f["mtu"] for n, f in per_host.items() if f.get("mtu")}
    for n, f in per_host.items():
        if "mtu" not in f:
            continue
        if len(set(mtus.values())) > 1:
            out.append(Check(n, "mtu", FAIL, f"{f['mtu']} (hosts differ: {', '.join(f'{k}={v}' for k, v in mtus.items())})",
                             "set the same MTU on every host's interface (ip link set IFACE mtu N)"))
        else:
            out.append(Check(n, "mtu", OK, str(f["mtu"])))
    for n, f in per_host.items():
        code = f.get("code")
        if code is None:
            out.append(Check(n, "code", WARN, "no code synced yet", "fab sync"))
        elif local_code is not None and code != local_code:
            out.append(Check(n, "code", WARN, f"tree {code[:12]} differs from this machine's {local_code[:12]}",
                             "fab sync (fab train syncs first)"))
        else:
            out.append(Check(n, "code", OK, f"tree {code[:12]}"))
    return out


def suggest_interface(master_address: str, addrs: dict[str, list[str]]) -> str | None:
    if not _is_ip(master_address):
        return None
    target = ipaddress.ip_address(master_address)
    for iface, cidrs in addrs.items():
        for cidr in cidrs:
            if target in ipaddress.ip_interface(cidr).network and iface != "lo":
                return iface
    return None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def local_code_hash(root: Path) -> str:
    """The same hash the hosts compute over the synced tree (files rsync copies, C sort order)."""
    import fnmatch
    import os

    def excluded(name: str) -> bool:
        return any(fnmatch.fnmatch(name, pat) for pat in plan.RSYNC_EXCLUDES)
    files = []
    # Excluded directories are pruned, not walked: a project's .venv alone can hold 100k files.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not excluded(d)]
        for name in filenames:
            path = Path(dirpath) / name
            if not excluded(name) and path.is_file() and not path.is_symlink():
                files.append("./" + path.relative_to(root).as_posix())
    listing = "".join(f"{hashlib.sha256((root / f[2:]).read_bytes()).hexdigest()}  {f}\n"
                      for f in sorted(files, key=lambda s: s.encode()))
    return hashlib.sha256(listing.encode()).hexdigest()


# ---------------------------------------------------------------- phase 3: reachability

# Lives until its stdin closes (the orchestrator is done) or its time is up, so the master port
# is free again before anything else uses it.
LISTENER = r"""
import select, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(64)
print("listening", flush=True)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    ready, _, _ = select.select([s, sys.stdin], [], [], 0.2)
    if s in ready:
        c, a = s.accept(); c.close()
    if sys.stdin in ready and not sys.stdin.read(1):
        break
s.close()
"""
CONNECT = r"""
import socket, sys
src, dst, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(); s.settimeout(float(sys.argv[4]))
try:
    s.bind((src, 0)); s.connect((dst, port)); print("connected")
except socket.timeout:
    print("timed out (packets dropped: a firewall?)"); sys.exit(3)
except OSError as e:
    print(e.strerror or e); sys.exit(4)
"""


def reachability(session: Session, inv: Inventory, sources: dict[str, str], timeout: float = 2.0) -> list[Check]:
    """Open a listener on rank 0's master port for a few seconds; connect from each worker's own
    interface address. A dropped SYN (firewall) times out; a rejected one is refused."""
    master, port = inv.master, inv.job.master_port
    with session.command(master, shell(["python3", "-c", LISTENER, str(port), str(timeout + 10)]),
                         timeout + 15, "test listener") as listener:
        ready = b""
        while b"listening" not in ready:
            data = listener.recv(1024)
            if not data:
                return [Check(master.name, "reach", FAIL, "could not open a test listener on the master port",
                              f"check python3 and port {port} on {master.name}")]
            ready += data
        return _connect_workers(session, inv, sources, listener, timeout)


def _connect_workers(session: Session, inv: Inventory, sources: dict[str, str], listener, timeout: float
                     ) -> list[Check]:
    master, port = inv.master, inv.job.master_port

    def connect(host: Host) -> Check:
        src = sources.get(host.name, "0.0.0.0")
        r = session.run(host, shell(["python3", "-c", CONNECT, src, master.hostname, str(port), str(timeout)]),
                        timeout=timeout + 10)
        if r.ok:
            return Check(host.name, "reach", OK, f"{master.hostname}:{port} from {src}")
        return Check(host.name, "reach", FAIL,
                     f"cannot reach {master.name} {master.hostname}:{port} from {src}: {_last(r.stdout + r.stderr)}",
                     f"open TCP {port} on {master.name} for {src} (firewall: iptables/nftables/ufw), "
                     f"and check the route between the hosts")
    workers = tuple(h for h in inv.hosts if h.rank > 0 and h.name in sources)
    results = session.fan_out(connect, workers)
    listener.close_stdin()  # the listener exits on EOF; wait for it so the port is free again
    listener.exit_status()
    out = [Check(master.name, "reach", OK, f"listening on {port}")]
    for h in workers:
        r = results[h.name]
        out.append(r if isinstance(r, Check) else Check(h.name, "reach", FAIL, describe(h, r), ""))
    return out


# ---------------------------------------------------------------- the whole run

def run(session: Session, inv: Inventory, image: str | None = None, limits: Limits = Limits(),
        run_job=None, code: bool = True, source: Path = plan.PROJECT_ROOT) -> list[Check]:
    """Every check on every host of `inv`. With `run_job` (launch.run_once: the job lifecycle's one
    short run), the collective smoke test too."""
    marker = "@@fabtrain-" + secrets.token_hex(4)
    with ThreadPoolExecutor(max_workers=1) as pool:
        local_code = pool.submit(local_code_hash, source) if code else None

        def one(host: Host) -> tuple[list[Check], dict]:
            img = image or inv.image_for(host)
            start = time.monotonic()
            try:
                session.connection(host)
            except BaseException as exc:  # noqa: BLE001 - reported as the host's ssh check
                return [Check(host.name, "ssh", FAIL, describe(host, exc), _ssh_fix(host, exc))], {}
            connect = time.monotonic() - start
            access = gpu_access(session, host)
            cmds = probe_commands(inv, host, img, access)
            res = session.run(host, probe_script(cmds, marker), what="preflight probe",
                              timeout=PROBE_TIMEOUT + GPU_CONTAINER_TIMEOUT)
            facts = parse_probe(res.stdout, marker)
            offset, rtt = measure_clock(session, host)
            checks = [Check(host.name, "ssh", OK, f"connect {connect * 1000:.0f} ms, rtt {rtt * 1000:.1f} ms")]
            checks += judge_host(inv, host, facts, img, limits, access)
            checks.append(judge_time(host, offset, rtt, facts.get("ntp", (1, ""))[1], limits))
            addrs = parse_addrs(facts.get("addr", (1, ""))[1])
            links = parse_links(facts.get("link", (1, ""))[1])
            summary = {"image_id": facts.get("image", (1, ""))[1] if facts.get("image", (1, ""))[0] == 0 else None,
                       "code": (facts["code"][1].split()[0] if facts.get("code", (1, ""))[0] == 0
                                and facts["code"][1] else None),
                       "python": facts.get("python", (1, ""))[0] == 0, "image_info": image_info(facts)}
            if host.interface in links:
                summary["mtu"] = links[host.interface]["mtu"]
            if addrs.get(host.interface):
                summary["source"] = addrs[host.interface][0].split("/")[0]
            return checks, summary

        results = session.fan_out(one, inv.hosts)
        checks: list[Check] = []
        per_host: dict[str, dict] = {}
        for host in inv.hosts:
            err, r = results.error(host.name), results.value(host.name)
            if err:
                checks.append(Check(host.name, "ssh", FAIL, describe(host, err), _ssh_fix(host, err)))
                continue
            checks += r[0]
            if r[1]:
                per_host[host.name] = r[1]
        local = local_code.result() if local_code else None
    across = judge_across(inv, per_host, local) if per_host else []
    if not code:
        across = [c for c in across if c.check != "code"]
    # A per-host image "ok" is replaced by the cross-host verdict when the ids differ.
    replaced = {(c.host, c.check) for c in across if c.check == "image"}
    checks = [c for c in checks if (c.host, c.check) not in replaced] + across
    checks += _reach(session, inv, checks, per_host)
    if run_job:
        checks += smoke_test(session, inv, image, checks, run_job)
    order = {name: i for i, name in enumerate(CHECKS)}
    ranks = {h.name: h.rank for h in inv.hosts}
    return sorted(checks, key=lambda c: (ranks.get(c.host, 0), order.get(c.check, 99)))


def _reach(session: Session, inv: Inventory, checks: list[Check], per_host: dict[str, dict]) -> list[Check]:
    if len(inv.hosts) < 2:
        return []
    bad = {(c.host, c.check) for c in checks if c.status == FAIL}
    master = inv.master.name
    if master not in per_host or (master, "port") in bad or not per_host[master].get("python"):
        why = "master port busy" if (master, "port") in bad else "rank 0 not probed or has no python3"
        return [Check(h.name, "reach", SKIP, why) for h in inv.hosts if h.rank > 0]
    sources = {n: f["source"] for n, f in per_host.items()
               if f.get("source") and f.get("python") and n != master}
    skipped = [Check(h.name, "reach", SKIP, "no usable interface address or python3")
               for h in inv.hosts if h.rank > 0 and h.name not in sources and h.name in per_host]
    return reachability(session, inv, sources) + skipped


# ---------------------------------------------------------------- phase 4: smoke test

def smoke_test(session: Session, inv: Inventory, image: str | None, checks: list[Check], run_job) -> list[Check]:
    """An all_reduce across every host inside the real containers, with the measured bus bandwidth.
    `run_job(session, inv, spec, run_dir)` is the job lifecycle's start -> watch -> clean up."""
    if any(c.status == FAIL for c in checks):
        return [Check(h.name, "smoke", SKIP, "other checks failed") for h in inv.hosts]
    if any(c.check == "code" and c.status != OK for c in checks):
        return [Check(h.name, "smoke", SKIP, "code not synced", "fab sync") for h in inv.hosts]
    # NCCL says which transport it took (NET/IB or NET/Socket) at INFO level; gloo ignores these.
    spec = plan.JobSpec(job_id=plan.new_job_id("preflight"), script="trainers/smoke.py", image=image,
                        env=(("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET")))
    run_dir = plan.PROJECT_ROOT / "runs" / spec.job_id
    result = run_job(session, inv, spec, run_dir)
    out = []
    for h in inv.hosts:
        o = result.outcomes.get(h.name)
        log = (run_dir / f"{h.name}.log").read_text(errors="replace") if (run_dir / f"{h.name}.log").exists() else ""
        m = re.search(r"SMOKE ok backend=(\S+) world=(\d+) .*?busbw=([\d.]+) MB/s", log)
        if o and o.exit_code == 0 and m:
            detail = f"all_reduce over {m.group(2)} ranks ({m.group(1)}), bus bw {float(m.group(3)):.0f} MB/s"
            out.append(judge_transport(h, detail, nccl_transport(log) if m.group(1) == "nccl" else None))
        elif o and o.exit_code == 0:
            out.append(Check(h.name, "smoke", OK, "all_reduce ok"))
        else:
            why = (o.error if o and o.error else f"exit {o.exit_code if o else '?'}") + f": {_last(log)}"
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


def _ssh_fix(host: Host, exc: BaseException) -> str:
    if isinstance(exc, HostKeyError) or "host key" in str(exc):
        return "compare the fingerprint with the host's own, then add it to known_hosts (see detail)"
    return (f"check that {host.ssh.hostname}:{host.ssh.port} runs sshd and accepts the key "
            f"{host.ssh.key or '(agent)'}")


def failed(checks: list[Check], strict: bool = False) -> list[Check]:
    bad = {FAIL, WARN} if strict else {FAIL}
    return [c for c in checks if c.status in bad]


def to_json(checks: list[Check], strict: bool = False) -> str:
    return json.dumps({"ok": not failed(checks, strict), "checks": [asdict(c) for c in checks]}, indent=2)


def render(checks: list[Check], console) -> None:
    from rich.markup import escape
    from rich.table import Table

    hosts = list(dict.fromkeys(c.host for c in checks))
    names = [n for n in CHECKS if any(c.check == n for c in checks)]
    style = {OK: "green", WARN: "yellow", FAIL: "bold red", NA: "dim", SKIP: "dim"}
    table = Table(title="preflight", show_lines=False)
    table.add_column("check")
    for h in hosts:
        table.add_column(h, overflow="fold")
    by = {(c.host, c.check): c for c in checks}
    for name in names:
        cells = []
        for h in hosts:
            c = by.get((h, name))
            cells.append(f"[{style[c.status]}]{c.status}[/] {escape(sanitize(c.detail[:60]))}" if c else "[dim]-[/]")
        table.add_row(name, *cells)
    console.print(table)
    for c in checks:
        if c.status in (FAIL, WARN):
            colour = "red" if c.status == FAIL else "yellow"
            console.print(f"[{colour}]{c.status.upper()}[/] {c.host} {c.check}: {escape(sanitize(c.detail))}"
                          + (f"\n      fix: {escape(sanitize(c.fix))}" if c.fix else ""), highlight=False, soft_wrap=True)
