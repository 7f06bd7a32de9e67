"""The ampwatch collector: ingest, storage, Prometheus metrics (filled by the collector issue)."""

__all__: list[str] = []
