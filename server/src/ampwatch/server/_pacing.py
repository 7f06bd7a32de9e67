"""Long passes in worker threads that leave the GIL to the event loop now and then.

A worker thread doing pure-Python work for a second (``/metrics`` at the default ``max_ranks_per_run``) holds the GIL
for all of it, bar the interpreter's forced switches: the event loop, which gives the GIL up at
every poll for I/O, gets it back only a switch interval (5 ms) later each time, so ingest answers
queue behind the pass. Sleeping a millisecond after every few milliseconds of work hands the GIL over at
once and leaves the event loop its share of the interpreter while the pass lasts. Only while the loop has
work: a pass given ``busy`` pauses when it says so (ingest requests in flight), and runs at full speed
while the loop idles (a healthy job's batches come a few milliseconds in every hundred).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

__all__ = ["Pacer", "paced"]

T = TypeVar("T")


class Pacer:
    """Call it between two pieces of a pass: it sleeps ``pause_s`` whenever ``work_s`` has passed since its last
    pause (never if ``pause_s`` is 0); with ``busy``, only when it returns true then (else the work goes on for
    another ``work_s``).

    Time, not a count of items: the caller's work per item varies (a rank whose /metrics lines are kept
    costs next to nothing, one formatted again about 40 us), and what the event loop waits for is time.
    """

    __slots__ = ("work_s", "pause_s", "busy", "_due")

    def __init__(self, work_s: float, pause_s: float, busy: Callable[[], bool] | None = None) -> None:
        self.work_s, self.pause_s, self.busy = work_s, pause_s, busy
        self._due = time.perf_counter() + work_s

    def __call__(self) -> None:
        if not self.pause_s or time.perf_counter() < self._due:
            return
        if self.busy is None or self.busy():
            time.sleep(self.pause_s)
        self._due = time.perf_counter() + self.work_s


def paced(items: Sequence[T], work_s: float, pause_s: float, busy: Callable[[], bool] | None = None) \
        -> Iterator[T]:
    """Yield ``items``, a :class:`Pacer` called after each."""
    if not pause_s:
        yield from items
        return
    pace = Pacer(work_s, pause_s, busy)
    for item in items:
        yield item
        pace()
