"""The /metrics exposition: metric names defined once, rendered fresh from the in-memory state at each scrape.

Why a hand renderer for the per-rank series: 1,024 ranks x 2 optimizers is ~50,000 samples, and
prometheus_client's ``generate_latest`` formats them in ~0.7 s on this machine; formatting lines from
label strings cached per rank takes a few tens of milliseconds. The collector's own metrics (a few
dozen series) use prometheus_client objects on the app's own registry, with a custom Collector for the
values read at scrape time.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ampwatch.contract import metrics as m
from ampwatch.contract.protocol import STREAK_LADDER

from ._floats import exposition_float, promql_max, promql_min
from ._state import CollectorState, RankState, escape_label

__all__ = ["CONTENT_TYPE", "render_ranks", "scrape", "SelfMetrics", "NotificationMetrics"]

# We write the classic text format 0.0.4 (what Prometheus asks for by default).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


_HEADERS = {metric: f"# HELP {metric.name} {metric.help}\n# TYPE {metric.name} {metric.type}\n"
            for metric in m.METRICS}

_OPTIMIZER_TOTALS = [(m.OPTIMIZER_STEPS, "steps"), (m.OPTIMIZER_SKIPPED_STEPS, "skipped"),
                     (m.OPTIMIZER_SCHEDULER_STEPS_AFTER_SKIP, "scheduler_steps_after_skip"),
                     (m.OPTIMIZER_POISONED_STEPS, "poisoned_steps")]
_RANK_TOTALS = [(m.LOSS_SCALE_BACKOFFS, "backoffs"), (m.LOSS_SCALE_GROWTHS, "growths"),
                (m.LOSS_SCALE_MANUAL_SETS, "manual_sets"), (m.AGENT_DROPPED_EVENTS, "dropped_events"),
                (m.AGENT_SEND_FAILURES, "send_failures"), (m.AGENT_REJECTED_BATCHES, "rejected_batches"),
                (m.AGENT_ERRORS, "agent_errors")]


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
        add(_HEADERS[family])
        name = family.name
        for r in ranks:
            for opt, labels in r.optimizer_labels.items():
                add(f"{name}{{{labels}}} {r.totals[opt].get(field, 0)}\n")
    for family, value in ((m.OPTIMIZER_CONSECUTIVE_SKIPPED, _consecutive), (m.OPTIMIZER_LONGEST_SKIP_STREAK, RankState.longest_streak)):
        add(_HEADERS[family])
        for r in ranks:
            for opt, labels in r.optimizer_labels.items():
                add(f"{family.name}{{{labels}}} {value(r, opt)}\n")
    add(_HEADERS[m.OPTIMIZER_SKIP_STREAKS])
    for r in ranks:
        version, text = r.ladder_text
        if version != r.ladder_version:  # these lines rarely change: format them only when they do
            text = "".join(f'{m.OPTIMIZER_SKIP_STREAKS}{{{labels},min_length="{length}"}} {r.totals[opt].get(f"reached_{length}", 0)}\n'
                           for opt, labels in r.optimizer_labels.items()
                           for length in STREAK_LADDER)  # every rung from the start: increase() needs the 0
            r.ladder_text = (r.ladder_version, text)
        add(text)
    add(_HEADERS[m.NONFINITE_GRADIENT_INFO])
    for r in ranks:
        for opt, labels in r.optimizer_labels.items():
            param = r.latest_nonfinite(opt)
            if param is not None:
                add(f'{m.NONFINITE_GRADIENT_INFO}{{{labels},parameter="{escape_label(param)}"}} 1\n')
    add(_HEADERS[m.LOSS_SCALE])
    for r in ranks:
        scale = _loss_scale(r)
        if scale is not None:
            add(f"{m.LOSS_SCALE}{{{r.labels}}} {exposition_float(scale)}\n")
    for family, field in _RANK_TOTALS:
        add(_HEADERS[family])
        for r in ranks:
            add(f"{family.name}{{{r.labels}}} {r.totals[''].get(field, 0)}\n")
    add(_HEADERS[m.ITERATION])
    for r in ranks:
        add(f"{m.ITERATION}{{{r.labels}}} {r.current.batch.state.iteration}\n")
    add(_HEADERS[m.RANK_LAST_SEEN])
    for r in ranks:
        add(f"{m.RANK_LAST_SEEN}{{{r.labels}}} {r.last_seen!r}\n")
    add(_HEADERS[m.RANK_CLOSED])
    for r in ranks:
        add(f"{m.RANK_CLOSED}{{{r.labels}}} {int(r.closed)}\n")
    add(_HEADERS[m.RANK_INFO])
    for r in ranks:
        add(f"{m.RANK_INFO}{{{_info_labels(r)}}} 1\n")
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
    for family, pick in ((m.RUN_RANKS_REPORTING, lambda row: row[1]), (m.RUN_RANKS_IN_SKIP_STREAK, lambda row: row[2]),
                         # As PromQL's min/max (NaN only when every scale is NaN), as the rules compute them.
                         (m.RUN_LOSS_SCALE_MIN, lambda row: promql_min(row[3]) if row[3] else None),
                         (m.RUN_LOSS_SCALE_MAX, lambda row: promql_max(row[3]) if row[3] else None)):
        add(_HEADERS[family])
        for row in rows:
            value = pick(row)
            if value is not None:
                add(f"{family.name}{{{row[0]}}} {exposition_float(value)}\n")


class SelfMetrics(Collector):
    """The collector's own metrics, on a registry of their own (one per app, so tests stay isolated)."""

    def __init__(self, state: CollectorState, db_size: Callable[[], int], version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = _counter(m.COLLECTOR_INGEST_REQUESTS, r)
        self.batches = _counter(m.COLLECTOR_BATCHES_APPLIED, r)
        self.events = _counter(m.COLLECTOR_EVENTS_APPLIED, r)
        self.duplicates = _counter(m.COLLECTOR_DUPLICATE_BATCHES, r)
        self.rejected = _counter(m.COLLECTOR_REJECTED_BATCHES, r)
        self.latency = Histogram(m.COLLECTOR_INGEST_DURATION.name, m.COLLECTOR_INGEST_DURATION.help, registry=r,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        self._state, self._db_size, self._version = state, db_size, version
        r.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Yield the values read at scrape time."""
        yield GaugeMetricFamily(m.COLLECTOR_DATABASE_SIZE.name, m.COLLECTOR_DATABASE_SIZE.help, value=self._db_size())
        yield GaugeMetricFamily(m.COLLECTOR_RANKS_TRACKED.name, m.COLLECTOR_RANKS_TRACKED.help,
                                value=self._state.rank_count())
        info = GaugeMetricFamily(m.COLLECTOR_BUILD_INFO.name, m.COLLECTOR_BUILD_INFO.help,
                                 labels=list(m.COLLECTOR_BUILD_INFO.labels))
        info.add_metric([self._version], 1)
        yield info

    def describe(self) -> list:
        return []  # values are read at scrape time; nothing to pre-register

    def render(self) -> str:
        """Render the collector's own metrics."""
        return generate_latest(self.registry).decode()


class NotificationMetrics(Collector):
    """Expose ``ampwatch_collector_notifications_total{target,outcome}``, read at scrape time from ``counts()``."""

    def __init__(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self._counts()
        if not counts:  # no target configured: no family at all, rather than an empty one
            return
        metric = m.COLLECTOR_NOTIFICATIONS
        family = CounterMetricFamily(metric.name.removesuffix("_total"), metric.help, labels=list(metric.labels))
        for (target, outcome), value in sorted(counts.items()):
            family.add_metric([target, outcome], value)
        yield family

    def describe(self) -> list:
        return []


def _counter(metric: m.Metric, registry: CollectorRegistry) -> Counter:
    """Return a prometheus_client Counter exposing ``metric`` (it appends ``_total`` itself)."""
    return Counter(metric.name.removesuffix("_total"), metric.help, list(metric.labels), registry=registry)


def scrape(state: CollectorState, own: SelfMetrics, silent_after: float, now: Optional[float] = None) -> str:
    """Return the full /metrics body."""
    return render_ranks(state, time.time() if now is None else now, silent_after) + own.render()
