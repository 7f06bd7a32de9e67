"""The built-in alerts' texts are the Prometheus rules' texts, filled in as Prometheus fills them."""

from __future__ import annotations

import pytest

from ampwatch.contract.alerts import ALERT_NAMES
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds
from ampwatch.dashboards.rules import alerting_rules
from ampwatch.server.alerting.annotations import annotations_for

SHORT = AlertThresholds(skip_streak_warning=4, skip_streak_critical=8, skip_streak_window_s=6, backoff_window_s=60,
                        backoff_min_count=5, collapsed_loss_scale=0.5, skip_ratio_window_s=90)
LABELS = {"run": "exp-1", "rank": "3", "optimizer": "gen", "host": "node-7", "local_rank": "3"}


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
