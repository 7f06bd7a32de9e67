"""Each rank's alert history: bounded however long it reports, exact past 32 bits, counted from zero when young."""

from __future__ import annotations

import dataclasses

import pytest

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server._state import RankSnapshot
from ampwatch.server._totals import OptimizerTotals, RankTotals, ladder
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch.server.alerting.history import HistoryLayout, RankHistory
from ampwatch_support.alert_ranks import FakeRank

# Streak alerts at 8 and 64 (rungs the history keeps), every window 600 s.
LAYOUT = HistoryLayout(dataclasses.replace(
    T, skip_streak_warning=8, skip_streak_critical=64, skip_streak_window_s=600, backoff_window_s=600,
    skip_ratio_window_s=600, scheduler_window_s=600, poisoned_window_s=600, origin_window_s=600, conflict_window_s=600))


def test_a_ranks_history_stays_bounded_however_long_it_reports():
    alerts = BuiltinAlerts(T, resolution_s=5.0)
    r = FakeRank(alerts)
    for tenth in range(100_000):  # ten batches a second for almost three hours
        r.iterate()
        r.send(tenth / 10)
    history = alerts._ranks[("exp", 0)]
    horizon = max(T.skip_streak_window_s, T.backoff_window_s, T.skip_ratio_window_s,
                  T.scheduler_window_s, T.poisoned_window_s, T.origin_window_s, T.conflict_window_s)
    assert len(history) <= 2 * horizon / 5.0 + 3


def test_a_ranks_history_keeps_counters_past_32_bits_and_counts_an_optimizer_seen_later_from_zero():
    history = RankHistory("exp", 0, LAYOUT, resolution_s=5.0)
    big = 2 ** 40

    def snap(t: float, growths: int, **optimizers: OptimizerTotals) -> RankSnapshot:
        return RankSnapshot(run="exp", rank=0, last_seen=t, iteration=big + int(t),
                            totals=RankTotals(backoffs=3, growths=growths), optimizers=optimizers)

    history.record(snap(0.0, 5, gen=OptimizerTotals(steps=10)), calibration_iterations=100)
    history.record(snap(10.0, 6, gen=OptimizerTotals(steps=big, skipped=5, streaks_reached=ladder({8: 2}))), 100)
    history.record(snap(20.0, 6, gen=OptimizerTotals(steps=big + 1),
                        disc=OptimizerTotals(steps=7, poisoned_steps=1)), 100)
    first, second, third = (history.baseline(20.0, window) for window in (20, 10, 0))
    # First seen past calibration: the first snapshot is its origin, not zero.
    assert (first.count("iteration"), first.count("steps", "gen"), first.count("steps", "disc"),
            first.count("backoffs")) == (big, 10, 0, 3)
    assert (second.count("steps", "gen"), second.count("skipped", "gen")) == (big, 5)
    assert (third.count("steps", "disc"), third.count("steps", "gen")) == (7, big + 1)
    assert history.baseline(20.0, 100).count("steps", "gen") == 10  # older than anything kept: the origin
    # Whether a counter rose after the baseline moment: the growth and the streak at 10 s, the poisoned step at 20 s.
    assert (first.rose("growths") and first.rose("streaks_reached", "gen", 8)
            and not first.rose("streaks_reached", "gen", 64))
    assert (not second.rose("growths") and not second.rose("streaks_reached", "gen", 8)
            and second.rose("poisoned_steps", "disc"))
    assert not third.rose("poisoned_steps", "disc") and not third.rose("poisoned_steps", "gen")
    # The origin: rises after the first snapshot count.
    assert history.baseline(20.0, 100).rose("growths") and history.baseline(20.0, 100).rose("poisoned_steps", "disc")
    assert history.current.last_seen == 20.0 and len(history) == 3


def test_a_young_ranks_history_counts_everything_from_zero():
    history = RankHistory("exp", 0, LAYOUT, resolution_s=5.0)
    history.record(RankSnapshot(run="exp", rank=0, last_seen=0.0, iteration=3, totals=RankTotals(growths=1),
                                optimizers={"gen": OptimizerTotals(steps=3, scheduler_steps_after_skip=1)}), 100)
    origin = history.baseline(0.0, 60)
    assert (origin.count("iteration"), origin.count("steps", "gen")) == (0, 0)
    assert origin.rose("growths") and origin.rose("scheduler_steps_after_skip", "gen")
    assert not origin.rose("streaks_reached", "gen", 8) and not origin.rose("scheduler_steps_after_skip", "other")


def test_a_baseline_bound_to_an_alert_answers_only_for_the_counters_it_declares():
    history = RankHistory("exp", 0, LAYOUT, resolution_s=5.0)
    history.record(RankSnapshot(run="exp", rank=0, last_seen=0.0, iteration=500,
                                optimizers={"gen": OptimizerTotals(steps=3, skipped=1)}), 100)
    ratio = history.since("AmpHighSkippedStepRatio", 0.0)
    assert (ratio.count("skipped", "gen"), ratio.count("steps", "gen")) == (1, 3)
    with pytest.raises(KeyError, match="'backoffs' is not among the counters its alert declares"):
        ratio.count("backoffs")
