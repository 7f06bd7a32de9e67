"""The thresholds config: validated, with its profiles; the contract imports the standard library only."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
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
