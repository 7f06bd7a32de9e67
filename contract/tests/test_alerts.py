"""The alert definitions: complete against the thresholds, with texts that fill in."""

from __future__ import annotations

import dataclasses

import pytest

from ampwatch.contract.alerts import ALERT_NAMES, ALERTS, DEFAULT_RUNBOOK_BASE_URL
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, DEMO_THRESHOLDS, AlertThresholds

FIELDS = {"run": "exp-1", "rank": "3", "optimizer": "gen", "host": "node-7", "local_rank": "3",
          "value": "7", "percent": "50%", "duration": "2m 5s"}


def test_every_threshold_is_read_by_some_alert_and_every_alert_reads_only_real_thresholds():
    known = {field.name for field in dataclasses.fields(AlertThresholds)}
    read = {field for definition in ALERTS.values() for field in definition.thresholds_read}
    assert read == known


def test_names_are_unique_and_each_alert_has_a_known_scope_and_severity():
    assert len(set(ALERT_NAMES)) == len(ALERT_NAMES) == len(ALERTS)
    for definition in ALERTS.values():
        assert definition.scope in ("run", "rank", "optimizer", "host")
        assert definition.severities and {s.level for s in definition.severities} <= {"warning", "critical"}


@pytest.mark.parametrize("t", [DEFAULT_THRESHOLDS, DEMO_THRESHOLDS], ids=["default", "demo"])
@pytest.mark.parametrize("name", ALERT_NAMES)
def test_every_text_fills_in_with_the_thresholds_and_the_evaluators_fields(name, t):
    definition = ALERTS[name]
    for severity in definition.severities:
        texts = definition.annotations(t, FIELDS, severity.level)
        assert "{" not in texts["summary"] + texts["description"], texts
        assert texts["runbook_url"] == f"{DEFAULT_RUNBOOK_BASE_URL}#{name.lower()}"
        if severity.threshold:
            assert str(getattr(t, severity.threshold)) in texts["summary"]


def test_thresholds_show_in_the_texts_as_durations_and_short_numbers():
    texts = ALERTS["AmpSustainedLossScaleBackoff"].annotations(
        dataclasses.replace(DEFAULT_THRESHOLDS, backoff_window_s=600, backoff_min_count=5), FIELDS)
    assert "at least 5 times in the last 10m" in texts["description"]
    texts = ALERTS["AmpLossScaleCollapsed"].annotations(DEFAULT_THRESHOLDS, FIELDS)
    assert texts["summary"] == "The loss scale collapsed below 1, or is NaN or infinite"


def test_the_for_window_is_read_from_the_thresholds():
    t = dataclasses.replace(DEFAULT_THRESHOLDS, desync_for_s=42)
    assert ALERTS["AmpLossScaleDesync"].for_seconds(t) == 42
    assert ALERTS["AmpPoisonedStep"].for_seconds(t) == 0
