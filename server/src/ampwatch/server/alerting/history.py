"""One rank's recent past, as compact as the alert windows allow: what the declared counters need.

What a history keeps comes from the alert definitions (``ampwatch.contract.alerts``) and the thresholds,
through a :class:`HistoryLayout`; nothing here names an alert or a counter. A windowed condition
(``increase(x[w])`` in PromQL) compares a rank's current snapshot with the counters it had ``w``
seconds ago. Two kinds of question:

- *how much* (a definition's ``counts``: ``>= n``, a ratio, the value then): kept as one row of
  machine integers per kept moment, about ``resolution_s`` apart, back to the longest window;
- *whether at all* (its ``rises``: ``> 0``, ``== 0``): counters never go down, so "rose since the
  baseline moment" is "last rose after it": one time per counter (per rung of a ladder counter),
  whatever the window.

At the default windows (30 min, 5 s apart) and two optimizers that is about 12 KiB per rank,
where whole snapshots took about 400 KiB.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Any

from ampwatch.contract.alerts import ALERTS, AlertDefinition
from ampwatch.contract.counters import COUNTERS, GAUGES
from ampwatch.contract.thresholds import AlertThresholds

from .._state import RankSnapshot
from .._totals import OptimizerTotals

__all__ = ["RankHistory", "Baseline", "HistoryLayout", "rank_reader"]

_NONE = OptimizerTotals()
_NEVER = -math.inf


def _unique(values: Iterable[Any]) -> tuple:
    return tuple(dict.fromkeys(values))


def rank_reader(name: str) -> Callable[[RankSnapshot], Any]:
    """Read a rank's counter or gauge off a snapshot: its own field (iteration, conflicts, loss_scale) or its
    totals'."""
    return attrgetter(name if name in RankSnapshot.__dataclass_fields__ else f"totals.{name}")


class HistoryLayout:
    """What every rank's history keeps, derived from the windowed alert definitions and one set of thresholds.

    - ``counts``: the counters some definition compares over its window, a row per kept moment;
    - ``rises``: those it asks only whether they rose (ladder counters at the severities' lengths);
    - ``triggers``: the counters whose move can make some alert hold (all but each one's ``context``):
      a rank none of whose triggers moved within the longest window, and none of whose definitions'
      gauges is above 0, is quiet (:meth:`RankHistory.quiet`);
    - ``windows``: each windowed alert's window in seconds; ``horizon_s`` the longest.
    """

    def __init__(self, t: AlertThresholds, alerts: Mapping[str, AlertDefinition] = ALERTS) -> None:
        windowed = [d for d in alerts.values() if d.window]
        self.windows: dict[str, float] = {d.name: getattr(t, d.window)  # type: ignore[arg-type]  # each has one
                                          for d in windowed}
        self.horizon_s = max(self.windows.values(), default=0.0)
        self.reads: dict[str, frozenset[str]] = {d.name: frozenset((*d.counts, *d.rises)) for d in windowed}
        counts = _unique(c for d in windowed for c in d.counts)
        self.rank_counts = tuple(c for c in counts if COUNTERS[c].per == "rank")
        self.optimizer_counts = tuple(c for c in counts if COUNTERS[c].per == "optimizer")
        rises = _unique((c, rung) for d in windowed for c in d.rises for rung in _rungs(d, c, t))
        self.rank_rises = tuple(r for r in rises if COUNTERS[r[0]].per == "rank")
        self.optimizer_rises = tuple(r for r in rises if COUNTERS[r[0]].per == "optimizer")
        self.rungs = {(c, rung) for c, rung in rises if rung is not None}
        triggers = _unique(c for d in windowed for c in (*d.counts, *d.rises) if c not in d.context)
        self.rank_triggers = tuple(map(rank_reader, (c for c in triggers if COUNTERS[c].per == "rank")))
        self.optimizer_triggers = tuple(attrgetter(c) for c in triggers if COUNTERS[c].per == "optimizer")
        gauges = _unique(g for d in windowed for g in d.gauges)
        self._optimizer_gauges = tuple(attrgetter(g) for g in gauges if GAUGES[g].per == "optimizer")
        self._rank_gauges = tuple(attrgetter(g) for g in gauges if GAUGES[g].per == "rank")
        self._rank_count_readers = tuple(map(rank_reader, self.rank_counts))
        self._rank_rise_readers = tuple(rank_reader(c) for c, _ in self.rank_rises)
        self.count_head, self.count_width = len(self.rank_counts), len(self.optimizer_counts)
        self.rise_head, self.rise_width = len(self.rank_rises), len(self.optimizer_rises)
        self.rank_count_slot = {c: i for i, c in enumerate(self.rank_counts)}
        self.optimizer_count_slot = {c: i for i, c in enumerate(self.optimizer_counts)}
        self.rank_rise_slot = {c: i for i, (c, _) in enumerate(self.rank_rises)}
        self.optimizer_rise_slot = {r: i for i, r in enumerate(self.optimizer_rises)}

    def rank_row(self, s: RankSnapshot) -> list[int]:
        return [read(s) for read in self._rank_count_readers]

    def moved(self, before: RankSnapshot, now: RankSnapshot) -> bool:
        """Return whether a trigger moved from ``before`` to ``now``, or a declared gauge is above 0."""
        if any(read(now) != read(before) for read in self.rank_triggers):
            return True
        if any(read(now) for read in self._rank_gauges) or any(any(read(now).values())
                                                               for read in self._optimizer_gauges):
            return True
        for name, opt in now.optimizers.items():
            old = before.optimizers.get(name, _NONE)
            if any(read(opt) != read(old) for read in self.optimizer_triggers):
                return True
        return False

    def rank_rise_values(self, s: RankSnapshot) -> list[int]:
        return [read(s) for read in self._rank_rise_readers]


def _rungs(d: AlertDefinition, counter: str, t: AlertThresholds) -> tuple[int | None, ...]:
    """The rungs of a ladder counter a definition asks about: its severities' lengths; (None,) for a plain one."""
    if not COUNTERS[counter].ladder:
        return (None,)
    return tuple(getattr(t, s.threshold) for s in d.severities if s.threshold)


class Baseline:
    """A rank at one past moment: its counters then, and whether others rose since. Reads cost O(1).

    Bound to one alert (:meth:`RankHistory.since`), it answers only for the counters that alert declares:
    a condition that reads another fails at once, instead of being skipped on ranks where only that moved.
    """

    __slots__ = ("_row", "_at", "_history", "_reads")

    def __init__(self, row: Sequence[int], at: float, history: RankHistory,
                 reads: frozenset[str] | None = None) -> None:
        self._row, self._at, self._history, self._reads = row, at, history, reads

    def count(self, counter: str, optimizer: str | None = None) -> int:
        """Return a counter's value at this moment (an optimizer's, for a per-optimizer counter; 0 if unseen)."""
        if self._reads is not None and counter not in self._reads:
            raise _undeclared(counter)
        layout = self._history.layout
        if optimizer is None:
            return self._row[layout.rank_count_slot[counter]]
        j = self._history._index.get(optimizer)
        if j is None:
            return 0
        return self._row[layout.count_head + layout.count_width * j + layout.optimizer_count_slot[counter]]

    def rose(self, counter: str, optimizer: str | None = None, rung: int | None = None) -> bool:
        """Return whether a counter (an optimizer's; a ladder counter's ``rung``) rose after this moment."""
        if self._reads is not None and counter not in self._reads:
            raise _undeclared(counter)
        h = self._history
        layout = h.layout
        if optimizer is None:
            return h._rose[layout.rank_rise_slot[counter]] > self._at
        j = h._index.get(optimizer)
        if j is None:
            return False
        return h._rose[layout.rise_head + layout.rise_width * j + layout.optimizer_rise_slot[(counter, rung)]] \
            > self._at


def _undeclared(counter: str) -> KeyError:
    return KeyError(f"{counter!r} is not among the counters its alert declares (ampwatch.contract.alerts)")


class RankHistory:
    """Hold one rank's latest snapshot and what its alert windows need of its past, back to the layout's horizon.

    :meth:`record` costs a few microseconds; memory is bounded by the horizon: ``8 + 4 * row`` bytes per
    kept moment while counters fit in 32 bits (64 past that), a row being the layout's rank counts plus
    its optimizer counts per optimizer, plus 8 bytes of rise time per rise the layout keeps.
    """

    __slots__ = ("run", "rank", "current", "layout", "_times", "_rows", "_latest", "_rose", "_index",
                 "_resolution_s", "_origin", "_moved_at", "_found_at", "_found")

    def __init__(self, run: str, rank: int, layout: HistoryLayout, resolution_s: float = 5.0) -> None:
        self.run, self.rank, self.layout = run, rank, layout
        self.current: RankSnapshot | None = None
        self._times = array("d")
        self._rows = array("i")  # one row per kept time; widened to 64 bits when a counter passes 2**31
        self._latest = array("i")  # the current snapshot's row
        self._rose = array("d", [_NEVER] * len(layout.rank_rises))  # when each rise counter last rose
        self._index: dict[str, int] = {}  # optimizer -> its number, in the order first seen
        self._resolution_s = resolution_s
        self._origin: array | None = None
        self._moved_at = _NEVER  # when a trigger last moved, or a declared gauge was last above 0
        self._found_at = math.nan  # baselines searched at that time, by window (one reading)
        self._found: dict[float, Baseline] = {}

    @property
    def horizon_s(self) -> float:
        return self.layout.horizon_s

    def record(self, snapshot: RankSnapshot, calibration_iterations: int) -> None:
        """Make ``snapshot`` the current one and keep what the windows need (replacing a too-close predecessor)."""
        for name in snapshot.optimizers:
            if name not in self._index:
                self._widen(name)
        previous = self.current
        if previous is None:
            # A rank first seen while young started from zero counters; one first seen later (e.g. after a
            # collector restart) has a past we did not watch, so its first snapshot is the baseline.
            young = snapshot.iteration <= calibration_iterations
            previous = RankSnapshot(run=self.run, rank=self.rank, last_seen=_NEVER) if young else snapshot
        self._note_rises(previous, snapshot)
        if self.layout.moved(previous, snapshot):
            self._moved_at = snapshot.last_seen
        row = self._row(snapshot)
        if self._origin is None:
            self._origin = row if previous is snapshot else array(row.typecode, [0] * len(row))
        self.current, self._latest, self._found_at = snapshot, row, math.nan
        stride = len(row)
        # The latest sample always stays; the previous latest stays as a window baseline only if the new one
        # is at least resolution_s after the sample before it (so any two kept samples apart are that far).
        if len(self._times) >= 2 and snapshot.last_seen - self._times[-2] < self._resolution_s:
            self._times[-1] = snapshot.last_seen
            self._rows[-stride:] = row
        else:
            self._times.append(snapshot.last_seen)
            self._rows.extend(row)
        # Keep exactly one sample at or before the horizon: it is the baseline of the longest window.
        cut = bisect.bisect_right(self._times, snapshot.last_seen - self.layout.horizon_s) - 1
        if cut > 0:
            del self._times[:cut]
            del self._rows[:cut * stride]

    def baseline(self, now: float, window_s: float) -> Baseline:
        """Return the rank as it was ``window_s`` seconds before ``now`` (its origin if it is younger)."""
        return self._baseline(now, window_s, None)

    def since(self, alert: str, now: float, still: bool = False) -> Baseline:
        """Return the rank one window of ``alert`` before ``now``, answering only for the counters it declares.

        ``still``: the rank is :meth:`quiet`; its latest moment serves as the baseline (every declared
        trigger rose by 0 in any window, and nothing rose since), without a search.
        """
        reads = self.layout.reads[alert]
        if still:
            return Baseline(self._latest, math.inf, self, reads)
        window_s = self.layout.windows[alert]
        if self._found_at != now:
            self._found_at, self._found = now, {}
        found = self._found.get(window_s)
        if found is None:  # the alerts of one window share its search
            found = self._found[window_s] = self._baseline(now, window_s, None)
        return Baseline(found._row, found._at, self, reads)

    def _baseline(self, now: float, window_s: float, reads: frozenset[str] | None) -> Baseline:
        i = bisect.bisect_right(self._times, now - window_s) - 1
        # Pruning always keeps a sample at or before the horizon, so i < 0 means the rank was first seen
        # inside the window: every rise since the origin counts.
        if i < 0:
            return Baseline(self._origin, _NEVER, self, reads)  # type: ignore[arg-type]  # set by record()
        stride = self._stride()
        return Baseline(self._rows[i * stride:(i + 1) * stride], self._times[i], self, reads)

    def _stride(self) -> int:
        return len(self.layout.rank_counts) + len(self.layout.optimizer_counts) * len(self._index)

    def __len__(self) -> int:
        return len(self._times)

    def quiet(self, now: float) -> bool:
        """Return whether no windowed alert can hold at ``now``: none of their triggers moved within any window.

        True when, since the earliest moment any window's baseline can be (the kept sample at or before the
        horizon; the origin for a rank younger than the horizon), no trigger of a windowed definition moved
        and none of their gauges was above 0. Every window's increase of a trigger is then 0 and no trigger
        rose: the periodic pass reads such a rank's windows at its latest moment (``since(..., still=True)``),
        which is most ranks of a healthy job, whose calibration skips are older than the longest window. O(1).
        """
        if self._moved_at == _NEVER:
            return True
        return bool(self._times) and now - self.layout.horizon_s >= self._times[0] >= self._moved_at

    def _note_rises(self, before: RankSnapshot, now: RankSnapshot) -> None:
        rose, at, layout = self._rose, now.last_seen, self.layout
        for i, (old, new) in enumerate(zip(layout.rank_rise_values(before), layout.rank_rise_values(now), strict=True)):
            if new > old:
                rose[i] = at
        per, head = len(layout.optimizer_rises), len(layout.rank_rises)
        for name, opt in now.optimizers.items():
            old_opt = before.optimizers.get(name, _NONE)
            base = head + per * self._index[name]
            for k, (counter, rung) in enumerate(layout.optimizer_rises):
                if rung is None:
                    moved = getattr(opt, counter) > getattr(old_opt, counter)
                else:
                    moved = opt.reached(rung) > old_opt.reached(rung)
                if moved:
                    rose[base + k] = at

    def _row(self, s: RankSnapshot) -> array:
        values = self.layout.rank_row(s)
        width = len(self.layout.optimizer_counts)
        values.extend([0] * (width * len(self._index)))
        head = len(self.layout.rank_counts)
        for name, opt in s.optimizers.items():
            o = head + width * self._index[name]
            for k, counter in enumerate(self.layout.optimizer_counts):
                values[o + k] = getattr(opt, counter)
        try:
            return array(self._rows.typecode, values)
        except OverflowError:  # a counter past 2**31: every row to 64 bits, once
            self._rows = array("q", self._rows)
            if self._origin is not None:
                self._origin = array("q", self._origin)
            return array("q", values)

    def _widen(self, optimizer: str) -> None:
        """Give a newly seen optimizer its columns; earlier rows (and the origin) count 0 for it."""
        stride = self._stride()
        width = len(self.layout.optimizer_counts)
        self._index[optimizer] = len(self._index)
        zeros = [0] * width
        old, rows = self._rows, array(self._rows.typecode)
        for i in range(len(self._times)):  # one row per kept time (a row may be empty: a layout without rank counts)
            rows.extend(old[i * stride:(i + 1) * stride])
            rows.extend(zeros)
        self._rows = rows
        if self._origin is not None:
            self._origin.extend(zeros)
        self._rose.extend([_NEVER] * len(self.layout.optimizer_rises))
