"""A run's loss scale over a window of iterations: min / median / max across ranks, and the outlier ranks.

Read from the ranks' :class:`~._scale_trace.ScaleTrace` (memory only). The window is cut into at most
``buckets`` equal slices; each rank's change points are walked once, and a sweep over the slices keeps
a histogram of the scales in force (a handful of distinct powers of two), so a request costs
O(change points in the window + slices x distinct scales): a few milliseconds at 1,024 ranks in a
quiet run, tens in a whole-job storm (every rank's scale changing at every batch), which is why the
route copies the traces on the event loop (:func:`traces`) and computes in a worker thread. The
answer is a few hundred numbers plus the outliers' points, whatever the rank count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ._floats import wire_float
from ._scale_trace import ScaleTrace
from ._state import RankState

__all__ = ["WINDOWS", "lower_median", "run_scale", "traces"]

WINDOWS = {"200": 200, "1000": 1000, "5000": 5000, "all": None}
"""The windows a request may ask for: the last N iterations, or all the collector holds."""

_OFF = "off"  # the histogram's key for scales a log axis cannot show (0, negative, NaN, infinite)


def _key(scale: float) -> Any:
    return scale if math.isfinite(scale) and scale > 0 else _OFF


def lower_median(counts: Iterable[tuple[float, int]]) -> float | None:
    """The lower median of scales given as ``(scale, how many ranks)`` (NaN left out): with an even number of
    ranks the lower of the two middle ones, a scale some rank holds, never an average of two. O(distinct scales)."""
    ordered = sorted((s, n) for s, n in counts if n > 0 and not math.isnan(s))
    seen, middle = 0, (sum(n for _, n in ordered) - 1) // 2
    for scale, n in ordered:
        seen += n
        if seen > middle:
            return scale
    return None  # nothing counted


def _distance(low: float, high: float, floor: float | None, ceiling: float | None) -> float:
    """Powers of two by which [low, high] leaves [floor, ceiling]; infinite for a scale off the log axis."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return math.inf
    if floor is None or ceiling is None:
        return 0.0
    return max(math.log2(floor / low) if low < floor else 0.0, math.log2(high / ceiling) if high > ceiling else 0.0)


def traces(ranks: Iterable[RankState]) -> dict[int, ScaleTrace]:
    """Copy the ranks' traces (O(ranks), array copies): :func:`run_scale` may then run off the event loop."""
    return {r.rank: r.scale_trace.copy() for r in ranks if len(r.scale_trace)}


def run_scale(run: str, traced: dict[int, ScaleTrace], window: int | None, buckets: int = 200,
              outliers: int = 6, asked: Iterable[int] = ()) -> dict[str, Any]:
    """Return the spread of the run's loss scale over the last ``window`` iterations (None: all) and its outliers.

    ``traced``: rank -> its trace (see :func:`traces`). ``outliers``: how many ranks furthest from the median
    to add, each with its points; ``asked``: ranks to add whatever their distance (the page passes its ranks
    in trouble). A run of at most ``outliers`` ranks shows every rank.
    """
    body: dict[str, Any] = {"run": run, "window": window, "ranks": len(traced)}
    if not traced:
        return dict(body, start=None, end=None, width=None, spread=None, outliers=[])
    end = max(t.last_iteration for t in traced.values())
    oldest = min(t.iterations[0] for t in traced.values())
    start = max(oldest, end - window) if window else oldest
    width = max(1, math.ceil((end - start + 1) / buckets))
    count = (end - start) // width + 1
    changes: list[dict[Any, int]] = [{} for _ in range(count)]  # per slice: scale -> ranks in (+) or out (-)
    entered: list[list[float]] = [[] for _ in range(count)]  # per slice: on-axis scales taken up within it
    extremes: dict[int, tuple[float, float]] = {}  # rank -> its lowest and highest scale in the window

    def move(slice_: int, scale: Any, by: int) -> None:
        changes[slice_][scale] = changes[slice_].get(scale, 0) + by

    for rank, trace in traced.items():
        current, low, high = None, math.inf, -math.inf
        last = min(trace.last_iteration, end)
        if last < start:
            continue  # stopped reporting before the window
        for iteration, scale in trace.points(start, last):
            slice_, key = (iteration - start) // width, _key(scale)
            if current is not None:
                move(slice_, current, -1)
            move(slice_, key, +1)
            if key is _OFF:
                low, high = -math.inf, math.inf
            else:
                entered[slice_].append(scale)
                low, high = min(low, scale), max(high, scale)
            current = key
        if current is None:
            continue
        if last < end:  # the rank stopped reporting (killed, closed, or behind): it leaves the spread there
            gone = (last - start) // width + 1
            if gone < count:
                move(gone, current, -1)
        extremes[rank] = (low, high)

    histogram: dict[Any, int] = {}
    lows: list[float | None] = []
    medians: list[float | None] = []
    highs: list[float | None] = []
    reporting: list[int] = []
    for slice_ in range(count):
        in_force = [s for s, n in histogram.items() if s is not _OFF and n > 0]
        for scale, by in changes[slice_].items():
            histogram[scale] = histogram.get(scale, 0) + by
        seen = in_force + entered[slice_]
        lows.append(min(seen) if seen else None)
        highs.append(max(seen) if seen else None)
        medians.append(lower_median((s, n) for s, n in histogram.items() if s is not _OFF))
        reporting.append(sum(histogram.values()))

    # A rank's distance: how far its lowest and highest scale in the window lie outside the range the median
    # moved through, in powers of two (a whole-job backoff moves every rank and the median alike: no outlier).
    on_axis = [m for m in medians if m is not None]
    floor, ceiling = (min(on_axis), max(on_axis)) if on_axis else (None, None)
    distance = {rank: _distance(low, high, floor, ceiling) for rank, (low, high) in extremes.items()}
    wanted = set(asked) & set(extremes)
    if len(extremes) <= outliers:
        wanted = set(extremes)
    else:
        furthest = sorted((r for r in extremes if distance[r] > 0), key=lambda r: (-distance[r], r))
        wanted.update(furthest[:outliers])
    shown = []
    for rank_id in sorted(wanted):
        trace = traced[rank_id]
        last = min(trace.last_iteration, end)
        held = list(trace.points(start, last))
        if held and held[-1][0] < last:
            held.append((last, held[-1][1]))
        points = [[i, wire_float(s)] for i, s in held]
        shown.append({"rank": rank_id, "asked": rank_id in set(asked), "deviation": wire_float(distance[rank_id]),
                      "loss_scale": wire_float(trace.scale_at(last)), "iteration": trace.last_iteration,
                      "points": points})
    return dict(body, start=start, end=end, width=width,
                spread={"iteration": [start + i * width for i in range(count)],
                        "min": [wire_float(v) for v in lows], "median": [wire_float(v) for v in medians],
                        "max": [wire_float(v) for v in highs], "reporting": reporting},
                outliers=shown)
