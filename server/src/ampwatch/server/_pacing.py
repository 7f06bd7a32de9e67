"""Long passes in worker threads that leave the GIL to the event loop now and then.

A worker thread doing pure-Python work for a second (``/metrics`` at 16,384 ranks) holds the GIL
for all of it, bar the interpreter's forced switches: the event loop, which gives the GIL up at
every poll for I/O, gets it back only a switch interval (5 ms) later each time, so ingest answers
queue behind the pass. Sleeping a millisecond every few hundred items hands the GIL over at once.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence, TypeVar

__all__ = ["paced"]

T = TypeVar("T")


def paced(items: Sequence[T], every: int, pause_s: float) -> Iterator[T]:
    """Yield ``items``, sleeping ``pause_s`` after each ``every`` of them (not after the last; never if 0)."""
    if not pause_s or len(items) <= every:
        yield from items
        return
    for first in range(0, len(items), every):
        if first:
            time.sleep(pause_s)
        yield from items[first:first + every]
