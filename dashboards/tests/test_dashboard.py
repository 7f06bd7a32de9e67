"""The Grafana dashboard model: modern panels, one fixed data source, valid queries on contract metrics."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ampwatch.contract.thresholds import AlertThresholds
from ampwatch.dashboards.dashboard import DATASOURCE_UID, VARIABLES_AT_ALL, dashboard_json, panel_queries

REPO = Path(__file__).resolve().parents[2]
MODEL = dashboard_json()
PANELS = [p for p in MODEL["panels"] if p["type"] != "row"]
REQUIRED_TITLES = [
    "Loss scale across ranks", "Skipped steps across ranks", "Skip ratio: median and top ranks",
    "Consecutive-skip streaks", "Backoffs vs growths across ranks", "Ranks reporting / silent",
    "Scale spread across ranks (largest / smallest)",
    "Offending parameters", "Scheduler steps after skips", "Poisoned steps", "Firing ampwatch alerts",
    "Collector ingest requests by status", "Collector ingest latency (p99)", "Ranks on suspect devices (GPU or data)",
    "Loss level across ranks", "Gradient-norm level", "Spikes across ranks", "Ranks with spikes",
    "Gradient outliers across ranks (DDP)",
]
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {**VARIABLES_AT_ALL, "$__rate_interval": "1m", "$__range": "1h"}


def _panel(title: str) -> dict:
    (panel,) = [p for p in PANELS if p["title"] == title]
    return panel


def test_the_dashboard_has_every_required_panel():
    titles = [p["title"] for p in PANELS]
    assert [t for t in REQUIRED_TITLES if t not in titles] == []


def test_panels_are_modern_time_series_stat_or_table_never_angular_graph():
    assert {p["type"] for p in PANELS} <= {"timeseries", "stat", "table"}
    assert {p["type"] for p in PANELS} == {"timeseries", "stat", "table"}


def test_every_panel_query_and_variable_uses_the_fixed_data_source_uid():
    expected = {"type": "prometheus", "uid": DATASOURCE_UID}
    for panel in PANELS:
        assert panel["datasource"] == expected, panel["title"]
        assert panel["targets"] and all(t["datasource"] == expected for t in panel["targets"]), panel["title"]
    for variable in MODEL["templating"]["list"]:
        assert variable["datasource"] == expected


def test_the_dashboard_has_run_rank_and_optimizer_variables_that_filter_every_per_rank_query():
    assert [v["name"] for v in MODEL["templating"]["list"]] == ["cluster", "run", "rank", "optimizer"]
    for title, expr in panel_queries(MODEL):
        if "ampwatch_collector_" in expr or expr.startswith("ALERTS"):
            continue
        assert '$run"' in expr, title
        if "ampwatch_optimizer_" in expr or "ampwatch_nonfinite" in expr:
            assert '$optimizer"' in expr, title


def test_every_series_a_panel_or_variable_reads_is_filtered_by_the_cluster_variable_and_grouped_by_cluster():
    # A central store holds several clusters (docs/central-store.md): each selector carries the cluster filter, and
    # each by/on grouping keeps cluster, so two clusters' runs of the same name are two lines, never one.
    queries = panel_queries(MODEL) + [(v["name"], v["query"]) for v in MODEL["templating"]["list"]
                                      if v["name"] != "cluster"]
    for title, expr in queries:
        selectors = re.findall(r"\b(?:ampwatch_\w+|ALERTS)\b(?:\{[^}]*\})?", expr)
        assert selectors, title
        assert [s for s in selectors if 'cluster=~"$cluster"' not in s] == [], (title, expr)
        assert [g for g in re.findall(r"\b(?:by|on) \(([^)]*)\)", expr) if not g.startswith("cluster")] == [], \
            (title, expr)


def test_the_cluster_variable_is_all_by_default_so_one_prometheus_without_the_label_still_answers():
    (cluster,) = [v for v in MODEL["templating"]["list"] if v["name"] == "cluster"]
    assert cluster["query"] == "label_values(ampwatch_rank_info, cluster)"
    # Grafana sends allValue for All: the regex ".*" also matches a series that has no cluster label at all.
    assert (cluster["includeAll"], cluster["allValue"], cluster["current"]["text"]) == (True, ".*", "All")
    # Every variable "All" by default, as VARIABLES_AT_ALL says for the tools that run the queries themselves.
    variables = MODEL["templating"]["list"]
    assert {f"${v['name']}": v["allValue"] for v in variables if v["current"]["text"] == "All"} == VARIABLES_AT_ALL


def test_the_loss_scale_panel_has_a_log2_axis():
    scale = _panel("Loss scale across ranks")["fieldConfig"]["defaults"]["custom"]["scaleDistribution"]
    assert scale == {"type": "log", "log": 2}


def test_threshold_lines_come_from_the_alert_thresholds():
    model = dashboard_json(AlertThresholds(skip_streak_warning=8, skip_streak_critical=32, skip_ratio=0.25))
    def steps(title):
        (panel,) = [p for p in model["panels"] if p["title"] == title]
        return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps("Consecutive-skip streaks") == [None, 8]
    assert steps("Skip ratio: median and top ranks") == [None, 0.25]


def test_the_level_panels_draw_a_band_and_the_spike_line_at_the_agents_spike_sigma():
    model = dashboard_json(AlertThresholds(spike_sigma=4.5))
    for title in ("Loss level across ranks", "Gradient-norm level"):
        (panel,) = [p for p in model["panels"] if p["title"] == title]
        legends = {t["legendFormat"].split(" {{")[0]: t["expr"] for t in panel["targets"]}
        assert {"mean", "mean - std", "mean + std", "spike line"} <= set(legends), title
        assert "+ 4.5 * ampwatch_" in legends["spike line"], title
        (dashed,) = panel["fieldConfig"]["overrides"]
        pattern = re.compile(dashed["matcher"]["options"])
        drawn = [t["legendFormat"] for t in panel["targets"] if pattern.search(t["legendFormat"])]
        assert sorted(legend.split(" {{")[0] for legend in drawn) == ["mean + std", "mean - std", "spike line"]


# Two ranks of run exp spiked (rank 1's loss twice, rank 2's gen optimizer once); rank 2 stood out from the
# others once; every series one per minute for 20 minutes, as a collector exposes them.
_SPIKE_SERIES = {
    'ampwatch_loss_mean{run="exp",rank="0"}': "2+0x20", 'ampwatch_loss_std{run="exp",rank="0"}': "0.1+0x20",
    'ampwatch_loss_mean{run="exp",rank="1"}': "3+0x20", 'ampwatch_loss_std{run="exp",rank="1"}': "0.5+0x20",
    'ampwatch_loss_mean{run="exp",rank="2"}': "4+0x20", 'ampwatch_loss_std{run="exp",rank="2"}': "0.25+0x20",
    'ampwatch_loss_spikes_total{run="exp",rank="0"}': "0+0x20",
    'ampwatch_loss_spikes_total{run="exp",rank="1"}': "0 0 1 2+0x17",
    'ampwatch_optimizer_grad_norm_spikes_total{run="exp",rank="1",optimizer="gen"}': "0+0x20",
    'ampwatch_optimizer_grad_norm_spikes_total{run="exp",rank="2",optimizer="gen"}': "0 0 0 1+0x17",
    'ampwatch_rank_gradient_outliers_total{run="exp",rank="1"}': "0+0x20",
    'ampwatch_rank_gradient_outliers_total{run="exp",rank="2"}': "0 0 0 1+0x17",
    'ampwatch_rank_info{run="exp",rank="1",host="node-a",local_rank="1"}': "1+0x20",
    'ampwatch_rank_info{run="exp",rank="2",host="node-b",local_rank="0"}': "1+0x20",
}


def _panel_query(title: str, legend: str = "") -> str:
    (expr,) = [t["expr"] for t in _panel(title)["targets"] if t["legendFormat"].startswith(legend)]
    return expr.replace("$__range", "20m").replace("$__rate_interval", "1m").replace('=~"$run"', '=~".*"') \
        .replace('=~"$cluster"', '=~".*"').replace('=~"$rank"', '=~".*"').replace('=~"$optimizer"', '=~".*"')


def test_the_spike_panels_show_the_levels_ranks_and_hosts_their_series_say(tmp_path, run_tool):
    # The real Prometheus query engine (promtool's unit tests) runs each panel's query over the series above.
    cases = [
        # The median rank's loss level, its band and its spike line (mean + 6 deviations, each a median over ranks).
        (_panel_query("Loss level across ranks", "mean {{"), [({"run": "exp"}, 3)]),
        (_panel_query("Loss level across ranks", "mean - std"), [({"run": "exp"}, 2.5)]),
        (_panel_query("Loss level across ranks", "spike line"), [({"run": "exp"}, 5.5)]),
        # Which ranks spiked, in which signal (the values' extrapolation aside: count the rows).
        (f"count by (run, rank, optimizer, signal) ({_panel_query('Ranks with spikes')})",
         [({"run": "exp", "rank": "1", "signal": "loss"}, 1),
          ({"run": "exp", "rank": "2", "optimizer": "gen", "signal": "gradient norm"}, 1)]),
        # The rank that stood out, with its host and local rank.
        (f"count by (run, rank, host, local_rank) ({_panel_query('Gradient outliers across ranks (DDP)')})",
         [({"run": "exp", "rank": "2", "host": "node-b", "local_rank": "0"}, 1)]),
    ]
    tests = {"evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": series, "values": values} for series, values in _SPIKE_SERIES.items()],
        "promql_expr_test": [{"expr": expr, "eval_time": "10m",
                              "exp_samples": [{"labels": "{" + ",".join(f'{k}="{v}"' for k, v in labels.items())
                                               + "}", "value": value} for labels, value in samples]}
                             for expr, samples in cases],
    }]}
    (tmp_path / "panels.test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run_tool("promtool", "test", "rules", str(tmp_path / "panels.test.yaml"), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alerts_panel_lists_firing_ampwatch_alerts():
    (expr,) = [t["expr"] for t in _panel("Firing ampwatch alerts")["targets"]]
    assert expr == 'ALERTS{cluster=~"$cluster", alertname=~"Amp.*", alertstate="firing"}'


def test_no_time_series_panel_draws_a_line_per_rank_only_a_runs_spread_and_its_top_ranks():
    # A per-rank selector reaches the panel only through an aggregation by run (or run and optimizer) or
    # through topk/bottomk, so a 1,024-rank run draws a handful of lines.
    by_run = r"by \(cluster, run(?:, optimizer)?\)"
    aggregated = re.compile(rf"^(?:(?:sum|min|max|count) {by_run}|quantile {by_run} \(0\.5,"
                            rf"|(?:topk|bottomk) {by_run} \(5,)")
    for panel in PANELS:
        if panel["type"] != "timeseries":
            continue
        for target in panel["targets"]:
            expr = target["expr"]
            if "ampwatch_collector_" in expr:
                continue
            assert aggregated.match(expr), (panel["title"], expr)


def test_every_panel_query_is_valid_promql(tmp_path, run_tool):
    # promtool parses PromQL offline when the queries are recording rules.
    rules = [{"record": f"panel:query:{i}", "expr": _substitute(expr)}
             for i, (_, expr) in enumerate(panel_queries(MODEL))]
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = run_tool("promtool", "check", "rules", str(tmp_path / "panels.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_a_panel_reads_is_in_the_metrics_contract():
    contract = set(re.findall(r"`(ampwatch_[a-z_]+)`", (REPO / "docs" / "metrics.md").read_text()))
    used = {re.sub(r"_bucket$", "", name)
            for _, expr in panel_queries(MODEL) for name in re.findall(r"ampwatch_[a-z_]+", expr)}
    assert used and used <= contract, sorted(used - contract)
    assert not any(name.startswith("ampwatch_run_") for name in used)


def test_panels_fit_the_grid_without_overlapping():
    cells = set()
    for panel in MODEL["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, panel["title"]
        cells |= area


def test_panel_ids_are_unique():
    ids = [p["id"] for p in MODEL["panels"]]
    assert len(ids) == len(set(ids)) and None not in ids


def _substitute(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr
