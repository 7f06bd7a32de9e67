"""When each alert judged across a run holds: one condition per alert, in :data:`RUN_CONDITIONS`.

A run-wide condition reads what it needs of each rank first (its :attr:`RunCondition.fact`, from the
rank's window), then judges the run from those facts. An alert that *speaks for* a per-rank one
(``ampwatch.contract.alerts.SPEAKERS``) holds when most of the run's ranks hold that one; the pass
(:mod:`.conditions`) then holds the ranks' own instances back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ampwatch.contract.alerts import ALERTS, SPEAKERS
from ampwatch.contract.thresholds import AlertThresholds

from .._floats import promql_divide, promql_max, promql_min
from .._state import RankSnapshot
from .rank_conditions import ActiveAlert, RankReading, latest_diagnosis, make_alert

__all__ = ["HAND_WRITTEN", "RankFacts", "RunCondition", "RUN_CONDITIONS"]


@dataclasses.dataclass(frozen=True, slots=True)
class RankFacts:
    """What the run-wide conditions need of one rank at ``now``: its snapshot and each one's fact about it."""

    current: RankSnapshot
    facts: Mapping[str, Any]
    """Alert name -> what its :attr:`RunCondition.fact` read of the rank's window; for an alert that speaks for a
    per-rank one, the severities at which that one holds on the rank."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunCondition:
    """An alert judged across a run: what it reads of each rank, then what holds for the run."""

    judge: Callable[[str, list[RankFacts], list[RankFacts], AlertThresholds], Iterable[ActiveAlert]]
    """``(run, its ranks' facts, those of its open ranks (not closed; maybe none), t)`` -> the instances that hold."""
    fact: Callable[[RankReading, AlertThresholds], Any] | None = None
    """What it needs of one rank's window (None: its snapshot alone)."""
    idle: Any = None
    """The fact of a quiet rank (none of the alert's triggers moved within its window), which the periodic pass
    takes without reading (a property test checks it against ``fact``)."""


def _backing_off(r: RankReading, t: AlertThresholds) -> bool:
    """Backed off often enough without growing over the backoff window, once past calibration."""
    cur, base = r.current, r.since("AmpSustainedLossScaleBackoff")
    # Backoffs at start-up are the scaler calibrating its first scale, which is normal: a rank counts only once its
    # whole window is past calibration (a rank younger than the window has a zero baseline).
    return base.count("iteration") >= t.calibration_iterations and \
        cur.totals.backoffs - base.count("backoffs") >= t.backoff_min_count and not base.rose("growths")


def _sustained_backoff(run: str, ranks: list[RankFacts], open_ranks: list[RankFacts],
                       t: AlertThresholds) -> Iterable[ActiveAlert]:
    if not open_ranks:
        return
    backing_off = sum(1 for f in open_ranks if f.facts["AmpSustainedLossScaleBackoff"])
    share = backing_off / len(open_ranks)
    if backing_off and share >= t.backoff_rank_share:
        yield make_alert("AmpSustainedLossScaleBackoff", {"run": run}, share, t)


def _desync(run: str, ranks: list[RankFacts], open_ranks: list[RankFacts], t: AlertThresholds) -> Iterable[ActiveAlert]:
    scales = [f.current.loss_scale for f in open_ranks
              if f.current.scaler_enabled and f.current.loss_scale is not None]
    if len(scales) >= 2:
        # max / min as PromQL computes it: a rank at 0 or +Inf beside a finite one is apart by +Inf.
        spread = promql_divide(promql_max(scales), promql_min(scales))
        if spread >= t.desync_scale_ratio:
            yield make_alert("AmpLossScaleDesync", {"run": run}, spread, t)


def _origin_started(r: RankReading, t: AlertThresholds) -> int:
    """Skipped iterations the rank started (its own gradients non-finite before DDP's all-reduce) in the window."""
    return r.current.totals.origin_iterations - r.since("AmpSkipOriginRank").count("origin_iterations")


def _origin(run: str, ranks: list[RankFacts], open_ranks: list[RankFacts], t: AlertThresholds) -> Iterable[ActiveAlert]:
    # An open rank that started enough skipped iterations in the window alerts while few of the run's ranks
    # started any.
    starting = sum(1 for f in ranks if f.facts["AmpSkipOriginRank"] > 0)
    if not starting or starting > max(len(open_ranks) * t.origin_rank_share, 1):
        return
    for f in ranks:
        cur = f.current
        if f.facts["AmpSkipOriginRank"] >= t.origin_min_count and not cur.closed:
            labels = {"run": cur.run, "rank": str(cur.rank), "host": cur.host, "local_rank": str(cur.local_rank)}
            yield make_alert("AmpSkipOriginRank", labels, f.facts["AmpSkipOriginRank"], t,
                             diagnosis=latest_diagnosis(cur))


def _most_ranks(name: str) -> Callable[[str, list[RankFacts], list[RankFacts], AlertThresholds], Iterable[ActiveAlert]]:
    """The condition of a run-wide alert that speaks for a per-rank one: most of the run's ranks (and two at least)
    hold that alert at a severity. Closed ranks count too, as their alerts do within a window: a job that ends in a
    storm stays one alert."""
    severities = ALERTS[name].severities

    def judge(run: str, ranks: list[RankFacts], open_ranks: list[RankFacts], t: AlertThresholds) \
            -> Iterable[ActiveAlert]:
        for severity in severities:
            holding = sum(1 for f in ranks if severity.level in f.facts[name])
            share = holding / len(ranks)
            if holding >= 2 and share >= t.storm_rank_share:
                yield make_alert(name, {"run": run}, share, t, severity.level)
    return judge


HAND_WRITTEN: Mapping[str, RunCondition] = {
    "AmpSustainedLossScaleBackoff": RunCondition(_sustained_backoff, _backing_off, idle=False),
    "AmpLossScaleDesync": RunCondition(_desync),
    "AmpSkipOriginRank": RunCondition(_origin, _origin_started, idle=0),
}
"""The condition of each bespoke alert judged across a run."""

RUN_CONDITIONS: Mapping[str, RunCondition] = {
    **{speaker: RunCondition(_most_ranks(speaker), idle=frozenset()) for speaker in SPEAKERS.values()},
    **HAND_WRITTEN,
}
"""The condition of each alert judged across a run (``AlertDefinition.across_run``: scope ``run``, or ``host``
without a declared condition: a rank judged beside its run): those that speak for a per-rank alert follow from it,
the bespoke ones are hand-written."""
