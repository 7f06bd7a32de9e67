"""What protocol v1 and a collector with default settings accept: the limits the agent keeps to.

The collector refuses a batch that breaks the protocol (422) and a rank past its
cardinality limits, so the agent never sends what would be refused: the batch
builder cuts strings to these lengths (``_batch.fit_event``), and ``watch()``
warns when a job is larger than a collector with default settings holds. The
numbers come from ``ampwatch.contract.protocol`` (standard library only, no web
stack in a training image), which the collector's schema and defaults read too.
"""

from __future__ import annotations

import logging

from ampwatch.contract.protocol import COLLECTOR_DEFAULTS, MAX_BATCH_EVENTS, MAX_PARAMS, TEXT_LIMITS

__all__ = ["CUT_MARK", "TEXT_LIMITS", "MAX_PARAMS", "MAX_BATCH_EVENTS", "COLLECTOR_DEFAULTS", "cut",
           "warn_past_collector_limits"]

log = logging.getLogger("ampwatch.agent")

CUT_MARK = "…"
"""Ends a string the agent had to cut, so a reader sees it is not whole."""


def cut(text: str, limit: int) -> str:
    """Return ``text`` if it fits in ``limit`` characters, else its start ending in :data:`CUT_MARK`."""
    return text if len(text) <= limit else text[:limit - len(CUT_MARK)] + CUT_MARK


def warn_past_collector_limits(optimizers: int, world_size: int, *, sending: bool = True) -> bool:
    """Log one warning when a job is larger than a collector with default limits holds; return whether it did.

    Costs a few comparisons; call it once per ``watch()``. Nothing is said when
    the agent sends nothing (no collector configured).
    """
    if not sending:
        return False
    past = []
    for option, count, what in (("max_optimizers_per_rank", optimizers, "optimizers on this rank"),
                                ("max_ranks_per_run", world_size, "ranks in this run")):
        limit = COLLECTOR_DEFAULTS[option]
        if count > limit:
            flag = "--" + option.replace("_", "-")
            past.append(f"{count} {what}, over its default limit of {limit} (raise it with {flag} or "
                        f"AMPWATCH_SERVER_{option.upper()})")
    if not past:
        return False
    log.warning("ampwatch: a collector with default settings refuses this job: %s. Its batches are then "
                "refused for good (logged once, counted in rejected_batches); watch fewer optimizers or start "
                "the collector with the higher limit.", "; ".join(past))
    return True
