"""Build the ampwatch Grafana dashboard (bare dashboard model for file provisioning) with grafanalib.

Every panel queries the collector's per-rank series through the Prometheus data
source with the fixed uid :data:`DATASOURCE_UID`, filtered by the template
variables ``cluster``, ``run``, ``rank`` and ``optimizer``: every series it reads by ``cluster`` (the label each
cluster's scraper adds in a central store, docs/central-store.md; All, the default, also matches series without
it, as on one Prometheus), and it groups by cluster wherever it groups by run, so two clusters' runs of the same
name stay apart. Threshold lines come from the same
:class:`~ampwatch.contract.thresholds.AlertThresholds` as the alert rules.

Example::

    from ampwatch.dashboards.dashboard import render_dashboard
    open("ampwatch.json", "w").write(render_dashboard())
"""

from __future__ import annotations

import json
from typing import Any

from grafanalib._gen import DashboardEncoder
from grafanalib.core import (
    Dashboard,
    GridPos,
    RowPanel,
    Stat,
    Table,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

from ampwatch.contract import metrics as m
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds

__all__ = [
    "DASHBOARD_UID",
    "DATASOURCE_UID",
    "VARIABLES_AT_ALL",
    "build_dashboard",
    "dashboard_json",
    "panel_queries",
    "render_dashboard",
]

#: uid of the Prometheus data source the dashboard queries; Grafana's provisioning
#: (deploy/grafana/provisioning/datasources/) creates it with this uid.
DATASOURCE_UID = "ampwatch-prometheus"
#: uid of the dashboard itself, stable so that links to it survive re-provisioning.
DASHBOARD_UID = "ampwatch-overview"

#: What Grafana puts for each template variable of the dashboard when it is "All" (the default): a tool that runs
#: the panels' queries itself (tests, bench) substitutes these.
VARIABLES_AT_ALL = {"$cluster": ".*", "$run": ".*", "$rank": ".*", "$optimizer": ".*"}

_DATASOURCE = {"type": "prometheus", "uid": DATASOURCE_UID}
_CLUSTER = 'cluster=~"$cluster"'
_RUN = f'{_CLUSTER}, run=~"$run"'
_RANK = f'{_RUN}, rank=~"$rank"'
_OPTIMIZER = f'{_RANK}, optimizer=~"$optimizer"'
_OPEN = f"on (cluster, run, rank) {m.RANK_CLOSED}{{{_CLUSTER}}} == 0"
_WIDTH = 24  # Grafana's grid is 24 units wide
# Per-rank panels show a run's spread (lowest, median, highest) and its few outlier ranks, never a line per
# rank: at 1,024 ranks x 2 optimizers that is 2,048 lines and megabytes per refresh.
_OUTLIERS = 5


def build_dashboard(t: AlertThresholds = DEFAULT_THRESHOLDS) -> Dashboard:
    """Return the grafanalib dashboard, panels laid out and numbered."""
    sections = [
        ("Overview", 5, [
            (_stat("Ranks reporting / silent", [
                (f"count by (cluster, run) ((time() - {m.RANK_LAST_SEEN}{{{_RANK}}} <= {t.silent_after_s})"
                 f" and {_OPEN})",
                 "{{run}} reporting"),
                # "or 0 * ..." turns "no silent rank" into a 0 rather than no data.
                (f"count by (cluster, run) ((time() - {m.RANK_LAST_SEEN}{{{_RANK}}} > {t.silent_after_s}) and {_OPEN})"
                 f" or on (cluster, run) (0 * count by (cluster, run) ({m.RANK_CLOSED}{{{_RANK}}}))", "{{run}} silent"),
            ], f"Ranks seen within {t.silent_after_s}s and not closed, and ranks silent longer than that "
               "without closing (AmpRankSilent)."), 6),
            (_stat("Poisoned steps", [
                (f"sum by (cluster, run, optimizer) ({m.OPTIMIZER_POISONED_STEPS}{{{_OPTIMIZER}}})",
                 "{{run}} {{optimizer}}"),
            ], "Steps that updated parameters with non-finite gradients, or left them non-finite "
               "(AmpPoisonedStep). Anything above 0 means the weights are likely NaN.", red_from=1), 6),
            (_table("Firing ampwatch alerts", [
                (f'ALERTS{{{_CLUSTER}, alertname=~"Amp.*", alertstate="firing"}}', ""),
            ], "Alerts from the ampwatch rules firing now, with their labels.",
                hide=["Time", "Value", "__name__", "alertstate"]), 12),
        ]),
        ("Loss scale", 8, [
            (_series("Loss scale across ranks", [
                *_spread(f"{m.LOSS_SCALE}{{{_RANK}}}", "run"),
                (f"bottomk by (cluster, run) ({_OUTLIERS}, {m.LOSS_SCALE}{{{_RANK}}})", "{{run}} rank {{rank}}"),
            ], "Lowest, median and highest loss scale after the last update() of each run's ranks, and the "
               f"{_OUTLIERS} lowest ranks, on a log2 axis: halvings are backoffs, doublings growths. Below 1 is "
               "a collapse (AmpLossScaleCollapsed). Pick ranks with the rank variable to see them alone.",
                log2=True, threshold=t.collapsed_loss_scale, step=True), 12),
            (_series("Scale spread across ranks (largest / smallest)", [
                (f"max by (cluster, run) ({m.LOSS_SCALE}{{{_RUN}}} and {_OPEN})"
                 f" / min by (cluster, run) ({m.LOSS_SCALE}{{{_RUN}}} and {_OPEN})", "{{run}}"),
            ], "1 when every open rank of a run has the same loss scale; at or above the line for "
               f"{t.desync_for_s}s the ranks are out of sync (AmpLossScaleDesync).",
                threshold=t.desync_scale_ratio, step=True), 12),
            (_series("Backoffs vs growths across ranks", [
                (f"sum by (cluster, run) (increase({m.LOSS_SCALE_BACKOFFS}{{{_RANK}}}[$__rate_interval]))",
                 "backoffs {{run}}"),
                (f"sum by (cluster, run) (increase({m.LOSS_SCALE_GROWTHS}{{{_RANK}}}[$__rate_interval]))",
                 "growths {{run}}"),
                (f"count by (cluster, run) (increase({m.LOSS_SCALE_BACKOFFS}{{{_RANK}}}[$__rate_interval]) > 0)",
                 "ranks backing off {{run}}"),
            ], "Scale transitions per interval, summed over each run's ranks, and how many ranks backed off. "
               f"Backoffs on many ranks with no growth for {t.backoff_window_s}s is sustained backoff "
               "(AmpSustainedLossScaleBackoff).", bars=True), 12),
            (_series("Iterations per second across ranks", [
                *_spread(f"rate({m.ITERATION}{{{_RANK}}}[$__rate_interval])", "run"),
                (f"bottomk by (cluster, run) ({_OUTLIERS}, rate({m.ITERATION}{{{_RANK}}}[$__rate_interval]))",
                 "{{run}} rank {{rank}}"),
            ], "scaler.update() calls per second: slowest, median and fastest rank of each run, and the "
               f"{_OUTLIERS} slowest ranks. A rank that stops advancing is stuck or gone.", unit="ops"), 12),
        ]),
        ("Skipped steps", 8, [
            (_series("Skipped steps across ranks", [
                (f"sum by (cluster, run, optimizer) "
                 f"(increase({m.OPTIMIZER_SKIPPED_STEPS}{{{_OPTIMIZER}}}[$__rate_interval]))",
                 "skipped {{run}} {{optimizer}}"),
                (f"count by (cluster, run, optimizer) "
                 f"(increase({m.OPTIMIZER_SKIPPED_STEPS}{{{_OPTIMIZER}}}[$__rate_interval])"
                 " > 0)", "ranks skipping {{run}} {{optimizer}}"),
            ], "scaler.step(optimizer) calls skipped because the optimizer's unscaled gradients held inf/NaN, "
               "summed over each run's ranks, and how many ranks skipped: all of them at once is a whole-job "
               "storm (one rank's inf/NaN spreads through DDP's all-reduce), a few is a rank problem.",
                bars=True), 12),
            (_series("Skip ratio: median and top ranks", [
                (f"quantile by (cluster, run, optimizer) (0.5, {_skip_ratio()})", "median {{run}} {{optimizer}}"),
                (f"topk by (cluster, run, optimizer) ({_OUTLIERS}, {_skip_ratio()})",
                 "{{run}} rank {{rank}} {{optimizer}}"),
            ], f"Share of scaler.step() calls that skipped: the median rank and the {_OUTLIERS} ranks that skip "
               "most, per run and optimizer. The line is the AmpHighSkippedStepRatio "
               f"threshold (judged over {t.skip_ratio_window_s}s).",
                unit="percentunit", threshold=t.skip_ratio), 12),
            (_series("Consecutive-skip streaks", [
                (f"topk by (cluster, run) ({_OUTLIERS}, {m.OPTIMIZER_CONSECUTIVE_SKIPPED}{{{_OPTIMIZER}}})",
                 "current {{run}} rank {{rank}} {{optimizer}}"),
                (f"count by (cluster, run, optimizer) ({m.OPTIMIZER_CONSECUTIVE_SKIPPED}{{{_OPTIMIZER}}} > 0)",
                 "ranks in a streak {{run}} {{optimizer}}"),
                (f"max by (cluster, run, optimizer) ({m.OPTIMIZER_LONGEST_SKIP_STREAK}{{{_OPTIMIZER}}})",
                 "longest so far {{run}} {{optimizer}}"),
            ], f"The {_OUTLIERS} longest current skip streaks of each run, how many ranks are in one, and the "
               f"longest streak any rank saw. The line is the warning threshold ({t.skip_streak_warning}); a "
               "streak shorter than a scrape interval only shows in 'longest' and in the alert.",
                threshold=t.skip_streak_warning, step=True), 12),
            (_series("Scheduler steps after skips", [
                (f"topk by (cluster, run) ({_OUTLIERS}, {m.OPTIMIZER_SCHEDULER_STEPS_AFTER_SKIP}{{{_OPTIMIZER}}})",
                 "{{run}} rank {{rank}} {{optimizer}}"),
            ], f"LR scheduler steps taken right after a skipped step (AmpSchedulerStepsOnSkipped), the {_OUTLIERS} "
               "ranks with the most per run: gate scheduler.step() with watch.stepped(optimizer).", step=True), 12),
            (_table("Offending parameters", [
                (f"count by (cluster, run, optimizer, parameter) ({m.NONFINITE_GRADIENT_INFO}{{{_OPTIMIZER}}})", ""),
            ], "The parameters named as holding non-finite gradients on each rank's latest skip, with how many "
               "ranks named each (column ranks): one parameter on every rank points at the model or the data, "
               "one rank alone at its GPU. Start the investigation here.",
                hide=["Time"], rename={"Value": "ranks"}), 24),
            (_table("Ranks where skips started (DDP)", [
                (f"topk by (cluster, run) (20, sum by (cluster, run, rank) "
                 f"(increase({m.RANK_ORIGIN_ITERATIONS}{{{_RANK}}}[$__range])) > 0)"
                 f" * on (cluster, run, rank) group_left (host, local_rank)"
                 f" topk by (cluster, run, rank) (1, {m.RANK_INFO}{{{_CLUSTER}}})", ""),
            ], "Skipped iterations over the dashboard's time range whose inf/NaN was in the rank's own "
               "gradients before DDP's all-reduce (agents watching with ddp=), with host and local rank, the 20 "
               "ranks with the most per run. One or a few ranks here again and again: suspect that GPU, host or "
               f"data shard (AmpSkipOriginRank: >= {t.origin_min_count} within {t.origin_window_s}s).",
                hide=["Time", "__name__", "job", "instance"]), 24),
            (_table("Ranks on suspect devices (GPU or data)", [
                (f"topk by (cluster, run) (20, max by (cluster, run, rank, device) "
                 f"({m.RANK_ON_SUSPECT_DEVICE}{{{_RANK}}}))", ""),
            ], "The device each rank runs on (a GPU's UUID, else host:local_rank), those the collector suspects "
               "first (column suspect 1: the sole origin of skips or poisoned steps on different samples again and "
               "again, over every run it keeps; AmpSuspectDevice), 20 per run. GET /v1/suspects and the status "
               "page have each suspect's evidence, and the suspect samples (data, not a device).",
                hide=["Time"], rename={"Value": "suspect"}), 24),
        ]),
        ("Spikes and gradient outliers", 8, [
            (_series("Loss level across ranks", _level(m.LOSS_MEAN, m.LOSS_STD, _RANK, "run", t), "The loss's "
               f"rolling level (the agent's window of the last {t.spike_window_iterations} iterations): the median "
               "rank's mean, its mean -/+ one standard deviation (the band), and the line a value must pass to be a "
               f"spike (mean + {t.spike_sigma:g} deviations: AmpLossSpike), with the {_OUTLIERS} ranks whose mean is "
               "highest. Pick one rank with the rank variable to see its own band.", dashed=_BAND), 12),
            (_series("Gradient-norm level", [
                *_level(m.OPTIMIZER_GRAD_NORM_MEAN, m.OPTIMIZER_GRAD_NORM_STD, _OPTIMIZER, "run, optimizer", t),
                (f"topk by (cluster, run, optimizer) ({_OUTLIERS}, {m.OPTIMIZER_LOCAL_GRAD_NORM_MEAN}{{{_OPTIMIZER}}})",
                 "own {{run}} rank {{rank}} {{optimizer}}"),
            ], "The rolling level of the gradient norm each optimizer stepped with: the median rank's mean, its "
               f"band of one deviation and its spike line (mean + {t.spike_sigma:g} deviations: AmpGradNormSpike); "
               f"with ddp=, the {_OUTLIERS} ranks whose own norm before DDP's all-reduce is highest on average "
               "(one far above the others: AmpRankGradientOutlier).", dashed=_BAND), 12),
            (_series("Spikes across ranks", [
                (f"sum by (cluster, run) (increase({m.LOSS_SPIKES}{{{_RANK}}}[$__rate_interval]))",
                 "loss spikes {{run}}"),
                (f"count by (cluster, run) (increase({m.LOSS_SPIKES}{{{_RANK}}}[$__rate_interval]) > 0)",
                 "ranks with a loss spike {{run}}"),
                (f"sum by (cluster, run, optimizer) (increase({m.OPTIMIZER_GRAD_NORM_SPIKES}{{{_OPTIMIZER}}}"
                 "[$__rate_interval]))", "gradient-norm spikes {{run}} {{optimizer}}"),
                (f"count by (cluster, run, optimizer) (increase({m.OPTIMIZER_GRAD_NORM_SPIKES}{{{_OPTIMIZER}}}"
                 "[$__rate_interval]) > 0)", "ranks with a gradient-norm spike {{run}} {{optimizer}}"),
            ], "Loss and gradient-norm spikes per interval, summed over each run's ranks, and how many ranks had "
               "one: every rank at once is the job (the learning rate, a bad stretch of data; with DDP the "
               "all-reduced gradient norm spikes everywhere), one rank its batch or its GPU. The events (GET "
               "/v1/runs/{run}/events, the status page) name the iteration and its samples.", bars=True), 12),
            (_table("Ranks with spikes", [
                (f"topk by (cluster, run) (20, label_replace(sum by (cluster, run, rank) "
                 f"(increase({m.LOSS_SPIKES}{{{_RANK}}}[$__range])) > 0, \"signal\", \"loss\", \"\", \"\")"
                 f" or label_replace(sum by (cluster, run, rank, optimizer) "
                 f"(increase({m.OPTIMIZER_GRAD_NORM_SPIKES}{{{_OPTIMIZER}}}[$__range])) > 0, \"signal\", "
                 f"\"gradient norm\", \"\", \"\"))", ""),
            ], "Loss and gradient-norm spikes of each rank over the dashboard's time range, the 20 ranks with the "
               "most per run (column spikes).", hide=["Time"], rename={"Value": "spikes"}), 12),
            (_table("Gradient outliers across ranks (DDP)", [
                (f"topk by (cluster, run) (20, sum by (cluster, run, rank) "
                 f"(increase({m.RANK_GRADIENT_OUTLIERS}{{{_RANK}}}[$__range])) > 0)"
                 f" * on (cluster, run, rank) group_left (host, local_rank)"
                 f" topk by (cluster, run, rank) (1, {m.RANK_INFO}{{{_CLUSTER}}})", ""),
            ], "Iterations over the dashboard's time range where a rank's own gradient norm before DDP's "
               "all-reduce stood out from the other ranks' (the collector's gradient_outlier events; agents "
               "watching with ddp=), with host and local rank, the 20 ranks with the most per run. One rank again "
               "and again: suspect that GPU, host or data shard (AmpRankGradientOutlier).",
                hide=["Time", "__name__", "job", "instance"], rename={"Value": "outliers"}), 24),
        ]),
        ("Collector and agents", 7, [
            (_series("Collector ingest requests by status", [
                (f"sum by (cluster, instance, code) "
                 f"(rate({m.COLLECTOR_INGEST_REQUESTS}{{{_CLUSTER}}}[$__rate_interval]))",
                 "{{instance}} {{code}}"),
                (f"sum by (cluster, instance, reason) "
                 f"(rate({m.COLLECTOR_REJECTED_BATCHES}{{{_CLUSTER}}}[$__rate_interval]))",
                 "{{instance}} rejected {{reason}}"),
            ], "Batches received per second by HTTP status, and batches refused by reason.", unit="reqps"), 8),
            (_series("Collector ingest latency (p99)", [
                (f"histogram_quantile(0.99, sum by (cluster, instance, le) "
                 f"(rate({m.COLLECTOR_INGEST_DURATION}_bucket{{{_CLUSTER}}}[$__rate_interval])))", "{{instance}}"),
            ], "Time from request to durable answer (the agent's batches wait this long).", unit="s"), 8),
            (_series("Agent delivery trouble", [
                (f"sum by (cluster, run) (increase({m.AGENT_SEND_FAILURES}{{{_RANK}}}[$__rate_interval]))",
                 "send failures {{run}}"),
                (f"sum by (cluster, run) (increase({m.AGENT_DROPPED_EVENTS}{{{_RANK}}}[$__rate_interval]))",
                 "dropped events {{run}}"),
                (f"topk by (cluster, run) ({_OUTLIERS}, increase({m.AGENT_SEND_FAILURES}{{{_RANK}}}[$__rate_interval])"
                 f" + increase({m.AGENT_DROPPED_EVENTS}{{{_RANK}}}[$__rate_interval]))", "{{run}} rank {{rank}}"),
            ], "Failed deliveries and events dropped by a full agent buffer, summed over each run's ranks, and "
               f"the {_OUTLIERS} ranks with the most.", bars=True), 8),
        ]),
    ]
    panels = _layout(sections)
    return Dashboard(
        title="ampwatch: AMP loss scale and skipped steps",
        uid=DASHBOARD_UID,
        description="GradScaler skips, loss-scale transitions, loss and gradient-norm spikes and rank health across "
                    "every rank of a run.",
        tags=["ampwatch", "amp", "pytorch"],
        timezone="browser",
        refresh="10s",
        time=Time("now-1h", "now"),
        schemaVersion=39,
        panels=panels,
        templating=Templating(list=[
            # A central store's clusters (docs/central-store.md); none on one Prometheus: All matches every series.
            _variable("cluster", f"label_values({m.RANK_INFO}, cluster)"),
            _variable("run", f"label_values({m.RANK_INFO}{{{_CLUSTER}}}, run)"),
            _variable("rank", f"label_values({m.RANK_INFO}{{{_RUN}}}, rank)"),
            _variable("optimizer", f"label_values({m.OPTIMIZER_STEPS}{{{_RUN}}}, optimizer)"),
        ]),
    ).auto_panel_ids()


def dashboard_json(t: AlertThresholds = DEFAULT_THRESHOLDS) -> dict[str, Any]:
    """Return the dashboard model as plain JSON data."""
    return json.loads(json.dumps(build_dashboard(t).to_json_data(), cls=DashboardEncoder))


def render_dashboard(t: AlertThresholds = DEFAULT_THRESHOLDS) -> str:
    """Render the dashboard JSON file for Grafana's file provisioning."""
    return json.dumps(dashboard_json(t), indent=2, sort_keys=True) + "\n"


def panel_queries(model: dict[str, Any]) -> list[tuple[str, str]]:
    """List ``(panel title, PromQL)`` for every query of every panel of a dashboard model."""
    return [(panel["title"], target["expr"])
            for panel in model["panels"] for target in panel.get("targets", [])]


def _spread(expr: str, by: str) -> list[tuple[str, str]]:
    """Lowest, median and highest value of ``expr`` across ranks, one line each per ``by``."""
    legend = "{{" + by + "}}"  # Grafana's {{label}}
    return [(f"min by (cluster, {by}) ({expr})", f"lowest {legend}"),
            (f"quantile by (cluster, {by}) (0.5, {expr})", f"median {legend}"),
            (f"max by (cluster, {by}) ({expr})", f"highest {legend}")]


_BAND = "^(mean [-+] std|spike line) "
"""The legends of a level's band and spike line (:func:`_level`), drawn dashed beside its mean."""


def _level(mean: m.Metric, std: m.Metric, selector: str, by: str, t: AlertThresholds) -> list[tuple[str, str]]:
    """A signal's rolling level across ranks, per ``by``: the median rank's mean, the band of one deviation around
    it, and its spike line (``spike_sigma`` deviations above), each a median over ranks; the top ranks by mean."""
    legend = " ".join("{{" + label.strip() + "}}" for label in by.split(","))
    mean_, std_ = f"{mean}{{{selector}}}", f"{std}{{{selector}}}"
    return [(f"quantile by (cluster, {by}) (0.5, {mean_})", f"mean {legend}"),
            (f"quantile by (cluster, {by}) (0.5, {mean_} - {std_})", f"mean - std {legend}"),
            (f"quantile by (cluster, {by}) (0.5, {mean_} + {std_})", f"mean + std {legend}"),
            (f"quantile by (cluster, {by}) (0.5, {mean_} + {t.spike_sigma:g} * {std_})", f"spike line {legend}"),
            *([(f"topk by (cluster, {by}) ({_OUTLIERS}, {mean_})", f"{legend} rank {{{{rank}}}}")]
              if by == "run" else [])]


def _skip_ratio() -> str:
    """Skipped / all scaler.step() calls per interval, per rank and optimizer."""
    skipped = f"increase({m.OPTIMIZER_SKIPPED_STEPS}{{{_OPTIMIZER}}}[$__rate_interval])"
    return (f"sum by (cluster, run, rank, optimizer) ({skipped})"
            f" / sum by (cluster, run, rank, optimizer) ({skipped} + "
            f"increase({m.OPTIMIZER_STEPS}{{{_OPTIMIZER}}}[$__rate_interval]))")


def _targets(queries: list[tuple[str, str]], instant: bool = False, table: bool = False) -> list[Target]:
    return [Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + i), datasource=_DATASOURCE,
                   instant=instant, format="table" if table else "time_series")
            for i, (expr, legend) in enumerate(queries)]


def _steps(threshold: float | None, red_from: float | None = None) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if threshold is not None:
        steps.append({"color": "red", "value": threshold})
    if red_from is not None:
        steps.append({"color": "red", "value": red_from})
    return steps


def _series(title: str, queries: list[tuple[str, str]], description: str, *, log2: bool = False,
            threshold: float | None = None, unit: str = "short", bars: bool = False,
            step: bool = False, dashed: str | None = None) -> TimeSeries:
    """A time-series panel; ``dashed``: a regular expression of the legends drawn as dashed lines."""
    overrides = [{"matcher": {"id": "byRegexp", "options": dashed},
                  "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]}]
    return TimeSeries(
        overrides=overrides if dashed else [],
        title=title, description=description, dataSource=_DATASOURCE, targets=_targets(queries),
        unit=unit, scaleDistributionType="log" if log2 else "linear", scaleDistributionLog=2,
        drawStyle="bars" if bars else "line", fillOpacity=60 if bars else 0,
        lineInterpolation="stepAfter" if step else "linear",
        thresholds=_steps(threshold), thresholdsStyleMode="line" if threshold is not None else "off",
        legendDisplayMode="list", tooltipMode="multi",
    )


def _stat(title: str, queries: list[tuple[str, str]], description: str,
          red_from: float | None = None) -> Stat:
    return Stat(title=title, description=description, dataSource=_DATASOURCE,
                targets=_targets(queries, instant=True), reduceCalc="lastNotNull",
                graphMode="none", thresholds=_steps(None, red_from), noValue="0")


def _table(title: str, queries: list[tuple[str, str]], description: str, hide: list[str],
           rename: dict[str, str] | None = None) -> Table:
    return Table(
        title=title, description=description, dataSource=_DATASOURCE,
        targets=_targets(queries, instant=True, table=True), filterable=True,
        transformations=[{"id": "organize", "options": {"excludeByName": {name: True for name in hide},
                                                        "renameByName": rename or {}}}],
    )


def _variable(name: str, query: str) -> Template:
    return Template(name=name, label=name, query=query, dataSource=_DATASOURCE,
                    includeAll=True, multi=True, allValue=".*", default="All", refresh=2)


def _layout(sections: list[tuple[str, int, list[tuple[Any, int]]]]) -> list[Any]:
    # Flow panels left to right in rows of 24 units, each section under its own row header.
    panels, y = [], 0
    for title, height, members in sections:
        panels.append(RowPanel(title=title, gridPos=GridPos(h=1, w=_WIDTH, x=0, y=y)))
        y, x = y + 1, 0
        for panel, width in members:
            if x + width > _WIDTH:
                y, x = y + height, 0
            panels.append(_with_pos(panel, GridPos(h=height, w=width, x=x, y=y)))
            x += width
        y += height
    return panels


def _with_pos(panel: Any, pos: GridPos) -> Any:
    panel.gridPos = pos
    return panel
