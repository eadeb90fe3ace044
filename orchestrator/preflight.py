"""Preflight: named checks per host, each with a status, what was seen, and the fix.

Each host is probed with one remote script (one SSH round trip) that gathers raw facts; pure
functions turn the facts into results, so the judging logic is unit-tested without a network.
"""
from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import asdict, dataclass

from .inventory import Host, Inventory
from .plan import shell
from .remote import Session, describe

OK, WARN, FAIL, NA, SKIP = "ok", "warn", "fail", "n/a", "skipped"


@dataclass(frozen=True)
class Check:
    host: str
    check: str
    status: str
    detail: str
    fix: str = ""


def probe_commands(inv: Inventory, host: Host, image: str) -> dict[str, list[str]]:
    """The raw facts gathered on one host, as name -> argv."""
    cmds = {
        "docker": ["docker", "version", "--format", "{{.Server.Version}}"],
        "image": ["docker", "image", "inspect", "--format", "{{.Id}}", image],
        "addr": ["ip", "-o", "-4", "addr", "show"],
        "link": ["ip", "-o", "link", "show"],
    }
    if host.rank == 0:
        cmds["port"] = ["ss", "-Htlnp", f"sport = :{inv.job.master_port}"]
    return cmds


def probe_script(cmds: dict[str, list[str]], marker: str) -> str:
    """One shell script printing each command's output between markers, with its exit code."""
    parts = [f"echo {marker} {name}; {shell(argv)} 2>&1; echo {marker}rc $?" for name, argv in cmds.items()]
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


def judge_host(inv: Inventory, host: Host, facts: dict[str, tuple[int, str]], image: str) -> list[Check]:
    n = host.name
    out = []
    rc, text = facts.get("docker", (127, "no answer"))
    if rc == 0 and text:
        out.append(Check(n, "docker", OK, f"engine {text}"))
    elif "permission denied" in text.lower():
        out.append(Check(n, "docker", FAIL, f"{host.ssh.user} may not use the Docker socket",
                         f"on {n}: sudo usermod -aG docker {host.ssh.user} (then log in again)"))
    else:
        out.append(Check(n, "docker", FAIL, f"engine not reachable: {_last(text)}",
                         f"on {n}: start the engine (sudo systemctl start docker)"))
    rc, text = facts.get("image", (1, ""))
    if rc == 0 and text.startswith("sha256:"):
        out.append(Check(n, "image", OK, f"{image} {text[7:19]}"))
    else:
        out.append(Check(n, "image", FAIL, f"{image} not present",
                         f"fab image.push --image {image} (or docker pull it on {n})"))
    addrs = parse_addrs(facts.get("addr", (1, ""))[1])
    links = parse_links(facts.get("link", (1, ""))[1])
    out.append(judge_interface(inv, host, addrs, links))
    if "port" in facts:
        rc, text = facts["port"]
        port = inv.job.master_port
        if rc != 0:
            out.append(Check(n, "port", WARN, f"could not list listeners: {_last(text)}",
                             "install iproute2 (ss) on the host"))
        elif text:
            holder = re.search(r'users:\(\("([^"]+)",pid=(\d+)', text)
            who = f" by {holder.group(1)} (pid {holder.group(2)})" if holder else ""
            out.append(Check(n, "port", FAIL, f"master port {port} already in use{who}",
                             f"stop it (fab stop, or kill the process on {n}) or set job.master_port"))
        else:
            out.append(Check(n, "port", OK, f"master port {port} free"))
    return out


def judge_interface(inv: Inventory, host: Host, addrs: dict[str, list[str]], links: dict[str, dict]) -> Check:
    n, iface = host.name, host.interface
    if iface not in links:
        hint = suggest_interface(inv.master.address, addrs)
        fix = (f"set interface: {hint} for {n} (its subnet holds {inv.master.address})" if hint
               else f"set interface to one of: {', '.join(sorted(addrs))}")
        return Check(n, "interface", FAIL, f"no interface {iface!r}", fix)
    if not links[iface]["up"]:
        return Check(n, "interface", FAIL, f"{iface} is down", f"on {n}: sudo ip link set {iface} up")
    if iface not in addrs:
        return Check(n, "interface", FAIL, f"{iface} has no IPv4 address",
                     f"give {iface} an address, or pick another interface")
    return Check(n, "interface", OK, f"{iface} {addrs[iface][0]} mtu {links[iface]['mtu']}")


def suggest_interface(master_address: str, addrs: dict[str, list[str]]) -> str | None:
    import ipaddress
    try:
        target = ipaddress.ip_address(master_address)
    except ValueError:
        return None
    for iface, cidrs in addrs.items():
        for cidr in cidrs:
            if target in ipaddress.ip_interface(cidr).network and iface != "lo":
                return iface
    return None


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def run(session: Session, inv: Inventory, image: str | None = None) -> list[Check]:
    marker = "@@fabtrain-" + secrets.token_hex(4)

    def one(host: Host) -> list[Check]:
        img = image or inv.image_for(host)
        start = time.monotonic()
        try:
            session.connection(host)
        except BaseException as exc:  # noqa: BLE001 - reported as the host's ssh check
            return [Check(host.name, "ssh", FAIL, describe(host, exc), _ssh_fix(host, exc))]
        connect = time.monotonic() - start
        res = session.run(host, probe_script(probe_commands(inv, host, img), marker), timeout=30)
        checks = [Check(host.name, "ssh", OK, f"{host.ssh.user}@{host.address} connect {connect * 1000:.0f} ms, "
                                              f"probe {res.seconds * 1000:.0f} ms")]
        return checks + judge_host(inv, host, parse_probe(res.stdout, marker), img)

    results = session.fan_out(one)
    checks: list[Check] = []
    for host in session.hosts:
        r = results[host.name]
        checks += r if isinstance(r, list) else [Check(host.name, "ssh", FAIL, describe(host, r), "")]
    return checks


def _ssh_fix(host: Host, exc: BaseException) -> str:
    text = describe(host, exc)
    return "see the detail" if "accept it deliberately" in text or "CHANGED" in text else \
        f"check that {host.address}:{host.ssh.port} runs sshd and accepts the key {host.ssh.key or ''}"


def failed(checks: list[Check], strict: bool = False) -> list[Check]:
    bad = {FAIL, WARN} if strict else {FAIL}
    return [c for c in checks if c.status in bad]


def to_json(checks: list[Check]) -> str:
    return json.dumps({"ok": not failed(checks), "checks": [asdict(c) for c in checks]}, indent=2)


def render(checks: list[Check], console) -> None:
    from rich.table import Table

    hosts = list(dict.fromkeys(c.host for c in checks))
    names = list(dict.fromkeys(c.check for c in checks))
    style = {OK: "green", WARN: "yellow", FAIL: "bold red", NA: "dim", SKIP: "dim"}
    table = Table(title="preflight", show_lines=False)
    table.add_column("host")
    for name in names:
        table.add_column(name)
    by = {(c.host, c.check): c for c in checks}
    for h in hosts:
        cells = []
        for name in names:
            c = by.get((h, name))
            cells.append(f"[{style[c.status]}]{c.status}[/] {c.detail}" if c else "[dim]-[/]")
        table.add_row(h, *cells)
    console.print(table)
    for c in checks:
        if c.status in (FAIL, WARN):
            colour = "red" if c.status == FAIL else "yellow"
            console.print(f"[{colour}]{c.status.upper()}[/] {c.host} {c.check}: {c.detail}"
                          + (f"\n      fix: {c.fix}" if c.fix else ""), highlight=False, soft_wrap=True)
