"""Prometheus rules and the Grafana dashboard of ampwatch, generated from ampwatch.contract.

``ampwatch.dashboards.rules`` (PyYAML) turns the thresholds and alert
definitions of ``ampwatch.contract`` into the rule file;
``ampwatch.dashboards.dashboard`` (grafanalib) builds the dashboard;
``ampwatch-dashboards generate`` writes both into ``dashboards/generated/``.
"""
