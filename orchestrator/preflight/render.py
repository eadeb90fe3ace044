"""Showing a preflight's checks: a rich table of check x host with every failure and warning and
its fix below it (`render`), or JSON for scripts (`to_json`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from orchestrator.core import hostile
from orchestrator.preflight.checks import CHECKS, FAIL, NA, OK, SKIP, WARN, Check, failed

if TYPE_CHECKING:
    from rich.console import Console


def to_json(checks: list[Check], strict: bool = False) -> str:
    return json.dumps({"ok": not failed(checks, strict), "checks": [asdict(c) for c in checks]}, indent=2)


def short(detail: str, width: int = 60) -> str:
    """A cell's text: cut at a word, marked, never inside a number (the full text is below the table)."""
    return detail if len(detail) <= width else detail[: width - 1].rsplit(" ", 1)[0] + " …"


def render(checks: list[Check], console: Console) -> None:
    """Details and fixes name what hosts said: plain text (hostile.rich_text), never markup."""
    from rich.table import Table
    from rich.text import Text

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
            cells.append(
                Text.assemble((c.status, style[c.status]), " ", hostile.rich_text(short(c.detail)))
                if c
                else Text("-", style="dim")
            )
        table.add_row(name, *cells)
    console.print(table)
    for c in checks:
        if c.status in (FAIL, WARN):
            colour = "red" if c.status == FAIL else "yellow"
            line = Text.assemble(
                (c.status.upper(), colour),
                " ",
                hostile.rich_text(
                    f"{c.host} {c.check}: {c.detail}" + (f"\n      fix: {c.fix}" if c.fix else "")
                ),
            )
            console.print(line, highlight=False, soft_wrap=True)
