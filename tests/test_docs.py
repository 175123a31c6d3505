"""The README stays a five-minute page, and every relative link in README.md and docs/ leads to a file that exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# [text](target) and [text](target "title"); images too. Fenced code blocks are skipped (shell, Python, tables of
# output).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _links(text: str) -> list[tuple[int, str]]:
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out += [(i, m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return out


def _relative(target: str) -> str | None:
    """The file part of a relative link; None for external links and same-page anchors."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "//")):
        return None
    return target.split("#", 1)[0].split("?", 1)[0] or None


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}): move reference text into docs/"
    )


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        if not page.is_file():
            continue
        for line, target in _links(page.read_text()):
            path = _relative(target)
            if path is not None and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_the_link_checker_sees_links():
    """Guards the checker itself: a broken link is found, external links and anchors are not files, code is skipped."""
    text = (
        "[a](notes/x.md#y) ![b](img.png) [c](https://e.org/z.md) [d](#top) `[e](not/a/link.md)`\n```\n[f](g.md)\n```\n"
    )
    assert [t for _, t in _links(text)] == ["notes/x.md#y", "img.png", "https://e.org/z.md", "#top"]
    assert [_relative(t) for _, t in _links(text)] == ["notes/x.md", "img.png", None, None]


def test_readme_links_the_docs_pages():
    """Every page directly under docs/ is reachable from the README (the reading list), so none is orphaned."""
    readme = (ROOT / "README.md").read_text()
    linked = {_relative(t) for _, t in _links(readme)}
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked | {"docs/credit/README.md"}, sorted(pages - linked)


def test_readme_marks_the_main_job_section():
    """The main job's printed tables sit between the two markers, which tools and people replace as one block."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count("<!-- main-job:begin -->") == 1 and readme.count("<!-- main-job:end -->") == 1
    section = readme.split("<!-- main-job:begin -->", 1)[1].split("<!-- main-job:end -->", 1)[0]
    assert "**What it printed**" in section and "**What it shows.**" in section
    assert re.search(r"^```\n\| method .*?^learning: .*?^power: .*?^```$", section, re.M | re.S)
