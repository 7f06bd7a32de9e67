"""When each alert of one rank holds: one function per alert, in :data:`RANK_CONDITIONS`, as the Prometheus rules say.

A common alert's function is compiled from the condition its definition declares (:mod:`.forms`); the
bespoke alerts' are written here (:data:`HAND_WRITTEN`). Pure: thresholds come in as an
``ampwatch.contract.thresholds.AlertThresholds`` (the one config the rules are generated from), each
alert's name, severities, ``for:``, texts, window and the counters it reads from
``ampwatch.contract.alerts``; times are plain Unix seconds passed in by the caller.

A windowed condition (``increase(x[w])`` in PromQL) compares a rank's current snapshot with its
counters one window ago, ``r.since(name)``, which answers only for the counters the definition
declares; which ranks the periodic pass reads in full follows from those declarations
(:meth:`~.history.RankHistory.quiet`), never from this module. Alerts judged across a run are in
:mod:`.run_conditions`; the pass over both, in :mod:`.conditions`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping

from ampwatch.contract.alerts import ALERTS
from ampwatch.contract.counters import GAUGES
from ampwatch.contract.thresholds import AlertThresholds

from .._state import RankSnapshot
from .annotations import AlertTexts
from .forms import compiled
from .history import Baseline, RankHistory

__all__ = ["ActiveAlert", "Finding", "HAND_WRITTEN", "RankReading", "RANK_CONDITIONS", "SEVERITY", "make_alert",
           "built", "spoken_key", "usable_scale"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ActiveAlert:
    """A condition that holds now; the state machine applies its ``for_s`` before it fires."""

    name: str
    labels: Mapping[str, str]
    value: float
    for_s: float
    annotations: Mapping[str, str]
    key: tuple = dataclasses.field(init=False, repr=False, compare=False)
    """The identity of the alert, ``(name, frozenset of its labels)``, made once: a pass in a whole-job storm
    asks for it several times for each of thousands of alerts (a set needs no sorting of the labels)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.name, frozenset(self.labels.items())))

    @property
    def group(self) -> tuple:
        """Return the evaluation group that produced it: ``(run, rank)`` or ``(run,)`` (alerts judged across a run)."""
        run = self.labels["run"]
        if "rank" in self.labels and not ALERTS[self.name].across_run:
            return (run, self.labels["rank"])
        return (run,)


class RankReading:
    """One rank as the conditions read it at ``now``: its latest snapshot and, per alert, its baseline one window ago.

    ``still``: the rank is quiet (:meth:`~.history.RankHistory.quiet`), so each window's baseline is its
    latest moment, read without a search.
    """

    __slots__ = ("history", "current", "now", "still")

    def __init__(self, history: RankHistory, now: float, still: bool = False) -> None:
        self.history, self.now, self.still = history, now, still
        self.current: RankSnapshot = history.current  # type: ignore[assignment]  # a read history has recorded

    def since(self, alert: str) -> Baseline:
        """Return the rank one window of ``alert`` before now (it answers for the counters ``alert`` declares)."""
        return self.history.since(alert, self.now, self.still)


SEVERITY = {(name, level): d.severity(level).level for name, d in ALERTS.items()
             for level in (*(s.level for s in d.severities), *((None,) if len(d.severities) == 1 else ()))}
"""``(alert, level)`` -> its severity label (level None: an alert's only one), looked up once per alert held."""

Finding = tuple[str, str | None, str | None, float]
"""An instance of a rank's alert that holds, not built yet: ``(alert name, optimizer (None: an alert of the
rank), level (None: the alert's only severity), value)``. The periodic pass builds an :class:`ActiveAlert` only for
those no run-wide alert speaks for: in a whole-job storm, a handful instead of several per rank."""


def make_alert(name: str, labels: dict, value: float, t: AlertThresholds, level: str | None = None,
               diagnosis: tuple | None = None) -> ActiveAlert:
    """The :class:`ActiveAlert` ``name`` that holds with ``labels`` (its severity label added: ``level``'s);
    ``diagnosis``: the rank's latest (event id, began, samples), added to the texts as ``began`` and ``samples``."""
    definition = ALERTS[name]
    labels["severity"] = SEVERITY[name, level]
    return ActiveAlert(name=name, labels=labels, value=value, for_s=definition.for_seconds(t),
                       annotations=AlertTexts(name, labels, value, t, level, diagnosis))


def built(cur: RankSnapshot, finding: Finding, t: AlertThresholds) -> ActiveAlert:
    """The :class:`ActiveAlert` of one of ``cur``'s findings (labels: run, rank, and its optimizer if any)."""
    name, optimizer, level, value = finding
    labels = {"run": cur.run, "rank": str(cur.rank)}
    if optimizer is not None:
        labels["optimizer"] = optimizer
    for label in _BESIDE.get(name, ()):
        labels[label] = str(getattr(cur, label))
    return make_alert(name, labels, value, t, level, latest_diagnosis(cur, optimizer))


def latest_diagnosis(cur: RankSnapshot, optimizer: str | None = None) -> tuple | None:
    """``cur``'s latest (event id, began, samples) for ``optimizer`` (None: of any optimizer), or None."""
    if optimizer is not None:
        return cur.diagnosis.get(optimizer)
    return max(cur.diagnosis.values(), key=lambda d: d[0], default=None)


_BESIDE = {name: labels for name, d in ALERTS.items()
           if (labels := (*(label for g in d.gauges if GAUGES[g].per == "rank"
                            for label in GAUGES[g].metric.labels if label not in ("run", "rank")),
                          *(label for label in d.labels if label not in ("run", "rank", "optimizer"))))}
"""Each alert's labels besides run, rank and optimizer, read off the snapshot's field of that name: those the series
of its rank gauges carry (``device``), as the Prometheus alert carries them from that series, and a host alert's host
and local rank (its scope's labels), as the rule joins them from ``ampwatch_rank_info``."""


def spoken_key(a: ActiveAlert) -> tuple:
    """The identity of a per-rank alert as the pass holds it back (:func:`~.conditions.evaluate_with_facts`'s keys):
    ``(name, run, rank, optimizer or None, severity label)``, made without building the alert."""
    return a.name, a.labels["run"], int(a.labels["rank"]), a.labels.get("optimizer"), a.labels["severity"]


def _streak(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
    """Each streak alert that holds: per optimizer and severity, the current streak."""
    cur, base = r.current, r.since("AmpConsecutiveSkippedSteps")
    for opt_name in cur.optimizers:
        streak = cur.consecutive_skipped.get(opt_name, 0)
        for severity in ALERTS["AmpConsecutiveSkippedSteps"].severities:
            threshold = getattr(t, severity.threshold)  # type: ignore[arg-type]  # each names a length
            # A streak that reached the threshold and ended between two batches shows only in the ladder.
            if base.rose("streaks_reached", opt_name, threshold) or (streak >= threshold and not cur.closed):
                yield "AmpConsecutiveSkippedSteps", opt_name, severity.level, streak


def usable_scale(scale: float, t: AlertThresholds) -> bool:
    """Return whether a loss scale still works: finite and at least ``collapsed_loss_scale``.

    Below it (0 included) gradients are no longer scaled up; NaN and +Inf scale every loss to a
    non-finite one, so every step skips and backoffs cannot bring the scale back.
    """
    return t.collapsed_loss_scale <= scale < math.inf


# Without a window: read for every rank at every pass, so a plain list, not a generator.
def _silent(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
    cur = r.current
    silent_for = r.now - cur.last_seen
    if not cur.closed and silent_for > t.silent_after_s:
        return [("AmpRankSilent", None, None, silent_for)]
    return ()


# Without a window: read for every rank at every pass, so a plain list, not a generator.
def _suspect_device(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
    cur = r.current
    # The collector's verdict on the rank's device (docs/suspects.md), taken with each batch it applies.
    if cur.on_suspect_device > 0 and not cur.closed:
        return [("AmpSuspectDevice", None, None, cur.on_suspect_device)]
    return ()


HAND_WRITTEN: Mapping[str, Callable[[RankReading, AlertThresholds], Iterable[Finding]]] = {
    "AmpConsecutiveSkippedSteps": _streak,
    "AmpRankSilent": _silent,
    "AmpSuspectDevice": _suspect_device,
}
"""The condition of each bespoke alert of one rank (one that declares no ``condition``)."""

RANK_CONDITIONS: Mapping[str, Callable[[RankReading, AlertThresholds], Iterable[Finding]]] = {
    **{name: compiled(d) for name, d in ALERTS.items() if d.condition is not None}, **HAND_WRITTEN}
"""The condition of each alert of one rank (scope ``optimizer`` or ``rank``, or ``host`` with a declared condition:
``AlertDefinition.across_run`` false): the instances that hold now, as
:data:`Finding` s. Compiled from each declared ``condition``, hand-written for the bespoke ones."""
