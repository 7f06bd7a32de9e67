"""A run's newest events with storms collapsed: what the run page's events table shows.

A whole-job storm writes thousands of events within seconds; shipped one by one they would flush
everything else off the page and cost megabytes per refresh. Here the newest events are read once
(newest first) and the events of one storm (same kind, iteration, optimizer and cause on
``group_from`` ranks or more) become one row carrying their count, their ranks and the newest of
them; other events keep a row each. Rows start only among the newest ``scan`` events, but a storm's
members are counted over as many again behind them: the edge of the scan would otherwise cut a storm
(at 1,024 ranks a few heartbeats of a whole-job storm fill 5,000 events) and its row would claim a
fraction of its ranks. Costs one indexed read of ``2 * scan`` rows and O(scan) grouping.
"""

from __future__ import annotations

from typing import Any

from ._rank_ranges import rank_ranges
from ._stored_form import event_of_row

__all__ = ["GROUP_FROM", "STORM_KINDS", "collapse"]

STORM_KINDS = frozenset({"skip", "scale_change", "streak_end"})
"""Kinds a storm produces on every rank at once."""

GROUP_FROM = 5
"""Events of one storm on this many ranks or more share one row."""


def _storm_key(row: dict[str, Any]) -> tuple:
    return (row["kind"], row["iteration"], row["optimizer"] or "", row["cause"] or "")


def collapse(rows: list[dict[str, Any]], limit: int, group_from: int = GROUP_FROM,
             fresh: int | None = None) -> list[dict[str, Any]]:
    """Turn event rows (newest first: id, rank, incarnation, kind, time, iteration, optimizer, cause, body) into at most
    ``limit`` table rows, newest first: ``{"event", "count", "ranks", "rank_ranges"}`` (count 1: one event).

    Rows start only among the first ``fresh`` (default: all); the rest only add to the storms those start."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row["kind"] in STORM_KINDS:
            groups.setdefault(_storm_key(row), []).append(row)
    out: list[dict[str, Any]] = []
    done: set[tuple] = set()
    for row in rows[:fresh]:
        if len(out) >= limit:
            break
        members = groups.get(_storm_key(row)) if row["kind"] in STORM_KINDS else None
        if members is not None and len(members) >= group_from:
            key = _storm_key(row)
            if key in done:
                continue
            done.add(key)
            ranks = [m["rank"] for m in members]
            out.append({"event": _event(row), "count": len(members), "ranks": len(set(ranks)),
                        "rank_ranges": rank_ranges(ranks)})
        else:
            out.append({"event": _event(row), "count": 1, "ranks": 1, "rank_ranges": str(row["rank"])})
    return out


def _event(row: dict[str, Any]) -> dict[str, Any]:
    return dict(event_of_row(row), rank=row["rank"], incarnation=row["incarnation"])
