"""One rank's recent past, as compact as the alert windows allow: the counters their ``increase`` subtracts.

A windowed condition (``increase(x[w])`` in PromQL) compares a rank's current
snapshot with the counters it had ``w`` seconds ago. :class:`RankHistory` keeps,
about ``resolution_s`` apart and back to the longest window, only those counters:
one row of machine integers per kept moment (iteration, backoffs, growths, and per
optimizer its steps, skips, scheduler steps after a skip, poisoned steps and the
streak-ladder rungs the streak alert reads). At the default windows (30 min, 5 s
apart) and two optimizers that is about 25 KiB per rank, where whole snapshots
took about 450 KiB.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Iterable, Optional, Sequence

from .._state import RankSnapshot

__all__ = ["RankHistory", "Baseline"]

_HEAD = 3  # iteration, backoffs, growths
_PER_OPTIMIZER = 4  # steps, skipped, scheduler_steps_after_skip, poisoned_steps; then one per streak length


class Baseline:
    """The counters a rank had at one past moment (0 for an optimizer it did not have yet). Reads cost O(1)."""

    __slots__ = ("_row", "_offsets", "_rungs")

    def __init__(self, row: Sequence[int], offsets: dict[str, int], rungs: dict[int, int]) -> None:
        self._row, self._offsets, self._rungs = row, offsets, rungs

    @property
    def iteration(self) -> int:
        return self._row[0]

    @property
    def backoffs(self) -> int:
        return self._row[1]

    @property
    def growths(self) -> int:
        return self._row[2]

    def _get(self, optimizer: str, field: int) -> int:
        offset = self._offsets.get(optimizer)
        return 0 if offset is None else self._row[offset + field]

    def steps(self, optimizer: str) -> int:
        return self._get(optimizer, 0)

    def skipped(self, optimizer: str) -> int:
        return self._get(optimizer, 1)

    def scheduler_steps_after_skip(self, optimizer: str) -> int:
        return self._get(optimizer, 2)

    def poisoned_steps(self, optimizer: str) -> int:
        return self._get(optimizer, 3)

    def reached(self, optimizer: str, length: int) -> int:
        """Return how many streaks of ``optimizer`` had reached ``length`` (one of the history's streak lengths)."""
        return self._get(optimizer, _PER_OPTIMIZER + self._rungs[length])


class RankHistory:
    """Hold one rank's latest snapshot and its past counters, about ``resolution_s`` apart, back to ``horizon_s``.

    ``streak_lengths`` are the streak-ladder rungs whose counts a window needs (the streak alert's
    thresholds). :meth:`record` costs a few microseconds; memory is bounded by the horizon, at
    ``8 + 4 * (3 + (4 + len(streak_lengths)) * optimizers)`` bytes per kept moment while counters fit
    in 32 bits (64 bits past that).
    """

    __slots__ = ("run", "rank", "current", "_times", "_rows", "_stride", "_offsets", "_rungs", "_horizon_s",
                 "_resolution_s", "_origin")

    def __init__(self, run: str, rank: int, horizon_s: float, resolution_s: float = 5.0,
                 streak_lengths: Iterable[int] = ()) -> None:
        self.run, self.rank = run, rank
        self.current: Optional[RankSnapshot] = None
        self._times = array("d")
        self._rows = array("i")  # one row of _stride counters per time; widened to 64 bits on overflow
        self._stride = _HEAD
        self._offsets: dict[str, int] = {}  # optimizer -> where its counters start in a row
        self._rungs = {length: i for i, length in enumerate(dict.fromkeys(streak_lengths))}
        self._horizon_s, self._resolution_s = horizon_s, resolution_s
        self._origin: Optional[array] = None

    def record(self, snapshot: RankSnapshot, calibration_iterations: int) -> None:
        """Make ``snapshot`` the current one and keep its counters (replacing a too-close predecessor's)."""
        row = self._row(snapshot)
        if self._origin is None:
            # A rank first seen while young started from zero counters; one first seen later (e.g. after a
            # collector restart) has a past we did not watch, so its first snapshot is the baseline.
            self._origin = array(self._rows.typecode, [0] * self._stride) \
                if snapshot.iteration <= calibration_iterations else row
        self.current = snapshot
        # The latest sample always stays; the previous latest stays as a window baseline only if the new one
        # is at least resolution_s after the sample before it (so any two kept samples apart are that far).
        if len(self._times) >= 2 and snapshot.last_seen - self._times[-2] < self._resolution_s:
            self._times[-1] = snapshot.last_seen
            self._rows[-self._stride:] = row
        else:
            self._times.append(snapshot.last_seen)
            self._rows.extend(row)
        # Keep exactly one sample at or before the horizon: it is the baseline of the longest window.
        cut = bisect.bisect_right(self._times, snapshot.last_seen - self._horizon_s) - 1
        if cut > 0:
            del self._times[:cut]
            del self._rows[:cut * self._stride]

    def baseline(self, now: float, window_s: float) -> Baseline:
        """Return the counters the rank had ``window_s`` seconds before ``now`` (its origin if it is younger)."""
        i = bisect.bisect_right(self._times, now - window_s) - 1
        # Pruning always keeps a sample at or before the horizon, so i < 0 means the rank was first seen
        # inside the window.
        row = self._rows[i * self._stride:(i + 1) * self._stride] if i >= 0 else self._origin
        return Baseline(row, self._offsets, self._rungs)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._times)

    def _row(self, s: RankSnapshot) -> array:
        for name in s.optimizers:
            if name not in self._offsets:
                self._widen(name)
        values = [0] * self._stride
        values[0:_HEAD] = s.iteration, s.totals.backoffs, s.totals.growths
        for name, opt in s.optimizers.items():
            o = self._offsets[name]
            values[o:o + _PER_OPTIMIZER] = opt.steps, opt.skipped, opt.scheduler_steps_after_skip, opt.poisoned_steps
            for length, j in self._rungs.items():
                values[o + _PER_OPTIMIZER + j] = opt.reached(length)
        try:
            return array(self._rows.typecode, values)
        except OverflowError:  # a counter past 2**31: every row to 64 bits, once
            self._rows = array("q", self._rows)
            if self._origin is not None:
                self._origin = array("q", self._origin)
            return array("q", values)

    def _widen(self, optimizer: str) -> None:
        """Give a newly seen optimizer its columns; earlier rows (and the origin) count 0 for it."""
        width = _PER_OPTIMIZER + len(self._rungs)
        old, stride = self._rows, self._stride
        self._offsets[optimizer] = stride
        self._stride = stride + width
        zeros = [0] * width
        rows = array(old.typecode)
        for i in range(0, len(old), stride):
            rows.extend(old[i:i + stride])
            rows.extend(zeros)
        self._rows = rows
        if self._origin is not None:
            self._origin = self._origin + array(old.typecode, zeros)
