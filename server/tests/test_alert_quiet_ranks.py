"""The periodic pass skips the window reads of quiet ranks, and finds exactly what reading every window finds."""

from __future__ import annotations

import random

import pytest

from ampwatch.contract.protocol import STREAK_LADDER
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server._state import RankSnapshot
from ampwatch.server._totals import OptimizerTotals, RankTotals
from ampwatch.server.alerting.conditions import evaluate, held_back, rank_alerts, rank_facts, run_alerts_of
from ampwatch.server.alerting.history import HistoryLayout, RankHistory
from ampwatch.server.alerting.rank_conditions import spoken_key

LAYOUT = HistoryLayout(T)
HORIZON = LAYOUT.horizon_s


def _history() -> RankHistory:
    return RankHistory("exp", 0, LAYOUT, 5.0)


class _Rank:
    """One rank's cumulative counters, moved by a random plan."""

    def __init__(self, rank: int, rng: random.Random, trouble: float) -> None:
        self.rank, self.rng, self.trouble = rank, rng, trouble
        self.iteration = self.steps = self.skipped = self.backoffs = self.growths = self.origin = 0
        self.sched = self.poisoned = self.conflicts = self.streak = 0
        self.scale = 65536.0

    def step(self, t: float, calibrating: bool, stalled: bool = False) -> RankSnapshot:
        rng = self.rng
        if stalled:  # hung (say mid-streak): the agent's heartbeats still come, the counters stand still
            return self._snapshot(t)
        self.iteration += 10
        if calibrating or rng.random() < self.trouble:
            self.skipped += 1
            self.streak += 1
            self.backoffs += 1
            self.scale /= 2
            self.origin += rng.random() < 0.3
            self.sched += rng.random() < 0.1
        else:
            self.steps += 10
            self.streak = 0
            self.growths += rng.random() < 0.05
        self.poisoned += rng.random() < self.trouble / 10
        self.conflicts += rng.random() < self.trouble / 20
        return self._snapshot(t)

    def _snapshot(self, t: float) -> RankSnapshot:
        reached = tuple(1 if self.streak >= n else 0 for n in STREAK_LADDER)
        return RankSnapshot(run="exp", rank=self.rank, last_seen=t, iteration=self.iteration, loss_scale=self.scale,
                            totals=RankTotals(backoffs=self.backoffs, growths=self.growths,
                                              origin_iterations=self.origin),
                            optimizers={"gen": OptimizerTotals(steps=self.steps, skipped=self.skipped,
                                                               scheduler_steps_after_skip=self.sched,
                                                               poisoned_steps=self.poisoned,
                                                               streaks_reached=reached)},
                            consecutive_skipped={"gen": self.streak}, conflicts=self.conflicts)


def _full_pass(histories: list[RankHistory], now: float) -> tuple[list, set]:
    """Every alert that holds, built rank by rank, with the keys of those a run-wide alert speaks for."""
    found, by_run = [], {}
    for h in histories:
        found.extend(rank_alerts(h, now, T))
        by_run.setdefault(h.run, []).append(rank_facts(h, now, T))
    run_wide = [a for run, ranks in by_run.items() for a in run_alerts_of(run, ranks, T)]
    held = held_back(found, run_wide)
    return [a for a in found if spoken_key(a) not in held] + run_wide, held


def _key(alert) -> tuple:
    return alert.name, tuple(sorted(alert.labels.items())), repr(alert.value)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("storm", [False, True], ids=["some-ranks", "whole-job"])
def test_a_pass_that_skips_quiet_ranks_finds_what_reading_every_window_finds(seed, storm):
    rng = random.Random(seed)
    # Most ranks healthy after calibration, a few in trouble now and then; some stop reporting (silent). In a
    # whole-job storm every rank skips often, so run-wide alerts hold and speak for the ranks' own.
    ranks = [_Rank(r, random.Random(seed * 100 + r), 0.3 if storm else rng.choice((0.0, 0.0, 0.0, 0.001, 0.02, 0.3)))
             for r in range(40)]
    held_any = False
    histories = []
    for r in ranks:
        h = _history()
        h.rank = r.rank
        histories.append(h)
    stops = {r.rank: rng.uniform(600, 9000) for r in ranks if rng.random() < 0.15}
    stalls = {r.rank: rng.uniform(600, 6000) for r in ranks if rng.random() < 0.15}
    # Some ranks send their first batch only after calibration skipped (a young first batch with skips in it).
    late = {r.rank for r in ranks if rng.random() < 0.3}
    skipped_reads = 0
    for step in range(1, 1100):  # 10 s apart, over three hours: every window fills and rolls past calibration
        t = step * 10.0
        for r, h in zip(ranks, histories, strict=True):
            if t >= stops.get(r.rank, float("inf")):
                continue
            snapshot = r.step(t, calibrating=step <= 3, stalled=t >= stalls.get(r.rank, float("inf")))
            if r.rank not in late or step > 3:
                h.record(snapshot, T.calibration_iterations)
        if step % 25 == 0:
            now = t + rng.uniform(0, 9)
            skipped_reads += sum(h.quiet(now) for h in histories)
            expected, held = _full_pass(histories, now)
            held_any |= bool(held)
            assert sorted(map(_key, evaluate(histories, now, T))) == sorted(map(_key, expected))
    assert skipped_reads > 0  # the shortcut was taken (else this test proves nothing about it)
    assert held_any == storm  # a run-wide alert held ranks' alerts back in the storm, and only there


def test_a_rank_whose_calibration_skips_are_older_than_every_window_is_quiet_but_still_goes_silent():
    h, rank = _history(), _Rank(0, random.Random(1), 0.0)
    for step in range(1, 400):
        h.record(rank.step(step * 10.0, calibrating=step <= 3), T.calibration_iterations)
    last = 399 * 10.0
    assert not h.quiet(30.0 + HORIZON - 1)  # its calibration skips are still inside the longest window
    assert h.quiet(last)
    silent = evaluate([h], last + T.silent_after_s + 1, T)
    assert [a.name for a in silent] == ["AmpRankSilent"]


def test_a_rank_in_a_streak_or_with_a_recent_poisoned_step_is_not_quiet():
    h, rank = _history(), _Rank(0, random.Random(1), 0.0)
    for step in range(1, 400):
        h.record(rank.step(step * 10.0, calibrating=False), T.calibration_iterations)
    assert h.quiet(3990.0)
    rank.poisoned += 1
    h.record(rank.step(4000.0, calibrating=False), T.calibration_iterations)
    assert not h.quiet(4000.0)
    assert "AmpPoisonedStep" in {a.name for a in evaluate([h], 4000.0, T)}


def test_the_history_keeps_what_the_alert_definitions_declare_and_its_horizon_is_their_longest_window():
    assert LAYOUT.horizon_s == max(T.skip_streak_window_s, T.backoff_window_s, T.skip_ratio_window_s,
                                   T.scheduler_window_s, T.poisoned_window_s, T.origin_window_s, T.conflict_window_s,
                                   T.spike_window_s, T.outlier_window_s)
    assert set(LAYOUT.rank_counts) == {"backoffs", "iteration", "origin_iterations"}
    assert set(LAYOUT.optimizer_counts) == {"skipped", "steps"}
    assert set(LAYOUT.rank_rises) == {("growths", None), ("conflicts", None), ("loss_spikes", None),
                                      ("gradient_outliers", None)}
    assert set(LAYOUT.optimizer_rises) == {("streaks_reached", T.skip_streak_warning),
                                           ("streaks_reached", T.skip_streak_critical),
                                           ("scheduler_steps_after_skip", None), ("poisoned_steps", None),
                                           ("grad_norm_spikes", None)}


def test_a_rank_hung_in_a_long_streak_keeps_its_streak_alert_past_every_window():
    h, rank = _history(), _Rank(0, random.Random(1), 0.0)
    for step in range(1, 400):  # clean past calibration, then a streak longer than the critical threshold
        h.record(rank.step(step * 10.0, calibrating=400 - T.skip_streak_critical - 5 <= step), T.calibration_iterations)
    assert rank.streak > T.skip_streak_critical
    for step in range(400, 400 + int(2 * HORIZON / 10)):  # then hung: heartbeats, nothing moves, for two horizons
        h.record(rank.step(step * 10.0, calibrating=False, stalled=True), T.calibration_iterations)
    now = (400 + 2 * HORIZON / 10) * 10.0
    assert not h.quiet(now)
    found = {(a.name, a.labels.get("optimizer")) for a in evaluate([h], now, T)}
    assert ("AmpConsecutiveSkippedSteps", "gen") in found
    assert sorted(map(_key, evaluate([h], now, T))) == sorted(map(_key, _full_pass([h], now)[0]))


def test_a_young_ranks_first_batch_counts_against_its_origin_until_the_window_passes():
    """A rank's first batch, still in calibration, already carries a poisoned step: every window is measured
    from zero (the origin) until the rank is older than the window."""
    h, rank = _history(), _Rank(0, random.Random(1), 0.0)
    rank.poisoned = 1
    h.record(rank.step(40.0, calibrating=True), T.calibration_iterations)
    for step in range(5, int(HORIZON / 10)):
        h.record(rank.step(step * 10.0, calibrating=False), T.calibration_iterations)
    for now in (40.0 + T.poisoned_window_s - 300, 40.0 + T.poisoned_window_s - 20):
        assert not h.quiet(now)
        assert "AmpPoisonedStep" in {a.name for a in evaluate([h], now, T)}


@pytest.mark.parametrize("seed", range(3))
def test_each_run_conditions_idle_fact_is_what_its_fact_reads_of_a_quiet_rank(seed):
    from ampwatch.server.alerting.rank_conditions import RankReading
    from ampwatch.server.alerting.run_conditions import RUN_CONDITIONS
    rng = random.Random(seed)
    histories = []
    for r in range(12):
        h, rank = _history(), _Rank(r, random.Random(seed * 50 + r), rng.choice((0.0, 0.3)))
        for step in range(1, 400):
            h.record(rank.step(step * 10.0, calibrating=step <= 3 or 200 < step < 200 + r), T.calibration_iterations)
        histories.append(h)
    now = 4000.0
    quiet = [h for h in histories if h.quiet(now)]
    assert quiet
    for name, condition in RUN_CONDITIONS.items():
        if condition.fact is not None:
            assert {condition.fact(RankReading(h, now), T) for h in quiet} == {condition.idle}, name


def test_a_job_whose_scale_stayed_collapsed_past_every_window_is_one_run_alert_when_its_ranks_are_quiet():
    # A storm of 20 skips on every rank (the scale falls from 2**16 to 2**-4), then clean steps past the longest
    # window: the ranks are quiet, their scales still collapsed. The run-wide alert still speaks for them.
    ranks = [_Rank(r, random.Random(r), 0.0) for r in range(4)]
    histories = []
    for r in ranks:
        h = _history()
        h.rank = r.rank
        for step in range(1, 60 + int(HORIZON / 10) + 5):
            h.record(r.step(step * 10.0, calibrating=30 <= step < 50), T.calibration_iterations)
        histories.append(h)
    now = (60 + HORIZON / 10 + 5) * 10.0
    assert all(h.quiet(now) for h in histories) and ranks[0].scale == 2.0 ** -4
    found = evaluate(histories, now, T)
    assert [(a.name, a.labels) for a in found] == [("AmpRunLossScaleCollapsed", {"run": "exp", "severity": "critical"})]
    assert sorted(map(_key, found)) == sorted(map(_key, _full_pass(histories, now)[0]))
