"""The /metrics exposition: the contract's series, rendered from the ranks' views at each scrape.

Why a hand renderer for the per-rank series: 1,024 ranks x 2 optimizers is ~50,000 samples, and
prometheus_client's ``generate_latest`` formats them an order of magnitude slower than formatting lines
from label strings cached per rank (figures: docs/collector.md#speed). The collector's own metrics (a few
dozen series) use prometheus_client objects on the app's own registry, with a custom Collector for the
values read at scrape time.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ampwatch.contract import metrics as m
from ampwatch.contract.protocol import STREAK_LADDER

from ._floats import exposition_float, promql_max, promql_min
from ._pacing import paced as _paced
from ._state import CollectorState, RankState, RankView

__all__ = ["CONTENT_TYPE", "RENDER_PAUSE_S", "Exposition", "SelfMetrics", "NotificationMetrics", "accepts_gzip",
           "gzip_exposition"]

# We write the classic text format 0.0.4 (what Prometheus asks for by default).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

def accepts_gzip(accept_encoding: str) -> bool:
    """Return whether an ``Accept-Encoding`` header accepts gzip: named with a q above 0, or else ``*`` so."""
    q_of: dict[str, float] = {}
    for part in accept_encoding.split(","):
        coding, _, params = part.partition(";")
        q = 1.0
        name, _, value = params.partition("=")
        if name.strip().lower() == "q":
            try:
                q = float(value)
            except ValueError:
                q = 0.0
        q_of[coding.strip().lower()] = q
    return q_of.get("gzip", q_of.get("*", 0.0)) > 0


def gzip_exposition(body: str) -> bytes:
    """Return the exposition gzipped at level 1: about 20 ms and a tenth of the size for 1,024 ranks."""
    return gzip.compress(body.encode(), compresslevel=1, mtime=0)


_HEADERS = {metric: f"# HELP {metric.name} {metric.help}\n# TYPE {metric.name} {metric.type}\n"
            for metric in m.METRICS}

_OPTIMIZER_TOTALS = ((m.OPTIMIZER_STEPS, "steps"), (m.OPTIMIZER_SKIPPED_STEPS, "skipped"),
                     (m.OPTIMIZER_SCHEDULER_STEPS_AFTER_SKIP, "scheduler_steps_after_skip"),
                     (m.OPTIMIZER_POISONED_STEPS, "poisoned_steps"), (m.OPTIMIZER_GRAD_NORM_SPIKES, "grad_norm_spikes"))
_RANK_TOTALS = ((m.LOSS_SCALE_BACKOFFS, "backoffs"), (m.LOSS_SCALE_GROWTHS, "growths"),
                (m.LOSS_SCALE_MANUAL_SETS, "manual_sets"), (m.AGENT_DROPPED_EVENTS, "dropped_events"),
                (m.AGENT_SEND_FAILURES, "send_failures"), (m.AGENT_REJECTED_BATCHES, "rejected_batches"),
                (m.AGENT_ERRORS, "agent_errors"), (m.RANK_ORIGIN_ITERATIONS, "origin_iterations"),
                (m.AGENT_REFUSED_SPOOL_FILES, "refused_spool_files"), (m.LOSS_SPIKES, "loss_spikes"))


def escape_label(value: str) -> str:
    """Escape a label value for the Prometheus text format."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _RankLines:
    """One rank's label strings, its streak-ladder lines with the ladder tuples they were formatted from, and
    (in a collector holding :data:`KEEP_LINES_FROM` ranks or more) all its lines with the view they came from."""

    __slots__ = ("rank", "optimizers", "ladder_from", "ladder", "view", "lines")

    def __init__(self, rank: RankState) -> None:
        self.rank = f'run="{escape_label(rank.run)}",rank="{rank.rank}"'
        self.optimizers: dict[str, str] = {}
        self.ladder_from: list[tuple[int, ...]] = []
        self.ladder = ""
        self.view: RankView | None = None  # the view ``lines`` were formatted from
        self.lines: tuple[str, ...] = ()

    def block(self, view: RankView, keep: bool) -> tuple[str, ...]:
        """Return the rank's lines of each of :data:`_FAMILIES` as of ``view``; ``keep``: keep them until the
        view changes (about 4 KiB a rank), so that the next scrape formats them only if it is new."""
        if view is self.view:
            return self.lines
        lines = _format_rank(view, self)
        self.lines, self.view = (lines, view) if keep else ((), None)
        return lines

    def labels(self, view: RankView) -> dict[str, str]:
        """Return ``{optimizer: its label string}`` for every optimizer of the rank (as of ``view``)."""
        if len(self.optimizers) != len(view.optimizer_totals):
            for name in view.optimizers():
                if name not in self.optimizers:
                    self.optimizers[name] = f'{self.rank},optimizer="{escape_label(name)}"'
        return self.optimizers

    def ladder_lines(self, view: RankView) -> str:
        """Return the streak-ladder lines of the rungs reached, formatted again only when a ladder moved."""
        ladders = [totals.streaks_reached for totals in view.optimizer_totals.values()]
        # Totals hand an unmoved ladder on as the same tuple; a held reference keeps its id from being reused.
        if len(ladders) != len(self.ladder_from) or \
                any(a is not b for a, b in zip(ladders, self.ladder_from, strict=True)):
            name = m.OPTIMIZER_SKIP_STREAKS.name
            self.ladder = "".join(
                f'{name}{{{labels},min_length="{length}"}} {count}\n'
                for labels, reached in zip(self.labels(view).values(), ladders, strict=True)
                for length, count in zip(STREAK_LADDER, reached, strict=True) if count)
            # A rung appears once a streak reached it (48% of all samples at 1,024 ranks were zero rungs): the
            # rules' "new and non-zero" term (dashboards/forms.py, counter_rose) catches its first count.
            self.ladder_from = ladders
        return self.ladder


def _loss_scale(view: RankView) -> float | None:
    batch = view.current.batch if view.current else None
    if batch is None or not batch.scaler.enabled:
        return None
    return batch.state.loss_scale


def _info_labels(view: RankView, labels: str) -> str:
    batch = view.owner.batch
    return (f'{labels},host="{escape_label(batch.host)}",local_rank="{batch.local_rank}",'
            f'world_size="{batch.world_size}",scaler_enabled="{str(batch.scaler.enabled).lower()}",'
            f'scaler_kind="{escape_label(batch.scaler.kind)}",agent_version="{escape_label(batch.agent.version)}"')


_SCALAR_OPTIMIZER = ((m.OPTIMIZER_CONSECUTIVE_SKIPPED, RankView.consecutive_skipped),
                     (m.OPTIMIZER_LONGEST_SKIP_STREAK, RankView.longest_streak))
_SCALAR_RANK = ((m.ITERATION, lambda v: v.current.batch.state.iteration),
                (m.RANK_LAST_SEEN, lambda v: repr(v.last_seen)),
                (m.RANK_CLOSED, lambda v: int(v.closed)),
                (m.RANK_CONFLICTS, lambda v: len(v.conflicting)),
                (m.RANK_GRADIENT_OUTLIERS, lambda v: v.gradient_outliers))
# The rolling levels (wire SignalLevel): the newest process's, exposed only while it sends one.
_OPTIMIZER_LEVELS = (("grad_norm", m.OPTIMIZER_GRAD_NORM_MEAN, m.OPTIMIZER_GRAD_NORM_STD),
                     ("local_grad_norm", m.OPTIMIZER_LOCAL_GRAD_NORM_MEAN, m.OPTIMIZER_LOCAL_GRAD_NORM_STD))
_RANK_LEVELS = (("loss", m.LOSS_MEAN, m.LOSS_STD),)
_FAMILIES = (*(metric for metric, _ in _OPTIMIZER_TOTALS), *(metric for metric, _ in _SCALAR_OPTIMIZER),
             *(metric for _, mean, std in _OPTIMIZER_LEVELS for metric in (mean, std)),
             m.OPTIMIZER_SKIP_STREAKS, m.NONFINITE_GRADIENT_INFO, m.LOSS_SCALE,
             *(metric for metric, _ in _RANK_TOTALS), *(metric for metric, _ in _SCALAR_RANK),
             *(metric for _, mean, std in _RANK_LEVELS for metric in (mean, std)), m.RANK_INFO)
"""The per-rank families in the order /metrics lists them (each family's lines together, as the format asks)."""
_NUMBERED_FAMILIES = tuple(enumerate(_FAMILIES))


def _format_rank(v: RankView, lines: _RankLines) -> tuple[str, ...]:
    """Return one rank's lines of each of :data:`_FAMILIES`, in that order (a family it has no sample of: "")."""
    labels = lines.labels(v)
    totals = v.optimizer_totals
    out = ["".join(f"{metric.name}{{{label}}} {getattr(totals[opt], field)}\n" for opt, label in labels.items())
           for metric, field in _OPTIMIZER_TOTALS]
    out += ["".join(f"{metric.name}{{{label}}} {value(v, opt)}\n" for opt, label in labels.items())
            for metric, value in _SCALAR_OPTIMIZER]
    state = v.owner.batch.state
    for field, mean, std in _OPTIMIZER_LEVELS:
        levels = [(label, level) for opt, label in labels.items()
                  if (sent := state.optimizers.get(opt)) is not None and (level := getattr(sent, field)) is not None]
        out += ["".join(f"{metric.name}{{{label}}} {exposition_float(getattr(level, part))}\n"
                        for label, level in levels) for metric, part in ((mean, "mean"), (std, "std"))]
    out.append(lines.ladder_lines(v))
    named = m.NONFINITE_GRADIENT_INFO.name
    out.append("".join(f'{named}{{{label},parameter="{escape_label(param)}"}} 1\n'
                       for opt, label in labels.items() if (param := v.latest_nonfinite(opt)) is not None))
    scale = _loss_scale(v)
    out.append("" if scale is None else f"{m.LOSS_SCALE.name}{{{lines.rank}}} {exposition_float(scale)}\n")
    out += [f"{metric.name}{{{lines.rank}}} {getattr(v.totals, field)}\n" for metric, field in _RANK_TOTALS]
    out += [f"{metric.name}{{{lines.rank}}} {value(v)}\n" for metric, value in _SCALAR_RANK]
    for field, mean, std in _RANK_LEVELS:
        level = getattr(state, field)
        out += ["" if level is None else f"{metric.name}{{{lines.rank}}} {exposition_float(getattr(level, part))}\n"
                for metric, part in ((mean, "mean"), (std, "std"))]
    out.append(f"{m.RANK_INFO.name}{{{_info_labels(v, lines.rank)}}} 1\n")
    return tuple(out)


RENDER_WORK_S = 0.005
"""Formatting between two pauses of the worker-thread render: the interpreter's switch interval. After a pause
the render waits for the GIL up to that long while the event loop is busy (a storm's ingest): a millisecond
of work between pauses made a render in a storm several times slower than its CPU time."""
KEEP_LINES_FROM = 4096
"""Ranks held from which each rank's lines are kept between scrapes: at the contract's default
``max_ranks_per_run`` (``COLLECTOR_DEFAULTS``) ranks x 2 optimizers a render with half the ranks changed then
takes about 0.75 s of CPU instead of 1.8 s (``python -m bench.experiments.metrics_render``) for about 4 KiB a
rank; below, a render takes a tenth of a second or less and the memory is not worth it."""
RENDER_PAUSE_S = 0.001  # what the app's worker-thread render sleeps between them


class Exposition:
    """Render ``/metrics`` from the state at each scrape; keeps each rank's label strings between scrapes.

    Costs about 50 ms at 1,024 ranks x 2 optimizers, about 0.7 s of CPU at the default ``max_ranks_per_run``
    (``bench.experiments.metrics_render``), nearly all of it formatting lines. Safe to run in a worker thread
    while the event loop applies batches: it reads one :class:`RankView` per rank (all of one batch, never
    half), and one render runs at a time. The cache is rebuilt from the ranks held at each scrape, so a rank
    that left memory leaves it too.
    """

    def __init__(self, state: CollectorState, own: SelfMetrics, silent_after: float,
                 clock: Callable[[], float] = time.time, pause_s: float = 0.0,
                 busy: Callable[[], bool] | None = None, keep_lines_from: int = KEEP_LINES_FROM,
                 suspects: Callable[[], dict] | None = None) -> None:
        self.state, self.own, self.silent_after, self.clock = state, own, silent_after, clock
        self.suspects = suspects
        """The suspects as judged now (``SuspectJudge.current``: it reads the database once per change)."""
        self.pause_s = pause_s
        """Sleep this long after each :data:`RENDER_WORK_S` of formatting: the app renders in a worker thread
        (``_pacing``)."""
        self.busy = busy
        """Whether the event loop has work now (ingest requests in flight): pause only then (None: always)."""
        self.keep_lines_from = keep_lines_from
        """Keep each rank's lines between scrapes while at least this many ranks are held."""
        self._lines: dict[RankState, _RankLines] = {}
        self._rendering = threading.Lock()  # the label cache is one render's at a time

    def render(self, now: float | None = None) -> str:
        """Return the full /metrics body: every rank's series, then the collector's own."""
        return self.render_ranks(self.clock() if now is None else now) + self.own.render()

    def render_ranks(self, now: float) -> str:
        """Render every per-optimizer, per-rank and per-run family (text format 0.0.4)."""
        with self._rendering:
            return self._render_ranks(self.state.views(), now)

    def _render_ranks(self, held: list[tuple[RankState, RankView]], now: float) -> str:
        cached = self._lines
        self._lines = by_rank = {r: cached.get(r) or _RankLines(r) for r, _ in held}
        ranks = [(v, by_rank[r]) for r, v in held]
        # A big job's ranks keep their lines of every family, formatted again only when the view changed
        # since the last scrape (a view is replaced whole by each applied batch): at a 30 s heartbeat and
        # 15 s scrapes, about half the ranks are unchanged from one scrape to the next.
        keep = len(ranks) >= self.keep_lines_from
        blocks = [lines.block(v, keep) for v, lines in _paced(ranks, RENDER_WORK_S, self.pause_s, self.busy)]
        out: list[str] = []
        for family, metric in _paced(_NUMBERED_FAMILIES, RENDER_WORK_S, self.pause_s, self.busy):
            out.append(_HEADERS[metric])
            out.extend(block[family] for block in blocks)
        self._render_suspects(ranks, out.append)
        self._render_runs([v for v, _ in ranks], now, out.append)
        return "".join(out)

    def _render_suspects(self, ranks: list[tuple[RankView, _RankLines]], add: Callable[[str], None]) -> None:
        """Each rank's ``on_suspect_device`` (not kept with its lines: the judgement moves without a batch), and
        each device's evidence counts (docs/suspects.md), as judged now."""
        judged = self.suspects() if self.suspects is not None else {"devices": [], "origin_events": []}
        suspected = {d["device"] for d in judged["devices"]}
        name = m.RANK_ON_SUSPECT_DEVICE.name
        add(_HEADERS[m.RANK_ON_SUSPECT_DEVICE])
        for v, lines in ranks:
            device = v.device()
            add(f'{name}{{{lines.rank},device="{escape_label(device)}"}} {int(device in suspected)}\n')
        devices = {d["device"]: d for d in judged["origin_events"]}
        for metric, value in ((m.DEVICE_ORIGIN_EVENTS, lambda d: d["origin_events"]),
                              (m.DEVICE_SUSPECT, lambda d: int(d["device"] in suspected))):
            add(_HEADERS[metric])
            for d in devices.values():
                add(f'{metric.name}{{device="{escape_label(d["device"])}",host="{escape_label(d["host"])}",'
                    f'local_rank="{d["local_rank"]}"}} {value(d)}\n')

    def _render_runs(self, views: list[RankView], now: float, add: Callable[[str], None]) -> None:
        by_run: dict[str, list[RankView]] = {}
        for v in views:
            by_run.setdefault(v.run, []).append(v)
        rows = []
        for run, live in by_run.items():
            reporting = sum(1 for v in live if not v.closed and v.last_seen + self.silent_after > now)
            in_streak = sum(1 for v in live
                            if not v.closed and any(v.consecutive_skipped(o) for o in v.optimizers()))
            scales = [s for s in map(_loss_scale, live) if s is not None]
            rows.append((f'run="{escape_label(run)}"', reporting, in_streak, scales))
        for metric, pick in ((m.RUN_RANKS_REPORTING, lambda row: row[1]),
                             (m.RUN_RANKS_IN_SKIP_STREAK, lambda row: row[2]),
                             # As PromQL's min/max (NaN only when every scale is NaN), as the rules compute them.
                             (m.RUN_LOSS_SCALE_MIN, lambda row: promql_min(row[3]) if row[3] else None),
                             (m.RUN_LOSS_SCALE_MAX, lambda row: promql_max(row[3]) if row[3] else None)):
            add(_HEADERS[metric])
            for row in rows:
                value = pick(row)
                if value is not None:
                    add(f"{metric.name}{{{row[0]}}} {exposition_float(value)}\n")


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
