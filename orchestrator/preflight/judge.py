"""Phase 2 of a preflight: pure functions judge each host's facts into checks (`judge_host` and
the judge_* per check, `judge_time` for the clock offset); then the hosts are compared against each
other (compare). They take plain data, so they are unit-tested without a network."""

from __future__ import annotations

import ipaddress
import re

from orchestrator.config.inventory import Host, Inventory
from orchestrator.core import hostile
from orchestrator.core.jobspec import LOCAL
from orchestrator.hostcmds import dockerargs
from orchestrator.preflight.checks import DEFAULT_LIMITS, FAIL, NA, OK, SKIP, WARN, Check, Limits, _last
from orchestrator.preflight.probe import (
    DOCKER_TIMEOUT,
    GPU_CONTAINER_TIMEOUT,
    RSYNC_CVES,
    TIMED_OUT,
    Facts,
    count_gpus,
    image_info,
    parse_addrs,
    parse_links,
    parse_rsync_fact,
    parse_rsync_version,
)


def judge_host(
    inv: Inventory,
    host: Host,
    facts: Facts,
    image: str,
    limits: Limits = DEFAULT_LIMITS,
    access: dockerargs.GpuAccess | None = None,
) -> list[Check]:
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
    if "rsync" in facts:
        out.append(judge_rsync(n, facts["rsync"]))
    return out


# rsync before 3.2.4 handles remote arguments the old way (a remote shell splits and expands them
# unless -s is given); 3.4.0 fixed two flaws of the receiving client, which is this machine when
# fab fetches a host's outputs and snapshots: CVE-2024-12087 (a sending server writes outside the
# destination) and CVE-2024-12088 (--safe-links bypassed).
RSYNC_MIN = (3, 2, 4)
RSYNC_SAFE = (3, 4, 0)


def judge_rsync(name: str, fact: tuple[int, str]) -> Check:
    """The rsync of a host (`name` its name; the fact from its probe) or of this machine (LOCAL;
    probe.local_rsync): refused before 3.2.4 or when missing or unreadable, a warning before 3.4
    unless its package names the fixes for both CVEs (a distribution's backport). RSYNC_OLD_ARGS
    and RSYNC_PROTECT_ARGS are shown where set: fab's explicit -s (sshargs.RSYNC_PROTECT) overrides
    both here, and a server rsync reads neither, so they change nothing."""
    here = name == LOCAL
    where = "on this machine" if here else f"on {name}"
    upgrade = (
        f"{where}: upgrade rsync to 3.4 or later (a distribution's build of 3.2.7 with the fixes will do)"
    )
    rc, text = fact
    info = parse_rsync_fact(text)
    shown = hostile.line(info["version"], 120)
    if not info["version"]:
        return Check(
            name,
            "rsync",
            FAIL,
            "no rsync" if rc == 0 else f"could not run rsync: {_last(hostile.line(text))}",
            f"{where}: install rsync 3.4 or later (e.g. sudo apt-get install rsync)",
        )
    version = parse_rsync_version(info["version"])
    if version is None:
        return Check(
            name,
            "rsync",
            FAIL,
            f"cannot read rsync's version from {shown!r} (not rsync 3.x?)",
            f"{where}: install rsync 3.4 or later, first in PATH",
        )
    number = ".".join(map(str, version))
    env = info["env"]
    note = ""
    if env:
        names = ", ".join(f"{k}={hostile.line(v, 40)}" for k, v in sorted(env.items()))
        note = (
            f"; {names} set (no effect: fab passes -s, which overrides it)"
            if here
            else f"; {names} in its SSH environment (no effect: rsync's server side reads neither)"
        )
    if version < RSYNC_MIN:
        return Check(
            name,
            "rsync",
            FAIL,
            f"rsync {number} is older than 3.2.4: its argument handling differs "
            "(old style: remote paths split and expanded by the remote shell unless protected)" + note,
            upgrade,
        )
    if version < RSYNC_SAFE:
        if info["fixed"] >= set(RSYNC_CVES):
            return Check(name, "rsync", OK, f"{number}, its package fixes {' and '.join(RSYNC_CVES)}" + note)
        return Check(
            name,
            "rsync",
            WARN,
            f"rsync {number} is older than 3.4 and its package names no fix for "
            f"CVE-2024-12087 (a server can make the receiving rsync write outside its destination) and "
            f"CVE-2024-12088 (--safe-links bypass)" + note,
            upgrade,
        )
    return Check(name, "rsync", OK, number + note)


def describe_image(info: dict) -> str:
    parts = [f"python {info.get('python', '?')}", f"torch {info.get('torch', '?')}"]
    if info.get("cuda"):
        parts.append(f"CUDA {info['cuda']}")
    if info.get("hip"):
        parts.append(f"ROCm {info['hip']}")
    return ", ".join(parts)


def judge_image(host: Host, facts: Facts, image: str) -> Check:
    """The image is on the host and runs the job: python3 and an importable torch."""
    n = host.name
    rc, text = facts.get("image", (1, ""))
    if rc == TIMED_OUT:
        return Check(n, "image", SKIP, "the Docker engine did not answer")
    if not (rc == 0 and text.startswith("sha256:")):
        return Check(
            n,
            "image",
            FAIL,
            f"{image} not present",
            f"fab image.push --image {image} (or docker pull it on {n})",
        )
    ident = f"{image} {text[7:19]}"
    build = (
        f"fab image.build --base {image} --requirements REQS --tag NEW (REQS naming torch), then "
        "fab image.push --image NEW"
    )
    rc, out = facts.get("image_info", (1, ""))
    info = image_info(facts)
    if info is None:
        if rc == TIMED_OUT:
            return Check(
                n,
                "image",
                FAIL,
                f"{ident}: a container of it did not start within {GPU_CONTAINER_TIMEOUT}s",
                f"on {n}: check the Docker engine (docker run --rm {image} true)",
            )
        if "python3" in out and ("not found" in out or "no such file" in out.lower()):
            return Check(
                n,
                "image",
                FAIL,
                f"{ident} has no python3",
                "use an image with python3 and torch (e.g. nvcr.io/nvidia/pytorch, rocm/pytorch)",
            )
        return Check(
            n,
            "image",
            FAIL,
            f"{ident}: python3 in it failed: {_last(out)}",
            f"on {n}: docker run --rm --entrypoint python3 {image} -c 'import torch'",
        )
    if "error" in info:
        return Check(
            n,
            "image",
            FAIL,
            f"{ident}: python {info.get('python')} but no torch ({info['error'][:120]})",
            build,
        )
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
        why = "not writable" if blocker == path else f"cannot be created: {blocker} is owned by {owner}"
        parts.append(f"{path} ({why})")
    paths = " ".join(f[1] for f in denied)
    return Check(
        n,
        "dirs",
        FAIL,
        f"{user} cannot write " + ", ".join(parts),
        f"on {n}: sudo install -d -o {user} -g $(id -gn {user}) {paths}  (or set job.code_dir / "
        f"job.output_dir to directories {user} owns)",
    )


def judge_docker(host: Host, facts: Facts, access: dockerargs.GpuAccess | None = None) -> Check:
    n = host.name
    rc, text = facts.get("docker", (127, "no answer"))
    if rc == 0 and text:
        detail = f"engine {text}"
        if host.gpu_vendor == "nvidia":
            if access is None or not (access.nvidia_runtime or access.cdi):
                return Check(
                    n,
                    "docker",
                    FAIL,
                    f"{detail}, but no nvidia runtime and no CDI specs",
                    f"on {n}: install nvidia-container-toolkit and run "
                    "'nvidia-ctk runtime configure --runtime=docker' (or generate CDI specs)",
                )
        if host.gpu_vendor == "amd" and facts.get("runtime", (1, ""))[0] != 0:
            return Check(
                n,
                "docker",
                FAIL,
                f"{detail}, but /dev/kfd or /dev/dri is missing",
                f"on {n}: install the ROCm kernel driver (amdgpu-dkms) and reboot",
            )
        return Check(n, "docker", OK, detail)
    if rc == TIMED_OUT:
        return Check(
            n,
            "docker",
            FAIL,
            f"engine gave no answer within {DOCKER_TIMEOUT}s (docker version hangs)",
            f"on {n}: the Docker engine is stuck; restart it (sudo systemctl restart docker) "
            f"and check its disk (journalctl -u docker)",
        )
    if "permission denied" in text.lower():
        return Check(
            n,
            "docker",
            FAIL,
            f"{host.ssh.user} may not use the Docker socket",
            f"on {n}: sudo usermod -aG docker {host.ssh.user} (then log in again)",
        )
    return Check(
        n,
        "docker",
        FAIL,
        f"engine not reachable: {_last(text)}",
        f"on {n}: start the engine (sudo systemctl start docker)",
    )


def judge_gpus(host: Host, facts: Facts) -> Check:
    n = host.name
    if host.gpu_vendor == "none":
        return Check(n, "gpus", NA, "CPU host")
    rc, text = facts.get("gpu", (1, ""))
    tool = "nvidia-smi" if host.gpu_vendor == "nvidia" else "rocm-smi"
    if rc != 0:
        return Check(
            n, "gpus", FAIL, f"{tool} failed: {_last(text)}", f"on {n}: install or repair the GPU driver"
        )
    count, model = count_gpus(host.gpu_vendor, text)
    if count != host.gpu_count:
        return Check(
            n,
            "gpus",
            FAIL,
            f"{count} x {model} found, inventory says {host.gpu_count}",
            f"set gpus.count: {count} for {n}, or find the missing GPUs ({tool})",
        )
    info = image_info(facts)
    rc, text = facts.get("image_info", (1, ""))
    if info is None or "gpus" not in info:
        if rc == TIMED_OUT:
            return Check(
                n,
                "gpus",
                FAIL,
                f"{count} x {model} on the host; a GPU container did not start in time",
                f"on {n}: check the Docker engine and the container toolkit",
            )
        return Check(
            n,
            "gpus",
            FAIL,
            f"{count} x {model} on the host, but a container cannot use them: {_last(text)}",
            f"on {n}: check the container toolkit (docker run {' '.join(dockerargs.device_args(host))} ...)",
        )
    seen = int(info["gpus"])
    if seen != count:
        return Check(
            n,
            "gpus",
            FAIL,
            f"{count} on the host, {seen} visible in the container",
            "check CUDA_VISIBLE_DEVICES / device flags and the image's CUDA or ROCm version",
        )
    return Check(n, "gpus", OK, f"{count} x {model}, {seen} visible in container")


def judge_interface(inv: Inventory, host: Host, addrs: dict[str, list[str]], links: dict[str, dict]) -> Check:
    n, iface = host.name, host.interface
    if iface not in links:
        hint = suggest_interface(inv.master.hostname, addrs)
        fix = (
            f"set interface: {hint} for {n} (its subnet holds {inv.master.hostname})"
            if hint
            else f"set interface to one of: {', '.join(sorted(addrs))}"
        )
        return Check(n, "interface", FAIL, f"no interface {iface!r}", fix)
    if iface == "lo" or iface.startswith(("docker", "br-", "veth", "virbr")):
        hint = suggest_interface(inv.master.hostname, addrs)
        return Check(
            n,
            "interface",
            FAIL,
            f"{iface} is a loopback or container bridge, not a network card",
            f"set interface: {hint or 'the NIC that links the hosts'} for {n}",
        )
    if not links[iface]["up"]:
        return Check(n, "interface", FAIL, f"{iface} is down", f"on {n}: sudo ip link set {iface} up")
    if iface not in addrs:
        return Check(
            n,
            "interface",
            FAIL,
            f"{iface} has no IPv4 address",
            f"give {iface} an address, or pick another interface",
        )
    if (
        host.rank == 0
        and _is_ip(host.hostname)
        and not any(ipaddress.ip_interface(c).ip == ipaddress.ip_address(host.hostname) for c in addrs[iface])
    ):
        owner = next(
            (
                i
                for i, cs in addrs.items()
                for c in cs
                if ipaddress.ip_interface(c).ip == ipaddress.ip_address(host.hostname)
            ),
            None,
        )
        return Check(
            n,
            "interface",
            FAIL,
            f"MASTER_ADDR {host.hostname} is not on {iface} ({', '.join(addrs[iface])})",
            f"set interface: {owner} for {n}" if owner else f"use an address of {iface} as rank 0's address",
        )
    return Check(n, "interface", OK, f"{iface} {addrs[iface][0]} mtu {links[iface]['mtu']}")


def judge_route(inv: Inventory, host: Host, fact: tuple[int, str]) -> Check:
    """Workers must reach MASTER_ADDR through the interface NCCL and gloo are told to use."""
    n = host.name
    if host.rank == 0:
        return Check(n, "route", NA, "rank 0")
    rc, text = fact
    m = re.search(r"\bdev (\S+)", text)
    if rc != 0 or not m:
        return Check(
            n,
            "route",
            FAIL,
            f"no route to MASTER_ADDR {inv.master.hostname}: {_last(text)}",
            f"on {n}: add a route to {inv.master.hostname} via {host.interface}",
        )
    if m.group(1) != host.interface and not m.group(1) == "lo":
        return Check(
            n,
            "route",
            FAIL,
            f"{inv.master.hostname} is reached via {m.group(1)}, not {host.interface}",
            f"set interface: {m.group(1)} for {n}, or route {inv.master.hostname} via {host.interface}",
        )
    return Check(n, "route", OK, f"to {inv.master.hostname} via {m.group(1)}")


def judge_port(inv: Inventory, host: Host, fact: tuple[int, str]) -> Check:
    n, port = host.name, inv.job.master_port
    rc, text = fact
    if rc != 0:
        return Check(
            n, "port", WARN, f"could not list listeners: {_last(text)}", "install iproute2 (ss) on the host"
        )
    if text:
        holder = re.search(r'users:\(\("([^"]+)",pid=(\d+)', text)
        who = f" by {holder.group(1)} (pid {holder.group(2)})" if holder else ""
        return Check(
            n,
            "port",
            FAIL,
            f"master port {port} already in use{who}",
            f"stop it (fab stop, or kill the process on {n}) or set job.master_port",
        )
    return Check(n, "port", OK, f"master port {port} free")


def judge_shm(inv: Inventory, host: Host, fact: tuple[int, str], limits: Limits) -> Check:
    n = host.name
    if inv.job.shm_size:
        return Check(n, "shm", OK, f"--shm-size {inv.job.shm_size}")
    rc, text = fact
    fields = text.splitlines()[-1].split() if rc == 0 and text else []
    if len(fields) < 4 or not fields[1].isdigit():
        return Check(
            n, "shm", WARN, f"could not read /dev/shm: {_last(text)}", "check that /dev/shm is mounted"
        )
    mb = int(fields[1]) // 1024
    if mb < limits.shm_warn_mb:
        return Check(
            n,
            "shm",
            WARN,
            f"/dev/shm is {mb} MB (--ipc host)",
            f"enlarge /dev/shm on {n}, or set job.shm_size (e.g. 16g)",
        )
    return Check(n, "shm", OK, f"{mb} MB (--ipc host)")


def judge_disk(inv: Inventory, host: Host, fact: tuple[int, str], limits: Limits) -> Check:
    n = host.name
    rc, text = fact
    rows = [line.split() for line in text.splitlines() if len(line.split()) >= 6]
    if rc != 0 or len(rows) < 2:
        return Check(n, "disk", WARN, f"could not read free space: {_last(text)}", "")
    worst = min(int(r[3]) for r in rows[:2]) / 1024**2
    paths = f"{inv.job.code_dir}, {inv.job.output_dir}"
    if worst < limits.disk_fail_gb:
        return Check(
            n, "disk", FAIL, f"{worst:.1f} GB free at {paths}", f"free space on {n} or move output_dir"
        )
    if worst < limits.disk_warn_gb:
        return Check(
            n, "disk", WARN, f"{worst:.1f} GB free at {paths}", f"snapshots may not fit; free space on {n}"
        )
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
