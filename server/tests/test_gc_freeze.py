"""The collector process keeps its live heap frozen, and still collects garbage cycles in full once an hour."""

from __future__ import annotations

import gc
import weakref

from ampwatch.server import _gc


class _Node:
    def __init__(self) -> None:
        self.other: object = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # freed only by the cycle collector
    return weakref.ref(a)


def test_live_objects_are_frozen_and_a_cycle_frozen_meanwhile_is_collected_by_the_hourly_full_collection():
    now = [0.0]

    def clock() -> float:
        return now[0]

    def sleeping(seconds: float):
        return lambda _: now.__setitem__(0, now[0] + seconds)

    try:
        gc.collect()
        cycle = _cycle()
        _gc._keep_frozen(sleep=sleeping(_gc.FREEZE_EVERY_S), clock=clock, rounds=1)
        assert gc.get_freeze_count() > 0
        assert cycle() is not None  # frozen: young and full collections no longer see it
        gc.collect()
        assert cycle() is not None
        # An hour on, the next round thaws and collects everything, then freezes what is live again.
        _gc._keep_frozen(sleep=sleeping(_gc.FULL_COLLECTION_EVERY_S), clock=clock, rounds=1)
        assert cycle() is None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
