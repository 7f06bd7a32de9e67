"""Prometheus rules and the Grafana dashboard of ampwatch, generated from one thresholds config.

Importing this package (or ``ampwatch.dashboards.thresholds``) pulls in no
third-party module, so the collector can read the same thresholds as the
rules. ``ampwatch.dashboards.rules`` needs PyYAML and
``ampwatch.dashboards.dashboard`` needs grafanalib.
"""

from .thresholds import DEFAULT_THRESHOLDS, STREAK_LADDER, AlertThresholds, promql_duration

__all__ = ["AlertThresholds", "DEFAULT_THRESHOLDS", "STREAK_LADDER", "promql_duration"]
