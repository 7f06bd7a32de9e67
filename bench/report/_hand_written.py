"""Text written by hand in docs/benchmarks.md, carried over when the page is rendered again.

A hand-written block is marked::

    <!-- hand-written: NAME -->
    ...
    <!-- end hand-written: NAME -->

:func:`carry_over` puts each block of the earlier page into the new one at the same place: after the line
that came before it, found in the new page by its :func:`anchor_key` (a result's caption by its command, whose
date and load change at each run) and which one of its section's lines with that key it was; else after that
line found elsewhere; else at the end of the section it was in; else, rather than drop it, before *How it is
measured* (or at the end).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["Block", "blocks", "carry_over", "anchor_key"]

_START = re.compile(r"^<!-- hand-written: ([\w.-]+) -->\s*$")
_END = "<!-- end hand-written: {} -->"
_LAST = "## How it is measured"
_CAPTION = re.compile(r"^(`[^`]+`),")  # a result's caption: its command in backticks, then date, commit and load


def anchor_key(line: str) -> str:
    """What of ``line`` a block placed after it is found by again: a caption's command (the rest is re-measured),
    any other line whole."""
    caption = _CAPTION.match(line)
    return caption.group(1) if caption else line


class Block(NamedTuple):
    """One marked block: its name, its lines (markers included), the last non-blank line before it, which of its
    section's lines with that line's :func:`anchor_key` it is (1: the first), and the ``## `` heading of the
    section it sits in (None before the first heading)."""

    name: str
    lines: list[str]
    after: str | None
    nth: int
    section: str | None


def _walk(lines: list[str]) -> Iterator[tuple[int, int | None, str | None, Counter]]:
    """Each non-blank line outside the blocks, and each block: ``(index, end index of the block or None, section
    heading, keys of the section's non-blank lines so far, that line's included)``; ValueError names a block left
    open."""
    section: str | None = None
    seen: Counter = Counter()
    i = 0
    while i < len(lines):
        line = lines[i]
        start = _START.match(line)
        if start:
            end = _END.format(start.group(1))
            try:
                j = lines.index(end, i + 1)
            except ValueError:
                raise ValueError(f"docs/benchmarks.md: the hand-written block {start.group(1)!r} has no closing line "
                                 f"{end!r}; add it where the block ends") from None
            yield i, j, section, seen
            seen[end] += 1  # the next block may sit right after this one
            i = j + 1
            continue
        if line.startswith("## "):
            section, seen = line, Counter()
        if line.strip():
            seen[anchor_key(line)] += 1
            yield i, None, section, seen
        i += 1


def blocks(page: str) -> list[Block]:
    """The hand-written blocks of ``page`` in order; ValueError names a block left open or named twice."""
    found: list[Block] = []
    lines = page.split("\n")
    before: str | None = None
    for i, end, section, seen in _walk(lines):
        if end is None:
            before = lines[i]
            continue
        name = _START.match(lines[i]).group(1)  # type: ignore[union-attr]
        if any(b.name == name for b in found):
            raise ValueError(f"docs/benchmarks.md: two hand-written blocks are named {name!r}; rename one")
        nth = seen[anchor_key(before)] if before is not None else 0
        found.append(Block(name, lines[i:end + 1], before, nth, section))
        before = lines[end]
    return found


def _section_span(lines: list[str], heading: str | None) -> tuple[int, int] | None:
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
        key = anchor_key(block.after)
        for i, end, section, seen in _walk(lines):
            if end is None and section == block.section and anchor_key(lines[i]) == key and seen[key] == block.nth:
                return i + 1
        found = [k for k, line in enumerate(lines) if line == block.after]
        if found:
            return found[0] + 1
    if span is not None:
        end = span[1]
        while end > span[0] + 1 and not lines[end - 1].strip():
            end -= 1
        return end
    return lines.index(_LAST) if _LAST in lines else len(lines)


def carry_over(new_page: str, earlier_page: str | None) -> str:
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
