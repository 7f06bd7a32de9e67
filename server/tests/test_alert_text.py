"""The built-in alerts' texts: the Prometheus rules' texts, filled in as Prometheus does, rendered only when read."""

from __future__ import annotations

import dataclasses

import pytest

from ampwatch.contract.alerts import ALERT_NAMES
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds
from ampwatch.dashboards.rules import alerting_rules
from ampwatch.server.alerting.annotations import annotations_for
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch_support.alert_ranks import FakeRank

T = DEFAULT_THRESHOLDS

SHORT = AlertThresholds(skip_streak_warning=4, skip_streak_critical=8, skip_streak_window_s=6, backoff_window_s=60,
                        backoff_min_count=5, collapsed_loss_scale=0.5, skip_ratio_window_s=90)
LABELS = {"run": "exp-1", "rank": "3", "optimizer": "gen", "host": "node-7", "local_rank": "3", "device": "GPU-1"}


def _fill(template: str, value: float, percent: str, duration: str) -> str:
    """Fill a rule's Go template the way Prometheus would for these labels and this value."""
    for label, text in LABELS.items():
        template = template.replace(f"{{{{ $labels.{label} }}}}", text)
    return (template.replace("{{ $value | humanizePercentage }}", percent)
            .replace("{{ $value | humanizeDuration }}", duration).replace("{{ $value }}", f"{value:g}"))


@pytest.mark.parametrize("t", [DEFAULT_THRESHOLDS, SHORT], ids=["default", "short"])
def test_every_built_in_alert_says_what_its_prometheus_rule_says(t):
    rules = alerting_rules(t)
    assert {rule["alert"] for rule in rules} == set(ALERT_NAMES)
    for rule in rules:
        name = rule["alert"]
        value, percent, duration = (0.75, "75%", "0.75s") if name != "AmpRankSilent" else (125.0, "12500%", "2m 5s")
        ours = annotations_for(name, LABELS, value, t, rule["labels"]["severity"])
        expected = {key: _fill(text, value, percent, duration) for key, text in rule["annotations"].items()}
        assert ours == expected, name
        assert "{" not in ours["summary"] + ours["description"], name  # nothing left unfilled


def test_a_firing_alerts_text_follows_its_value_and_is_rendered_only_when_read(monkeypatch):
    from ampwatch.server.alerting import annotations

    rendered = []
    real = annotations.annotations_for
    monkeypatch.setattr(annotations, "annotations_for", lambda *a: rendered.append(a[2]) or real(*a))
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts)
    for _ in range(T.skip_streak_warning):
        r.iterate(skipped=True)
    (fired,) = [a for a in r.send(1000.0) if a.name == "AmpConsecutiveSkippedSteps"]  # (its skips back off too)
    assert rendered == []  # judged on every batch, rendered only when someone reads it
    assert f"current streak: {T.skip_streak_warning} skipped" in fired.annotations["description"]
    for t in range(3):  # the streak goes on: the firing alert's value and text follow it
        r.iterate(skipped=True)
        assert [a for a in r.send(1001.0 + t) if a.name == "AmpConsecutiveSkippedSteps"] == []
    (firing,) = [a for a in alerts.firing() if a.name == "AmpConsecutiveSkippedSteps"]
    assert firing.value == T.skip_streak_warning + 3
    assert f"current streak: {T.skip_streak_warning + 3} skipped" in firing.annotations["description"]
    assert firing.annotations == real("AmpConsecutiveSkippedSteps", firing.labels, firing.value, T, "warning")
    assert rendered == [T.skip_streak_warning, T.skip_streak_warning + 3]  # once each, the states between never


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
