"""Every series the collector exposes at ``/metrics``: name, type, labels and help, written once.

The collector renders these (``ampwatch.server._metrics``), the rules and the
dashboard query them (``ampwatch.dashboards``), and docs/metrics.md documents
each (a test checks the three agree). A :class:`Metric` formats as its name,
so ``f"rate({OPTIMIZER_STEPS}[5m])"`` is a query.

Example::

    from ampwatch.contract.metrics import LOSS_SCALE
    LOSS_SCALE.name, LOSS_SCALE.type, LOSS_SCALE.labels   # 'ampwatch_loss_scale', 'gauge', ('run', 'rank')
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "Metric", "METRICS",
    "OPTIMIZER_STEPS", "OPTIMIZER_SKIPPED_STEPS", "OPTIMIZER_CONSECUTIVE_SKIPPED", "OPTIMIZER_LONGEST_SKIP_STREAK",
    "OPTIMIZER_SKIP_STREAKS", "OPTIMIZER_SCHEDULER_STEPS_AFTER_SKIP", "OPTIMIZER_POISONED_STEPS",
    "NONFINITE_GRADIENT_INFO", "OPTIMIZER_GRAD_NORM_SPIKES", "OPTIMIZER_GRAD_NORM_MEAN", "OPTIMIZER_GRAD_NORM_STD",
    "OPTIMIZER_LOCAL_GRAD_NORM_MEAN", "OPTIMIZER_LOCAL_GRAD_NORM_STD",
    "LOSS_SPIKES", "LOSS_MEAN", "LOSS_STD", "RANK_GRADIENT_OUTLIERS",
    "RANK_ORIGIN_ITERATIONS",
    "LOSS_SCALE", "LOSS_SCALE_BACKOFFS", "LOSS_SCALE_GROWTHS", "LOSS_SCALE_MANUAL_SETS", "ITERATION",
    "RANK_LAST_SEEN", "RANK_CLOSED", "RANK_INFO", "RANK_CONFLICTS",
    "AGENT_DROPPED_EVENTS", "AGENT_SEND_FAILURES", "AGENT_REJECTED_BATCHES", "AGENT_ERRORS",
    "AGENT_REFUSED_SPOOL_FILES",
    "RUN_RANKS_REPORTING", "RUN_RANKS_IN_SKIP_STREAK", "RUN_LOSS_SCALE_MIN", "RUN_LOSS_SCALE_MAX",
    "COLLECTOR_INGEST_REQUESTS", "COLLECTOR_BATCHES_APPLIED", "COLLECTOR_EVENTS_APPLIED",
    "COLLECTOR_DUPLICATE_BATCHES", "COLLECTOR_REJECTED_BATCHES", "COLLECTOR_REFUSED_REQUESTS",
    "COLLECTOR_INGEST_DURATION", "COLLECTOR_DATABASE_SIZE", "COLLECTOR_RANKS_TRACKED", "COLLECTOR_BUILD_INFO",
    "COLLECTOR_NOTIFICATIONS",
]

_OPTIMIZER = ("run", "rank", "optimizer")
_RANK = ("run", "rank")
_RUN = ("run",)


@dataclasses.dataclass(frozen=True, slots=True)
class Metric:
    """One exposed metric family."""

    name: str
    """The exposed name, ``_total`` included for counters."""
    type: str
    """``counter``, ``gauge`` or ``histogram``."""
    labels: tuple[str, ...]
    """Its labels, identity first (run, rank, optimizer), then those of its own."""
    help: str
    """The ``# HELP`` text."""

    def __str__(self) -> str:
        return self.name


# Per rank and optimizer.
OPTIMIZER_STEPS = Metric("ampwatch_optimizer_steps_total", "counter", _OPTIMIZER,
                         "scaler.step(opt) calls that updated parameters.")
OPTIMIZER_SKIPPED_STEPS = Metric("ampwatch_optimizer_skipped_steps_total", "counter", _OPTIMIZER,
                                 "scaler.step(opt) calls skipped because the unscaled gradients held inf/NaN.")
OPTIMIZER_CONSECUTIVE_SKIPPED = Metric("ampwatch_optimizer_consecutive_skipped_steps", "gauge", _OPTIMIZER,
                                       "Length of the current skip streak (0 once the optimizer steps again).")
OPTIMIZER_LONGEST_SKIP_STREAK = Metric("ampwatch_optimizer_longest_skip_streak", "gauge", _OPTIMIZER,
                                       "Longest skip streak seen so far.")
OPTIMIZER_SKIP_STREAKS = Metric("ampwatch_optimizer_skip_streaks_total", "counter", (*_OPTIMIZER, "min_length"),
                                "Skip streaks that reached at least min_length consecutive skips, counted when "
                                "they reach it.")
OPTIMIZER_SCHEDULER_STEPS_AFTER_SKIP = Metric("ampwatch_optimizer_scheduler_steps_after_skip_total", "counter",
                                              _OPTIMIZER,
                                              "LR scheduler steps taken right after a skipped step of this optimizer.")
OPTIMIZER_POISONED_STEPS = Metric("ampwatch_optimizer_poisoned_steps_total", "counter", _OPTIMIZER,
                                  "Steps that updated parameters with non-finite gradients, or left parameters "
                                  "non-finite.")
NONFINITE_GRADIENT_INFO = Metric("ampwatch_nonfinite_gradient_info", "gauge", (*_OPTIMIZER, "parameter"),
                                 "The latest parameter named as holding non-finite gradients on a skip (value 1).")
OPTIMIZER_GRAD_NORM_SPIKES = Metric("ampwatch_optimizer_grad_norm_spikes_total", "counter", _OPTIMIZER,
                                    "Iterations whose gradient norm (what the optimizer stepped with) spiked: at least "
                                    "spike_sigma standard deviations above its rolling window, or non-finite on a "
                                    "step that went through.")
OPTIMIZER_GRAD_NORM_MEAN = Metric("ampwatch_optimizer_grad_norm_mean", "gauge", _OPTIMIZER,
                                  "Mean of the gradient norm over its rolling window (the agent's last report).")
OPTIMIZER_GRAD_NORM_STD = Metric("ampwatch_optimizer_grad_norm_std", "gauge", _OPTIMIZER,
                                 "Standard deviation of the gradient norm over its rolling window.")
OPTIMIZER_LOCAL_GRAD_NORM_MEAN = Metric("ampwatch_optimizer_local_grad_norm_mean", "gauge", _OPTIMIZER,
                                        "Mean over its rolling window of this rank's own gradient norm before DDP's "
                                        "all-reduce, its infinity norm: the largest absolute value of this rank's "
                                        "own gradients (only ranks watched with ddp=).")
OPTIMIZER_LOCAL_GRAD_NORM_STD = Metric("ampwatch_optimizer_local_grad_norm_std", "gauge", _OPTIMIZER,
                                       "Standard deviation over its rolling window of this rank's own gradient norm "
                                       "(the infinity norm) before DDP's all-reduce.")

# Per rank.
LOSS_SPIKES = Metric("ampwatch_loss_spikes_total", "counter", _RANK,
                     "Iterations whose loss spiked: at least spike_sigma standard deviations above its rolling "
                     "window, or non-finite.")
LOSS_MEAN = Metric("ampwatch_loss_mean", "gauge", _RANK, "Mean of the loss over its rolling window.")
LOSS_STD = Metric("ampwatch_loss_std", "gauge", _RANK, "Standard deviation of the loss over its rolling window.")
RANK_GRADIENT_OUTLIERS = Metric("ampwatch_rank_gradient_outliers_total", "counter", _RANK,
                                "Iterations where this rank's own gradient norm before DDP's all-reduce stood out "
                                "from the other ranks' and from its own history (gradient_outlier events, judged by "
                                "the collector).")
LOSS_SCALE = Metric("ampwatch_loss_scale", "gauge", _RANK, "Current loss scale of the rank's GradScaler.")
LOSS_SCALE_BACKOFFS = Metric("ampwatch_loss_scale_backoffs_total", "counter", _RANK,
                             "update() calls that multiplied the scale by backoff_factor.")
LOSS_SCALE_GROWTHS = Metric("ampwatch_loss_scale_growths_total", "counter", _RANK,
                            "update() calls that multiplied the scale by growth_factor.")
LOSS_SCALE_MANUAL_SETS = Metric("ampwatch_loss_scale_manual_sets_total", "counter", _RANK,
                                "update(new_scale=...) calls that changed the scale.")
ITERATION = Metric("ampwatch_iteration", "gauge", _RANK, "Number of scaler.update() calls so far.")
RANK_LAST_SEEN = Metric("ampwatch_rank_last_seen_timestamp_seconds", "gauge", _RANK,
                        "Unix time of the last batch received from the rank.")
RANK_CLOSED = Metric("ampwatch_rank_closed", "gauge", _RANK, "1 once the rank closed cleanly, else 0.")
RANK_INFO = Metric("ampwatch_rank_info", "gauge",
                   (*_RANK, "host", "local_rank", "world_size", "scaler_enabled", "scaler_kind", "agent_version"),
                   "Identity of the rank (value 1).")
RANK_CONFLICTS = Metric("ampwatch_rank_conflicts_total", "counter", _RANK,
                        "Processes (agent incarnations) that claimed the rank while another one was still sending "
                        "to it; they are put out of the rank, whose gauges stay the first process's.")
RANK_ORIGIN_ITERATIONS = Metric("ampwatch_rank_origin_iterations_total", "counter", _RANK,
                                "Iterations where some optimizer skipped and this rank's own gradients held inf/NaN "
                                "before DDP's all-reduce (only ranks watched with ddp=).")
AGENT_DROPPED_EVENTS = Metric("ampwatch_agent_dropped_events_total", "counter", _RANK,
                              "Events the agent dropped because its buffer was full.")
AGENT_SEND_FAILURES = Metric("ampwatch_agent_send_failures_total", "counter", _RANK, "Failed delivery attempts.")
AGENT_REJECTED_BATCHES = Metric("ampwatch_agent_rejected_batches_total", "counter", _RANK,
                                "Batches the collector refused with a 4xx (not retried).")
AGENT_ERRORS = Metric("ampwatch_agent_errors_total", "counter", _RANK, "Internal agent errors (logged once, survived).")
AGENT_REFUSED_SPOOL_FILES = Metric("ampwatch_agent_refused_spool_files_total", "counter", _RANK,
                                   "Entries of the agent's spool refused unread: another user's, not a regular file "
                                   "or folder, or a file others may write.")
RANK_ON_SUSPECT_DEVICE = Metric("ampwatch_rank_on_suspect_device", "gauge", (*_RANK, "device"),
                                "1 while the device the rank runs on is a suspect (GET /v1/suspects, "
                                "docs/suspects.md), else 0: judged by the collector over its kept evidence.")

# Per device, across runs: the evidence GET /v1/suspects judges (docs/suspects.md).
DEVICE_ORIGIN_EVENTS = Metric("ampwatch_device_origin_events", "gauge", ("device", "host", "local_rank"),
                              "Kept skips and poisoned steps this device was the sole origin of (not calibration, "
                              "not a whole-job overflow), with or without samples.")
DEVICE_SUSPECT = Metric("ampwatch_device_suspect", "gauge", ("device", "host", "local_rank"),
                        "1 while the device is a suspect of GET /v1/suspects, else 0.")

# Per run: one collector's convenience views (rules aggregate the per-rank series instead).
RUN_RANKS_REPORTING = Metric("ampwatch_run_ranks_reporting", "gauge", _RUN,
                             "Ranks not closed and seen within the silence window.")
RUN_RANKS_IN_SKIP_STREAK = Metric("ampwatch_run_ranks_in_skip_streak", "gauge", _RUN,
                                  "Ranks with any optimizer in a skip streak.")
RUN_LOSS_SCALE_MIN = Metric("ampwatch_run_loss_scale_min", "gauge", _RUN, "Lowest loss scale across the run's ranks.")
RUN_LOSS_SCALE_MAX = Metric("ampwatch_run_loss_scale_max", "gauge", _RUN,
                            "Highest loss scale across the run's ranks.")

# The collector itself.
COLLECTOR_INGEST_REQUESTS = Metric("ampwatch_collector_ingest_requests_total", "counter", ("code",),
                                   "Ingest requests by HTTP status.")
COLLECTOR_BATCHES_APPLIED = Metric("ampwatch_collector_batches_applied_total", "counter", (), "Batches committed.")
COLLECTOR_EVENTS_APPLIED = Metric("ampwatch_collector_events_applied_total", "counter", (), "Events committed.")
COLLECTOR_DUPLICATE_BATCHES = Metric("ampwatch_collector_duplicate_batches_total", "counter", (),
                                     "Batches recognised as already applied.")
COLLECTOR_REJECTED_BATCHES = Metric("ampwatch_collector_rejected_batches_total", "counter", ("reason",),
                                    "Batches refused, by reason.")
COLLECTOR_REFUSED_REQUESTS = Metric("ampwatch_collector_refused_requests_total", "counter", ("reason",),
                                    "Requests refused before routing, and connections closed before a request, "
                                    "by reason (host, rate, read_auth, client_connections, request_timeout, "
                                    "idle_evicted).")
COLLECTOR_INGEST_DURATION = Metric("ampwatch_collector_ingest_duration_seconds", "histogram", (),
                                   "Time from request to durable answer.")
COLLECTOR_DATABASE_SIZE = Metric("ampwatch_collector_database_size_bytes", "gauge", (),
                                 "SQLite file size (database + WAL).")
COLLECTOR_RANKS_TRACKED = Metric("ampwatch_collector_ranks_tracked", "gauge", (), "Ranks currently held in memory.")
COLLECTOR_BUILD_INFO = Metric("ampwatch_collector_build_info", "gauge", ("version",), "Collector version (value 1).")
COLLECTOR_NOTIFICATIONS = Metric("ampwatch_collector_notifications_total", "counter", ("target", "outcome"),
                                 "Built-in alert notifications by target and outcome (sent, failed, dropped).")

METRICS: tuple[Metric, ...] = tuple(value for value in list(globals().values()) if isinstance(value, Metric))
"""Every metric above, in the order written."""
