"""Every relative link in README.md and docs/*.md resolves: the file exists, and a ``#anchor``
names a heading of the page it points to (GitHub's anchors). A renamed section or a deleted page
then fails here instead of leaving a dead link on the front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`+[^`]*`+")
# [text](target) and ![alt](target); the text may hold one level of brackets (`[a [b] c](x)`).
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, inline code spans blanked; (line no., line)."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, _CODE_SPAN.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the text without links' targets and markup, lower case,
    every character but letters, digits, ``_``, ``-`` and spaces dropped, spaces turned to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page defines: its headings' slugs (a repeated slug gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """The relative links of ``page`` that do not resolve, as ``file:line: target (why)``, the
    file named relative to ``root``."""
    bad = []
    for no, line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if _EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}:{no}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading with anchor #{anchor} in {dest.name})")
    return bad


def test_slug_follows_githubs_rules():
    assert slug("The budget per rollout.mode") == "the-budget-per-rolloutmode"
    assert slug("minippo vs TRL `GRPOTrainer` (`benchmarks/vs_trl.py`)") == (
        "minippo-vs-trl-grpotrainer-benchmarksvs_trlpy"
    )
    assert slug("Engine: 2.5× HF, μ exact") == "engine-25-hf-μ-exact"
    assert slug("[Link](x.md) text") == "link-text"


def test_the_checker_finds_a_dead_file_and_a_dead_anchor(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other\n\n## Its section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Probe\n\n## A section\n\n"
        "[ok](#a-section) [ok2](other.md#its-section) [web](https://x.y)\n"
        "[gone](nowhere.md) [bad anchor](other.md#no-such-section) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    bad = broken_links(page, root=tmp_path)
    assert len(bad) == 2, bad
    assert bad[0] == "page.md:6: nowhere.md (no such file)"
    assert bad[1].startswith("page.md:6: other.md#no-such-section (no heading")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path):
    assert broken_links(page) == []
