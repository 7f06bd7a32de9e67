"""Fetch a collector's Prometheus exposition (``GET /metrics``) and read it back into samples."""

from __future__ import annotations

__all__ = ["samples", "scrape", "value"]


def scrape(url: str) -> str:
    """Return the exposition the collector at ``url`` serves now."""
    import httpx
    return httpx.get(url + "/metrics", timeout=10).text


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Parse an exposition into ``{(sample name, labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of an exposition, or None when absent."""
    return samples(text).get((name, frozenset(labels.items())))
