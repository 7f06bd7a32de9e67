"""Summary, description and runbook link of a built-in alert: the definition's texts, filled in as Prometheus would."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from ampwatch.contract.alerts import ALERTS
from ampwatch.contract.thresholds import AlertThresholds

__all__ = ["annotations_for"]


def annotations_for(name: str, labels: Mapping[str, Any], value: float, thresholds: AlertThresholds,
                    level: Optional[str] = None) -> dict[str, str]:
    """Return the summary, description and runbook_url of one instance of alert ``name``.

    The texts are those of the Prometheus rules (one definition, ``ampwatch.contract.alerts``), with
    the labels and the value filled in as Prometheus fills its templates; ``level`` is the severity
    whose threshold the text names (the streak alert has two). Costs a few string formats.
    """
    fields = {"run": "", "rank": "", "optimizer": "", "host": "", "local_rank": "",
              **{k: str(v) for k, v in labels.items()},
              "value": _number(value), "percent": _percent(value), "duration": _duration(value)}
    return ALERTS[name].annotations(thresholds, fields, level)


def _number(value: float) -> str:
    # As Prometheus's {{ $value }} (Go's %v): "0.25", "65536", and "NaN", "+Inf", "-Inf" for the non-finite.
    if math.isfinite(value):
        return f"{value:g}"
    return "NaN" if value != value else ("+Inf" if value > 0 else "-Inf")


def _percent(value: float) -> str:
    # As Prometheus's humanizePercentage: 0.5 -> "50%", 0.1234 -> "12.34%".
    return f"{value * 100:.4g}%"


def _duration(seconds: float) -> str:
    # Close to Prometheus's humanizeDuration: "45.5s", "2m 5s", "1h 2m 3s" (NaN and infinities as they are).
    if not math.isfinite(seconds):
        return _number(seconds)
    if seconds < 60:
        return f"{seconds:.4g}s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return " ".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n or unit == "s")
