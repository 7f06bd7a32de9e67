"""What protocol v1 and a collector with default settings accept: the limits the agent keeps to.

The collector refuses a batch that breaks the protocol (422) and a rank past its
cardinality limits, so the agent never sends what would be refused: the batch
builder cuts strings to these lengths (``_batch.fit_event``), and ``watch()``
warns when a job is larger than a collector with default settings holds. The
agent must not import the server (no web stack in a training image): these
numbers are written here once and a contract test (tests/test_contract_agent.py)
checks them against the collector's schema and defaults.
"""

from __future__ import annotations

import logging

__all__ = ["CUT_MARK", "TEXT_LIMITS", "MAX_PARAMS", "MAX_BATCH_EVENTS", "COLLECTOR_DEFAULTS", "cut",
           "warn_past_collector_limits"]

log = logging.getLogger("ampwatch.agent")

CUT_MARK = "…"
"""Ends a string the agent had to cut, so a reader sees it is not whole."""

TEXT_LIMITS = {
    "label": 128,           # run id, optimizer names (checked at watch() time: they are identities, never cut)
    "param_name": 512,      # params[].name of skip and poisoned_step events
    "scheduler": 256,       # scheduler_after_skip's scheduler label
    "warning_code": 128,    # warning's code
    "warning_message": 4096,  # warning's message
    "host": 255,
    "version": 64,          # agent.version, agent.torch
    "scaler_kind": 128,     # scaler.kind
}
"""Longest string the protocol accepts per field, in characters (docs/protocol.md)."""

MAX_PARAMS = 16
"""Entries in one event's ``params`` list (the rest are counted in ``params_total``)."""

MAX_BATCH_EVENTS = 10_000
"""Events in one batch."""

COLLECTOR_DEFAULTS = {
    "max_optimizers_per_rank": 16,  # past it: refused for good (422), the rank's optimizers do not change
    "max_ranks_per_run": 4096,      # past it: refused for good (422)
    "max_runs": 1000,               # past it: back-pressure (429, Retry-After), clears as finished runs retire
    "max_body_bytes": 8 * 1024 * 1024,  # past it: 413; the sender splits a batch's events to stay under it
}
"""A collector's cardinality limits with default settings (its ``--max-*`` options)."""


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
