"""Evaluate the ampwatch alert conditions from per-rank snapshots, as the Prometheus rules do, without Prometheus.

Pure: thresholds come in as an ``ampwatch.contract.thresholds.AlertThresholds``
(the one config the rules are generated from), each alert's name, severities,
``for:`` and texts from ``ampwatch.contract.alerts``; times are plain Unix
seconds passed in by the caller.

Windowed conditions (``increase(x[w])`` in PromQL) compare a rank's current
snapshot (``RankView.snapshot()``) with the counters it had ``w`` seconds ago,
kept by :class:`~.history.RankHistory`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, ContextManager, Iterable, Mapping, Optional, Sequence

from ampwatch.contract.alerts import ALERTS
from ampwatch.contract.thresholds import AlertThresholds

from .._floats import promql_divide, promql_max, promql_min
from .._state import RankSnapshot
from .annotations import AlertTexts
from .history import RankHistory

__all__ = ["ActiveAlert", "RankFacts", "usable_scale", "rank_alerts", "rank_facts", "run_alerts", "run_alerts_of",
           "evaluate"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ActiveAlert:
    """A condition that holds now; the state machine applies its ``for_s`` before it fires."""

    name: str
    labels: Mapping[str, str]
    value: float
    for_s: float
    annotations: Mapping[str, str]

    @property
    def key(self) -> tuple:
        """Return the identity of the alert (name and labels)."""
        return (self.name, tuple(sorted(self.labels.items())))

    @property
    def group(self) -> tuple:
        """Return the evaluation group that produced it: ``(run, rank)`` or ``(run,)`` (alerts judged across a run)."""
        run = self.labels["run"]
        if "rank" in self.labels and ALERTS[self.name].scope != "host":
            return (run, self.labels["rank"])
        return (run,)


def _alert(name: str, labels: dict, value: float, t: AlertThresholds, level: Optional[str] = None) -> ActiveAlert:
    definition = ALERTS[name]
    labels["severity"] = definition.severity(level).level
    return ActiveAlert(name=name, labels=labels, value=value, for_s=definition.for_seconds(t),
                       annotations=AlertTexts(name, labels, value, t, level))


def _streak_alerts(h: RankHistory, now: float, t: AlertThresholds) -> Iterable[ActiveAlert]:
    cur = h.current
    base = h.baseline(now, t.skip_streak_window_s)
    for opt_name, opt in cur.optimizers.items():
        streak = cur.consecutive_skipped.get(opt_name, 0)
        for severity in ALERTS["AmpConsecutiveSkippedSteps"].severities:
            threshold = getattr(t, severity.threshold)
            # A streak that reached the threshold and ended between two batches shows only in the ladder.
            if base.streak_reached_since(opt_name, threshold) or (streak >= threshold and not cur.closed):
                labels = {"run": cur.run, "rank": str(cur.rank), "optimizer": opt_name}
                yield _alert("AmpConsecutiveSkippedSteps", labels, streak, t, severity.level)


def _window_alerts(h: RankHistory, now: float, t: AlertThresholds) -> Iterable[ActiveAlert]:
    cur = h.current
    ratio_base = h.baseline(now, t.skip_ratio_window_s)
    sched_base = h.baseline(now, t.scheduler_window_s)
    poison_base = h.baseline(now, t.poisoned_window_s)
    for opt_name, opt in cur.optimizers.items():
        labels = {"run": cur.run, "rank": str(cur.rank), "optimizer": opt_name}
        skipped = opt.skipped - ratio_base.skipped(opt_name)
        stepped = opt.steps - ratio_base.steps(opt_name)
        calls = skipped + stepped
        if calls >= max(t.skip_ratio_min_steps, 1) and skipped / calls >= t.skip_ratio:
            yield _alert("AmpHighSkippedStepRatio", dict(labels), skipped / calls, t)
        if sched_base.scheduler_stepped_after_skip_since(opt_name):
            yield _alert("AmpSchedulerStepsOnSkipped", dict(labels), opt.scheduler_steps_after_skip, t)
        if poison_base.poisoned_since(opt_name):
            yield _alert("AmpPoisonedStep", dict(labels), opt.poisoned_steps, t)


def usable_scale(scale: float, t: AlertThresholds) -> bool:
    """Return whether a loss scale still works: finite and at least ``collapsed_loss_scale``.

    Below it (0 included) gradients are no longer scaled up; NaN and +Inf scale every loss to a
    non-finite one, so every step skips and backoffs cannot bring the scale back.
    """
    return t.collapsed_loss_scale <= scale < math.inf


def rank_alerts(h: RankHistory, now: float, t: AlertThresholds) -> list[ActiveAlert]:
    """Return the alerts of one rank that hold at ``now`` (streaks, ratio, collapse, silence, scheduler, poison,
    conflict)."""
    cur = h.current
    labels = {"run": cur.run, "rank": str(cur.rank)}
    found = list(_streak_alerts(h, now, t))
    found.extend(_window_alerts(h, now, t))
    if h.baseline(now, t.conflict_window_s).conflicted_since():
        found.append(_alert("AmpRankConflict", dict(labels), cur.conflicts, t))
    found.extend(_state_alerts(cur, now, t))
    return found


def _state_alerts(cur: RankSnapshot, now: float, t: AlertThresholds) -> list[ActiveAlert]:
    """The alerts of one rank's latest state alone, no window: scale collapsed, rank silent."""
    if cur.closed:
        # A rank that closed cleanly is finished: its last scale and silence are not trouble.
        return []
    found = []
    labels = {"run": cur.run, "rank": str(cur.rank)}
    if cur.scaler_enabled and cur.loss_scale is not None and not usable_scale(cur.loss_scale, t):
        found.append(_alert("AmpLossScaleCollapsed", dict(labels), cur.loss_scale, t))
    silent_for = now - cur.last_seen
    if silent_for > t.silent_after_s:
        found.append(_alert("AmpRankSilent", labels, silent_for, t))
    return found


def _windows_need_moves(t: AlertThresholds) -> bool:
    """Whether every window alert needs a counter to move (a ratio or count threshold above 0), so that a
    :meth:`~.history.RankHistory.quiet` rank has none."""
    return t.skip_ratio > 0 and t.backoff_min_count > 0 and t.origin_min_count > 0


@dataclasses.dataclass(frozen=True, slots=True)
class RankFacts:
    """What the run-wide alerts need of one rank at ``now``: its snapshot and two window counts (no history)."""

    current: RankSnapshot
    origin_started: int
    """Skipped iterations the rank started (its own gradients non-finite before DDP's all-reduce) in the window."""
    backing_off: bool
    """Backed off often enough without growing over the backoff window, once past calibration."""


def rank_facts(h: RankHistory, now: float, t: AlertThresholds) -> RankFacts:
    """Read from one rank's history what :func:`run_alerts_of` needs; costs three baseline look-ups."""
    cur = h.current
    origin = h.baseline(now, t.origin_window_s)
    base = h.baseline(now, t.backoff_window_s)
    # Calibration backoffs at start-up are normal (GRADSCALER.md claim 11): a rank counts only once its
    # whole window is past calibration (a rank younger than the window has a zero baseline).
    backing_off = base.iteration >= t.calibration_iterations and \
        cur.totals.backoffs - base.backoffs >= t.backoff_min_count and not base.grew_since()
    return RankFacts(cur, cur.totals.origin_iterations - origin.origin_iterations, backing_off)


def _origin_alerts(ranks: list[RankFacts], open_ranks: int, t: AlertThresholds) -> Iterable[ActiveAlert]:
    # An open rank that started enough skipped iterations in the window alerts while few of the run's ranks
    # started any.
    starting = sum(1 for f in ranks if f.origin_started > 0)
    if not starting or starting > max(open_ranks * t.origin_rank_share, 1):
        return
    for f in ranks:
        cur = f.current
        if f.origin_started >= t.origin_min_count and not cur.closed:
            labels = {"run": cur.run, "rank": str(cur.rank), "host": cur.host, "local_rank": str(cur.local_rank)}
            yield _alert("AmpSkipOriginRank", labels, f.origin_started, t)


def run_alerts(run: str, ranks: Iterable[RankHistory], now: float, t: AlertThresholds) -> list[ActiveAlert]:
    """Return the alerts of one run across its open ranks (sustained backoff, scale desync, skip origin).

    Open means not closed cleanly (a silent rank still counts until the collector expires it), as in the rules.
    """
    return run_alerts_of(run, [rank_facts(h, now, t) for h in ranks], t)


def run_alerts_of(run: str, ranks: list[RankFacts], t: AlertThresholds) -> list[ActiveAlert]:
    """Return the run-wide alerts of ``run`` from its ranks' :func:`rank_facts` (pure: no history read)."""
    open_ranks = [f for f in ranks if not f.current.closed]
    if not open_ranks:
        return []
    found = list(_origin_alerts(ranks, len(open_ranks), t))
    backing_off = sum(1 for f in open_ranks if f.backing_off)
    share = backing_off / len(open_ranks)
    if backing_off and share >= t.backoff_rank_share:
        found.append(_alert("AmpSustainedLossScaleBackoff", {"run": run}, share, t))
    scales = [f.current.loss_scale for f in open_ranks
              if f.current.scaler_enabled and f.current.loss_scale is not None]
    if len(scales) >= 2:
        # max / min as PromQL computes it: a rank at 0 or +Inf beside a finite one is apart by +Inf.
        spread = promql_divide(promql_max(scales), promql_min(scales))
        if spread >= t.desync_scale_ratio:
            found.append(_alert("AmpLossScaleDesync", {"run": run}, spread, t))
    return found


def evaluate(histories: Sequence[RankHistory], now: float, t: AlertThresholds,
             hold: Callable[[], ContextManager] = contextlib.nullcontext, slice_size: int = 128,
             between: Callable[[], object] = lambda: None) -> list[ActiveAlert]:
    """Return every alert that holds at ``now`` over all ranks and runs; O(ranks), ~20 us a rank, ~3 us a quiet one.

    The histories are read in slices of ``slice_size`` ranks, each inside ``hold()`` (the
    evaluator's lock), so whoever records into a history waits for one slice, not the whole pass;
    ``between()`` runs between two slices, outside the lock (a pass in a worker thread sleeps there,
    handing the GIL to the event loop); the run-wide alerts are then judged from what the slices
    read, outside it.
    """
    by_run: dict[str, list[RankFacts]] = {}
    found: list[ActiveAlert] = []
    skip_quiet = _windows_need_moves(t)
    for first in range(0, len(histories), slice_size):
        if first:
            between()
        with hold():
            for h in histories[first:first + slice_size]:
                if skip_quiet and h.quiet(now):  # no window alert can hold: only the state's own
                    found.extend(_state_alerts(h.current, now, t))
                    by_run.setdefault(h.run, []).append(RankFacts(h.current, 0, False))
                    continue
                found.extend(rank_alerts(h, now, t))
                by_run.setdefault(h.run, []).append(rank_facts(h, now, t))
    for run, ranks in by_run.items():
        found.extend(run_alerts_of(run, ranks, t))
    return found
