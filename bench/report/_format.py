"""What every section of docs/benchmarks.md shares: cell formats, so one figure reads the same in each table,
and the rows of a before/after table, so every such table names and orders its sides alike."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["SIDES", "beside_pushgateway", "find", "fmt", "link", "measured_by", "phase_rows", "ratio", "side_rows",
           "speed_beside"]


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: ``-`` for a figure not measured, thousands separated, floats to ``digits`` places."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def link(title: str) -> str:
    """A Markdown link to the section ``title`` of the same page, by the anchor GitHub gives its heading."""
    anchor = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
    return f"[section {title.split(' ', 1)[0].rstrip('.')}](#{anchor})"


def find(rows: list[dict], **match: Any) -> dict | None:
    """The first row whose fields equal ``match`` (a server at a level, say), or None when it was not measured."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def beside_pushgateway(rows: list[dict]) -> Iterator[tuple[int, dict, dict]]:
    """``(ranks, ampwatch's row, the Pushgateway's row)`` at 1,024 and 4,096 ranks, where both were measured."""
    for ranks in (1024, 4096):
        a, p = find(rows, target="ampwatch", ranks=ranks), find(rows, target="pushgateway", ranks=ranks)
        if a and p:
            yield ranks, a, p


def ratio(a: float | None, b: float | None, digits: int = 1) -> str:
    """``a / b`` as ``1.5x``, or ``-`` when either side is missing or zero."""
    if not a or not b:
        return "-"
    return f"{a / b:,.{digits}f}x"


def speed_beside(ours: float | None, theirs: float | None) -> str:
    """How our time compares with theirs, as ``2.7x faster`` or ``1.6x slower`` (``-`` when either is missing)."""
    if not ours or not theirs:
        return "-"
    return f"{ratio(theirs, ours)} faster" if ours <= theirs else f"{ratio(ours, theirs)} slower"


SIDES = ("before", "after")
"""A before/after result's two sides, in the order every table lists them."""


def measured_by(doc: dict) -> str:
    """The command and date of a hand-run result, as its table's caption starts: ``python -m bench.x``, date, the
    commit it ran at, and the load average on this 2-core machine as it ended, where the result recorded them."""
    load = doc.get("load_average")
    return (f"`{doc['command']}`, {doc['date']}" + (f", at commit {doc['commit']}" if doc.get("commit") else "")
            + (f", load average {' / '.join(map(str, load))} (1 / 5 / 15 min)" if load else ""))


def _side_name(doc: dict, side: str, ref: str | None) -> str:
    return f"before ({doc[side]['ref'] if ref is None else ref})" if side == "before" else "after"


def side_rows(doc: dict, row: Callable[[str, dict], str], ref: str | None = None,
              sides: Iterable[str] = SIDES) -> list[str]:
    """One row per side of a before/after result: ``row(name, doc[side])``, named ``before (<ref>)`` or ``after``.

    ``ref`` is the earlier commit where the result keeps it outside its sides; ``sides``, an order other than
    before then after.
    """
    return [row(_side_name(doc, side, ref), doc[side]) for side in sides]


def phase_rows(doc: dict, phases: Iterable[str], row: Callable[[str, str, dict], str]) -> list[str]:
    """Rows of a before/after result measured in phases: ``row(name, phase, doc[side][phase])``, side by side."""
    return [row(_side_name(doc, side, None), phase, doc[side][phase]) for side in SIDES for phase in phases]
