"""The job's hosts as the command line chooses them: --include and --exclude (DeepSpeed's host@host
syntax, each host optionally with its GPUs or CPU slots) and --num-nodes, among the inventory's
hosts, ranks renumbered; and what the command line alone can tell of them before any host is asked.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from orchestrator.commandline import cli
from orchestrator.core.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

    from orchestrator.config.inventory import Inventory


def host_list(value: str, option: str, inv: Inventory) -> dict[str, tuple[int, ...]]:
    """DeepSpeed's launcher syntax, `node1@node3` (hosts joined by @), each host optionally with its
    GPUs (CPU slots on a host without GPUs): `node1:0,1@node2:2,3`. Inventory host name -> the
    units asked for (() when the host is named alone)."""
    known = [h.name for h in inv.all_hosts]
    example = f"{option} {'@'.join(known[:2])}"
    out: dict[str, tuple[int, ...]] = {}
    for part in (p.strip() for p in value.split("@")):
        name, colon, units = part.partition(":")
        if not name:
            raise UserError(
                f"{option} {value!r}: an empty host name; write hosts joined by @, e.g. {example}",
                exit_code=2,
            )
        if name not in known:
            raise UserError(
                f"{option} {value!r}: no host {name!r} in {inv.path}; hosts are {', '.join(known)}",
                exit_code=2,
            )
        listed = [u.strip() for u in units.split(",")] if colon else []
        if colon and (not all(u.isdigit() for u in listed) or len(set(listed)) != len(listed)):
            raise UserError(
                f"{option} {value!r}: {part!r} should list distinct GPU (or CPU slot) indices "
                f"after the colon, e.g. {name}:0,1",
                exit_code=2,
            )
        if colon and option == "--exclude":
            raise UserError(
                f"{option} {value!r}: --exclude takes whole hosts; choose GPUs with --include {name}:i,j",
                exit_code=2,
            )
        if name in out:
            raise UserError(f"{option} {value!r}: {name} is named twice", exit_code=2)
        out[name] = tuple(sorted(int(u) for u in listed))
    return out


def select_hosts(
    inv: Inventory,
    include: str | None,
    exclude: str | None,
    busy: AbstractSet[str] = frozenset(),
    num_nodes: str | int | None = None,
) -> Inventory:
    """The job's hosts: the inventory's (in its rank order), only --include's, less --exclude's; with
    --num-nodes N, the first N of them that no other job holds (`busy`). Ranks are renumbered."""
    hosts = list(inv.hosts)
    if include:
        chosen = host_list(include, "--include", inv)
        hosts = [h for h in inv.all_hosts if h.name in chosen]
    if exclude:
        dropped = host_list(exclude, "--exclude", inv)
        hosts = [h for h in hosts if h.name not in dropped]
    if num_nodes is not None:
        n = cli.count("--num-nodes", num_nodes)
        free = [h for h in hosts if h.name not in busy]
        if len(free) < n:
            raise UserError(
                f"--num-nodes {n}: only {len(free)} of {', '.join(h.name for h in hosts)} are free "
                f"({', '.join(sorted(busy & {h.name for h in hosts})) or 'none'} run other jobs); "
                f"wait, or ask for fewer",
                exit_code=2,
            )
        hosts = free[:n]
    if not hosts:
        raise UserError("--include/--exclude leave no host to run on", exit_code=2)
    names = {h.name for h in hosts}
    return replace(
        inv,
        hosts=tuple(replace(h, rank=i) for i, h in enumerate(hosts)),
        spares=tuple(s for s in inv.spares if s.name not in names),
    )


def units_asked(inv: Inventory, include: str | None) -> str:
    """JobSpec.units: --include's hosts that list units, in the same syntax ('' when none do)."""
    if not include:
        return ""
    return "@".join(
        f"{n}:{','.join(map(str, u))}" for n, u in host_list(include, "--include", inv).items() if u
    )


def planned_hosts(
    inv: Inventory, include: str | None, exclude: str | None, num_nodes: str | int | None
) -> Inventory:
    """The job's hosts as far as the command line tells, before any host is asked: --include's (or
    the inventory's) less --exclude's, the first --num-nodes of them. Which N of them are free is
    known only from the hosts (select_hosts with `busy`); more than there are is refused here."""
    some = select_hosts(inv, include, exclude)
    n = cli.count("--num-nodes", num_nodes)
    if n is None:
        return some
    if n > len(some.hosts):
        which = f"of {inv.path} left by --include/--exclude" if include or exclude else f"in {inv.path}"
        raise UserError(f"--num-nodes {n}: give 1 to {len(some.hosts)} (the hosts {which})", exit_code=2)
    return replace(some, hosts=some.hosts[:n])
