"""The cell formats every section of docs/benchmarks.md shares, so one figure reads the same in each table."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["find", "fmt", "ratio"]


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: ``-`` for a figure not measured, thousands separated, floats to ``digits`` places."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def find(rows: list[dict], **match: Any) -> Optional[dict]:
    """The first row whose fields equal ``match`` (a server at a level, say), or None when it was not measured."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def ratio(a: Optional[float], b: Optional[float], digits: int = 1) -> str:
    """``a / b`` as ``1.5x``, or ``-`` when either side is missing or zero."""
    if not a or not b:
        return "-"
    return f"{a / b:,.{digits}f}x"
