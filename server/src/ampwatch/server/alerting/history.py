"""One rank's recent past, as compact as the alert windows allow: what their ``increase`` needs.

A windowed condition (``increase(x[w])`` in PromQL) compares a rank's current
snapshot with the counters it had ``w`` seconds ago. Two kinds of question:

- *how much* (``>= n``, a ratio): steps, skips, backoffs, iterations a rank started a DDP skip
  (origin), and the iteration (calibration).
  :class:`RankHistory` keeps these as one row of machine integers per kept moment, about
  ``resolution_s`` apart, back to the longest window;
- *whether at all* (``> 0``, ``== 0``): growths, scheduler steps after a skip, poisoned steps,
  streaks reaching a threshold. Counters never go down, so "rose since the baseline moment" is
  "last rose after it": one time per counter, whatever the window.

At the default windows (30 min, 5 s apart) and two optimizers that is about 12 KiB per rank,
where whole snapshots took about 400 KiB.
"""

from __future__ import annotations

import bisect
import math
from array import array
from typing import Iterable, Optional, Sequence

from .._state import RankSnapshot
from .._totals import OptimizerTotals

__all__ = ["RankHistory", "Baseline"]

_NONE = OptimizerTotals()
_HEAD = 3  # row: iteration, backoffs, origin iterations; then steps, skipped per optimizer
_ROW_PER_OPTIMIZER = 2
_NEVER = -math.inf
_RANK_RISES = 2
# Rise times: growths, conflicts; then per optimizer scheduler_steps_after_skip, poisoned_steps, one per streak length.


def _moved(before: RankSnapshot, now: RankSnapshot) -> bool:
    """Return whether anything a window alert reads moved from ``before`` to ``now`` (growths, steps and the
    iteration aside: they matter only beside a skip or a backoff), or a streak is running."""
    if (now.totals.backoffs != before.totals.backoffs or now.conflicts != before.conflicts
            or now.totals.origin_iterations != before.totals.origin_iterations or any(now.consecutive_skipped.values())):
        return True
    for name, opt in now.optimizers.items():
        old = before.optimizers.get(name, _NONE)
        if (opt.skipped != old.skipped or opt.scheduler_steps_after_skip != old.scheduler_steps_after_skip
                or opt.poisoned_steps != old.poisoned_steps):
            return True
    return False


class Baseline:
    """A rank at one past moment: its counters then, and whether others rose since. Reads cost O(1)."""

    __slots__ = ("_row", "_at", "_history")

    def __init__(self, row: Sequence[int], at: float, history: "RankHistory") -> None:
        self._row, self._at, self._history = row, at, history

    @property
    def iteration(self) -> int:
        return self._row[0]

    @property
    def backoffs(self) -> int:
        return self._row[1]

    @property
    def origin_iterations(self) -> int:
        """Skipped iterations whose inf/NaN started in this rank's own gradients (DDP hook), up to this moment."""
        return self._row[2]

    def steps(self, optimizer: str) -> int:
        return self._counter(optimizer, 0)

    def skipped(self, optimizer: str) -> int:
        return self._counter(optimizer, 1)

    def grew_since(self) -> bool:
        """Return whether the scale grew after this moment."""
        return self._history._rose[0] > self._at

    def conflicted_since(self) -> bool:
        """Return whether a process claimed the rank in conflict after this moment."""
        return self._history._rose[1] > self._at

    def scheduler_stepped_after_skip_since(self, optimizer: str) -> bool:
        return self._rose(optimizer, 0)

    def poisoned_since(self, optimizer: str) -> bool:
        return self._rose(optimizer, 1)

    def streak_reached_since(self, optimizer: str, length: int) -> bool:
        """Return whether a skip streak of ``optimizer`` reached ``length`` (one of the history's) after this moment."""
        return self._rose(optimizer, 2 + self._history._rungs[length])

    def _counter(self, optimizer: str, field: int) -> int:
        j = self._history._index.get(optimizer)
        return 0 if j is None else self._row[_HEAD + _ROW_PER_OPTIMIZER * j + field]

    def _rose(self, optimizer: str, field: int) -> bool:
        h = self._history
        j = h._index.get(optimizer)
        return j is not None and h._rose[_RANK_RISES + (2 + len(h._rungs)) * j + field] > self._at


class RankHistory:
    """Hold one rank's latest snapshot and what its alert windows need of its past, back to ``horizon_s``.

    ``streak_lengths`` are the streak-ladder rungs a window asks about (the streak alert's
    thresholds). :meth:`record` costs a few microseconds; memory is bounded by the horizon:
    ``8 + 4 * (3 + 2 * optimizers)`` bytes per kept moment while counters fit in 32 bits (64 past
    that), plus ``8 * (1 + (2 + len(streak_lengths)) * optimizers)`` bytes of rise times.
    """

    __slots__ = ("run", "rank", "current", "_times", "_rows", "_rose", "_index", "_rungs", "_horizon_s",
                 "_resolution_s", "_origin", "_moved_at")

    def __init__(self, run: str, rank: int, horizon_s: float, resolution_s: float = 5.0,
                 streak_lengths: Iterable[int] = ()) -> None:
        self.run, self.rank = run, rank
        self.current: Optional[RankSnapshot] = None
        self._times = array("d")
        self._rows = array("i")  # one row per kept time; widened to 64 bits when a counter passes 2**31
        self._rose = array("d", [_NEVER] * _RANK_RISES)  # when each yes/no counter last rose (a collector time)
        self._index: dict[str, int] = {}  # optimizer -> its number, in the order first seen
        self._rungs = {length: i for i, length in enumerate(dict.fromkeys(streak_lengths))}
        self._horizon_s, self._resolution_s = horizon_s, resolution_s
        self._origin: Optional[array] = None
        self._moved_at = _NEVER  # when a counter a window alert reads last moved, or a streak was last seen

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
        if _moved(previous, snapshot):
            self._moved_at = snapshot.last_seen
        row = self._row(snapshot)
        if self._origin is None:
            self._origin = row if previous is snapshot else array(row.typecode, [0] * len(row))
        self.current = snapshot
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
        cut = bisect.bisect_right(self._times, snapshot.last_seen - self._horizon_s) - 1
        if cut > 0:
            del self._times[:cut]
            del self._rows[:cut * stride]

    def baseline(self, now: float, window_s: float) -> Baseline:
        """Return the rank as it was ``window_s`` seconds before ``now`` (its origin if it is younger)."""
        i = bisect.bisect_right(self._times, now - window_s) - 1
        # Pruning always keeps a sample at or before the horizon, so i < 0 means the rank was first seen
        # inside the window: every rise since the origin counts.
        if i < 0:
            return Baseline(self._origin, _NEVER, self)  # type: ignore[arg-type]
        stride = _HEAD + _ROW_PER_OPTIMIZER * len(self._index)
        return Baseline(self._rows[i * stride:(i + 1) * stride], self._times[i], self)

    def __len__(self) -> int:
        return len(self._times)

    def quiet(self, now: float) -> bool:
        """Return whether no window alert can hold at ``now``: nothing they read moved within any window.

        True when, since the earliest moment any window's baseline can be (the kept sample at or before the
        horizon; the origin for a rank younger than the horizon), no skip, backoff, origin iteration,
        scheduler step after a skip, poisoned step or conflict was counted and no streak was running. Every
        window's increase is then 0 and every "rose since" false: the periodic pass skips those reads
        (most ranks of a healthy job, whose calibration skips are older than the longest window). O(1).
        """
        if self._moved_at == _NEVER:
            return True
        return bool(self._times) and now - self._horizon_s >= self._times[0] >= self._moved_at

    def _note_rises(self, before: RankSnapshot, now: RankSnapshot) -> None:
        rose, at = self._rose, now.last_seen
        if now.totals.growths > before.totals.growths:
            rose[0] = at
        if now.conflicts > before.conflicts:
            rose[1] = at
        per = 2 + len(self._rungs)
        for name, opt in now.optimizers.items():
            old = before.optimizers.get(name, _NONE)
            base = _RANK_RISES + per * self._index[name]
            if opt.scheduler_steps_after_skip > old.scheduler_steps_after_skip:
                rose[base] = at
            if opt.poisoned_steps > old.poisoned_steps:
                rose[base + 1] = at
            for length, k in self._rungs.items():
                if opt.reached(length) > old.reached(length):
                    rose[base + 2 + k] = at

    def _row(self, s: RankSnapshot) -> array:
        values = [0] * (_HEAD + _ROW_PER_OPTIMIZER * len(self._index))
        values[0], values[1], values[2] = s.iteration, s.totals.backoffs, s.totals.origin_iterations
        for name, opt in s.optimizers.items():
            o = _HEAD + _ROW_PER_OPTIMIZER * self._index[name]
            values[o], values[o + 1] = opt.steps, opt.skipped
        try:
            return array(self._rows.typecode, values)
        except OverflowError:  # a counter past 2**31: every row to 64 bits, once
            self._rows = array("q", self._rows)
            if self._origin is not None:
                self._origin = array("q", self._origin)
            return array("q", values)

    def _widen(self, optimizer: str) -> None:
        """Give a newly seen optimizer its columns; earlier rows (and the origin) count 0 for it."""
        stride = _HEAD + _ROW_PER_OPTIMIZER * len(self._index)
        self._index[optimizer] = len(self._index)
        zeros = [0] * _ROW_PER_OPTIMIZER
        old, rows = self._rows, array(self._rows.typecode)
        for i in range(0, len(old), stride):
            rows.extend(old[i:i + stride])
            rows.extend(zeros)
        self._rows = rows
        if self._origin is not None:
            self._origin.extend(zeros)
        self._rose.extend([_NEVER] * (2 + len(self._rungs)))
