"""Summary, description and runbook link of every ampwatch alert, written once for both evaluators.

The Prometheus rules (``rules.py``) render these texts as Go templates
(``{{ $labels.run }}``, ``{{ $value | humanizePercentage }}``); the collector's
built-in alerts render the same texts with the alert's own labels and value.
Standard library only, like ``thresholds.py``, so the collector can import it
without grafanalib or PyYAML.

Example::

    from ampwatch.dashboards.alert_text import render_annotations
    from ampwatch.dashboards.thresholds import DEFAULT_THRESHOLDS
    render_annotations("AmpLossScaleCollapsed", DEFAULT_THRESHOLDS, {"run": "exp-1", "rank": "3"}, 0.5)
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from .thresholds import AlertThresholds, promql_duration as _dur

__all__ = ["DEFAULT_RUNBOOK_BASE_URL", "alert_text", "prometheus_annotations", "render_annotations", "runbook_url"]

#: Where ``runbook_url`` points; each alert appends ``#<alertname in lower case>``,
#: the anchor of its section in docs/alerts.md.
DEFAULT_RUNBOOK_BASE_URL = "https://github.com/ampwatch/ampwatch/blob/main/docs/alerts.md"

# Placeholders: {run}, {rank}, {optimizer} (labels), {value}, {percent} and {duration} (the value, as a
# number, a percentage, a duration). No other braces may appear in the texts.
_WHERE = "optimizer {optimizer} on rank {rank} of run {run}"
_ON_RANK = "rank {rank} of run {run}"


def alert_text(name: str, t: AlertThresholds, threshold: Optional[int] = None) -> tuple[str, str]:
    """Return the summary and description templates of alert ``name`` (``threshold``: the streak length)."""
    if name == "AmpConsecutiveSkippedSteps":
        return (f"An optimizer skipped {threshold} or more steps in a row",
                f"The {_WHERE} skipped at least {threshold} consecutive steps within the last "
                f"{_dur(t.skip_streak_window_s)}: its parameters were not updated (current streak: "
                "{value} skipped steps).")
    collapsed = f"{t.collapsed_loss_scale:g}"
    texts = {
        "AmpSustainedLossScaleBackoff": (
            "Many ranks of a run keep backing off the loss scale",
            f"{{percent}} of the open ranks of run {{run}} backed the loss scale off at least "
            f"{t.backoff_min_count} times in the last {_dur(t.backoff_window_s)} without any growth: "
            "gradients keep overflowing."),
        "AmpLossScaleCollapsed": (
            f"The loss scale collapsed below {collapsed}, or is NaN or infinite",
            f"The loss scale of {_ON_RANK} is {{value}}, not a finite value of at least {collapsed}: "
            "backoffs keep halving it because gradients are non-finite at any scale, or it became 0, NaN or "
            "infinite, where every step skips and it can never recover."),
        "AmpLossScaleDesync": (
            "Ranks of a run disagree on the loss scale",
            "The largest loss scale among the open ranks of run {run} is {value} times the smallest: the "
            "ranks no longer see the same gradients or scaler state."),
        "AmpHighSkippedStepRatio": (
            "An optimizer skips a large share of its steps",
            f"The {_WHERE} skipped {{percent}} of its steps over the last {_dur(t.skip_ratio_window_s)}."),
        "AmpRankSilent": (
            "A rank stopped reporting without closing",
            f"No batch from {_ON_RANK} for {{duration}} and it did not close: "
            "the process died, hung, or cannot reach the collector."),
        "AmpSchedulerStepsOnSkipped": (
            "An LR scheduler stepped after a skipped optimizer step",
            f"The LR scheduler of {_WHERE} stepped right after skipped steps "
            "(so far: {value}): the schedule runs ahead of the real updates."),
        "AmpPoisonedStep": (
            "An optimizer updated its parameters with non-finite gradients",
            f"The {_WHERE} stepped although its gradients were non-finite, or its parameters "
            "became non-finite (poisoned steps so far: {value}): the weights are likely NaN for good."),
    }
    return texts[name]


def runbook_url(name: str, base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> str:
    """Return the link to the runbook section of alert ``name`` in docs/alerts.md."""
    return f"{base_url}#{name.lower()}"


def prometheus_annotations(name: str, t: AlertThresholds, threshold: Optional[int] = None,
                           base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict[str, str]:
    """Return the annotations of a Prometheus alerting rule (Go templates over ``$labels`` and ``$value``)."""
    fields = {label: f"{{{{ $labels.{label} }}}}" for label in ("run", "rank", "optimizer")}
    fields.update(value="{{ $value }}", percent="{{ $value | humanizePercentage }}",
                  duration="{{ $value | humanizeDuration }}")
    summary, description = alert_text(name, t, threshold)
    return {"summary": summary.format(**fields), "description": description.format(**fields),
            "runbook_url": runbook_url(name, base_url)}


def render_annotations(name: str, t: AlertThresholds, labels: Mapping[str, Any], value: float,
                       threshold: Optional[int] = None, base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict[str, str]:
    """Return the annotations of one alert instance, filled in as Prometheus would fill the rule's templates."""
    fields = {"run": "", "rank": "", "optimizer": "", **{k: str(v) for k, v in labels.items()}}
    fields.update(value=_number(value), percent=_percent(value), duration=_duration(value))
    summary, description = alert_text(name, t, threshold)
    return {"summary": summary.format(**fields), "description": description.format(**fields),
            "runbook_url": runbook_url(name, base_url)}


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
