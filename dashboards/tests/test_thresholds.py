"""The thresholds config: validated, and importable without third-party modules."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ampwatch.dashboards.thresholds import (
    DEFAULT_THRESHOLDS, STREAK_LADDER, AlertThresholds, promql_duration,
)


def test_streak_ladder_is_the_protocols_powers_of_two_up_to_1024():
    assert STREAK_LADDER == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@pytest.mark.parametrize("field", ["skip_streak_warning", "skip_streak_critical"])
def test_a_streak_threshold_off_the_ladder_raises_naming_the_field(field):
    with pytest.raises(ValueError, match=rf"^{field}=100 is not on the collector's streak ladder; use one of 1, 2, 4"):
        AlertThresholds(**{field: 100, "skip_streak_critical": 128} if field == "skip_streak_warning"
                        else {field: 100})


def test_a_critical_streak_not_above_the_warning_raises():
    with pytest.raises(ValueError, match="skip_streak_critical=16 must be above skip_streak_warning=16"):
        AlertThresholds(skip_streak_warning=16, skip_streak_critical=16)


@pytest.mark.parametrize("field, value, message", [
    ("backoff_rank_share", 0.0, "backoff_rank_share=0.0 must be in"),
    ("backoff_rank_share", 1.5, "backoff_rank_share=1.5 must be in"),
    ("skip_ratio", 0, "skip_ratio=0 must be in"),
    ("desync_scale_ratio", 1.0, "desync_scale_ratio=1.0 must be > 1"),
    ("collapsed_loss_scale", 0.0, "collapsed_loss_scale=0.0 must be > 0"),
    ("silent_after_s", 0, "silent_after_s=0 must be > 0 seconds"),
    ("backoff_window_s", 1.5, "backoff_window_s=1.5 must be a whole number of seconds"),
    ("backoff_min_count", -1, "backoff_min_count=-1 must be a whole number >= 0"),
    ("calibration_iterations", True, "calibration_iterations=True must be a number"),
])
def test_an_invalid_value_raises_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        AlertThresholds(**{field: value})


def test_thresholds_are_frozen():
    with pytest.raises(AttributeError):
        DEFAULT_THRESHOLDS.skip_streak_warning = 8  # type: ignore[misc]


@pytest.mark.parametrize("seconds, text", [(900, "15m"), (3600, "1h"), (90, "90s"), (0, "0s"), (7200, "2h"), (45, "45s")])
def test_promql_duration_uses_the_largest_whole_unit(seconds, text):
    assert promql_duration(seconds) == text


def test_importing_the_thresholds_pulls_in_no_third_party_module():
    code = ("import sys; import ampwatch.dashboards.thresholds; "
            "print(sorted(m for m in ('yaml', 'grafanalib', 'attr') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
