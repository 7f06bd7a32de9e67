"""The README and the docs/ pages: every relative link reaches a file of the repository, and its ``#anchor`` a
heading of that page (text moved from one page to another keeps its links); a default the contract names is
given as the contract gives it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ampwatch.contract.protocol import COLLECTOR_DEFAULTS, KEEP_ALIVE_S

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (a ``#`` line there is no heading, a ``[x](y)`` no link)."""
    kept, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", _prose(page), flags=re.M)}


def _links(page: Path) -> list[str]:
    found = re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`\n]*`", "", _prose(page)))
    return [link for link in found if not re.match(r"[a-z]+:", link)]


def test_anchors_are_spelled_as_github_spells_them():
    assert anchor("9. A 16,384-rank job on one collector") == "9-a-16384-rank-job-on-one-collector"
    assert anchor("Clipping after `unscale_`, and more") == "clipping-after-unscale_-and-more"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_a_heading(page):
    broken = []
    for link in _links(page):
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in _anchors(target):
            broken.append(f"{link}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def _size(cell: str) -> int:
    """``16384``, ``16,384``, ``8 MiB`` or ```65` s`` as a number (of bytes, of seconds)."""
    number, _, unit = cell.strip().partition(" ")
    return int(number.strip("`").replace(",", "")) * {"": 1, "MiB": 1024 * 1024, "s": 1}[unit]


def test_the_collector_page_gives_each_default_the_contract_names_as_the_contract_does():
    text = (ROOT / "docs" / "collector.md").read_text()
    for name, value in COLLECTOR_DEFAULTS.items():
        option = "--" + name.replace("_", "-")
        (row,) = re.findall(rf"^\| `{option}` \| `AMPWATCH_SERVER_\w+` \| ([^|]+) \|", text, flags=re.M)
        assert _size(row) == value, f"the options table gives {option} a default of {row}, the contract {value}"
        (limit,) = re.findall(rf"^\| [^|]+ \| `{option}` \(([^)]+)\) \|", text, flags=re.M)
        assert _size(limit) == value, f"the limits table gives {option} a default of {limit}, the contract {value}"
    (keep_alive,) = re.findall(r"^\| `--keep-alive` \| `AMPWATCH_SERVER_KEEP_ALIVE` \| ([^|]+) \|", text, flags=re.M)
    assert _size(keep_alive) == KEEP_ALIVE_S


def test_the_readme_stays_a_page_a_newcomer_reads_in_five_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines: move the manual's part into docs/ and link it"
