"""Phase 2 of a preflight: pure functions judge each host's facts into checks (`judge_host` and
the judge_* per check, `judge_time` for the clock offset; the storage checks are in storagecheck,
the rsync check in rsynccheck); then the hosts are compared against each other (compare). They take
plain data, so they are unit-tested without a network."""

from __future__ import annotations

import ipaddress
import re

from orchestrator.config.inventory import Host, Inventory
from orchestrator.hostcmds import dockerargs
from orchestrator.preflight.checks import DEFAULT_LIMITS, FAIL, NA, OK, SKIP, WARN, Check, Limits, _last
from orchestrator.preflight.probe import (
    DOCKER_TIMEOUT,
    GPU_CONTAINER_TIMEOUT,
    TIMED_OUT,
    Facts,
    count_gpus,
    image_info,
    parse_addrs,
    parse_links,
)
from orchestrator.preflight.rsynccheck import judge_rsync
from orchestrator.preflight.storagecheck import judge_dirs, judge_disk, judge_shm


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
