"""The values of a rank that alerts read, by name: cumulative counters, and the gauges of its latest state.

Each name is what a batch's ``state`` calls it (``state.backoffs``, ``state.optimizers[o].skipped``),
except ``conflicts`` and ``gradient_outliers``, which the collector counts itself; each value
names the series the collector exposes it as, which the Prometheus rules read. An alert definition
(:mod:`ampwatch.contract.alerts`) names the counters its condition compares over a window and the
gauges that can make it hold on their own; the collector's alert history keeps exactly those.

Example::

    from ampwatch.contract.counters import COUNTERS
    COUNTERS["skipped"].per  # "optimizer"
    str(COUNTERS["skipped"].metric)  # "ampwatch_optimizer_skipped_steps_total"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from . import metrics as m
from .metrics import Metric

__all__ = ["RankValue", "COUNTERS", "GAUGES"]


@dataclasses.dataclass(frozen=True, slots=True)
class RankValue:
    """One value a rank reports: a counter (never goes down) or a gauge."""

    name: str
    """Its name in a batch's ``state`` (or ``state.optimizers[o]``)."""
    per: str
    """``rank`` or ``optimizer``: one value per rank, or one per optimizer of the rank."""
    meaning: str
    metric: Metric
    """The series the collector exposes it as (labelled by run, rank and, per optimizer, optimizer)."""
    ladder: bool = False
    """One count per rung of ``protocol.STREAK_LADDER`` (streaks that reached at least that length)."""


COUNTERS: Mapping[str, RankValue] = {c.name: c for c in (
    RankValue("iteration", "rank", "the rank's training iteration (never lower than one it reported before)",
              m.ITERATION),
    RankValue("backoffs", "rank", "loss-scale backoffs", m.LOSS_SCALE_BACKOFFS),
    RankValue("growths", "rank", "loss-scale growths", m.LOSS_SCALE_GROWTHS),
    RankValue("origin_iterations", "rank", "skipped iterations whose inf/NaN started in this rank's own gradients",
              m.RANK_ORIGIN_ITERATIONS),
    RankValue("loss_spikes", "rank", "iterations whose loss spiked above its rolling window, or was non-finite",
              m.LOSS_SPIKES),
    RankValue("gradient_outliers", "rank", "iterations where this rank's own gradient norm stood out from the other "
              "ranks' and its own history (counted by the collector)", m.RANK_GRADIENT_OUTLIERS),
    RankValue("conflicts", "rank", "processes that claimed the rank while it was live (counted by the collector)",
              m.RANK_CONFLICTS),
    RankValue("steps", "optimizer", "scaler.step() calls that updated the parameters", m.OPTIMIZER_STEPS),
    RankValue("skipped", "optimizer", "scaler.step() calls that skipped", m.OPTIMIZER_SKIPPED_STEPS),
    RankValue("scheduler_steps_after_skip", "optimizer", "LR scheduler steps right after a skipped step",
              m.OPTIMIZER_SCHEDULER_STEPS_AFTER_SKIP),
    RankValue("poisoned_steps", "optimizer", "updates with non-finite gradients or parameters",
              m.OPTIMIZER_POISONED_STEPS),
    RankValue("grad_norm_spikes", "optimizer", "iterations whose gradient norm spiked above its rolling window, or "
              "was non-finite on a step that went through", m.OPTIMIZER_GRAD_NORM_SPIKES),
    RankValue("streaks_reached", "optimizer", "skip streaks that reached each rung's length", m.OPTIMIZER_SKIP_STREAKS,
              ladder=True),
)}
"""The cumulative counters alert conditions may compare over a window, by name."""

GAUGES: Mapping[str, RankValue] = {g.name: g for g in (
    RankValue("consecutive_skipped", "optimizer", "the current skip streak (0 when the last step updated)",
              m.OPTIMIZER_CONSECUTIVE_SKIPPED),
    RankValue("loss_scale", "rank", "the loss scale (none without an enabled GradScaler)", m.LOSS_SCALE),
    RankValue("on_suspect_device", "rank", "1 while the device the rank runs on is a suspect, else 0 (derived by "
              "the collector from its kept evidence, docs/suspects.md)", m.RANK_ON_SUSPECT_DEVICE),
)}
"""Values of a rank's latest state that alert conditions read: a windowed definition's ``gauges`` (a current streak)
can make it hold while its counters stand still; an ``Outside`` condition (:mod:`ampwatch.contract.conditions`)
judges one."""
