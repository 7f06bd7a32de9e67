"""Compile the condition a common alert declares (``ampwatch.contract.conditions``) to PromQL, and its recordings.

The collector's built-in evaluator compiles the same declarations to Python
(``ampwatch.server.alerting.forms``); each form's PromQL here and its Python there say the same:

- ``Rose``: the counter's non-zero series (a recording: nearly always 0, read once per evaluation)
  that differ from their value one window ago (:func:`counter_rose`); the value is the counter;
- ``RoseBy``: ``sum by (...) (increase(counter[window])) >= at_least``; the value is the rise;
- ``Share``: the part's and the whole's rises over the window, recorded, then their ratio, judged where
  the whole rose by ``min_count`` or more; the value is the share;
- ``Outside``: the gauge differs from itself clamped into ``[low, high]`` (NaN differs from itself,
  an infinity from the largest float), on ranks that have not closed; the value is the gauge.

Every grouping (``by``, ``on``) keeps :data:`CLUSTER`, the label each cluster's scraper adds to what it
remote-writes to a central store (docs/central-store.md): there, two clusters' runs of the same name stay apart;
on one Prometheus the label is absent (empty on every series), and the grouping is the same as without it.

An alert of scope ``host`` labels each rank's instance with its host and local rank, joined from
``ampwatch_rank_info`` (:func:`on_host`).

Example::

    from ampwatch.contract.alerts import ALERTS
    from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
    from ampwatch.dashboards.forms import expression
    print(expression(ALERTS["AmpPoisonedStep"], DEFAULT_THRESHOLDS))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ampwatch.contract import metrics as m
from ampwatch.contract.alerts import AlertDefinition
from ampwatch.contract.conditions import Outside, Rose, RoseBy, Share
from ampwatch.contract.counters import COUNTERS, GAUGES
from ampwatch.contract.thresholds import AlertThresholds
from ampwatch.contract.thresholds import promql_duration as dur

__all__ = ["CLUSTER", "counter_rose", "expression", "indent", "keys", "nonzero_name", "num", "on_host", "record",
           "recordings"]

_LARGEST_FLOAT = "1.7976931348623157e+308"
_IDENTITY = ("run", "rank", "optimizer")

CLUSTER = "cluster"
"""The label that names a cluster in a central store: its scraper's external label (absent on one Prometheus)."""


def keys(*labels: str) -> str:
    """Return the label list of a ``by``/``on`` grouping over ``labels``, :data:`CLUSTER` first.

    >>> keys("run", "rank")
    'cluster, run, rank'
    """
    return ", ".join((CLUSTER, *labels))


_RANK = keys("run", "rank")


def expression(definition: AlertDefinition, t: AlertThresholds) -> str:
    """Return the PromQL condition of a definition that declares one (its ``condition``), for thresholds ``t``."""
    expr = _form(definition, t)
    return on_host(expr) if definition.scope == "host" else expr


def on_host(expr: str) -> str:
    """Label each rank's series of ``expr`` with its host and local rank (``ampwatch_rank_info``, whose value is 1,
    so the value stays), as an alert of scope ``host`` carries them for the hardware ticket.

    One info series per rank (``topk``): a rank that two collectors expose (a run restarted on another replica
    while the first still keeps it) would make the join many-to-many, an error that stops the whole rule, for
    every run."""
    return (f"(\n{indent(expr)}\n)\n"
            f"* on ({_RANK}) group_left (host, local_rank) topk by ({_RANK}) (1, {m.RANK_INFO})")


def indent(text: str) -> str:
    """Indent every line of ``text`` by two spaces (an operand inside parentheses)."""
    return "\n".join("  " + line for line in text.splitlines())


def _form(definition: AlertDefinition, t: AlertThresholds) -> str:
    c = definition.condition
    if isinstance(c, Rose):
        metric = COUNTERS[c.counter].metric
        return counter_rose(nonzero_name(metric), metric, getattr(t, c.window))
    if isinstance(c, RoseBy):
        metric = COUNTERS[c.counter].metric
        return (f"sum by ({keys(*_identity(metric))}) (increase({metric}[{dur(getattr(t, c.window))}])) "
                f">= {getattr(t, c.at_least)}")
    if isinstance(c, Share):
        part, whole, ratio = _share_names(c, t)
        return (f"{ratio} >= {num(getattr(t, c.at_least))}\n"
                f"and on ({keys(*_identity(COUNTERS[c.part].metric))}) {whole} >= {getattr(t, c.min_count)}")
    if isinstance(c, Outside):
        metric = GAUGES[c.gauge].metric
        high = num(getattr(t, c.high)) if c.high else _LARGEST_FLOAT
        return (f"{metric} != clamp({metric}, {num(getattr(t, c.low))}, {high})\n"
                f"unless on ({_RANK}) {nonzero_name(m.RANK_CLOSED)}")
    raise TypeError(f"alert {definition.name} declares no condition of a known form: {c!r}")


def recordings(definitions: Iterable[AlertDefinition], t: AlertThresholds, form: type) -> list[dict[str, Any]]:
    """Return the recording rules the conditions of ``form`` among ``definitions`` read, each once."""
    rules: dict[str, dict[str, Any]] = {}
    for c in (d.condition for d in definitions):
        if not isinstance(c, form):
            continue
        if isinstance(c, Rose):
            metric = COUNTERS[c.counter].metric
            rules.setdefault(nonzero_name(metric), record(nonzero_name(metric), f"{metric} > 0"))
        elif isinstance(c, Share):
            part, whole, ratio = _share_names(c, t)
            w, by = dur(getattr(t, c.window)), keys(*_identity(COUNTERS[c.part].metric))
            rules.setdefault(part, record(part, f"sum by ({by}) (increase({COUNTERS[c.part].metric}[{w}]))"))
            rules.setdefault(whole, record(whole, f"sum by ({by}) (increase({COUNTERS[c.rest].metric}[{w}]))\n"
                                                  f"+ {part}"))
            rules.setdefault(ratio, record(ratio, f"{part} / {whole}"))
    return list(rules.values())


def _share_names(c: Share, t: AlertThresholds) -> tuple[str, str, str]:
    """Name the recordings of a share: the part's rise, the whole's, and the ratio (``level:metric:operation``)."""
    metric, w = COUNTERS[c.part].metric, dur(getattr(t, c.window))
    level, stem = _level(metric), metric.name.removesuffix("_total")
    return (f"{level}:{stem}:increase{w}", f"{level}:ampwatch_{COUNTERS[c.part].per}_{c.whole}:increase{w}",
            f"{level}:{stem}:ratio{w}")


def counter_rose(nonzero: str, counter: Any, window_s: int, current: str = "") -> str:
    """Return the counters ``nonzero`` selects (those above 0) that rose within the window.

    Their value now (``current``, default ``nonzero`` itself, a recording) differs from their value one window
    ago, or they had none then (a series born already above 0, its first scrape after the event). Two instant
    reads instead of increase()'s range read; it may fire up to one scrape interval longer (the last sample before
    the window counts), and a counter reset that came back to the very value it had one window ago is the one rise
    it misses.
    """
    return f"{nonzero}\nunless\n{current or nonzero} == {counter} offset {dur(window_s)}"


def nonzero_name(metric: m.Metric) -> str:
    """Name the recorded non-zero series of a collector metric (``_total`` dropped, as for every recording)."""
    return f"{_level(metric)}:{metric.name.removesuffix('_total')}:nonzero"


def _identity(metric: m.Metric) -> tuple[str, ...]:
    return tuple(label for label in metric.labels if label in _IDENTITY)


def _level(metric: m.Metric) -> str:
    return "_".join(_identity(metric))


def record(name: str, expr: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Return a recording rule."""
    return {"record": name, "expr": expr, **({"labels": labels} if labels else {})}


def num(value: float) -> str:
    """Render a threshold as PromQL reads it: 1.0 -> "1", 0.1 -> "0.1" (the short form humans read)."""
    return f"{value:g}"
