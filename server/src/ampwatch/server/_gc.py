"""Garbage-collector settings of the collector process: fewer and shorter pauses on the ingest path."""

from __future__ import annotations

import gc

__all__ = ["tune_gc", "GC_THRESHOLDS"]

# Young collections every 5,000 allocations instead of 700, and older ones 20x rarer than that: each
# ingested batch allocates ~100 short-lived containers, and at 1,024 ranks the defaults ran a 60-100 ms
# full collection every ~3 s (bench: docs/benchmarks.md, "Ingest tail").
GC_THRESHOLDS = (5_000, 20, 20)


def tune_gc() -> None:
    """Freeze the start-up heap (modules, routes, schemas) and collect less often; call once before serving."""
    gc.collect()
    gc.freeze()  # objects that live as long as the process: full collections no longer walk them
    gc.set_threshold(*GC_THRESHOLDS)
