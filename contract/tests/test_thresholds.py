"""The thresholds config: validated, with its profiles; the contract imports the standard library only."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest

from ampwatch.contract import thresholds
from ampwatch.contract.protocol import STREAK_LADDER
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, PROFILES, AlertThresholds, promql_duration

CONTRACT_SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


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
    ("backoff_min_count", 0, "backoff_min_count=0 must be a whole number >= 1"),
    ("calibration_iterations", True, "calibration_iterations=True must be a number"),
])
def test_an_invalid_value_raises_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        AlertThresholds(**{field: value})


NAN, INF = float("nan"), float("inf")

# Values each kind of limit must refuse, written out here (not read from the contract's limits), so that a kind
# loosened there fails every field of that kind: shares outside (0, 1], windows of no time, waits below 0, counts
# below 1, streak lengths off the ladder, scales and ratios that are not finite, and non-whole numbers where a whole
# one is meant. A field takes the values of its kind: a new threshold of a known kind needs no line here; a field
# given a limit of its own (no kind below) fails test_every_fields_limit_is_a_kind_this_test_refuses_values_of.
REFUSED_BY_KIND = {
    thresholds._ITERATIONS: (-1, 2.5),
    thresholds._RUNG: (0, 12, 16.0, 100, 2048),
    thresholds._SHARE: (0, 0.0, -0.5, 1.01, 2, NAN, INF),
    thresholds._WAIT: (-1, 1.5),
    thresholds._WINDOW: (0, -60, 1.5),
    thresholds._COUNT: (0, -3, 2.5),
    thresholds._SCALE: (0, -1.0, NAN, INF),
    thresholds._APART: (1, 0.5, NAN, INF),
    thresholds._WINDOW_ITERATIONS: (1, 0, -2, 2.5),
}
REFUSED = {field: REFUSED_BY_KIND.get(limit, ()) for field, limit in thresholds._LIMITS.items()}
# The edges each field accepts (the streak lengths with a valid partner).
ACCEPTED = [("storm_rank_share", 1), ("storm_rank_share", 0.01), ("backoff_rank_share", 1.0), ("skip_ratio", 1),
            ("origin_rank_share", 1), ("storm_edge_for_s", 0), ("backoff_for_s", 0), ("silent_for_s", 0),
            ("calibration_iterations", 0), ("skip_ratio_min_steps", 0), ("backoff_min_count", 1),
            ("origin_min_count", 1), ("skip_streak_window_s", 1), ("collapsed_loss_scale", 2.0 ** -24),
            ("desync_scale_ratio", 1.01), ("spike_window_iterations", 2), ("outlier_rank_share", 1)]


def test_every_fields_limit_is_a_kind_this_test_refuses_values_of():
    assert set(REFUSED) == {f.name for f in dataclasses.fields(AlertThresholds)}
    assert [field for field, values in REFUSED.items() if not values] == [], \
        "give the field a kind of limit listed in REFUSED_BY_KIND, or list the values its own limit must refuse"


@pytest.mark.parametrize("field, value", [(field, value) for field, values in REFUSED.items()
                                          for value in (*values, True, "5", None)])
def test_a_value_outside_a_fields_limits_is_refused_with_a_message_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}={re.escape(repr(value))} (must be|is not on) "):
        AlertThresholds(**{field: value})


@pytest.mark.parametrize("field, value", ACCEPTED)
def test_a_value_at_the_edge_of_a_fields_limits_is_accepted(field, value):
    assert getattr(AlertThresholds(**{field: value}), field) == value


def test_a_storm_share_outside_0_to_1_says_the_range():
    for value in (0, 1.5):
        with pytest.raises(ValueError, match=rf"^storm_rank_share={value} must be in \(0, 1\]$"):
            AlertThresholds(storm_rank_share=value)


def test_thresholds_are_frozen():
    with pytest.raises(AttributeError):
        DEFAULT_THRESHOLDS.skip_streak_warning = 8  # type: ignore[misc]


@pytest.mark.parametrize("seconds, text", [(900, "15m"), (3600, "1h"), (90, "90s"), (0, "0s"), (7200, "2h"),
                                           (45, "45s")])
def test_promql_duration_uses_the_largest_whole_unit(seconds, text):
    assert promql_duration(seconds) == text


def test_every_profile_is_valid_thresholds_and_default_is_what_the_rules_are_built_from():
    assert PROFILES["default"] is DEFAULT_THRESHOLDS == AlertThresholds()
    assert all(isinstance(t, AlertThresholds) for t in PROFILES.values())


def test_the_contract_imports_with_nothing_but_the_standard_library():
    # -S: no site-packages at all, so a third-party import would fail here rather than slip through.
    code = (f"import sys; sys.path.insert(0, {str(CONTRACT_SRC)!r}); "
            "import ampwatch.contract.alerts, ampwatch.contract.metrics, ampwatch.contract.protocol, "
            "ampwatch.contract.thresholds; "
            "ours = sys.stdlib_module_names | {'ampwatch', '__main__'}; "
            "print(sorted(n for n in sys.modules if n.split('.')[0] not in ours))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
