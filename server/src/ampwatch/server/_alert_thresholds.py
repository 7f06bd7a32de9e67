"""Alert thresholds of the built-in evaluator: the defaults, a named profile, or a JSON file of overrides."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Optional

__all__ = ["PROFILES", "load_thresholds", "thresholds_json"]


def _profiles() -> Mapping[str, Any]:
    from ampwatch.dashboards.thresholds import DEFAULT_THRESHOLDS
    return {
        "default": DEFAULT_THRESHOLDS,
        # Seconds instead of minutes, so a job of a minute (`make demo`) shows alerts firing AND resolving.
        # Never for production: a 5 s streak window forgets a streak before a 15 s scrape sees it.
        "demo": dataclasses.replace(
            DEFAULT_THRESHOLDS, calibration_iterations=10, skip_streak_warning=4, skip_streak_critical=16,
            skip_streak_window_s=5, backoff_window_s=5, backoff_min_count=3, backoff_for_s=1,
            collapsed_for_s=2, desync_for_s=10, skip_ratio_window_s=60, skip_ratio_for_s=5,
            silent_after_s=30, silent_for_s=5, scheduler_window_s=10, poisoned_window_s=30),
    }


PROFILES = ("default", "demo")
"""Names ``--alert-thresholds`` accepts besides a JSON file."""


def load_thresholds(spec: Optional[str]) -> Any:
    """Return the thresholds named by ``spec``: None or a profile name, else a JSON file of field overrides.

    The file holds one object, ``{"skip_streak_warning": 8, ...}``; fields left out keep
    their defaults, and every value is checked by ``AlertThresholds`` itself.
    """
    profiles = _profiles()
    if not spec:
        return profiles["default"]
    if spec in profiles:
        return profiles[spec]
    where = f"--alert-thresholds / AMPWATCH_SERVER_ALERT_THRESHOLDS={spec!r}"
    try:
        with open(spec, encoding="utf-8") as file:
            overrides = json.load(file)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file; give a JSON file of threshold overrides or one of the "
                         f"profiles {', '.join(PROFILES)}") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: cannot read it as JSON ({error})") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"{where}: the file must hold one JSON object of field: value, "
                         f'e.g. {{"skip_streak_warning": 8}}')
    default = profiles["default"]
    known = {field.name for field in dataclasses.fields(default)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; the fields are "
                         f"{', '.join(sorted(known))} (see ampwatch.dashboards.thresholds)")
    try:
        return dataclasses.replace(default, **overrides)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def thresholds_json(thresholds: Any) -> str:
    """Render thresholds as the JSON file ``--alert-thresholds`` reads (every field)."""
    return json.dumps(dataclasses.asdict(thresholds), indent=2, sort_keys=True) + "\n"
