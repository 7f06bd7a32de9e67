"""The built-in alerts and the Prometheus rules are the same alerts: names, severities, for: durations, links."""

from __future__ import annotations

import pytest

from ampwatch.contract.alerts import ALERT_NAMES, ALERTS, DEFAULT_RUNBOOK_BASE_URL, SPEAKERS, hand_written
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server.alerting.annotations import annotations_for

rules = pytest.importorskip("ampwatch.dashboards.rules", reason="the rules generator needs PyYAML (dev install)")


def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return int(duration[:-1]) * units[duration[-1]]


def _prometheus_alerts() -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for rule in rules.alerting_rules(T):
        found.setdefault(rule["alert"], []).append(rule)
    return found


def test_the_rules_define_every_alert_and_each_has_one_condition_in_both_evaluators():
    from ampwatch.server.alerting import rank_conditions, run_conditions
    # A run-wide alert that speaks for a per-rank one has its condition from that one's, and a common alert's is
    # compiled from its declared condition, in both evaluators: only the bespoke ones are written by hand.
    speakers = set(SPEAKERS.values())
    declared = {name for name, d in ALERTS.items() if d.condition is not None}
    bespoke = set(ALERT_NAMES) - speakers - declared
    assert bespoke == hand_written(ALERTS) and declared and bespoke
    assert list(_prometheus_alerts()) == list(ALERT_NAMES) and set(rules.CONDITIONS) == bespoke
    assert set(rank_conditions.RANK_CONDITIONS) | set(run_conditions.RUN_CONDITIONS) == set(ALERT_NAMES)
    assert set(rank_conditions.HAND_WRITTEN) | set(run_conditions.HAND_WRITTEN) == bespoke
    source = open(rank_conditions.__file__).read() + open(run_conditions.__file__).read()
    assert all(f'"{name}"' in source for name in bespoke)  # the built-in conditions name each bespoke alert
    assert not any(f'"{name}"' in source for name in declared)  # and no common one: it is compiled


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_each_rule_has_its_definitions_severities_and_for_duration(name):
    definition = ALERTS[name]
    found = _prometheus_alerts()[name]
    assert [r["labels"]["severity"] for r in found] == [s.level for s in definition.severities]
    # A per-rank alert that a run-wide one speaks for waits at least storm_edge_for_s, so that a scrape between
    # the ranks' batches at a whole-job event's edges never shows it (the collector holds it back as long).
    wait = max(definition.for_seconds(T), T.storm_edge_for_s) if name in SPEAKERS else definition.for_seconds(T)
    assert all(_seconds(r["for"]) == wait for r in found)


def test_the_streak_alert_has_a_warning_and_a_critical_rule_that_wait_only_for_a_storms_edges():
    streak_rules = _prometheus_alerts()["AmpConsecutiveSkippedSteps"]
    assert sorted(r["labels"]["severity"] for r in streak_rules) == ["critical", "warning"]
    assert ALERTS["AmpConsecutiveSkippedSteps"].for_seconds(T) == 0
    assert all(_seconds(r["for"]) == T.storm_edge_for_s for r in streak_rules)


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_each_alert_links_the_same_runbook_section_as_its_rule(name):
    rule = _prometheus_alerts()[name][0]
    ours = annotations_for(name, {"run": "r", "rank": "0", "optimizer": "o"}, 1.0, T, rule["labels"]["severity"])
    assert ours["runbook_url"] == rule["annotations"]["runbook_url"]
    assert ours["runbook_url"].startswith(DEFAULT_RUNBOOK_BASE_URL + "#")
