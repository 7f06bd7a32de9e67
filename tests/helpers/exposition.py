"""Read a Prometheus exposition (``GET /metrics``) back into samples."""

from __future__ import annotations

__all__ = ["samples", "value"]


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Parse an exposition into ``{(sample name, labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of an exposition, or None when absent."""
    return samples(text).get((name, frozenset(labels.items())))
