"""Alert thresholds of the built-in evaluator: the defaults, a named profile, or a JSON file of overrides."""

from __future__ import annotations

import dataclasses
import json

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, PROFILES, AlertThresholds

__all__ = ["load_thresholds"]


def load_thresholds(spec: str | None) -> AlertThresholds:
    """Return the thresholds named by ``spec``: None or a profile name, else a JSON file of field overrides.

    The file holds one object, ``{"skip_streak_warning": 8, ...}``; fields left out keep
    their defaults, and every value is checked by ``AlertThresholds`` itself.
    """
    if not spec:
        return DEFAULT_THRESHOLDS
    if spec in PROFILES:
        return PROFILES[spec]
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
    known = {field.name for field in dataclasses.fields(DEFAULT_THRESHOLDS)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; the fields are "
                         f"{', '.join(sorted(known))} (see ampwatch.contract.thresholds)")
    try:
        return dataclasses.replace(DEFAULT_THRESHOLDS, **overrides)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
