"""The counter plausibility bound: a batch whose counters rose faster than any training loop counts is refused.

Counters are cumulative, so one forged batch could raise a rank's totals for good (a skip counter
by 10^12). Each counter may rise, from one batch of a process to its next, by at most
``rate`` (``--max-counter-rate``, per second) times the time between the two batches, plus a
minute's worth. That time is the agent's own clock: each batch carries ``sent_at``, stamped when
it was built, so an agent cut off for an hour, or replaying its spool, sends batches whose counters
rose by an hour's worth over an hour of ``sent_at``, however fast they arrive. The collector's
clock bounds what a batch may claim: ``sent_at`` counts as at most :data:`CLOCK_SKEW_S` after the
batch arrived, and the previous batch's as at most :data:`FIRST_BATCH_SPAN_S` before it arrived.
A process's first batch may hold :data:`FIRST_BATCH_SPAN_S` worth (a day: it may have run that
long before it reached the collector).

A rank's processes run one after another, so the same bound holds for the rank as a whole: its totals
over every process may reach at most ``rate`` times the time since the collector first saw the rank,
plus :data:`FIRST_BATCH_SPAN_S` and :data:`FLOOR_S` worth. Without it each new process (a fresh
incarnation id costs nothing) would bring another day's worth.
"""

from __future__ import annotations

from ._incarnation import Incarnation
from ._state import RankView
from ._totals import OptimizerTotals, RankTotals

__all__ = ["implausible_rise", "CLOCK_SKEW_S", "FIRST_BATCH_SPAN_S", "FLOOR_S"]

CLOCK_SKEW_S = 300.0
"""How far ahead of the collector's clock an agent's clock may run."""
FIRST_BATCH_SPAN_S = 86400.0
"""The longest a process may run, or a batch wait, before the collector hears of it."""
FLOOR_S = 60.0
"""Every batch may add this many seconds' worth, whatever its clock says."""

_NONE = OptimizerTotals()
_NO_RANK = RankTotals()


def implausible_rise(old: Incarnation | None, new: Incarnation, now: float, rate: float,
                     rank: RankView | None = None) -> str | None:
    """Return why ``new.batch`` (the next of process ``old``, or its first) is implausible, else None.

    ``new`` is :func:`~._incarnation.next_incarnation` of ``old`` and the batch, so its counters are the batch's
    counted once for both: the batch's own, none lower than ``old``'s. A counter the batch lowered rises
    by 0 here, which the bound (always above 0) never refuses, as it would not refuse a fall.
    ``rank``: the rank's view before the batch, whose totals over every process are bounded too.
    ``rate`` 0 turns the bound off. Costs one pass over the counters.
    """
    if rate <= 0:
        return None
    batch = new.batch
    if old is None:
        span, over = FIRST_BATCH_SPAN_S, f"over a process's first batch ({FIRST_BATCH_SPAN_S:.0f} s' worth at most)"
    else:
        built = min(batch.sent_at, now + CLOCK_SKEW_S)
        before = max(old.batch.sent_at, old.last_seen - FIRST_BATCH_SPAN_S)
        span = max(0.0, built - before)
        over = f"over the {span:.0f} s between this process's batches (their sent_at)"
    allowed = rate * (FLOOR_S + span)
    lived = max(0.0, now - rank.first_seen) if rank is not None and rank.incarnations else 0.0
    allowed_total = rate * (FIRST_BATCH_SPAN_S + FLOOR_S + lived)
    found = _first_over(old, new, rank, allowed, allowed_total)
    if found is None:
        return None
    name, rise, total = found
    if rise > allowed:
        return (f"counter {name} rose by {rise} in one batch, over this collector's plausibility bound of "
                f"{allowed:.0f}: {rate:g} per second (--max-counter-rate) {over}, plus {FLOOR_S:.0f} s' worth. "
                f"No training loop counts that fast; if yours does, raise --max-counter-rate")
    return (f"counter {name} would reach {total} over all the processes of rank {new.batch.rank}, over this "
            f"collector's plausibility bound of {allowed_total:.0f} for one rank: {rate:g} per second "
            f"(--max-counter-rate) over the {lived:.0f} s since the collector first saw it, plus "
            f"{FIRST_BATCH_SPAN_S + FLOOR_S:.0f} s' worth. A rank's processes run one after another, so no "
            "training job counts that fast; if yours does, raise --max-counter-rate")


def _first_over(old: Incarnation | None, new: Incarnation, rank: RankView | None, allowed: float,
                allowed_total: float) -> tuple[str, int, int] | None:
    """Return (counter name, rise since ``old``, the rank's total after the rise) of the first counter of the
    batch past either bound, else None; names are formatted only for that one (this runs for every batch)."""
    rise = new.batch.state.iteration - (old.batch.state.iteration if old else 0)
    if rise > allowed:
        return "state.iteration", rise, 0
    found = _over(None, new.totals, old.totals if old else _NO_RANK, rank.totals if rank is not None else _NO_RANK,
                  allowed, allowed_total)
    for name in new.batch.state.optimizers:
        if found is not None:
            return found
        before = old.optimizers.get(name, _NONE) if old else _NONE
        total = rank.optimizer_totals.get(name, _NONE) if rank is not None else _NONE
        found = _over(name, new.optimizers[name], before, total, allowed, allowed_total)
    return found


def _over(optimizer: str | None, new: RankTotals | OptimizerTotals, old: RankTotals | OptimizerTotals,
          total: RankTotals | OptimizerTotals, allowed: float, allowed_total: float
          ) -> tuple[str, int, int] | None:
    if new is old:
        return None
    for field, a, b, t in zip(new.__dataclass_fields__, new._values(), old._values(),
                              total._values(), strict=True):
        if a is b or a == b:
            continue
        if isinstance(a, tuple):
            rise = max(x - y for x, y in zip(a, b, strict=True))
            after = max(z + x - y for x, y, z in zip(a, b, t, strict=True))
        else:
            rise, after = a - b, t + a - b
        if rise > allowed or (rise > 0 and after > allowed_total):
            where = "state" if optimizer is None else f"state.optimizers[{optimizer!r}]"
            return f"{where}.{field}", rise, after
    return None
