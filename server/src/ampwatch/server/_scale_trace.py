"""One rank's loss scale over iterations, kept small: the points where it changed, older ones thinned.

The collector already sees every change: each batch's ``scale_change`` events and its state's
``(iteration, loss_scale)``. A :class:`ScaleTrace` keeps those as a step function in two flat arrays
(16 bytes a point, at most :data:`CAPACITY` points: about 2 KiB a rank at worst). When it is full the
older half is thinned (every other point dropped), so a trace always spans the rank's watched history,
exact over its latest changes and coarser further back. Held in memory only: a restarted collector
starts each trace from the rank's last stored state.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Iterator

from ._schema import Batch, ScaleChangeEvent

__all__ = ["CAPACITY", "ScaleTrace"]

CAPACITY = 128
"""Change points kept per rank; past it the older half is thinned."""


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


class ScaleTrace:
    """A rank's loss scale as a step function: ``scale_at(i)`` is the scale in force at iteration ``i``.

    >>> trace = ScaleTrace()
    >>> trace.record(0, 65536.0); trace.record(10, 32768.0); trace.record(12, 32768.0)
    >>> trace.scale_at(11), trace.scale_at(5), len(trace)
    (32768.0, 65536.0, 2)
    """

    __slots__ = ("iterations", "scales", "last_iteration")

    def __init__(self) -> None:
        self.iterations = array("q")
        self.scales = array("d")
        self.last_iteration = -1  # the newest iteration reported (the step function holds up to here)

    def __len__(self) -> int:
        return len(self.iterations)

    def copy(self) -> ScaleTrace:
        """An independent copy (two array copies: microseconds), to read while the original keeps changing."""
        twin = ScaleTrace()
        twin.iterations, twin.scales, twin.last_iteration = array("q", self.iterations), array("d", self.scales), \
            self.last_iteration
        return twin

    def record(self, iteration: int, scale: float) -> None:
        """Note that ``scale`` was in force from ``iteration`` on; O(1), amortised O(1) when thinning."""
        if iteration < self.last_iteration:
            return  # older than what was reported since (a late event): the step function moved past it
        self.last_iteration = iteration
        if self.scales and _same(self.scales[-1], scale):
            return
        if self.iterations and self.iterations[-1] == iteration:
            self.scales[-1] = scale  # several changes within one iteration: the last one holds
            if len(self.scales) > 1 and _same(self.scales[-2], scale):
                del self.iterations[-1], self.scales[-1]
            return
        if len(self.iterations) >= CAPACITY:
            half = CAPACITY // 2
            del self.iterations[1:half:2]
            del self.scales[1:half:2]
        self.iterations.append(iteration)
        self.scales.append(scale)

    def rewind(self, iteration: int) -> None:
        """Forget everything after ``iteration`` (a process that restarted from an earlier checkpoint)."""
        keep = bisect_right(self.iterations, iteration)
        del self.iterations[keep:], self.scales[keep:]
        self.last_iteration = min(self.last_iteration, iteration)

    def record_batch(self, batch: Batch, new_process: bool) -> None:
        """Add a batch's scale changes and its state's scale; O(events)."""
        state = batch.state
        if not batch.scaler.enabled or state.loss_scale is None:
            return
        if new_process and state.iteration < self.last_iteration:
            self.rewind(state.iteration)
        for event in batch.events:
            if isinstance(event, ScaleChangeEvent) and event.after is not None:
                if not self.iterations and event.before is not None and event.iteration > 0:
                    self.record(event.iteration - 1, event.before)  # in force before the first change seen
                self.record(event.iteration, event.after)
        self.record(state.iteration, state.loss_scale)

    def scale_at(self, iteration: int) -> float | None:
        """The scale in force at ``iteration``; None before the first point. O(log points)."""
        i = bisect_right(self.iterations, iteration)
        return self.scales[i - 1] if i else None

    def points(self, start: int, end: int) -> Iterator[tuple[int, float]]:
        """The changes within ``(start, end]``, oldest first, after the point in force at ``start`` (if any)."""
        i = bisect_right(self.iterations, start)
        if i:
            yield start, self.scales[i - 1]
        while i < len(self.iterations) and self.iterations[i] <= end:
            yield self.iterations[i], self.scales[i]
            i += 1
