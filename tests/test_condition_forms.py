"""Each condition form, compiled by both evaluators, holds exactly where its table says: the collector's Python and
the real Prometheus (promtool) with the PromQL of ``ampwatch.dashboards.forms``.

Every row is one rank's values minute by minute and, at some minutes, what the condition finds then: nothing,
or an instance and its value. The Python side is fed the same values as snapshots and read at those minutes;
promtool evaluates the generated rule over the same values as series. A form compiled wrong on either side
fails its rows, whatever the other side does. Evaluation minutes stay off a window's edges where PromQL's
``increase()`` extrapolates (the forms agree there only up to a scrape interval). Each instance found carries the
same labels on both sides: an alert of scope ``host`` its rank's host and local rank too.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import typing
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from ampwatch.contract import metrics as m
from ampwatch.contract.alerts import ALERTS, AlertDefinition, Severity
from ampwatch.contract.conditions import Condition, Outside, Rose, RoseBy, Share
from ampwatch.contract.counters import COUNTERS, GAUGES
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
from ampwatch.dashboards import forms as promql
from ampwatch.server._state import RankSnapshot
from ampwatch.server._totals import OptimizerTotals, RankTotals
from ampwatch.server.alerting import forms as python
from ampwatch.server.alerting.history import HistoryLayout, RankHistory
from ampwatch.server.alerting.rank_conditions import RankReading, built

T = dataclasses.replace(DEFAULT_THRESHOLDS, poisoned_window_s=600, conflict_window_s=600, backoff_window_s=600,
                        backoff_min_count=3, skip_ratio_window_s=600, skip_ratio=0.5, skip_ratio_min_steps=4,
                        collapsed_loss_scale=1.0, desync_scale_ratio=2.0, outlier_window_s=600)
HOST, LOCAL_RANK = "node-b", 3  # the rank's, as its batches and ampwatch_rank_info say


def _test_alert(name: str, scope: str, condition) -> AlertDefinition:
    return AlertDefinition(name=name, scope=scope, severities=(Severity("warning"),), for_field=None,
                           summary="s", description="d", condition=condition)


POISONED, CONFLICT, OUTLIER = ALERTS["AmpPoisonedStep"], ALERTS["AmpRankConflict"], ALERTS["AmpRankGradientOutlier"]
RATIO, COLLAPSED = ALERTS["AmpHighSkippedStepRatio"], ALERTS["AmpLossScaleCollapsed"]
# Forms no alert of the contract takes in its own way yet: a rise of at least a count, a gauge with a ceiling.
BACKOFFS = _test_alert("AmpTestBackoffs", "rank", RoseBy("backoffs", window="backoff_window_s",
                                                         at_least="backoff_min_count"))
BAND = _test_alert("AmpTestScaleBand", "rank", Outside("loss_scale", low="collapsed_loss_scale",
                                                       high="desync_scale_ratio"))
DEFINITIONS = (POISONED, CONFLICT, OUTLIER, BACKOFFS, RATIO, COLLAPSED, BAND)
NAN, INF = math.nan, math.inf


class Row(NamedTuple):
    case: str
    alert: AlertDefinition
    values: dict[str, list[float | None]]
    """A counter's or gauge's name (or ``closed``) -> its value at each minute (None: no sample)."""
    finds: dict[int, float | None]
    """Minute -> the value of the one instance found then (None: nothing holds)."""


def _rises(*steps: int, n: int = 20) -> list[float | None]:
    """A counter that takes ``steps`` values, then keeps the last for ``n`` minutes in all."""
    return [*steps, *[steps[-1]] * (n - len(steps))]


ROWS = [
    # Rose: the counter rose within the window (10 min); its value is the counter.
    Row("a rise holds at once and for the window", POISONED, {"poisoned_steps": _rises(0, 0, 1)},
        {1: None, 2: 1, 6: 1, 11: 1, 12: None, 19: None}),
    Row("a series born above 0 holds", POISONED, {"poisoned_steps": [None, 2, 2, 2]}, {1: 2, 3: 2}),
    Row("a counter at 0 holds nothing", POISONED, {"poisoned_steps": _rises(0)}, {3: None, 15: None}),
    Row("a rank's counter rose", CONFLICT, {"conflicts": _rises(0, 0, 1, 1, 2)}, {2: 1, 4: 2, 13: 2, 15: None}),
    # Of scope host: the rank's own counter, its instance labelled with the rank's host and local rank.
    Row("a host alert's counter rose", OUTLIER, {"gradient_outliers": _rises(0, 0, 1)},
        {1: None, 2: 1, 11: 1, 12: None}),
    # RoseBy: it rose by 3 or more within the window; its value is the rise.
    Row("three backoffs within the window hold", BACKOFFS, {"backoffs": _rises(0, 0, 1, 2, 3)},
        {3: None, 4: 3, 8: 3, 12: None, 16: None}),
    Row("three backoffs spread wider than the window hold nothing", BACKOFFS,
        {"backoffs": _rises(0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3)}, {6: None, 11: None, 14: None}),
    # Share: skipped over skipped + steps, 0.5 or more, judged from 4 calls within the window; its value is the share.
    Row("every other call skipped holds at exactly the share", RATIO,
        {"skipped": list(range(20)), "steps": list(range(20))}, {1: None, 2: 0.5, 5: 0.5, 15: 0.5}),
    Row("a share below the threshold holds nothing", RATIO,
        {"skipped": _rises(0, 1), "steps": [3 * i for i in range(20)]}, {3: None, 8: None}),
    Row("too few calls are not judged", RATIO, {"skipped": _rises(0, 1), "steps": _rises(0)}, {1: None, 5: None}),
    # Outside: a rank that has not closed with a scale that is not a finite value of at least 1 (of at most 2 for
    # the band); its value is the scale.
    Row("below, NaN or infinite holds; at the bound or above it does not", COLLAPSED,
        {"loss_scale": [65536.0, 0.5, NAN, INF, 1.0, 0.0, -INF]},
        {0: None, 1: 0.5, 2: NAN, 3: INF, 4: None, 5: 0.0, 6: -INF}),
    Row("a closed rank's last scale holds nothing", COLLAPSED,
        {"loss_scale": [0.5, 0.5, 0.5, 0.5], "closed": [0, 0, 1, 1]}, {1: 0.5, 2: None, 3: None}),
    Row("a rank without a scale holds nothing", COLLAPSED, {"closed": [0, 0, 0]}, {1: None, 2: None}),
    Row("a band holds outside its floor and ceiling, not at them", BAND,
        {"loss_scale": [1.0, 2.0, 2.5, 0.5, -INF]}, {0: None, 1: None, 2: 2.5, 3: 0.5, 4: -INF}),
]


def _snapshot(values: dict[str, list[float | None]], minute: int) -> RankSnapshot | None:
    """The rank at ``minute`` as the collector hands it to the evaluator (None: nothing was sent then)."""
    now = {name: series[minute] for name, series in values.items() if series[minute] is not None}
    if not now:
        return None
    optimizer, totals, fields = {}, {}, {}
    for name, value in now.items():
        if name == "closed":
            fields["closed"] = bool(value)
        elif (COUNTERS.get(name) or GAUGES[name]).per == "optimizer":
            optimizer[name] = int(value)
        elif name in RankSnapshot.__dataclass_fields__:
            fields[name] = value if name == "loss_scale" else int(value)
        else:
            totals[name] = int(value)
    return RankSnapshot(run="r", rank=0, last_seen=minute * 60.0, iteration=minute, totals=RankTotals(**totals),
                        optimizers={"a": OptimizerTotals(**optimizer)} if optimizer else {}, host=HOST,
                        local_rank=LOCAL_RANK, **fields)


def _labels(row: Row) -> dict[str, str]:
    """The identifying labels of the row's one instance, as the alert's scope has them."""
    return {"run": "r", "rank": "0", **({"optimizer": "a"} if row.alert.scope == "optimizer" else {}),
            **({"host": HOST, "local_rank": str(LOCAL_RANK)} if row.alert.scope == "host" else {})}


def _python_finds(row: Row) -> dict[int, float | None]:
    condition = python.compiled(row.alert)
    history = RankHistory("r", 0, HistoryLayout(T, {row.alert.name: row.alert}))
    found: dict[int, float | None] = {}
    for minute in range(max(map(len, row.values.values()))):
        snapshot = _snapshot(row.values, minute)
        if snapshot is not None:
            history.record(snapshot, T.calibration_iterations)
        if minute in row.finds:
            findings = list(condition(RankReading(history, minute * 60.0), T))
            values = [value for *_, value in findings]
            assert len(values) <= 1, values
            if findings and row.alert.name in ALERTS:  # labelled as the collector builds its alerts
                labels = dict(built(history.current, findings[0], T).labels)  # type: ignore[arg-type]
                assert labels == {"severity": row.alert.severities[0].level, **_labels(row)}, minute
            found[minute] = values[0] if values else None
    return found


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.alert.name}: {r.case}")
def test_the_collectors_python_of_each_form_finds_what_its_table_says(row):
    found = _python_finds(row)
    assert found.keys() == row.finds.keys()
    for minute, expected in row.finds.items():
        assert (found[minute] is None) == (expected is None), (minute, found[minute])
        if expected is not None:
            assert found[minute] == pytest.approx(expected, nan_ok=True), minute


def _metric(name: str) -> m.Metric:
    return m.RANK_CLOSED if name == "closed" else (COUNTERS.get(name) or GAUGES[name]).metric


def _sample(value: float | None) -> str:
    if value is None:
        return "_"
    if math.isnan(value):
        return "NaN"
    return {INF: "Inf", -INF: "-Inf"}.get(value, repr(value))


def _rules() -> dict:
    closed = promql.nonzero_name(m.RANK_CLOSED)
    recordings = [promql.record(closed, f"{m.RANK_CLOSED} > 0")]
    for form in (Rose, Share):
        recordings += promql.recordings(DEFINITIONS, T, form)
    alerts = [{"alert": d.name, "expr": promql.expression(d, T), "for": "0s", "labels": {"severity": "warning"}}
              for d in DEFINITIONS]
    return {"groups": [{"name": "forms", "interval": "1m", "rules": recordings + alerts}]}


def _promtool_case(row: Row) -> dict:
    labels = _labels(row)
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items() if k not in ("host", "local_rank"))
    minutes = max(map(len, row.values.values()))
    # What the collector exposes of every rank: its identity (host, local rank) in ampwatch_rank_info, valued 1.
    info = {"series": f'{m.RANK_INFO}{{run="r",rank="0",host="{HOST}",local_rank="{LOCAL_RANK}",world_size="4"}}',
            "values": f"1x{minutes}"}
    return {
        "name": f"{row.alert.name}: {row.case}",
        "interval": "1m",
        "input_series": [*({"series": f"{_metric(name)}{{{selector}}}", "values": " ".join(map(_sample, series))}
                           for name, series in row.values.items()), info],
        "alert_rule_test": [{"eval_time": f"{minute}m", "alertname": row.alert.name,
                             "exp_alerts": [] if value is None else [{"exp_labels": {"severity": "warning", **labels}}]}
                            for minute, value in row.finds.items()],
    }


def test_prometheus_with_the_promql_of_each_form_finds_what_its_table_says(tmp_path: Path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: apt-get install prometheus"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_rules(), sort_keys=False))
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [_promtool_case(r) for r in ROWS]}
    (tmp_path / "forms.test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", "forms.test.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_table_has_a_row_that_holds_and_one_that_does_not_for_each_form():
    # Every form of the contract, so that each alert declaring one has its parity here (tests/test_alert_parity.py).
    for form in typing.get_args(Condition):
        rows = [r for r in ROWS if isinstance(r.alert.condition, form)]
        assert any(v is not None for r in rows for v in r.finds.values()), form.__name__
        assert any(v is None for r in rows for v in r.finds.values()), form.__name__
