"""The built-in alert evaluator: each alert fires when it should and stays silent when it should not."""

from __future__ import annotations

import dataclasses

import pytest

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch_support.alert_ranks import FakeRank, healthy_job, names

# What a test of one alert compares: its own instances, not what its ranks trip besides (a streak backs off too).
STREAK, RATIO = "AmpConsecutiveSkippedSteps", "AmpHighSkippedStepRatio"


def test_consecutive_skip_warning_fires_at_the_ingest_where_the_streak_reaches_the_threshold():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    for _ in range(200):
        r.iterate()
    assert r.send(1000.0) == []
    for _ in range(T.skip_streak_warning - 1):
        r.iterate(skipped=True)
    assert names(r.send(1001.0), STREAK) == []
    r.iterate(skipped=True)
    fired = [a for a in r.send(1001.5) if a.name == STREAK]
    assert names(fired) == [("AmpConsecutiveSkippedSteps", "firing", "warning")]
    alert = fired[0]
    assert dict(alert.labels) == {"run": "exp", "rank": "0", "optimizer": "gen", "severity": "warning"}
    assert alert.starts_at == 1001.5
    assert "gen" in alert.annotations["description"] and "run exp" in alert.annotations["description"]
    assert alert.annotations["runbook_url"].endswith("ampconsecutiveskippedsteps")




def test_critical_streak_fires_beside_the_warning_and_both_resolve_after_the_window():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=2.0 ** 80)
    for _ in range(200):
        r.iterate()
    r.send(0.0)
    for _ in range(T.skip_streak_critical):
        r.iterate(skipped=True)
    assert names(r.send(1.0), STREAK) == [("AmpConsecutiveSkippedSteps", "firing", "critical"),
                                          ("AmpConsecutiveSkippedSteps", "firing", "warning")]
    r.iterate()
    # The streak ended, but the ladder keeps both alerts up for the window, as the Prometheus rule does.
    assert names(r.send(2.0), STREAK) == []
    assert names(r.send(T.skip_streak_window_s - 1.0), STREAK) == []
    assert names(r.send(T.skip_streak_window_s + 5.0), STREAK) == [
        ("AmpConsecutiveSkippedSteps", "resolved", "critical"), ("AmpConsecutiveSkippedSteps", "resolved", "warning")]
    assert names(alerts.firing(), STREAK) == [] and len(names(alerts.resolved(), STREAK)) == 2


def test_a_streak_that_began_and_ended_between_two_batches_still_fires():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    for _ in range(200):
        r.iterate()
    r.send(0.0)
    for _ in range(T.skip_streak_warning + 2):
        r.iterate(skipped=True)
    for _ in range(5):
        r.iterate()
    assert r.streak == 0
    assert names(r.send(1.0), STREAK) == [("AmpConsecutiveSkippedSteps", "firing", "warning")]


def test_one_isolated_skip_fires_nothing():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    now = 0.0
    for second in range(600):
        for _ in range(2):
            r.iterate(skipped=(second == 300))
        now = float(second)
        assert r.send(now) == []
    assert alerts.evaluate(now) == [] and alerts.firing() == []


def test_early_calibration_backoffs_do_not_count_as_sustained_backoff():
    # Two ranks back off 8 times in their first iterations (init 2**16 calibrating), then train cleanly.
    alerts = BuiltinAlerts(T)
    ranks = [FakeRank(alerts, rank=i) for i in range(2)]
    for second in range(T.calibration_iterations + T.backoff_window_s + T.backoff_for_s + 60):
        for r in ranks:
            r.iterate(skipped=r.iteration < 8)
            r.send(float(second))
        assert alerts.evaluate(float(second)) == []
    assert ranks[0].backoffs == 8 and ranks[0].growths == 0


def _backoff_storm(alerts: BuiltinAlerts, ranks: list, bad: list, seconds: int, start: float = 0.0) -> list:
    """Train ranks one iteration a second; ranks in ``bad`` skip every 30th iteration after calibration."""
    changes = []
    for second in range(seconds):
        now = start + second
        for r in ranks:
            r.iterate(skipped=r.rank in bad and r.iteration > T.calibration_iterations and r.iteration % 30 == 0)
            changes += r.send(now)
        changes += alerts.evaluate(now)
    return changes


def test_sustained_backoff_on_most_ranks_fires_after_its_for_duration_and_resolves_on_growth():
    alerts = BuiltinAlerts(T)
    ranks = [FakeRank(alerts, rank=i) for i in range(4)]
    # A rank counts once its whole window is past calibration, as in the rules; then for_s must pass.
    before = T.calibration_iterations + T.backoff_window_s + T.backoff_for_s - 5
    changes = _backoff_storm(alerts, ranks, bad=[0, 1, 2], seconds=before)
    assert "AmpSustainedLossScaleBackoff" not in {a.name for a in changes}
    changes = _backoff_storm(alerts, ranks, bad=[0, 1, 2], seconds=10, start=float(before))
    fired = [a for a in changes if a.name == "AmpSustainedLossScaleBackoff"]
    assert [(a.status, dict(a.labels)) for a in fired] == [("firing", {"run": "exp", "severity": "warning"})]
    assert fired[0].value == pytest.approx(0.75)
    for r in ranks:
        r.growths += 1
        r.scale *= 2
        r.send(5000.0)
    resolved = [a for a in alerts.evaluate(5000.0) if a.name == "AmpSustainedLossScaleBackoff"]
    assert [a.status for a in resolved] == ["resolved"]


def test_repeated_backoff_on_a_single_rank_of_four_does_not_fire_the_run_alert():
    alerts = BuiltinAlerts(T)
    ranks = [FakeRank(alerts, rank=i) for i in range(4)]
    changes = _backoff_storm(alerts, ranks, bad=[3],
                             seconds=T.calibration_iterations + T.backoff_window_s + T.backoff_for_s + 60)
    assert ranks[3].backoffs >= 10
    assert "AmpSustainedLossScaleBackoff" not in {a.name for a in changes}


def test_a_collector_restart_does_not_mistake_old_backoffs_for_new_ones():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    for _ in range(5000):
        r.iterate(skipped=(_ % 500 == 499))
    assert r.backoffs >= T.backoff_min_count
    for second in range(T.backoff_for_s + 10):
        r.iterate()
        r.send(float(second))
        assert alerts.evaluate(float(second)) == []


def test_collapsed_scale_fires_only_after_lasting_its_for_duration():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=0.5)
    for _ in range(200):
        r.iterate()
    assert r.send(0.0) == []
    assert r.send(T.collapsed_for_s - 1.0) == []
    fired = r.send(float(T.collapsed_for_s))
    assert names(fired) == [("AmpLossScaleCollapsed", "firing", "critical")]
    assert fired[0].value == 0.5
    r.scale = 4.0
    assert names(r.send(T.collapsed_for_s + 1.0)) == [("AmpLossScaleCollapsed", "resolved", "critical")]


@pytest.mark.parametrize("scale", [0.0, 2.0 ** -149, -1.0, float("nan"), float("inf")],
                         ids=["zero", "float32-subnormal", "negative", "nan", "inf"])
def test_a_scale_of_zero_subnormal_negative_nan_or_infinity_collapses(scale):
    # The float32 scale reaches 0.0 after ~166 backoffs in a row from 2**16; at 0, NaN or +Inf every step skips.
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=scale)
    r.iterate()
    assert r.send(0.0) == []
    fired = r.send(float(T.collapsed_for_s))
    assert names(fired) == [("AmpLossScaleCollapsed", "firing", "critical")]
    assert fired[0].value == scale or scale != scale and fired[0].value != fired[0].value
    assert fired[0].to_json()["value"] == {"nan": "NaN", "inf": "Infinity"}.get(repr(scale), scale)


@pytest.mark.parametrize("scale", [1.0, 65536.0, 2.0 ** 127])
def test_a_finite_scale_of_at_least_one_never_collapses(scale):
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=scale)
    r.iterate()
    assert r.send(0.0) == [] and r.send(float(T.collapsed_for_s) + 1) == []


def test_a_rank_at_zero_beside_a_healthy_one_is_out_of_sync_but_ranks_all_at_zero_or_nan_agree():
    # As PromQL: max / min with min 0 is +Inf; 0 / 0 and NaN / NaN are NaN, which is not >= the ratio.
    for scales, expected in (((65536.0, 0.0), float("inf")), ((0.0, 0.0), None),
                             ((float("nan"), float("nan")), None), ((float("inf"), 65536.0), float("inf")),
                             ((float("nan"), 1024.0, 256.0), 4.0)):
        alerts = BuiltinAlerts(T)
        ranks = [FakeRank(alerts, rank=i, scale=scale) for i, scale in enumerate(scales)]
        fired = []
        for second in (0.0, float(T.desync_for_s)):
            for r in ranks:
                r.send(second)
            fired += alerts.evaluate(second)
        assert [a.value for a in fired if a.name == "AmpLossScaleDesync"] == ([expected] if expected else []), scales


def test_a_single_ranks_transient_scale_blip_does_not_fire_desync_but_a_lasting_one_does():
    alerts = BuiltinAlerts(T)
    a, b = FakeRank(alerts, rank=0), FakeRank(alerts, rank=1)
    for second in range(40):
        for r in (a, b):
            r.iterate()
        b.scale = 65536.0 / 4 if 10 <= second < 20 else 65536.0  # rank 1 lags for 10 s, then agrees again
        a.send(float(second)), b.send(float(second))
        assert alerts.evaluate(float(second)) == []
    b.scale = 65536.0 / 4
    fired = []
    for second in range(40, 40 + T.desync_for_s + 1):
        a.send(float(second)), b.send(float(second))
        fired += alerts.evaluate(float(second))
    assert names(fired) == [("AmpLossScaleDesync", "firing", "warning")]
    assert fired[0].value == 4.0 and dict(fired[0].labels) == {"run": "exp", "severity": "warning"}


def test_a_high_skipped_step_ratio_fires_but_not_below_the_minimum_number_of_steps():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=2.0 ** 100)
    r.send(-1.0)
    for i in range(T.skip_ratio_min_steps - 1):
        r.iterate(skipped=i % 4 == 0)  # 25% skipped, but too few calls to judge
    assert names(r.send(0.0), RATIO) == []
    assert names(r.send(T.skip_ratio_for_s + 1.0), RATIO) == []
    for i in range(10):
        r.iterate(skipped=i % 4 == 0)
    assert names(r.send(T.skip_ratio_for_s + 2.0), RATIO) == []  # now pending
    fired = [a for a in r.send(2 * T.skip_ratio_for_s + 3.0) if a.name == RATIO]
    assert names(fired) == [("AmpHighSkippedStepRatio", "firing", "warning")]
    assert fired[0].value == pytest.approx(r.skipped / (r.skipped + r.steps))


def test_a_skipped_step_ratio_exactly_at_the_threshold_fires_as_the_rules_greater_or_equal_does():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=2.0 ** 100)
    r.send(-1.0)
    calls, every = T.skip_ratio_min_steps, round(1 / T.skip_ratio)
    for i in range(calls):
        r.iterate(skipped=i % every == 0)  # one call in ten skips: exactly the threshold
    assert r.skipped / calls == T.skip_ratio
    assert names(r.send(0.0), RATIO) == []  # pending
    fired = [a for a in r.send(T.skip_ratio_for_s + 1.0) if a.name == RATIO]
    assert names(fired) == [("AmpHighSkippedStepRatio", "firing", "warning")]
    assert fired[0].value == T.skip_ratio


def test_a_silent_rank_fires_after_silence_plus_for_and_resolves_when_it_reports_again():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    r.iterate()
    r.send(0.0)
    for second in range(1, T.silent_after_s + T.silent_for_s + 1):  # evaluated every second, as the collector does
        assert alerts.evaluate(float(second)) == []
    fired = alerts.evaluate(T.silent_after_s + T.silent_for_s + 1.0)
    assert names(fired) == [("AmpRankSilent", "firing", "warning")]
    assert dict(fired[0].labels) == {"run": "exp", "rank": "0", "severity": "warning"}
    assert names(r.send(1000.0)) == [("AmpRankSilent", "resolved", "warning")]


def test_a_run_that_closed_cleanly_raises_neither_silence_nor_desync():
    alerts = BuiltinAlerts(T)
    a, b = FakeRank(alerts, rank=0), FakeRank(alerts, rank=1)
    for r in (a, b):
        r.iterate()
        r.closed = True
    b.scale = 1.0
    a.send(0.0), b.send(0.0)
    for now in (10.0, 400.0, 4000.0):
        assert alerts.evaluate(now) == []


def test_scheduler_steps_after_skips_and_poisoned_steps_fire_at_once_and_resolve_after_their_windows():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    r.iterate()
    r.send(0.0)
    r.scheduler, r.poisoned = 1, 2
    fired = r.send(1.0)
    assert names(fired) == [("AmpPoisonedStep", "firing", "critical"),
                            ("AmpSchedulerStepsOnSkipped", "firing", "warning")]
    assert {a.name: a.value for a in fired} == {"AmpPoisonedStep": 2, "AmpSchedulerStepsOnSkipped": 1}
    assert names(r.send(T.scheduler_window_s + 10.0)) == [("AmpSchedulerStepsOnSkipped", "resolved", "warning")]
    assert names(r.send(T.poisoned_window_s + 10.0)) == [("AmpPoisonedStep", "resolved", "critical")]


def test_a_whole_job_storm_is_one_run_alert_that_fires_and_resolves_and_no_rank_alert_of_it_ever_fires():
    t = dataclasses.replace(T, skip_streak_window_s=60)  # the storm lingers a minute, not ten
    alerts = BuiltinAlerts(t)
    ranks = healthy_job(alerts, 64)
    transitions = []
    # Every rank skips 20 in a row together; their batches straddle a pass, as a lockstep burst does.
    for r in ranks:
        for _ in range(20):
            r.iterate(skipped=True)
        transitions += r.send(10.0)
        if r.rank == 20:
            transitions += alerts.evaluate(10.2)
    for second in range(11, 14):
        transitions += alerts.evaluate(float(second))
    for r in ranks:  # the storm passes
        r.iterate()
        transitions += r.send(14.0)
    now = 14.0
    while now < 14.0 + t.skip_streak_window_s + 5:
        now += 1.0
        if now % 15 == 0:  # heartbeats
            for r in ranks:
                transitions += r.send(now)
        transitions += alerts.evaluate(now)
    storm = ("AmpRunSkipStorm", "AmpConsecutiveSkippedSteps", "AmpLossScaleCollapsed")
    transitions = [a for a in transitions if a.name in storm]  # (20 backoffs in a row do back off the scale)
    assert [(a.name, a.status, a.labels["severity"], a.value) for a in transitions] == [
        ("AmpRunSkipStorm", "firing", "warning", 1.0), ("AmpRunSkipStorm", "resolved", "warning", 1.0)]
    assert "100% of the ranks of run exp" in transitions[0].annotations["description"]


def test_a_job_whose_scale_collapses_for_a_minute_is_one_alert_per_trouble_and_a_rank_that_stands_out_keeps_its_own():
    # The streaks and collapses, per rank and run-wide (not what the job's backoffs trip besides).
    storm = (STREAK, "AmpRunSkipStorm", "AmpLossScaleCollapsed", "AmpRunLossScaleCollapsed")
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 8)
    for _ in range(T.skip_streak_warning):  # rank 3 stands out: in a streak of its own before the job's storm
        ranks[3].iterate(skipped=True)
    first = [a for a in ranks[3].send(5.0) + alerts.evaluate(5.5) if a.name in storm]
    assert first == []  # a rank of a job of several: a second look first
    first = [a for a in alerts.evaluate(6.5) if a.name in storm]
    assert [(a.name, a.labels["rank"], a.labels["severity"]) for a in first] == \
        [("AmpConsecutiveSkippedSteps", "3", "warning")]
    transitions, now = [], 10.0
    while now <= 70.0:  # a minute of every rank skipping at a scale of 0, two iterations a second
        for r in ranks:
            for _ in range(2):
                r.iterate(skipped=True)
            r.scale = 0.0
            transitions += r.send(now)
        transitions += alerts.evaluate(now + 0.5)
        now += 1.0
    changes = [(a.name, a.status, a.labels.get("rank", ""), a.labels["severity"]) for a in transitions
               if a.name in storm]
    # One storm alert per severity speaks for every rank's streaks, one collapse alert for every rank's collapsed
    # scale (it lasts 60 s: past its for, it would fire on each rank). Rank 3 stood out: its warning went first,
    # its critical too, while the job was at warning; each resolves into the storm once the storm reaches its
    # severity.
    assert changes == [("AmpRunSkipStorm", "firing", "", "warning"),
                       ("AmpConsecutiveSkippedSteps", "resolved", "3", "warning"),
                       ("AmpConsecutiveSkippedSteps", "firing", "3", "critical"),
                       ("AmpRunLossScaleCollapsed", "firing", "", "critical"),
                       ("AmpRunSkipStorm", "firing", "", "critical"),
                       ("AmpConsecutiveSkippedSteps", "resolved", "3", "critical")]
    assert "100% of the ranks of run exp have a loss scale below 1" in \
        next(a for a in transitions if a.name == "AmpRunLossScaleCollapsed").annotations["description"]
