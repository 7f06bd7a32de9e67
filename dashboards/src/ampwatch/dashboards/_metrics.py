"""Names of the collector's metrics that rules and panels query (contract: docs/metrics.md)."""

from __future__ import annotations

__all__ = [
    "OPTIMIZER_STEPS",
    "OPTIMIZER_SKIPPED_STEPS",
    "OPTIMIZER_CONSECUTIVE_SKIPPED",
    "OPTIMIZER_LONGEST_SKIP_STREAK",
    "OPTIMIZER_SKIP_STREAKS",
    "OPTIMIZER_SCHEDULER_STEPS_AFTER_SKIP",
    "OPTIMIZER_POISONED_STEPS",
    "NONFINITE_GRADIENT_INFO",
    "LOSS_SCALE",
    "LOSS_SCALE_BACKOFFS",
    "LOSS_SCALE_GROWTHS",
    "ITERATION",
    "RANK_LAST_SEEN",
    "RANK_CLOSED",
    "RANK_INFO",
    "AGENT_DROPPED_EVENTS",
    "AGENT_SEND_FAILURES",
    "COLLECTOR_INGEST_REQUESTS",
    "COLLECTOR_INGEST_DURATION",
    "COLLECTOR_RANKS_TRACKED",
    "COLLECTOR_REJECTED_BATCHES",
    "COLLECTOR_DATABASE_SIZE",
]

# Per rank and optimizer (labels run, rank, optimizer).
OPTIMIZER_STEPS = "ampwatch_optimizer_steps_total"
OPTIMIZER_SKIPPED_STEPS = "ampwatch_optimizer_skipped_steps_total"
OPTIMIZER_CONSECUTIVE_SKIPPED = "ampwatch_optimizer_consecutive_skipped_steps"
OPTIMIZER_LONGEST_SKIP_STREAK = "ampwatch_optimizer_longest_skip_streak"
OPTIMIZER_SKIP_STREAKS = "ampwatch_optimizer_skip_streaks_total"  # extra label min_length
OPTIMIZER_SCHEDULER_STEPS_AFTER_SKIP = "ampwatch_optimizer_scheduler_steps_after_skip_total"
OPTIMIZER_POISONED_STEPS = "ampwatch_optimizer_poisoned_steps_total"
NONFINITE_GRADIENT_INFO = "ampwatch_nonfinite_gradient_info"  # extra label parameter

# Per rank (labels run, rank).
LOSS_SCALE = "ampwatch_loss_scale"
LOSS_SCALE_BACKOFFS = "ampwatch_loss_scale_backoffs_total"
LOSS_SCALE_GROWTHS = "ampwatch_loss_scale_growths_total"
ITERATION = "ampwatch_iteration"
RANK_LAST_SEEN = "ampwatch_rank_last_seen_timestamp_seconds"
RANK_CLOSED = "ampwatch_rank_closed"
RANK_INFO = "ampwatch_rank_info"
AGENT_DROPPED_EVENTS = "ampwatch_agent_dropped_events_total"
AGENT_SEND_FAILURES = "ampwatch_agent_send_failures_total"

# The collector itself.
COLLECTOR_INGEST_REQUESTS = "ampwatch_collector_ingest_requests_total"
COLLECTOR_INGEST_DURATION = "ampwatch_collector_ingest_duration_seconds"
COLLECTOR_RANKS_TRACKED = "ampwatch_collector_ranks_tracked"
COLLECTOR_REJECTED_BATCHES = "ampwatch_collector_rejected_batches_total"
COLLECTOR_DATABASE_SIZE = "ampwatch_collector_database_size_bytes"
