"""Wire protocol v1 (docs/protocol.md): the facts the agent that sends and the collector that validates share.

The collector's schema (``ampwatch.server._schema``) enforces these
limits; the agent keeps to them before it sends (``ampwatch.agent._limits``),
so a batch from a real agent is never refused for a long name or too many
entries. ``tests/test_contract_agent.py`` checks both sides against this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import get_args

from .batch import EVENTS, DeliveryCounters, ScaleCause, fields

__all__ = [
    "PROTOCOL_VERSION", "STREAK_LADDER", "TEXT_LIMITS", "MAX_PARAMS", "MAX_SAMPLE_IDS", "MAX_SAMPLES_BEFORE",
    "MAX_BATCH_EVENTS", "EVENT_KINDS", "LISTED_EVENT_KINDS",
    "COLLECTOR_EVENT_KINDS",
    "SCALE_CAUSES", "DELIVERY_COUNTERS", "COLLECTOR_DEFAULTS", "is_rung", "HEARTBEAT_INTERVAL_S",
    "KEEP_ALIVE_S", "MAX_HEARTBEAT_INTERVAL_S", "NEWS_WITHIN_S", "NO_SCALER_KIND", "LEVEL_HEARTBEATS",
]

PROTOCOL_VERSION = 1
"""The ``protocol`` field of every batch; a collector refuses any other version (422)."""

STREAK_LADDER: tuple[int, ...] = tuple(2 ** i for i in range(11))
"""Streak lengths 1, 2, 4, ..., 1024: the keys (as strings) of ``streaks_reached``, the ``min_length``
label of ``ampwatch_optimizer_skip_streaks_total``, and the only allowed streak alert thresholds (a
streak that began and ended between two scrapes shows only on a rung)."""



def is_rung(position: int) -> bool:
    """Tell whether the ``position``-th skip of a streak (or backoff of a run) is sent as an event: 1, 2, 4, 8, ...

    A streak is reported by its rungs and its ``streak_end``, consecutive backoffs by their rungs and the
    rest at the run's end (``count``), so events grow with log2 of a storm, not its length.

    >>> [n for n in range(1, 20) if is_rung(n)]
    [1, 2, 4, 8, 16]
    """
    return position > 0 and position & (position - 1) == 0


TEXT_LIMITS: Mapping[str, int] = {
    "label": 128,             # run id, optimizer names: identities, never cut by the agent
    "param_name": 512,        # params[].name of skip and poisoned_step events, origin_params[] of skip events
    "scheduler": 256,         # scheduler_after_skip's scheduler label
    "warning_code": 128,      # warning's code
    "warning_message": 4096,  # warning's message
    "host": 255,
    "version": 64,            # agent.version, agent.torch
    "scaler_kind": 128,       # scaler.kind
    "sample_id": 128,         # samples.ids[] (a string id), of skip and poisoned_step events
    "module": 512,            # began.module
    "module_type": 128,       # began.module_type
    "device_text": 64,        # device.type, device.uuid, device.pci_bus_id
}
"""Longest string the protocol accepts per field, in characters."""

MAX_PARAMS = 16
"""Entries in one event's ``params`` list (the rest are counted in ``params_total``)."""

MAX_SAMPLE_IDS = 64
"""Ids in one ``samples.ids`` list (``samples.count`` counts them all, ``samples.digest`` covers them all)."""

MAX_SAMPLES_BEFORE = 4
"""Entries of ``samples_before``: the iterations before a streak's first skip whose samples it carries."""

MAX_BATCH_EVENTS = 10_000
"""Events in one batch."""

EVENT_KINDS: tuple[str, ...] = tuple(EVENTS)
"""Every ``kind`` an event may have (each one's fields: :data:`ampwatch.contract.batch.EVENTS`)."""

LISTED_EVENT_KINDS: tuple[str, ...] = ("loss_spike", "grad_norm_spike")
"""Kinds added to protocol 1 after its first collectors, which refuse a batch holding one (422): a collector that
takes them lists them in every 2xx answer (``"kinds": [...]``), and an agent sends an event of one only to a
collector whose answer listed it (docs/protocol.md#kinds-a-collector-lists). A new kind is added here, never
as a new protocol version."""

COLLECTOR_EVENT_KINDS = ("rank_conflict", "gradient_outlier")
"""Kinds of the events the collector records itself (never accepted from an agent), listed beside the
agents' events by ``GET /v1/runs/{run}/events``: ``rank_conflict``, two processes claim one run and rank;
``gradient_outlier``, a rank's own gradient norm stood out from the other ranks' and from its own
history (docs/alerts.md)."""

NO_SCALER_KIND = "none"
"""``scaler.kind`` of a rank that trains without a GradScaler (bf16 or float32; ``watch(None, ...)``), sent
with ``scaler.enabled`` false and null settings: nothing is scaled or skipped, so there is no loss scale
(``state.loss_scale`` null), and every optimizer step is checked for non-finite gradients (``poisoned_steps``).
A collector that does not know it takes it for a disabled scaler, which shows no loss scale either."""

SCALE_CAUSES: tuple[str, ...] = get_args(ScaleCause)
"""Why the scale changed (``ampwatch.contract.batch.ScaleCause``)."""

HEARTBEAT_INTERVAL_S = 15
"""Seconds: the agent's default ``AMPWATCH_PUSH_INTERVAL``. A rank's cumulative state reaches the collector
at least this often while it runs; news (a streak starting or reaching a rung, a poisoned step, a warning,
the close) goes within a second (a job of more than 500 ranks spreads it over up to 1.5 s). Prometheus
scrapes every 15-30 s, so a scrape rarely sees a stale count; the silence threshold
(``thresholds.silent_after_s``) is a multiple of it. A job too big for one collector to take every
rank's heartbeat that often gets a longer one by default, up to
:data:`MAX_HEARTBEAT_INTERVAL_S` (the agent's ``_schedule.default_heartbeat``)."""

NEWS_WITHIN_S = 2.0
"""Seconds: an agent sends a rank's news (a streak beginning or reaching a rung, a poisoned step, a warning, the
close) within this of it happening, whatever its job's size: its hold and its job's spread (the agent's
``_schedule``, 1.55 s) fit in it with room for the answer. A collector leans on it: a pass of its built-in alerts
that starts this long (twice over, for a loaded collector) after a rank's streak began has seen every rank whose
streak began with it (``server.alerting.early``)."""

LEVEL_HEARTBEATS = 4
"""An agent sends its rolling levels (``batch.RANK_LEVELS``, ``batch.OPTIMIZER_LEVELS``) in a batch at most once
every this many heartbeats, and in its last batch; a collector keeps a process's last ones for the batches in
between. In every batch they cost 19% more bytes per rank-hour in a healthy run (``bench.healthy``); a level over
128 iterations moves slowly, so a minute's resolution at the default heartbeat loses nothing."""

MAX_HEARTBEAT_INTERVAL_S = 30
"""Seconds: the longest default push interval, that of the biggest jobs. The silence threshold
(``thresholds.silent_after_s``, 120 s) stays at least 4 heartbeats, as docs/alerts.md asks of any push
interval (a healthy rank's batches are at most 1.5 heartbeats apart: 45 s), and a rank's connection stays
open between its batches (:data:`KEEP_ALIVE_S`)."""

KEEP_ALIVE_S = 65
"""Seconds a collector keeps an agent's idle kept-alive connection open by default (``--keep-alive``): above
the longest wait between one rank's batches at any default heartbeat (1.5 heartbeats: 22.5 s at 15 s, 45 s
at :data:`MAX_HEARTBEAT_INTERVAL_S`) and at a push interval of 40 s, so every batch of a running rank
reuses its connection. Below it, each heartbeat opened a new connection (a TCP handshake, with TLS a TLS
one too): at ``COLLECTOR_DEFAULTS["max_ranks_per_run"]`` ranks that was a quarter of the collector's CPU."""

DELIVERY_COUNTERS: tuple[str, ...] = fields(DeliveryCounters)
"""Keys of ``state.delivery``: the agent's own health counters."""

COLLECTOR_DEFAULTS: Mapping[str, int] = {
    "max_body_bytes": 8 * 1024 * 1024,  # past it: 413; the agent splits a batch's events to stay under it
    "max_runs": 1000,                   # past it: back-pressure (429, Retry-After), clears as finished runs retire
    "max_ranks_per_run": 16_384,        # past it: refused for good (422); a 2,048-node x 8-GPU job fits
    "max_optimizers_per_rank": 16,      # past it: refused for good (422); a rank's optimizers do not change
}
"""A collector's limits with default settings (its ``--max-*`` options): the collector's defaults, and what
``watch()`` warns about when a job is larger."""
