"""The /metrics exposition: metric names defined once, rendered fresh from the in-memory state at each scrape.

Why a hand renderer for the per-rank series: 1,024 ranks x 2 optimizers is ~50,000 samples, and
prometheus_client's ``generate_latest`` formats them in ~0.7 s on this machine; formatting lines from
label strings cached per rank takes a few tens of milliseconds. The collector's own metrics (a few
dozen series) use prometheus_client objects on the app's own registry, with a custom Collector for the
values read at scrape time.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ._floats import exposition_float, promql_max, promql_min
from ._schema import STREAK_LADDER
from ._state import DELIVERY_COUNTERS, CollectorState, RankState, escape_label

__all__ = ["CONTENT_TYPE", "FAMILIES", "render_ranks", "scrape", "SelfMetrics"]

# We write the classic text format 0.0.4 (what Prometheus asks for by default).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    name: str
    type: str
    help: str
    scope: str  # "optimizer", "rank" or "run"

    @property
    def header(self) -> str:
        return f"# HELP {self.name} {self.help}\n# TYPE {self.name} {self.type}\n"


def _f(name: str, kind: str, scope: str, help: str) -> Family:
    return Family(name, kind, help, scope)


# The one list of exposed names (docs/metrics.md documents each; tests check they agree).
STEPS = _f("ampwatch_optimizer_steps_total", "counter", "optimizer",
           "scaler.step(opt) calls that updated parameters.")
SKIPPED = _f("ampwatch_optimizer_skipped_steps_total", "counter", "optimizer",
             "scaler.step(opt) calls skipped because the unscaled gradients held inf/NaN.")
CONSECUTIVE = _f("ampwatch_optimizer_consecutive_skipped_steps", "gauge", "optimizer",
                 "Length of the current skip streak (0 once the optimizer steps again).")
LONGEST = _f("ampwatch_optimizer_longest_skip_streak", "gauge", "optimizer", "Longest skip streak seen so far.")
STREAKS = _f("ampwatch_optimizer_skip_streaks_total", "counter", "optimizer",
             "Skip streaks that reached at least min_length consecutive skips, counted when they reach it.")
SCHEDULER = _f("ampwatch_optimizer_scheduler_steps_after_skip_total", "counter", "optimizer",
               "LR scheduler steps taken right after a skipped step of this optimizer.")
POISONED = _f("ampwatch_optimizer_poisoned_steps_total", "counter", "optimizer",
              "Steps that updated parameters with non-finite gradients, or left parameters non-finite.")
NONFINITE = _f("ampwatch_nonfinite_gradient_info", "gauge", "optimizer",
               "The latest parameter named as holding non-finite gradients on a skip (value 1).")
LOSS_SCALE = _f("ampwatch_loss_scale", "gauge", "rank", "Current loss scale of the rank's GradScaler.")
BACKOFFS = _f("ampwatch_loss_scale_backoffs_total", "counter", "rank",
              "update() calls that multiplied the scale by backoff_factor.")
GROWTHS = _f("ampwatch_loss_scale_growths_total", "counter", "rank",
             "update() calls that multiplied the scale by growth_factor.")
MANUAL = _f("ampwatch_loss_scale_manual_sets_total", "counter", "rank",
            "update(new_scale=...) calls that changed the scale.")
ITERATION = _f("ampwatch_iteration", "gauge", "rank", "Number of scaler.update() calls so far.")
LAST_SEEN = _f("ampwatch_rank_last_seen_timestamp_seconds", "gauge", "rank",
               "Unix time of the last batch received from the rank.")
CLOSED = _f("ampwatch_rank_closed", "gauge", "rank", "1 once the rank closed cleanly, else 0.")
INFO = _f("ampwatch_rank_info", "gauge", "rank", "Identity of the rank (value 1).")
DELIVERY = {
    "dropped_events": _f("ampwatch_agent_dropped_events_total", "counter", "rank",
                         "Events the agent dropped because its buffer was full."),
    "send_failures": _f("ampwatch_agent_send_failures_total", "counter", "rank", "Failed delivery attempts."),
    "rejected_batches": _f("ampwatch_agent_rejected_batches_total", "counter", "rank",
                           "Batches the collector refused with a 4xx (not retried)."),
    "agent_errors": _f("ampwatch_agent_errors_total", "counter", "rank",
                       "Internal agent errors (logged once, survived)."),
}
RUN_REPORTING = _f("ampwatch_run_ranks_reporting", "gauge", "run",
                   "Ranks not closed and seen within the silence window.")
RUN_IN_STREAK = _f("ampwatch_run_ranks_in_skip_streak", "gauge", "run", "Ranks with any optimizer in a skip streak.")
RUN_SCALE_MIN = _f("ampwatch_run_loss_scale_min", "gauge", "run", "Lowest loss scale across the run's ranks.")
RUN_SCALE_MAX = _f("ampwatch_run_loss_scale_max", "gauge", "run", "Highest loss scale across the run's ranks.")

_OPTIMIZER_TOTALS = [(STEPS, "steps"), (SKIPPED, "skipped"), (SCHEDULER, "scheduler_steps_after_skip"),
                     (POISONED, "poisoned_steps")]
_RANK_TOTALS = [(BACKOFFS, "backoffs"), (GROWTHS, "growths"), (MANUAL, "manual_sets")] + \
               [(DELIVERY[name], name) for name in DELIVERY_COUNTERS]

FAMILIES: tuple[Family, ...] = (
    STEPS, SKIPPED, CONSECUTIVE, LONGEST, STREAKS, SCHEDULER, POISONED, NONFINITE, LOSS_SCALE, BACKOFFS,
    GROWTHS, MANUAL, ITERATION, LAST_SEEN, CLOSED, INFO, *DELIVERY.values(), RUN_REPORTING, RUN_IN_STREAK,
    RUN_SCALE_MIN, RUN_SCALE_MAX,
)


def _consecutive(rank: RankState, optimizer: str) -> int:
    values = rank.current.batch.state.optimizers.get(optimizer) if rank.current else None
    return values.consecutive_skipped if values is not None else 0


def _loss_scale(rank: RankState) -> Optional[float]:
    batch = rank.current.batch if rank.current else None
    if batch is None or not batch.scaler.enabled:
        return None
    return batch.state.loss_scale


def _info_labels(rank: RankState) -> str:
    batch = rank.current.batch
    return (f'{rank.labels},host="{escape_label(batch.host)}",local_rank="{batch.local_rank}",'
            f'world_size="{batch.world_size}",scaler_enabled="{str(batch.scaler.enabled).lower()}",'
            f'scaler_kind="{escape_label(batch.scaler.kind)}",agent_version="{escape_label(batch.agent.version)}"')


def render_ranks(state: CollectorState, now: float, silent_after: float) -> str:
    """Render every per-optimizer, per-rank and per-run family (text format 0.0.4)."""
    ranks = [r for ranks in state.runs.values() for r in ranks.values() if r.current is not None]
    out: list[str] = []
    add = out.append
    for family, field in _OPTIMIZER_TOTALS:
        add(family.header)
        name = family.name
        for r in ranks:
            for opt, labels in r.optimizer_labels.items():
                add(f"{name}{{{labels}}} {r.totals[opt].get(field, 0)}\n")
    for family, value in ((CONSECUTIVE, _consecutive), (LONGEST, RankState.longest_streak)):
        add(family.header)
        for r in ranks:
            for opt, labels in r.optimizer_labels.items():
                add(f"{family.name}{{{labels}}} {value(r, opt)}\n")
    add(STREAKS.header)
    for r in ranks:
        version, text = r.ladder_text
        if version != r.ladder_version:  # these lines rarely change: format them only when they do
            text = "".join(f'{STREAKS.name}{{{labels},min_length="{length}"}} {r.totals[opt].get("reached_" + length, 0)}\n'
                           for opt, labels in r.optimizer_labels.items()
                           for length in STREAK_LADDER)  # every rung from the start: increase() needs the 0
            r.ladder_text = (r.ladder_version, text)
        add(text)
    add(NONFINITE.header)
    for r in ranks:
        for opt, labels in r.optimizer_labels.items():
            param = r.latest_nonfinite(opt)
            if param is not None:
                add(f'{NONFINITE.name}{{{labels},parameter="{escape_label(param)}"}} 1\n')
    add(LOSS_SCALE.header)
    for r in ranks:
        scale = _loss_scale(r)
        if scale is not None:
            add(f"{LOSS_SCALE.name}{{{r.labels}}} {exposition_float(scale)}\n")
    for family, field in _RANK_TOTALS:
        add(family.header)
        for r in ranks:
            add(f"{family.name}{{{r.labels}}} {r.totals[''].get(field, 0)}\n")
    add(ITERATION.header)
    for r in ranks:
        add(f"{ITERATION.name}{{{r.labels}}} {r.current.batch.state.iteration}\n")
    add(LAST_SEEN.header)
    for r in ranks:
        add(f"{LAST_SEEN.name}{{{r.labels}}} {r.last_seen!r}\n")
    add(CLOSED.header)
    for r in ranks:
        add(f"{CLOSED.name}{{{r.labels}}} {int(r.closed)}\n")
    add(INFO.header)
    for r in ranks:
        add(f"{INFO.name}{{{_info_labels(r)}}} 1\n")
    _render_runs(state, now, silent_after, add)
    return "".join(out)


def _render_runs(state: CollectorState, now: float, silent_after: float, add: Callable[[str], None]) -> None:
    rows = []
    for run, ranks in state.runs.items():
        live = [r for r in ranks.values() if r.current is not None]
        reporting = sum(1 for r in live if not r.closed and r.last_seen + silent_after > now)
        in_streak = sum(1 for r in live if not r.closed and any(_consecutive(r, o) for o in r.optimizer_labels))
        scales = [s for s in map(_loss_scale, live) if s is not None]
        rows.append((f'run="{escape_label(run)}"', reporting, in_streak, scales))
    for family, pick in ((RUN_REPORTING, lambda row: row[1]), (RUN_IN_STREAK, lambda row: row[2]),
                         # As PromQL's min/max (NaN only when every scale is NaN), as the rules compute them.
                         (RUN_SCALE_MIN, lambda row: promql_min(row[3]) if row[3] else None),
                         (RUN_SCALE_MAX, lambda row: promql_max(row[3]) if row[3] else None)):
        add(family.header)
        for row in rows:
            value = pick(row)
            if value is not None:
                add(f"{family.name}{{{row[0]}}} {exposition_float(value)}\n")


class SelfMetrics(Collector):
    """The collector's own metrics, on a registry of their own (one per app, so tests stay isolated)."""

    def __init__(self, state: CollectorState, db_size: Callable[[], int], version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ampwatch_collector_ingest_requests", "Ingest requests by HTTP status.",
                                ["code"], registry=r)
        self.batches = Counter("ampwatch_collector_batches_applied", "Batches committed.", registry=r)
        self.events = Counter("ampwatch_collector_events_applied", "Events committed.", registry=r)
        self.duplicates = Counter("ampwatch_collector_duplicate_batches",
                                  "Batches recognised as already applied.", registry=r)
        self.rejected = Counter("ampwatch_collector_rejected_batches", "Batches refused, by reason.",
                                ["reason"], registry=r)
        self.latency = Histogram("ampwatch_collector_ingest_duration_seconds",
                                 "Time from request to durable answer.", registry=r,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        self._state, self._db_size, self._version = state, db_size, version
        r.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Yield the values read at scrape time."""
        yield GaugeMetricFamily("ampwatch_collector_database_size_bytes", "SQLite file size (database + WAL).",
                                value=self._db_size())
        yield GaugeMetricFamily("ampwatch_collector_ranks_tracked", "Ranks currently held in memory.",
                                value=self._state.rank_count())
        info = GaugeMetricFamily("ampwatch_collector_build_info", "Collector version (value 1).",
                                 labels=["version"])
        info.add_metric([self._version], 1)
        yield info

    def describe(self) -> list:
        return []  # values are read at scrape time; nothing to pre-register

    def render(self) -> str:
        """Render the collector's own metrics."""
        return generate_latest(self.registry).decode()


def scrape(state: CollectorState, own: SelfMetrics, silent_after: float, now: Optional[float] = None) -> str:
    """Return the full /metrics body."""
    return render_ranks(state, time.time() if now is None else now, silent_after) + own.render()
