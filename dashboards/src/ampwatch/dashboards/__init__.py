"""Grafana dashboards and Prometheus rules for ampwatch, as code (filled by the dashboards issue)."""

__all__: list[str] = []
