"""The values of a rank that alerts read, by name: cumulative counters, and the gauges of its latest state.

Each name is what a batch's ``state`` calls it (``state.backoffs``, ``state.optimizers[o].skipped``),
except ``conflicts``, which the collector counts itself (``ampwatch_rank_conflicts_total``). An alert
definition (:mod:`ampwatch.contract.alerts`) names the counters its condition compares over a window
and the gauges that can make it hold on their own; the collector's alert history keeps exactly those.

Example::

    from ampwatch.contract.counters import COUNTERS
    COUNTERS["skipped"].per  # "optimizer"
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

__all__ = ["RankValue", "COUNTERS", "GAUGES"]


@dataclasses.dataclass(frozen=True, slots=True)
class RankValue:
    """One value a rank reports: a counter (never goes down) or a gauge."""

    name: str
    """Its name in a batch's ``state`` (or ``state.optimizers[o]``)."""
    per: str
    """``rank`` or ``optimizer``: one value per rank, or one per optimizer of the rank."""
    meaning: str
    ladder: bool = False
    """One count per rung of ``protocol.STREAK_LADDER`` (streaks that reached at least that length)."""


COUNTERS: Mapping[str, RankValue] = {c.name: c for c in (
    RankValue("iteration", "rank", "the rank's training iteration (never lower than one it reported before)"),
    RankValue("backoffs", "rank", "loss-scale backoffs"),
    RankValue("growths", "rank", "loss-scale growths"),
    RankValue("origin_iterations", "rank", "skipped iterations whose inf/NaN started in this rank's own gradients"),
    RankValue("conflicts", "rank", "processes that claimed the rank while it was live (counted by the collector)"),
    RankValue("steps", "optimizer", "scaler.step() calls that updated the parameters"),
    RankValue("skipped", "optimizer", "scaler.step() calls that skipped"),
    RankValue("scheduler_steps_after_skip", "optimizer", "LR scheduler steps right after a skipped step"),
    RankValue("poisoned_steps", "optimizer", "updates with non-finite gradients or parameters"),
    RankValue("streaks_reached", "optimizer", "skip streaks that reached each rung's length", ladder=True),
)}
"""The cumulative counters alert conditions may compare over a window, by name."""

GAUGES: Mapping[str, RankValue] = {g.name: g for g in (
    RankValue("consecutive_skipped", "optimizer", "the current skip streak (0 when the last step updated)"),
)}
"""Values of a rank's latest state that can make a windowed alert hold while its counters stand still."""
