"""The built-in alert evaluator: each alert fires when it should and stays silent when it should not."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from ampwatch.contract.alerts import ALERT_NAMES
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server._state import RankSnapshot
from ampwatch.server._totals import OptimizerTotals, RankTotals, ladder
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch.server.alerting.history import RankHistory

LADDER = tuple(2 ** i for i in range(11))


class FakeRank:
    """Counters of one rank driven like the agent would count them (not a mock: the evaluator's input)."""

    def __init__(self, alerts: BuiltinAlerts, run: str = "exp", rank: int = 0, scale: float = 65536.0) -> None:
        self.alerts, self.run, self.rank = alerts, run, rank
        self.iteration = self.backoffs = self.growths = 0
        self.scale = scale
        self.steps = self.skipped = self.streak = 0
        self.reached: dict[int, int] = {}
        self.scheduler = self.poisoned = 0
        self.origins = 0  # skipped iterations this rank started (DDP, issue 17)
        self.closed = False

    def iterate(self, skipped: bool = False) -> None:
        """One training iteration of the single optimizer "gen" (a skip backs off the scale)."""
        self.iteration += 1
        if skipped:
            self.skipped += 1
            self.streak += 1
            if self.streak in LADDER:
                self.reached[self.streak] = self.reached.get(self.streak, 0) + 1
            self.backoffs += 1
            self.scale /= 2
        else:
            self.steps += 1
            self.streak = 0

    def snapshot(self, now: float) -> RankSnapshot:
        opt = OptimizerTotals(steps=self.steps, skipped=self.skipped, streaks_reached=ladder(self.reached),
                              scheduler_steps_after_skip=self.scheduler, poisoned_steps=self.poisoned)
        return RankSnapshot(run=self.run, rank=self.rank, last_seen=now, iteration=self.iteration,
                            loss_scale=self.scale, totals=RankTotals(backoffs=self.backoffs, growths=self.growths,
                                                                     origin_iterations=self.origins),
                            closed=self.closed, optimizers={"gen": opt}, consecutive_skipped={"gen": self.streak},
                            host=f"node-{self.rank // 8}", local_rank=self.rank % 8)

    def send(self, now: float) -> list:
        """Deliver a batch to the evaluator; return the transitions of this rank's alerts."""
        return self.alerts.observe(self.snapshot(now), now)


def names(alerts) -> list[tuple[str, str, str]]:
    return sorted((a.name, a.status, a.labels.get("severity", "")) for a in alerts)


def firing_names(alerts: BuiltinAlerts) -> set[str]:
    return {a.name for a in alerts.firing()}


def test_consecutive_skip_warning_fires_at_the_ingest_where_the_streak_reaches_the_threshold():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    for i in range(200):
        r.iterate()
    assert r.send(1000.0) == []
    for _ in range(T.skip_streak_warning - 1):
        r.iterate(skipped=True)
    assert r.send(1001.0) == []
    r.iterate(skipped=True)
    fired = r.send(1001.5)
    assert names(fired) == [("AmpConsecutiveSkippedSteps", "firing", "warning")]
    alert = fired[0]
    assert dict(alert.labels) == {"run": "exp", "rank": "0", "optimizer": "gen", "severity": "warning"}
    assert alert.starts_at == 1001.5
    assert "gen" in alert.annotations["description"] and "run exp" in alert.annotations["description"]
    assert alert.annotations["runbook_url"].endswith("ampconsecutiveskippedsteps")


def test_a_firing_alerts_text_follows_its_value_and_is_rendered_only_when_read(monkeypatch):
    from ampwatch.server.alerting import annotations

    rendered = []
    real = annotations.annotations_for
    monkeypatch.setattr(annotations, "annotations_for", lambda *a: rendered.append(a[2]) or real(*a))
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    for _ in range(T.skip_streak_warning):
        r.iterate(skipped=True)
    (fired,) = r.send(1000.0)
    assert rendered == []  # judged on every batch, rendered only when someone reads it
    assert f"current streak: {T.skip_streak_warning} skipped" in fired.annotations["description"]
    for t in range(3):  # the streak goes on: the firing alert's value and text follow it
        r.iterate(skipped=True)
        assert r.send(1001.0 + t) == []
    (firing,) = alerts.firing()
    assert firing.value == T.skip_streak_warning + 3
    assert f"current streak: {T.skip_streak_warning + 3} skipped" in firing.annotations["description"]
    assert firing.annotations == real("AmpConsecutiveSkippedSteps", firing.labels, firing.value, T, "warning")
    assert rendered == [T.skip_streak_warning, T.skip_streak_warning + 3]  # once each, the states between never


def test_critical_streak_fires_beside_the_warning_and_both_resolve_after_the_window():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=2.0 ** 80)
    for i in range(200):
        r.iterate()
    r.send(0.0)
    for _ in range(T.skip_streak_critical):
        r.iterate(skipped=True)
    assert names(r.send(1.0)) == [("AmpConsecutiveSkippedSteps", "firing", "critical"),
                                  ("AmpConsecutiveSkippedSteps", "firing", "warning")]
    r.iterate()
    # The streak ended, but the ladder keeps both alerts up for the window, as the Prometheus rule does.
    assert r.send(2.0) == []
    assert names(r.send(T.skip_streak_window_s - 1.0)) == []
    assert names(r.send(T.skip_streak_window_s + 5.0)) == [
        ("AmpConsecutiveSkippedSteps", "resolved", "critical"), ("AmpConsecutiveSkippedSteps", "resolved", "warning")]
    assert alerts.firing() == [] and len(alerts.resolved()) == 2


def test_a_streak_that_began_and_ended_between_two_batches_still_fires():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    for i in range(200):
        r.iterate()
    r.send(0.0)
    for _ in range(T.skip_streak_warning + 2):
        r.iterate(skipped=True)
    for _ in range(5):
        r.iterate()
    assert r.streak == 0
    assert names(r.send(1.0)) == [("AmpConsecutiveSkippedSteps", "firing", "warning")]


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
    assert r.send(0.0) == []
    assert r.send(T.skip_ratio_for_s + 1.0) == []
    for i in range(10):
        r.iterate(skipped=i % 4 == 0)
    assert r.send(T.skip_ratio_for_s + 2.0) == []  # now pending
    fired = r.send(2 * T.skip_ratio_for_s + 3.0)
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
    assert r.send(0.0) == []  # pending
    fired = r.send(T.skip_ratio_for_s + 1.0)
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
    assert names(fired) == [("AmpPoisonedStep", "firing", "critical"), ("AmpSchedulerStepsOnSkipped", "firing", "warning")]
    assert {a.name: a.value for a in fired} == {"AmpPoisonedStep": 2, "AmpSchedulerStepsOnSkipped": 1}
    assert names(r.send(T.scheduler_window_s + 10.0)) == [("AmpSchedulerStepsOnSkipped", "resolved", "warning")]
    assert names(r.send(T.poisoned_window_s + 10.0)) == [("AmpPoisonedStep", "resolved", "critical")]


def _origin_run(alerts: BuiltinAlerts, size: int) -> list[FakeRank]:
    ranks = [FakeRank(alerts, rank=r) for r in range(size)]
    for r in ranks:
        r.iterate()
        r.send(0.0)
    return ranks


def test_a_rank_that_keeps_starting_skips_fires_with_its_host_and_local_rank_and_resolves_after_the_window():
    alerts = BuiltinAlerts(T)
    ranks = _origin_run(alerts, 16)
    for k in range(T.origin_min_count):  # every rank skips (the all-reduce), rank 9's own gradients started it
        for r in ranks:
            r.iterate(skipped=True)
            r.origins += r.rank == 9
            r.send(10.0 + k)
        transitions = alerts.evaluate(10.0 + k)
        assert names(transitions) == ([("AmpSkipOriginRank", "firing", "warning")] if k == T.origin_min_count - 1
                                      else [])
    fired = alerts.firing()
    assert [dict(a.labels) for a in fired] == [{"run": "exp", "rank": "9", "host": "node-1", "local_rank": "1",
                                                "severity": "warning"}]
    assert fired[0].value == T.origin_min_count
    assert "host node-1, local rank 1" in fired[0].annotations["description"]
    for r in ranks:  # a rank's own batch does not resolve a run-wide judgement
        assert r.send(20.0) == []
    later = 10.0 + T.origin_window_s + 60
    for r in ranks:
        r.iterate()
        r.send(later)
    assert names(alerts.evaluate(later)) == [("AmpSkipOriginRank", "resolved", "warning")]


def test_skips_started_on_many_ranks_blame_the_job_not_a_gpu():
    alerts = BuiltinAlerts(T)
    ranks = _origin_run(alerts, 4)
    for k in range(T.origin_min_count):
        for r in ranks:
            r.iterate(skipped=True)
            r.origins += r.rank in (0, 1)  # two of four ranks: over origin_rank_share (a quarter)
            r.send(10.0 + k)
    assert alerts.evaluate(20.0) == [] and alerts.firing() == []


def test_a_rank_that_started_fewer_skips_than_the_minimum_does_not_fire():
    alerts = BuiltinAlerts(T)
    ranks = _origin_run(alerts, 2)
    for k in range(T.origin_min_count - 1):
        for r in ranks:
            r.iterate(skipped=True)
            r.origins += r.rank == 1
            r.send(10.0 + k)
    assert alerts.evaluate(20.0) == [] and alerts.firing() == []


def test_an_unchanged_firing_alert_is_announced_once():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=0.25)
    r.iterate()
    r.send(0.0)
    changes = []
    for second in range(1, 300):
        changes += r.send(float(second)) + alerts.evaluate(float(second))
    assert names(changes) == [("AmpLossScaleCollapsed", "firing", "critical")]


def test_forgetting_an_expired_rank_resolves_its_alerts():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=0.25)
    r.iterate()
    r.send(0.0)
    r.send(float(T.collapsed_for_s))
    assert firing_names(alerts) == {"AmpLossScaleCollapsed"}
    assert names(alerts.forget("exp", 0, now=100.0)) == [("AmpLossScaleCollapsed", "resolved", "critical")]
    assert alerts.evaluate(101.0) == []


def test_a_ranks_history_stays_bounded_however_long_it_reports():
    alerts = BuiltinAlerts(T, resolution_s=5.0)
    r = FakeRank(alerts)
    for tenth in range(100_000):  # ten batches a second for almost three hours
        r.iterate()
        r.send(tenth / 10)
    history = alerts._ranks[("exp", 0)]
    horizon = max(T.skip_streak_window_s, T.backoff_window_s, T.skip_ratio_window_s,
                  T.scheduler_window_s, T.poisoned_window_s, T.origin_window_s)
    assert len(history) <= 2 * horizon / 5.0 + 3


def test_a_ranks_history_keeps_counters_past_32_bits_and_counts_an_optimizer_seen_later_from_zero():
    history = RankHistory("exp", 0, horizon_s=600, resolution_s=5.0, streak_lengths=(8, 64))
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
    assert (first.iteration, first.steps("gen"), first.steps("disc"), first.backoffs) == (big, 10, 0, 3)
    assert (second.steps("gen"), second.skipped("gen")) == (big, 5)
    assert (third.steps("disc"), third.steps("gen")) == (7, big + 1)
    assert history.baseline(20.0, 100).steps("gen") == 10  # older than anything kept: the origin
    # Whether a counter rose after the baseline moment: the growth and the streak at 10 s, the poisoned step at 20 s.
    assert first.grew_since() and first.streak_reached_since("gen", 8) and not first.streak_reached_since("gen", 64)
    assert not second.grew_since() and not second.streak_reached_since("gen", 8) and second.poisoned_since("disc")
    assert not third.poisoned_since("disc") and not third.poisoned_since("gen")
    # The origin: rises after the first snapshot count.
    assert history.baseline(20.0, 100).grew_since() and history.baseline(20.0, 100).poisoned_since("disc")
    assert history.current.last_seen == 20.0 and len(history) == 3


def test_a_young_ranks_history_counts_everything_from_zero():
    history = RankHistory("exp", 0, horizon_s=600, resolution_s=5.0, streak_lengths=(8,))
    history.record(RankSnapshot(run="exp", rank=0, last_seen=0.0, iteration=3, totals=RankTotals(growths=1),
                                optimizers={"gen": OptimizerTotals(steps=3, scheduler_steps_after_skip=1)}), 100)
    origin = history.baseline(0.0, 60)
    assert (origin.iteration, origin.steps("gen")) == (0, 0)
    assert origin.grew_since() and origin.scheduler_stepped_after_skip_since("gen")
    assert not origin.streak_reached_since("gen", 8) and not origin.scheduler_stepped_after_skip_since("other")


def test_every_alert_has_severity_summary_description_and_runbook():
    alerts = BuiltinAlerts(dataclasses.replace(T, silent_for_s=0, collapsed_for_s=0, desync_for_s=0))
    a, b = FakeRank(alerts, rank=0, scale=0.25), FakeRank(alerts, rank=1)
    seen = []
    for r in (a, b):
        seen += r.send(-1.0)
        for _ in range(200):
            r.iterate()
    a.scheduler = a.poisoned = 1
    for _ in range(T.skip_streak_warning):
        a.iterate(skipped=True)
    seen += a.send(0.0) + b.send(0.0) + alerts.evaluate(0.0) + alerts.evaluate(T.silent_after_s + 1.0)
    assert {x.name for x in seen} >= {"AmpConsecutiveSkippedSteps", "AmpLossScaleCollapsed", "AmpLossScaleDesync",
                                       "AmpRankSilent", "AmpSchedulerStepsOnSkipped", "AmpPoisonedStep"}
    for x in seen:
        assert x.name in ALERT_NAMES
        assert x.labels["severity"] in ("warning", "critical")
        assert set(x.annotations) == {"summary", "description", "runbook_url"}
        assert x.labels["run"] in x.annotations["description"]


def test_evaluating_one_rank_changes_only_its_alerts_and_nothing_stays_indexed_once_all_resolved():
    from ampwatch.server.alerting.conditions import ActiveAlert
    from ampwatch.server.alerting.states import AlertStates

    def active(rank: int, name: str = "AmpConsecutiveSkippedSteps", for_s: float = 0.0) -> ActiveAlert:
        return ActiveAlert(name=name, labels={"run": "r", "rank": str(rank), "optimizer": "gen", "severity": "warning"},
                           value=16.0, for_s=for_s, annotations={})

    states = AlertStates()
    fired = [c for r in range(100) for c in states.advance([active(r)], 0.0, ("r", str(r)))]
    assert [a.labels["rank"] for a in fired] == [str(r) for r in range(100)]
    assert states.advance([active(3), active(3, "AmpHighSkippedStepRatio", for_s=60.0)], 0.5, ("r", "3")) == []
    # Rank 7 evaluated and clean: its alert resolves, no other rank's does.
    (gone,) = states.advance([], 1.0, ("r", "7"))
    assert (gone.labels["rank"], gone.ends_at) == ("7", 1.0) and len(states.firing()) == 99
    # Rank 3 evaluated with neither condition: its firing alert resolves and its pending one is dropped.
    assert [a.labels["rank"] for a in states.advance([], 2.0, ("r", "3"))] == ["3"]
    assert len(states.advance([], 3.0)) == 98  # everything evaluated, nothing holds
    assert states.firing() == [] and states._by_group == {} and states._pending == {}


# The periodic pass runs in a worker thread while batches are observed on the event loop's thread.

class _ParkingLock:
    """The evaluator's own lock, which parks the evaluating thread before its second slice of ranks.

    Not a mock: every acquire is a real lock's. It only makes the interleaving the test needs
    happen every time (the pass has read the first slice of histories; a batch arrives).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.evaluator: threading.Thread | None = None
        self.entered = 0
        self.parked, self.resume = threading.Event(), threading.Event()

    def __enter__(self) -> None:
        if threading.current_thread() is self.evaluator:
            self.entered += 1
            if self.entered == 3:  # 1: the pass took its ranks; 2: the first slice; 3: the second slice
                self.parked.set()
                assert self.resume.wait(60)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_streak_observed_during_a_pass_that_read_its_rank_before_is_not_resolved_by_that_pass():
    alerts = BuiltinAlerts()
    ranks = [FakeRank(alerts, rank=r) for r in range(600)]  # three slices of 256
    for r in ranks:
        r.iterate()
        r.send(100.0)
    lock = alerts._lock = _ParkingLock()
    transitions: list = []
    evaluating = threading.Thread(target=lambda: transitions.extend(alerts.evaluate(101.0)))
    lock.evaluator = evaluating
    evaluating.start()
    assert lock.parked.wait(60)
    # Rank 0 was read by the first slice, without a streak; its batch now carries one, which fires at once.
    for _ in range(T.skip_streak_warning):
        ranks[0].iterate(skipped=True)
    fired = ranks[0].send(101.0)
    assert [(a.name, a.status) for a in fired] == [("AmpConsecutiveSkippedSteps", "firing")]
    lock.resume.set()
    evaluating.join(60)
    assert not evaluating.is_alive()
    assert transitions == []  # the pass's older reading of rank 0 does not resolve what its batch fired
    assert [(a.name, a.labels["rank"]) for a in alerts.firing()] == [("AmpConsecutiveSkippedSteps", "0")]
    # The next pass reads the streak itself and keeps it firing.
    assert alerts.evaluate(102.0) == [] and len(alerts.firing()) == 1


def test_passes_in_a_thread_and_batches_on_another_end_in_the_same_alerts_as_one_thread_would():
    alerts, alone = BuiltinAlerts(), BuiltinAlerts()
    ranks = [FakeRank(alerts, rank=r) for r in range(1000)]
    twins = [FakeRank(alone, rank=r) for r in range(1000)]
    stop = threading.Event()
    failures: list[BaseException] = []

    def passes() -> None:
        try:
            # A pass, a short breath, the next: as the service ticks (every second there), never a tight loop that
            # would keep the evaluator's lock from the batches' thread (Python's locks are not fair).
            while not stop.wait(0.002):
                alerts.evaluate(150.0)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    evaluating = threading.Thread(target=passes)
    evaluating.start()
    try:
        for second in range(100, 150):
            for rank, twin in zip(ranks, twins):
                skip = rank.rank % 10 == 0 and second >= 120  # a tenth of the ranks start a long streak
                for r in (rank, twin):
                    r.iterate(skipped=skip)
                    r.send(float(second))
    finally:
        stop.set()
        evaluating.join(60)
    assert not failures
    alerts.evaluate(150.0)
    alone.evaluate(150.0)
    final = {(a.name, tuple(sorted(a.labels.items()))) for a in alerts.firing()}
    assert final == {(a.name, tuple(sorted(a.labels.items()))) for a in alone.firing()}
    assert any(name == "AmpConsecutiveSkippedSteps" for name, _ in final)
