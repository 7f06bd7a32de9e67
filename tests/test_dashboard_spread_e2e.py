"""End to end: at 64 ranks the dashboard draws each run's spread and its outlier ranks, not a line per rank.

A real collector gets protocol v1 batches from 64 ranks x 2 optimizers of one run; a real Prometheus
scrapes it every second. Three ranks are staged as outliers: rank 42 with a small scale (2**2) whose
``gen`` optimizer skips half its steps, rank 7 with a small scale too (2**4), rank 9 iterating at a
fifth of the others' pace. Every per-rank time-series panel's queries then run as Grafana sends them;
each panel returns a handful of series whatever the rank count, and the outlier ranks are among them.
Beside it, a 4-rank bf16 run without a GradScaler (one rank's steps poisoned): no scale line, no scale alert.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from ampwatch.contract.protocol import NO_SCALER_KIND
from ampwatch.dashboards.dashboard import VARIABLES_AT_ALL, dashboard_json
from ampwatch.dashboards.rules import render_rules
from ampwatch_support.batches import make_batch, optimizer, post_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.patience import SETTLE_S
from ampwatch_support.prometheus_stack import Processes, query_range, start_prometheus, wait_for_scrapes, wait_until
from ampwatch_support.webhook_receiver import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RUN, RANKS, BATCHES = "spread-64", 64, 10
SCALES = {42: 2.0 ** 2, 7: 2.0 ** 4}  # the rest stay at 2**16
SLOW = 9
GRAFANA_VARIABLES = {**VARIABLES_AT_ALL, "$__rate_interval": "4s", "$__range": "30s"}
SECTIONS = ("Loss scale", "Skipped steps")  # the per-rank time-series panels
BF16, BF16_RANKS, POISONED = "bf16-4", 4, 1  # a run without a scaler, and its rank whose steps are poisoned
NO_SCALER = {"enabled": False, "kind": NO_SCALER_KIND, "init_scale": None, "growth_factor": None,
             "backoff_factor": None, "growth_interval": None}


def _stream(url: str) -> None:
    for seq in range(1, BATCHES + 1):
        for rank in range(RANKS):
            iterations = 2 * seq if rank == SLOW else 10 * seq
            skipped = iterations // 2 if rank == 42 else 0
            post_batch(url, make_batch(run=RUN, rank=rank, world_size=RANKS, local_rank=rank % 8, seq=seq,
                                       incarnation=f"spread-{rank}", sent_at=time.time(), iteration=iterations,
                                       loss_scale=SCALES.get(rank, 2.0 ** 16),
                                       optimizers={"gen": optimizer(steps=iterations - skipped, skipped=skipped),
                                                   "disc": optimizer(steps=iterations)}))
        for rank in range(BF16_RANKS):
            poisoned = 5 * seq if rank == POISONED else 0
            post_batch(url, make_batch(run=BF16, rank=rank, world_size=BF16_RANKS, local_rank=rank, seq=seq,
                                       incarnation=f"bf16-rank-{rank}", sent_at=time.time(), iteration=10 * seq,
                                       scaler=NO_SCALER, loss_scale=None,
                                       optimizers={"gen": optimizer(steps=10 * seq, poisoned_steps=poisoned)}))
        time.sleep(0.5)


def _panels() -> dict[str, list[dict]]:
    """Return each per-rank time-series panel's targets, by title."""
    panels, section = {}, None
    for panel in dashboard_json()["panels"]:
        if panel["type"] == "row":
            section = panel["title"]
        elif panel["type"] == "timeseries" and section in SECTIONS:
            panels[panel["title"]] = panel["targets"]
    return panels


def _query(prometheus: str, expr: str, start: float, end: float) -> list[dict]:
    """Run a panel query as Grafana sends it, over ``start`` to ``end`` at 1 s steps."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return query_range(prometheus, expr, start, end)


def _values(series: dict) -> list[float]:
    return [float(v) for _, v in series["values"] if v != "NaN"]


def _last(series: dict) -> float:
    return float(series["values"][-1][1])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("spread")
    processes = Processes(tmp)
    collector = CollectorProcess(str(tmp / "ampwatch.db"))
    try:
        collector.start()
        prometheus = start_prometheus(processes, tmp, free_port(), render_rules(), [f"127.0.0.1:{collector.port}"])
        wait_for_scrapes(processes, prometheus)  # so that the stream's whole span is in its history
        start = time.time()
        _stream(collector.url)
        end = time.time()
        wait_until(lambda: query_range(prometheus, f'count(ampwatch_iteration{{run="{RUN}"}}) == {RANKS}', end - 4,
                                       end), SETTLE_S, f"Prometheus to have scraped all {RANKS} ranks")
        # The scrapes up to the end of the stream are in, and the rules evaluated on them: a scrape 2 s (two
        # intervals) after its end, by Prometheus's own timestamps.
        wait_until(lambda: query_range(prometheus, f"timestamp(up) > {end + 2}", end), SETTLE_S,
                   "Prometheus to scrape the collector after the stream ended")
        yield prometheus, start, end
    finally:
        processes.stop_all()
        collector.kill()


def test_every_per_rank_panel_draws_a_handful_of_lines_at_64_ranks(stack):
    prometheus, start, end = stack
    raw = query_range(prometheus, f'ampwatch_optimizer_steps_total{{run="{RUN}"}}', end - 4, end)
    assert len(raw) == 2 * RANKS  # what a line per rank and optimizer would have drawn
    panels = _panels()
    assert len(panels) == 8
    for title, targets in panels.items():
        series = [s for target in targets for s in _query(prometheus, target["expr"], start, end)
                  if s["metric"].get("run", RUN) == RUN]
        assert series, title
        # At any moment: 3 spread lines and 5 outliers per run and optimizer at most (topk may pick other
        # ranks at other moments, when values move).
        at_once = max(Counter(t for s in series for t, _ in s["values"]).values())
        assert at_once <= 16, (title, at_once)


def test_the_loss_scale_panel_shows_lowest_median_highest_and_the_small_scale_ranks(stack):
    prometheus, _, end = stack
    lines = {}
    for target in _panels()["Loss scale across ranks"]:
        for series in _query(prometheus, target["expr"], end - 2, end):  # every rank known: its last scale
            name = target["legendFormat"].split(" ")[0]
            lines.setdefault(name, {})[series["metric"].get("rank")] = _last(series)
    assert lines["lowest"] == {None: 2.0 ** 2}
    assert lines["median"] == {None: 2.0 ** 16}
    assert lines["highest"] == {None: 2.0 ** 16}
    outliers = lines["{{run}}"]
    assert len(outliers) == 5 and {"42": 2.0 ** 2, "7": 2.0 ** 4}.items() <= outliers.items()


def test_the_skip_ratio_panel_shows_the_median_and_the_rank_that_skips(stack):
    # Ratios per 4 s interval: NaN where an interval saw no step of a rank, so judged over the whole stream.
    prometheus, start, end = stack
    (median, top) = _panels()["Skip ratio: median and top ranks"]
    medians = {s["metric"]["optimizer"]: set(_values(s)) for s in _query(prometheus, median["expr"], start, end)
               if s["metric"]["run"] == RUN}
    assert medians == {"gen": {0.0}, "disc": {0.0}}
    skipping = {(s["metric"]["rank"], s["metric"]["optimizer"]): set(_values(s)) - {0.0}
                for s in _query(prometheus, top["expr"], start, end)}
    assert {key: ratios for key, ratios in skipping.items() if ratios} == {("42", "gen"): {0.5}}


def test_the_iteration_rate_panel_shows_the_slow_rank_among_the_slowest(stack):
    prometheus, start, end = stack
    targets = {t["legendFormat"].split(" ")[0]: t["expr"] for t in _panels()["Iterations per second across ranks"]}
    slowest = {s["metric"]["rank"]: _values(s) for s in _query(prometheus, targets["{{run}}"], start, end)
               if s["metric"]["run"] == RUN}
    (median,) = [s for s in _query(prometheus, targets["median"], start, end) if s["metric"]["run"] == RUN]
    assert str(SLOW) in slowest
    assert 0 < max(slowest[str(SLOW)]) < max(_values(median))


def test_a_run_without_a_scaler_draws_no_scale_line_and_raises_no_scale_alert(stack):
    prometheus, start, end = stack
    panels = {panel["title"]: panel["targets"] for panel in dashboard_json()["panels"] if "targets" in panel}
    for title in ("Loss scale across ranks", "Scale spread across ranks (largest / smallest)"):
        runs = {s["metric"].get("run") for t in panels[title] for s in _query(prometheus, t["expr"], start, end)}
        assert runs == {RUN}, title  # the scaled run's band and outliers; nothing at all for the bf16 run
    # Its ranks still iterate, and its poisoned steps are counted, in the panels that apply to it.
    rates = {s["metric"]["run"] for t in panels["Iterations per second across ranks"]
             for s in _query(prometheus, t["expr"], start, end)}
    assert BF16 in rates
    (poisoned,) = [s for s in _query(prometheus, panels["Poisoned steps"][0]["expr"], end, end + 2)
                   if s["metric"]["run"] == BF16]
    assert _last(poisoned) == 5 * BATCHES
    # No scale alert for it, pending or firing, at any evaluation of the stream (every second).
    scale_alerts = query_range(prometheus, f'ALERTS{{run="{BF16}", alertname=~"Amp.*(Scale|Backoff).*"}}', start, end)
    assert scale_alerts == []
    assert query_range(prometheus, f'ALERTS{{run="{BF16}", alertname="AmpPoisonedStep"}}', start, end)
