"""Summary, description and runbook link of each built-in alert: the Prometheus rules' texts, filled in here."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ampwatch.dashboards.alert_text import DEFAULT_RUNBOOK_BASE_URL, render_annotations

__all__ = ["annotations_for", "RUNBOOK_BASE"]

RUNBOOK_BASE = DEFAULT_RUNBOOK_BASE_URL + "#"
"""Runbook sections live in docs/alerts.md, as the Prometheus rules link them; the anchor is the lower-cased name."""


def annotations_for(name: str, labels: Mapping[str, str], value: float, threshold: object = "",
                    thresholds: Optional[Any] = None) -> dict[str, str]:
    """Return the summary, description and runbook_url of alert ``name`` (the rules' text, one source)."""
    if thresholds is None:
        from ampwatch.dashboards.thresholds import DEFAULT_THRESHOLDS
        thresholds = DEFAULT_THRESHOLDS
    return render_annotations(name, thresholds, labels, value, threshold if threshold != "" else None)
