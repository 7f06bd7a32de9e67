"""The forms a common alert's condition takes, declared once in its definition and compiled by both evaluators.

A definition (:mod:`ampwatch.contract.alerts`) whose ``condition`` is one of these forms needs no
condition written by hand: ``ampwatch.dashboards.forms`` compiles it to PromQL and
``ampwatch.server.alerting.forms`` to Python, so the two evaluators agree by construction. Each form
names the counters or gauge it reads (:mod:`ampwatch.contract.counters`) and the
:class:`~ampwatch.contract.thresholds.AlertThresholds` fields it compares them with; the definition's
window, counters and parameters follow from it.

Every form holds per instance of its alert: per optimizer for a counter or gauge of an optimizer, per
rank for one of a rank. Counters are judged over the window whether the rank closed or not (a rank
that closed in trouble keeps its alert for the window); a gauge only on ranks that have not closed
(a closed rank's gauges are its last values, not its state).

=====================================  ==========================  ===================================
form                                   holds when                  its value
=====================================  ==========================  ===================================
``Rose(counter, window)``              the counter rose within     the counter
                                       the window
``RoseBy(counter, window, at_least)``  it rose by ``at_least`` or  its rise
                                       more within the window
``Share(part, rest, window, ...)``     ``part`` rose by a share    that share
                                       of ``at_least`` or more of
                                       ``part + rest``, which rose
                                       by ``min_count`` (and 1) or
                                       more
``Outside(gauge, low, high)``          the gauge is not a finite   the gauge
                                       value in ``[low, high]``
                                       (NaN and infinities are
                                       outside; no value: nothing)
=====================================  ==========================  ===================================

Example::

    from ampwatch.contract.conditions import Rose
    Rose("poisoned_steps", window="poisoned_window_s").rises   # ('poisoned_steps',)
"""

from __future__ import annotations

import dataclasses

from .counters import COUNTERS, GAUGES

__all__ = ["Condition", "Outside", "Rose", "RoseBy", "Share"]


class _Form:
    """What every form says of the state it reads; each form overrides what it reads (none reads nothing)."""

    __slots__ = ()

    @property
    def counts(self) -> tuple[str, ...]:
        """Counters whose rise over the window it compares."""
        return ()

    @property
    def rises(self) -> tuple[str, ...]:
        """Counters whose rising at all over the window it asks."""
        return ()

    @property
    def context(self) -> tuple[str, ...]:
        """Counters it reads whose rise alone cannot make it hold."""
        return ()

    @property
    def parameters(self) -> tuple[str, ...]:
        """The AlertThresholds fields it compares with."""
        return ()


@dataclasses.dataclass(frozen=True, slots=True)
class Rose(_Form):
    """Holds while ``counter`` rose within the window (its value now differs from its value one window ago)."""

    counter: str
    window: str
    """The AlertThresholds field of the window, in seconds."""

    @property
    def rises(self) -> tuple[str, ...]:
        return (self.counter,)

    @property
    def per(self) -> str:
        return COUNTERS[self.counter].per


@dataclasses.dataclass(frozen=True, slots=True)
class RoseBy(_Form):
    """Holds while ``counter`` rose by ``at_least`` or more within the window; its value is the rise."""

    counter: str
    window: str
    at_least: str
    """The AlertThresholds field of the rise it takes (a count)."""

    @property
    def counts(self) -> tuple[str, ...]:
        return (self.counter,)

    @property
    def parameters(self) -> tuple[str, ...]:
        return (self.at_least,)

    @property
    def per(self) -> str:
        return COUNTERS[self.counter].per


@dataclasses.dataclass(frozen=True, slots=True)
class Share(_Form):
    """Holds while ``part``'s rise is a share of ``at_least`` or more of the rise of ``part + rest`` (the whole),
    judged once the whole rose by ``min_count`` (and 1) or more; its value is the share.

    The skip ratio: ``Share(part="skipped", rest="steps", whole="step_calls", ...)`` (a ``scaler.step()`` call
    either skips or updates).
    """

    part: str
    rest: str
    """The counter that makes up the whole with ``part``: its rise alone cannot make the share hold."""
    whole: str
    """What ``part + rest`` count, as the rules' recordings name it (``step_calls``)."""
    window: str
    at_least: str
    """The AlertThresholds field of the share, in (0, 1]."""
    min_count: str
    """The AlertThresholds field of the whole's rise below which the share is not judged."""

    @property
    def counts(self) -> tuple[str, ...]:
        return (self.part, self.rest)

    @property
    def context(self) -> tuple[str, ...]:
        return (self.rest,)

    @property
    def parameters(self) -> tuple[str, ...]:
        return (self.at_least, self.min_count)

    @property
    def per(self) -> str:
        return COUNTERS[self.part].per


@dataclasses.dataclass(frozen=True, slots=True)
class Outside(_Form):
    """Holds while ``gauge`` (one of a rank's) of a rank that has not closed is not a finite value in
    ``[low, high]``; its value is the gauge. NaN and the infinities are always outside; a rank without a value
    (no series) holds nothing."""

    gauge: str
    low: str
    """The AlertThresholds field of the lowest value inside."""
    high: str | None = None
    """The AlertThresholds field of the highest value inside; None: any finite value at or above ``low``."""

    window = None
    """It reads the latest state only."""

    @property
    def parameters(self) -> tuple[str, ...]:
        return (self.low, *filter(None, (self.high,)))

    @property
    def per(self) -> str:
        return GAUGES[self.gauge].per


Condition = Rose | RoseBy | Share | Outside
"""A condition of one of the forms both evaluators compile."""


def check(condition: Condition, where: str) -> None:
    """Raise a ValueError saying ``where`` unless ``condition`` reads counters and gauges the contract declares, each
    of one kind (all of a rank, or all of an optimizer)."""
    if isinstance(condition, Outside):
        if condition.gauge not in GAUGES:
            raise ValueError(f"{where}: {condition.gauge!r} is not a gauge of ampwatch.contract.counters.GAUGES")
        if GAUGES[condition.gauge].per != "rank":
            raise ValueError(f"{where}: {condition.gauge!r} is a gauge of each optimizer: Outside judges a rank's")
        return
    read = (*condition.counts, *condition.rises)
    for name in read:
        if name not in COUNTERS:
            raise ValueError(f"{where}: {name!r} is not a counter of ampwatch.contract.counters.COUNTERS")
        if COUNTERS[name].ladder:
            raise ValueError(f"{where}: {name!r} counts per rung of the streak ladder: no condition form reads it")
    if len({COUNTERS[name].per for name in read}) > 1:
        raise ValueError(f"{where}: {', '.join(read)} are not all counters of a rank, or all of an optimizer")
