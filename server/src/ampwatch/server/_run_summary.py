"""One run at a glance for the status page: ranks in trouble first, the rest counted, paged; from memory only.

At 1,024 ranks ``GET /v1/runs/{run}`` is about 1 MB rebuilt from SQLite; this summary reads the
ranks the collector holds (those in ``/metrics``) and the built-in alerts' histories. Building the rows
costs O(ranks) (milliseconds at 1,024 ranks); the query route keeps them in a :class:`~._view_cache.ViewCache`
until the run's change generation or its firing alerts move, and pages through them in O(limit).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Optional

from ampwatch.contract.thresholds import AlertThresholds

from ._floats import wire_float
from ._state import RankState, RankView
from .alerting.conditions import usable_scale
from .alerting.evaluator import BuiltinAlerts

__all__ = ["REASONS", "firing_of", "summary_page", "trouble_rows"]

REASONS = ("poisoned", "silent", "collapsed", "in_streak", "high_skip_ratio", "desynced", "alert")
"""Why a rank is in trouble, most urgent first: the order of the rows."""


def _scale(rank: RankView) -> Optional[float]:
    batch = rank.current.batch  # type: ignore[union-attr]
    return batch.state.loss_scale if batch.scaler.enabled else None


def _row(rank: RankView, now: float, silent_after: float, t: AlertThresholds, alerts: BuiltinAlerts,
         median: Optional[float], firing: Iterable[str]) -> dict[str, Any]:
    opts = rank.optimizer_totals.values()
    streak = max((rank.consecutive_skipped(name) for name in rank.optimizers()), default=0)
    recent = alerts.recent_skips(rank.run, rank.rank, t.skip_ratio_window_s, now)
    ratio = recent[0] / recent[1] if recent and recent[1] else None
    scale, closed = _scale(rank), rank.closed
    reasons = []
    if any(o.poisoned_steps for o in opts):
        reasons.append("poisoned")
    if not closed and now - rank.last_seen > silent_after:
        reasons.append("silent")
    if not closed and scale is not None and not usable_scale(scale, t):
        reasons.append("collapsed")
    if streak and not closed:
        reasons.append("in_streak")
    if ratio is not None and recent[1] >= t.skip_ratio_min_steps and ratio >= t.skip_ratio:  # type: ignore[index]
        reasons.append("high_skip_ratio")
    if not closed and scale is not None and median and math.isfinite(scale) and scale > 0 and \
            max(scale / median, median / scale) >= t.desync_scale_ratio:
        reasons.append("desynced")
    names = sorted(set(firing))
    if names:
        reasons.append("alert")
    batch = rank.current.batch  # type: ignore[union-attr]
    return {"rank": rank.rank, "host": batch.host, "reasons": reasons, "alerts": names,
            "iteration": batch.state.iteration, "loss_scale": wire_float(scale), "closed": closed,
            "last_seen": rank.last_seen, "silent_for": round(now - rank.last_seen, 1), "streak": streak,
            "steps": sum(o.steps for o in opts), "skipped": sum(o.skipped for o in opts),
            "recent_skip_ratio": ratio, "recent_window_s": t.skip_ratio_window_s}


def firing_of(run: str, alerts: BuiltinAlerts) -> tuple[dict[int, tuple[str, ...]], tuple[str, ...]]:
    """The run's firing alerts: names by rank, and the run-wide ones; O(firing alerts)."""
    by_rank: dict[int, list[str]] = {}
    run_alerts = set()
    for a in alerts.firing():
        if a.labels.get("run") != run:
            continue
        if "rank" in a.labels:
            by_rank.setdefault(int(a.labels["rank"]), []).append(a.name)
        else:
            run_alerts.add(a.name)
    return {rank: tuple(sorted(names)) for rank, names in sorted(by_rank.items())}, tuple(sorted(run_alerts))


def trouble_rows(run: str, ranks: Iterable[RankState], alerts: BuiltinAlerts, now: float, silent_after: float,
                 firing: tuple[dict[int, tuple[str, ...]], tuple[str, ...]]) -> tuple[dict[str, Any], float]:
    """Return every rank's row, ranks in trouble first, with the counts, and when a silent rank would change it.

    The expensive part of a summary (O(ranks)): what :func:`summary_page` pages through.
    """
    held = [view for r in ranks if (view := r.view).current is not None]  # each rank as of one batch
    t = alerts.thresholds
    open_scales = [s for r in held if not r.closed and (s := _scale(r)) is not None and math.isfinite(s) and s > 0]
    median = statistics.median(open_scales) if open_scales else None
    firing_by_rank, run_alerts = firing
    rows = [_row(r, now, silent_after, t, alerts, median, firing_by_rank.get(r.rank, ())) for r in held]
    counts = {reason: sum(reason in row["reasons"] for row in rows) for reason in REASONS}
    rows.sort(key=lambda row: (REASONS.index(row["reasons"][0]) if row["reasons"] else len(REASONS), row["rank"]))
    # The next rank to fall silent changes the rows with no batch arriving: the body holds until then.
    turning_silent = [r.last_seen + silent_after for r in held if not r.closed and now - r.last_seen <= silent_after]
    return {"run": run, "ranks": len(held), "closed": all(r.closed for r in held),
            "in_trouble": sum(bool(row["reasons"]) for row in rows), "counts": counts, "run_alerts": list(run_alerts),
            "scale": {"min": wire_float(min(open_scales)) if open_scales else None, "median": wire_float(median),
                      "max": wire_float(max(open_scales)) if open_scales else None},
            "rows": rows}, (min(turning_silent) if turning_silent else math.inf)


def summary_page(built: dict[str, Any], held: dict[int, RankState], now: float, offset: int = 0, limit: int = 50,
                 search: str = "") -> dict[str, Any]:
    """Return one page of :func:`trouble_rows`' rows, their progress (iteration, steps, last seen) read now.

    O(ranks) for a search, else O(limit): the rows stay in the order they were built in.
    """
    rows = built["rows"]
    if search:
        needle = search.strip().lower()
        rows = [row for row in rows if str(row["rank"]) == needle or needle in str(row["host"]).lower()
                or any(needle in reason for reason in row["reasons"])]
    page = []
    for row in rows[offset:offset + limit]:
        rank = held.get(row["rank"])
        view = rank.view if rank is not None else None
        if view is not None and view.current is not None:
            opts = view.optimizer_totals.values()
            row = dict(row, iteration=view.current.batch.state.iteration, last_seen=view.last_seen,
                       silent_for=round(now - view.last_seen, 1), steps=sum(o.steps for o in opts),
                       skipped=sum(o.skipped for o in opts))
        page.append(row)
    return {**{k: v for k, v in built.items() if k != "rows"}, "now": now, "matched": len(rows), "offset": offset,
            "limit": limit, "next": offset + limit if offset + limit < len(rows) else None, "rows": page}
