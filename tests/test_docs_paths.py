"""The README and docs/ cite only what the repository holds: every relative link and every path
in backticks exists, no path points outside the repository, and no development-process words."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
# A backticked token is a repository path when it names a file or folder under one of these.
TOP = ("ferry/", "tests/", "docs/", "benchmarks/", "scripts/", "Makefile", "pyproject.toml", "README.md")


def cited(page: Path) -> list[tuple[str, Path]]:
    """(as written, resolved) for each relative link and each backticked repository path on ``page``."""
    text = page.read_text()
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        out.append((target, (page.parent / target.split("#")[0]).resolve()))
    for token in CODE.findall(text):
        token = token.rstrip(".,:;")
        if token.startswith(TOP) and not any(c in token for c in "*$<>{}|"):
            out.append((token, (ROOT / token.split(":")[0]).resolve()))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_cites_exists_in_the_repository(page):
    missing = [written for written, path in cited(page) if not path.exists()]
    outside = [written for written, path in cited(page) if ROOT not in path.parents and path != ROOT]
    assert not missing, f"{page.name} cites what the repository does not hold: {missing}"
    assert not outside, f"{page.name} points outside the repository: {outside}"
    assert "../shared" not in page.read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_speak_of_the_product_not_of_its_development(page):
    words = re.findall(r"\b(?:stop|round|issue) \d+\b|\bthe seed\b", page.read_text(), re.IGNORECASE)
    assert not words, f"{page.name}: {words}"


def test_the_readme_is_a_guide_of_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
