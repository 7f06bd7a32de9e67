"""Text written by hand in docs/benchmarks.md, carried over when the page is rendered again.

A hand-written block is marked::

    <!-- hand-written: NAME -->
    ...
    <!-- end hand-written: NAME -->

:func:`carry_over` puts each block of the earlier page into the new one at the same place: after the line
that came before it, when the new page has that line (in the same section if it is there); else at the end
of the section it was in; else, rather than drop it, before *How it is measured* (or at the end).
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

__all__ = ["Block", "blocks", "carry_over"]

_START = re.compile(r"^<!-- hand-written: ([\w.-]+) -->\s*$")
_END = "<!-- end hand-written: {} -->"
_LAST = "## How it is measured"


class Block(NamedTuple):
    """One marked block: its name, its lines (markers included), the last non-blank line before it and the
    ``## `` heading of the section it sits in (None before the first heading)."""

    name: str
    lines: list[str]
    after: Optional[str]
    section: Optional[str]


def blocks(page: str) -> list[Block]:
    """The hand-written blocks of ``page`` in order; ValueError names a block left open or named twice."""
    found: list[Block] = []
    lines = page.split("\n")
    section: Optional[str] = None
    before: Optional[str] = None
    i = 0
    while i < len(lines):
        line = lines[i]
        start = _START.match(line)
        if start:
            name = start.group(1)
            if any(b.name == name for b in found):
                raise ValueError(f"docs/benchmarks.md: two hand-written blocks are named {name!r}; rename one")
            end = _END.format(name)
            try:
                j = lines.index(end, i + 1)
            except ValueError:
                raise ValueError(f"docs/benchmarks.md: the hand-written block {name!r} has no closing line "
                                 f"{end!r}; add it where the block ends") from None
            found.append(Block(name, lines[i:j + 1], before, section))
            before, i = end, j + 1
            continue
        if line.startswith("## "):
            section = line
        if line.strip():
            before = line
        i += 1
    return found


def _section_span(lines: list[str], heading: Optional[str]) -> Optional[tuple[int, int]]:
    """``(first, end)``: the lines of the section under ``heading`` (its heading first), or None if none has it."""
    if heading is None:
        first = 0
    elif heading in lines:
        first = lines.index(heading)
    else:
        return None
    end = next((k for k in range(first + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
    return first, end


def _place(lines: list[str], block: Block) -> int:
    """The index in ``lines`` to insert ``block`` at."""
    span = _section_span(lines, block.section)
    if block.after is not None:
        found = [k for k, line in enumerate(lines) if line == block.after]
        inside = [k for k in found if span and span[0] <= k < span[1]]
        if inside or found:
            return (inside or found)[0] + 1
    if span is not None:
        end = span[1]
        while end > span[0] + 1 and not lines[end - 1].strip():
            end -= 1
        return end
    return lines.index(_LAST) if _LAST in lines else len(lines)


def carry_over(new_page: str, earlier_page: Optional[str]) -> str:
    """``new_page`` with every hand-written block of ``earlier_page`` put back in its place."""
    if not earlier_page:
        return new_page
    lines = new_page.split("\n")
    for block in blocks(earlier_page):
        at = _place(lines, block)
        lead = [""] if at > 0 and lines[at - 1].strip() else []
        trail = [""] if at < len(lines) and lines[at].strip() else []
        lines[at:at] = lead + block.lines + trail
    return "\n".join(lines)
