"""The built-in alerts and the Prometheus rules are the same alerts: names, severities, for: durations, links."""

from __future__ import annotations

import pytest

from ampwatch.dashboards.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server._alert_text import RUNBOOK_BASE, annotations_for
from ampwatch.server._alerting import ALERT_NAMES, RULES

rules = pytest.importorskip("ampwatch.dashboards.rules", reason="the rules generator needs PyYAML (dev install)")


def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return int(duration[:-1]) * units[duration[-1]]


def _prometheus_alerts() -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for rule in rules.alerting_rules(T):
        found.setdefault(rule["alert"], []).append(rule)
    return found


def test_the_evaluator_knows_exactly_the_alerts_the_rules_define():
    assert set(ALERT_NAMES) == set(rules.ALERT_NAMES) == set(_prometheus_alerts())


@pytest.mark.parametrize("name", [n for n in ALERT_NAMES if RULES[n][0] is not None])
def test_each_alert_has_the_rules_severity_and_for_duration(name):
    (rule,) = _prometheus_alerts()[name]
    severity, for_field = RULES[name]
    assert rule["labels"]["severity"] == severity
    assert _seconds(rule["for"]) == (getattr(T, for_field) if for_field else 0)


def test_the_streak_alert_has_a_warning_and_a_critical_rule_that_fire_at_once():
    streak_rules = _prometheus_alerts()["AmpConsecutiveSkippedSteps"]
    assert sorted(r["labels"]["severity"] for r in streak_rules) == ["critical", "warning"]
    assert all(_seconds(r["for"]) == 0 for r in streak_rules)


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_each_alert_links_the_same_runbook_section_as_its_rule(name):
    rule = _prometheus_alerts()[name][0]
    ours = annotations_for(name, {"run": "r", "rank": "0", "optimizer": "o"}, 1.0)["runbook_url"]
    assert ours == rule["annotations"]["runbook_url"]
    assert ours.startswith(RUNBOOK_BASE)
