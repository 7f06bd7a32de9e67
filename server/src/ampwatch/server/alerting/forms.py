"""Compile the condition a common alert declares (``ampwatch.contract.conditions``) to Python: its rank condition.

The Prometheus rules compile the same declarations to PromQL (``ampwatch.dashboards.forms``); each
form's Python here and its PromQL there say the same:

- ``Rose``: the counter rose after the rank's moment one window ago; the value is the counter;
- ``RoseBy``: the counter now less its value one window ago is ``at_least`` or more; the value is that rise;
- ``Share``: the part's rise over the whole's (part and rest), judged once the whole rose by
  ``min_count`` and 1 or more (PromQL's 0 / 0 is NaN, which holds nothing); the value is the share;
- ``Outside``: a rank that has not closed has a value of the gauge, not a finite one in ``[low, high]``
  (NaN compares false, an infinity lies beyond the largest float, as PromQL's ``clamp`` has it); the
  value is the gauge.

What a windowed form reads of the rank's past it reads through ``r.since(alert)``, which answers
only for the counters the definition declares (here: derived from its condition).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from ampwatch.contract.alerts import AlertDefinition
from ampwatch.contract.conditions import Outside, Rose, RoseBy, Share
from ampwatch.contract.thresholds import AlertThresholds

from .history import rank_reader

if TYPE_CHECKING:
    from .._state import RankSnapshot
    from .rank_conditions import Finding, RankReading

__all__ = ["compiled"]

RankCondition = Callable[["RankReading", AlertThresholds], Iterable["Finding"]]


def compiled(d: AlertDefinition) -> RankCondition:
    """Return the condition of a definition that declares one: ``(rank reading, thresholds)`` -> its findings."""
    c = d.condition
    if isinstance(c, Rose):
        return _rose(d.name, c)
    if isinstance(c, RoseBy):
        return _rose_by(d.name, c)
    if isinstance(c, Share):
        return _share(d.name, c)
    if isinstance(c, Outside):
        return _outside(d.name, c)
    raise TypeError(f"alert {d.name} declares no condition of a known form: {c!r}")


def _instances(cur: RankSnapshot, per: str) -> Iterable[tuple[str | None, Any]]:
    """Each instance of an alert of ``per`` on the rank: ``(optimizer, its totals)``, or ``(None, the rank)``."""
    return cur.optimizers.items() if per == "optimizer" else ((None, cur),)


def _reader(name: str, per: str) -> Callable[[Any], Any]:
    """Read a counter off an instance of :func:`_instances`."""
    return attrgetter(name) if per == "optimizer" else rank_reader(name)


def _rose(name: str, c: Rose) -> RankCondition:
    read, counter, per = _reader(c.counter, c.per), c.counter, c.per

    def condition(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
        base = r.since(name)
        for optimizer, values in _instances(r.current, per):
            if base.rose(counter, optimizer):
                yield name, optimizer, None, read(values)
    return condition


def _rose_by(name: str, c: RoseBy) -> RankCondition:
    read, counter, per = _reader(c.counter, c.per), c.counter, c.per

    def condition(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
        base, at_least = r.since(name), getattr(t, c.at_least)
        for optimizer, values in _instances(r.current, per):
            rise = read(values) - base.count(counter, optimizer)
            if rise >= at_least:
                yield name, optimizer, None, rise
    return condition


def _share(name: str, c: Share) -> RankCondition:
    read_part, read_rest, per = _reader(c.part, c.per), _reader(c.rest, c.per), c.per

    def condition(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
        base, at_least, min_count = r.since(name), getattr(t, c.at_least), max(getattr(t, c.min_count), 1)
        for optimizer, values in _instances(r.current, per):
            part = read_part(values) - base.count(c.part, optimizer)
            whole = part + read_rest(values) - base.count(c.rest, optimizer)
            if whole >= min_count and part / whole >= at_least:
                yield name, optimizer, None, part / whole
    return condition


def _outside(name: str, c: Outside) -> RankCondition:
    read = rank_reader(c.gauge)

    # Read for every rank at every pass (no window): a plain list, not a generator.
    def condition(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
        cur = r.current
        value = read(cur)
        # A rank that closed cleanly is finished: its last value is not trouble.
        if cur.closed or value is None:
            return ()
        high = getattr(t, c.high) if c.high else sys.float_info.max
        if getattr(t, c.low) <= value <= high:
            return ()
        return [(name, None, None, value)]
    return condition
