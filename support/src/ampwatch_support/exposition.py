"""Fetch a collector's exposition (``GET /metrics``), read it back into samples, have promtool judge it."""

from __future__ import annotations

import shutil
import subprocess

__all__ = ["assert_promtool_accepts", "fewer_requests", "requests_and_batches", "samples", "scrape", "value"]


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


def requests_and_batches(url: str) -> tuple[float, float]:
    """Requests the collector at ``url`` answered 200, and the rank batches they carried (applied or recognised as
    duplicates): fewer requests than batches when a node relay gathered several ranks' batches in one."""
    text = scrape(url)
    return (value(text, "ampwatch_collector_ingest_requests_total", code="200") or 0,
            (value(text, "ampwatch_collector_batches_applied_total") or 0)
            + (value(text, "ampwatch_collector_duplicate_batches_total") or 0))


def fewer_requests(url: str, per_batch: float = 1.0, since: tuple[float, float] = (0.0, 0.0)) -> bool:
    """Whether the requests answered since ``since`` (requests, batches) number fewer than ``per_batch`` per
    batch they carried: at 1.0, some request carried several ranks' batches."""
    requests, batches = requests_and_batches(url)
    return requests - since[0] < per_batch * (batches - since[1])


def assert_promtool_accepts(text: str) -> None:
    """Fail unless ``promtool check metrics`` passes the exposition ``text`` without a word (no lint warning).

    promtool is Prometheus's own reader, stricter than the Python parser: a test that only parsed
    the text back would miss what a real scrape would refuse or warn about.
    """
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install the Debian package 'prometheus' (.ci/run does)"
    result = subprocess.run([promtool, "check", "metrics"], input=text, text=True, capture_output=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() + result.stderr.strip(), \
        result.stdout + result.stderr
