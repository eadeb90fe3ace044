"""The documentation holds together: a README a newcomer reads in five minutes, with the two
commands exactly as the project runs them; every relative link and anchor in README.md and docs/
resolving; every page of docs/ in mkdocs.yml's nav; and `mkdocs build --strict` passing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 250
TWO_COMMANDS = (
    "bash docker/bootstrap.sh --cluster && .venv/bin/fab cluster.up train --model tiny --epochs 5",
    "bash docker/bootstrap.sh --tests && .venv/bin/pytest tests -n 2",
)

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text less fenced blocks and inline code, where a bracket or a '#' is not Markdown."""
    return INLINE_CODE.sub(" ", FENCE.sub("", text))


def heading_texts(text: str) -> list[str]:
    """Each heading as it renders: inline code keeps its content, links their text, emphasis goes."""
    out = []
    for _, title in HEADING.findall(FENCE.sub("", text)):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        title = INLINE_CODE.sub(lambda m: m.group(2), title)
        out.append(re.sub(r"(\*\*|__|\*|_)(.+?)\1", r"\2", title))
    return out


def mkdocs_slug(title: str) -> str:
    """Python-Markdown's toc slugify, which mkdocs uses: ASCII, punctuation dropped, lowercase,
    runs of spaces and hyphens made one '-'."""
    value = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def github_slug(title: str) -> str:
    """GitHub's heading anchors (README.md is read there): punctuation dropped, each space a '-'."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(path: Path, slug) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets _1, _2 as toc gives it."""
    seen: dict[str, int] = {}
    out = set()
    for title in heading_texts(path.read_text()):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}_{n}")
    return out


def relative_links(path: Path) -> list[str]:
    """Every link or image target of a page that is not a URL or a mail address."""
    targets = LINK.findall(prose(path.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def test_readme_is_short_and_has_the_two_commands_verbatim():
    text = README.read_text()
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, at most {README_MAX_LINES}: move the rest to docs/"
    )
    for command in TWO_COMMANDS:
        assert f"```\n{command}\n```" in text, f"README.md: no fenced block holding exactly {command!r}"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in pages():
        for target in relative_links(page):
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
                broken.append(f"{where}: no file {shown}")
                continue
            if page.parent == DOCS and not dest.is_relative_to(DOCS):
                broken.append(f"{where}: leaves docs/, which mkdocs cannot follow; name the file in prose")
            if anchor and dest.suffix == ".md":
                if anchor not in anchors(dest, mkdocs_slug):
                    broken.append(f"{where}: {dest.name} has no heading with the anchor #{anchor}")
                elif page == README and anchor not in anchors(dest, github_slug):
                    broken.append(f"{where}: GitHub gives that heading another anchor than mkdocs does")
    assert not broken, "\n".join(broken)


def nav_files(nav) -> list[str]:
    """The pages named in mkdocs.yml's nav, however nested."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in nav_files(value)]
    return []


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    listed = nav_files(config["nav"])
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(on_disk) - set(listed)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(listed) - set(on_disk)) == [], "mkdocs.yml's nav names pages that do not exist"
    assert len(listed) == len(set(listed)), "a page is listed twice in mkdocs.yml's nav"


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed: CI must run bash docker/bootstrap.sh --tests first")
        pytest.skip("mkdocs is not installed (bash docker/bootstrap.sh --tests installs it)")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}{r.stderr}"


def test_the_events_table_lists_every_event_kind_the_code_emits():
    """docs/how-train-works.md's table of `--json` events and events.KINDS name the same events."""
    from orchestrator.core import events

    text = (ROOT / "docs" / "how-train-works.md").read_text()
    table = text.split("## Events for scripts", 1)[1].split("\n## ", 1)[0]
    listed = {m.group(1) for m in re.finditer(r"^\| `([a-z_]+)` \|", table, re.M)}
    kinds = set(events.KINDS)
    assert listed == kinds, (sorted(listed - kinds), sorted(kinds - listed))
