"""One run at a glance for the status page: ranks in trouble first, the rest counted, paged; from memory only.

At 1,024 ranks ``GET /v1/runs/{run}`` is about 1 MB rebuilt from SQLite; this summary reads the
ranks the collector holds (those in ``/metrics``) and the built-in alerts' histories. Building the rows
costs O(ranks) (milliseconds at 1,024 ranks); the query route keeps them in a :class:`~._view_cache.ViewCache`
until the run's change generation or its firing alerts move, and pages through them in O(limit).

While a rank of the run is open the rows say what is wrong *now* with the ranks still running
(``counts_cover: "live"``); once every rank closed, what went wrong over the run's whole life
(``"whole_run"``): how its scale ended, its lifetime skip ratio, its longest streak, and the
alerts that fired in it, however long ago they resolved.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from typing import Any

from ampwatch.contract.thresholds import AlertThresholds

from ._floats import wire_float
from ._run_scale import lower_median
from ._state import RankState, RankView
from .alerting.evaluator import BuiltinAlerts
from .alerting.rank_conditions import usable_scale

__all__ = ["REASONS", "firing_of", "summary_page", "trouble_rows"]

REASONS = ("poisoned", "silent", "collapsed", "in_streak", "long_streak", "high_skip_ratio", "alert", "desynced")
"""Why a rank is in trouble, most urgent first: the order of the rows (a rank sorts by its most urgent reason).
Skipping (a streak, a high skip ratio, an alert) comes before a scale merely out of line with the others."""

_RANKED = {reason: i for i, reason in enumerate(REASONS)}

Firing = tuple[dict[int, tuple[str, ...]], tuple[str, ...]]


def _scale(rank: RankView) -> float | None:
    """The rank's loss scale; None when it has none (no GradScaler, a disabled one, or not read yet)."""
    batch = rank.owner.batch
    return batch.state.loss_scale if batch.scaler.enabled else None


def _band(scales: Iterable[float | None], t: AlertThresholds) -> tuple[dict[str, Any], float | None]:
    """Return min, lower median and max of ``scales`` (collapsed ones too: 0, subnormal, infinite) with counts, and
    the median as a float.

    NaN has no place in an order: it counts as collapsed and in ``ranks``, outside min, median and max.
    None is a rank without a scale (``no_scale``): never collapsed, never in the band. O(ranks).
    """
    held = list(scales)
    known = [s for s in held if s is not None]
    ordered = [s for s in known if not math.isnan(s)]
    median = lower_median(collections.Counter(ordered).items())
    return {"min": wire_float(min(ordered)) if ordered else None, "median": wire_float(median),
            "max": wire_float(max(ordered)) if ordered else None, "ranks": len(known),
            "collapsed": sum(not usable_scale(s, t) for s in known), "no_scale": len(held) - len(known)}, median


def _high_lifetime_ratio(skipped: int, calls: int, t: AlertThresholds) -> bool:
    """A lifetime skip ratio at or above the alert's, judged once the rank made the alert's minimum of step calls
    or skipped as many steps as that minimum allows (a short run that skipped 31 of 160 is judged)."""
    return bool(calls) and skipped / calls >= t.skip_ratio and \
        (calls >= t.skip_ratio_min_steps or skipped >= t.skip_ratio * t.skip_ratio_min_steps)


def _progress(rank: RankView) -> tuple[int, int, int]:
    """The rank's skipped steps, step calls and poisoned steps over every process; O(optimizers)."""
    skipped = calls = poisoned = 0
    for o in rank.optimizer_totals.values():
        skipped, calls, poisoned = skipped + o.skipped, calls + o.skipped + o.steps, poisoned + o.poisoned_steps
    return skipped, calls, poisoned


def _row(rank: RankView, now: float, silent_after: float, t: AlertThresholds, recent: tuple[int, int] | None,
         median: float | None, names: Iterable[str], finished: bool) -> dict[str, Any]:
    # The hot loop of a summary (once per rank per build): each view property is read once.
    current = rank.owner
    batch = current.batch
    last_seen, closed = rank.last_seen, rank.closed
    streak = max((o.consecutive_skipped for o in batch.state.optimizers.values()), default=0)
    longest = max(current.longest.values(), default=0) if len(rank.incarnations) == 1 else \
        max((rank.longest_streak(name) for name in rank.optimizers()), default=0)
    skipped, calls, poisoned = _progress(rank)
    skipped_recently, calls_recently = recent or (0, 0)
    ratio = skipped_recently / calls_recently if calls_recently else None
    scale = _scale(rank)
    live = not closed and not finished
    judged = live or finished  # a closed rank of a live run: only what it did for good
    names = sorted(set(names))
    reasons = []  # in the order of REASONS
    if poisoned:
        reasons.append("poisoned")
    if live and now - last_seen > silent_after:
        reasons.append("silent")
    if judged and scale is not None and not usable_scale(scale, t):
        reasons.append("collapsed")
    if live and streak:
        reasons.append("in_streak")
    if finished and longest >= t.skip_streak_warning:
        reasons.append("long_streak")
    if _high_lifetime_ratio(skipped, calls, t) if finished else \
            (ratio is not None and calls_recently >= t.skip_ratio_min_steps and ratio >= t.skip_ratio):
        reasons.append("high_skip_ratio")
    if names:
        reasons.append("alert")
    if judged and scale is not None and median and math.isfinite(scale) and scale > 0 and \
            max(scale / median, median / scale) >= t.desync_scale_ratio:
        reasons.append("desynced")
    return {"rank": rank.rank, "host": batch.host, "reasons": reasons, "alerts": names,
            "iteration": batch.state.iteration, "loss_scale": wire_float(scale), "closed": closed,
            "last_seen": last_seen, "silent_for": round(now - last_seen, 1), "streak": streak,
            "longest_streak": longest, "steps": calls - skipped, "skipped": skipped, "poisoned_steps": poisoned,
            "recent_skip_ratio": ratio, "recent_window_s": t.skip_ratio_window_s}


def firing_of(run: str, alerts: BuiltinAlerts) -> Firing:
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


def _whole_job(rows: list[dict[str, Any]], live: int, t: AlertThresholds) -> dict[str, Any] | None:
    """The run-wide skip, when at least ``backoff_rank_share`` of its live ranks are in a streak together: how
    many, and the iteration most of their streaks began at (the first skipped one: DDP ranks skip in lockstep)."""
    starts = [row["iteration"] - row["streak"] for row in rows if "in_streak" in row["reasons"]]
    if not starts or len(starts) < t.backoff_rank_share * live:
        return None
    counted = collections.Counter(starts)
    since = min(counted, key=lambda start: (-counted[start], start))
    return {"skipping": len(starts), "live": live, "since_iteration": since, "since_ranks": counted[since]}


def _life(held: list[RankView], rows: list[dict[str, Any]], fired: list[dict]) -> dict[str, Any]:
    """What happened over the run's life, as its ranks' totals say (every process of each rank)."""
    skipped, calls = sum(row["skipped"] for row in rows), sum(row["steps"] + row["skipped"] for row in rows)
    longest = max(rows, key=lambda row: (row["longest_streak"], -row["rank"]), default=None)
    return {"iterations": max((row["iteration"] for row in rows), default=0), "step_calls": calls,
            "skipped": skipped, "skip_ratio": skipped / calls if calls else None,
            "streaks": sum(o.streaks for r in held for o in r.optimizer_totals.values()),
            "longest_streak": longest["longest_streak"] if longest else 0,
            "longest_streak_rank": longest["rank"] if longest and longest["longest_streak"] else None,
            "poisoned_steps": sum(row["poisoned_steps"] for row in rows),
            "poisoned_ranks": sum(bool(row["poisoned_steps"]) for row in rows), "alerts_fired": fired}


def trouble_rows(run: str, ranks: Iterable[RankState], alerts: BuiltinAlerts, now: float, silent_after: float,
                 firing: Firing) -> tuple[dict[str, Any], float]:
    """Return every rank's row, ranks in trouble first, with the counts, and when a silent rank would change it.

    The expensive part of a summary (O(ranks)): what :func:`summary_page` pages through.
    """
    held = [view for r in ranks if (view := r.view).current is not None]  # each rank as of one batch
    t = alerts.thresholds
    finished = bool(held) and all(r.closed for r in held)
    # The band: the open ranks' scales now, or once the run finished, every rank's last one.
    band, median = _band((_scale(r) for r in held if finished or not r.closed), t)
    firing_by_rank, run_alerts = firing
    fired, fired_by_rank = alerts.fired(run, by_rank=finished)
    recent = alerts.recent_skips(run, [r.rank for r in held], t.skip_ratio_window_s, now)
    rows = [_row(r, now, silent_after, t, recent.get(r.rank), median,
                 firing_by_rank.get(r.rank, ()) + fired_by_rank.get(r.rank, ()), finished) for r in held]
    counted = collections.Counter(reason for row in rows for reason in row["reasons"])
    counts = {reason: counted[reason] for reason in REASONS}
    rows.sort(key=lambda row: (_RANKED[row["reasons"][0]] if row["reasons"] else len(REASONS), row["rank"]))
    live = sum(not row["closed"] for row in rows)
    # The first rank to fall silent changes the rows with no batch arriving: the body holds until then.
    turning_silent = [row["last_seen"] + silent_after for row in rows
                      if not row["closed"] and now - row["last_seen"] <= silent_after]
    return {"run": run, "ranks": len(held), "closed": finished, "counts_cover": "whole_run" if finished else "live",
            "live_ranks": live, "in_trouble": sum(bool(row["reasons"]) for row in rows), "counts": counts,
            "run_alerts": list(run_alerts), "scale": band, "whole_job": _whole_job(rows, live, t),
            "life": _life(held, rows, fired), "rows": rows}, (min(turning_silent) if turning_silent else math.inf)


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
            skipped, calls, _ = _progress(view)
            row = dict(row, iteration=view.current.batch.state.iteration, last_seen=view.last_seen,
                       silent_for=round(now - view.last_seen, 1), steps=calls - skipped, skipped=skipped)
        page.append(row)
    return {**{k: v for k, v in built.items() if k != "rows"}, "now": now, "matched": len(rows), "offset": offset,
            "limit": limit, "next": offset + limit if offset + limit < len(rows) else None, "rows": page}
