"""Evaluate the ampwatch alert conditions from per-rank snapshots, as the Prometheus rules do, without Prometheus.

Pure: thresholds come in as an ``ampwatch.contract.thresholds.AlertThresholds``
(the one config the rules are generated from), each alert's name, severities,
``for:``, texts, window and the counters it reads from ``ampwatch.contract.alerts``;
times are plain Unix seconds passed in by the caller.

Each alert's condition is one function here, in :data:`RANK_CONDITIONS` (alerts of one rank) or
:data:`RUN_CONDITIONS` (judged across a run). A windowed condition (``increase(x[w])`` in PromQL)
compares a rank's current snapshot with its counters one window ago, ``r.since(name)``, which
answers only for the counters the definition declares; which ranks the periodic pass reads in full
follows from those declarations (:meth:`~.history.RankHistory.quiet`), never from this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, ContextManager, Iterable, Mapping, Optional, Sequence

from ampwatch.contract.alerts import ALERTS, SPEAKERS
from ampwatch.contract.thresholds import AlertThresholds

from .._floats import promql_divide, promql_max, promql_min
from .._state import RankSnapshot
from .annotations import AlertTexts
from .history import Baseline, RankHistory

__all__ = ["ActiveAlert", "Finding", "spoken_key", "RankFacts", "RankReading", "RunCondition", "RANK_CONDITIONS",
           "RUN_CONDITIONS", "usable_scale", "rank_alerts", "unspoken_rank_alerts", "rank_facts", "run_alerts",
           "run_alerts_of", "held_back", "evaluate", "evaluate_with_facts"]


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
        if "rank" in self.labels and ALERTS[self.name].scope != "host":
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


_SEVERITY = {(name, level): d.severity(level).level for name, d in ALERTS.items()
             for level in (*(s.level for s in d.severities), *((None,) if len(d.severities) == 1 else ()))}
"""``(alert, level)`` -> its severity label (level None: an alert's only one), looked up once per alert held."""

Finding = tuple[str, Optional[str], Optional[str], float]
"""An instance of a rank's alert that holds, not built yet: ``(alert name, optimizer (None: an alert of the
rank), level (None: the alert's only severity), value)``. The periodic pass builds an :class:`ActiveAlert` only for
those no run-wide alert speaks for: in a whole-job storm, a handful instead of several per rank."""


def _alert(name: str, labels: dict, value: float, t: AlertThresholds, level: Optional[str] = None) -> ActiveAlert:
    definition = ALERTS[name]
    labels["severity"] = _SEVERITY[name, level]
    return ActiveAlert(name=name, labels=labels, value=value, for_s=definition.for_seconds(t),
                       annotations=AlertTexts(name, labels, value, t, level))


def _built(cur: RankSnapshot, finding: Finding, t: AlertThresholds) -> ActiveAlert:
    """The :class:`ActiveAlert` of one of ``cur``'s findings (labels: run, rank, and its optimizer if any)."""
    name, optimizer, level, value = finding
    labels = {"run": cur.run, "rank": str(cur.rank)}
    if optimizer is not None:
        labels["optimizer"] = optimizer
    return _alert(name, labels, value, t, level)


def spoken_key(a: ActiveAlert) -> tuple:
    """The identity of a per-rank alert as the pass holds it back (:func:`evaluate_with_facts`'s keys):
    ``(name, run, rank, optimizer or None, severity label)``, made without building the alert."""
    return a.name, a.labels["run"], int(a.labels["rank"]), a.labels.get("optimizer"), a.labels["severity"]


def _streak(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
    """Each streak alert that holds: per optimizer and severity, the current streak."""
    cur, base = r.current, r.since("AmpConsecutiveSkippedSteps")
    for opt_name in cur.optimizers:
        streak = cur.consecutive_skipped.get(opt_name, 0)
        for severity in ALERTS["AmpConsecutiveSkippedSteps"].severities:
            threshold = getattr(t, severity.threshold)
            # A streak that reached the threshold and ended between two batches shows only in the ladder.
            if base.rose("streaks_reached", opt_name, threshold) or (streak >= threshold and not cur.closed):
                yield "AmpConsecutiveSkippedSteps", opt_name, severity.level, streak


def _skip_ratio(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
    cur, base = r.current, r.since("AmpHighSkippedStepRatio")
    for opt_name, opt in cur.optimizers.items():
        skipped = opt.skipped - base.count("skipped", opt_name)
        calls = skipped + opt.steps - base.count("steps", opt_name)
        if calls >= max(t.skip_ratio_min_steps, 1) and skipped / calls >= t.skip_ratio:
            yield "AmpHighSkippedStepRatio", opt_name, None, skipped / calls


def _rose_per_optimizer(name: str, counter: str) -> Callable[[RankReading, AlertThresholds], Iterable[Finding]]:
    """The condition of an alert that holds while an optimizer's ``counter`` rose within its window."""
    def condition(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
        cur, base = r.current, r.since(name)
        for opt_name, opt in cur.optimizers.items():
            if base.rose(counter, opt_name):
                yield name, opt_name, None, getattr(opt, counter)
    return condition


def _conflict(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
    if r.since("AmpRankConflict").rose("conflicts"):
        yield "AmpRankConflict", None, None, r.current.conflicts


def usable_scale(scale: float, t: AlertThresholds) -> bool:
    """Return whether a loss scale still works: finite and at least ``collapsed_loss_scale``.

    Below it (0 included) gradients are no longer scaled up; NaN and +Inf scale every loss to a
    non-finite one, so every step skips and backoffs cannot bring the scale back.
    """
    return t.collapsed_loss_scale <= scale < math.inf


# The conditions without a window run for every rank at every pass: plain lists, not generators.
def _collapsed(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
    cur = r.current
    # A rank that closed cleanly is finished: its last scale is not trouble.
    if not cur.closed and cur.scaler_enabled and cur.loss_scale is not None and not usable_scale(cur.loss_scale, t):
        return [("AmpLossScaleCollapsed", None, None, cur.loss_scale)]
    return ()


def _silent(r: RankReading, t: AlertThresholds) -> Iterable[Finding]:
    cur = r.current
    silent_for = r.now - cur.last_seen
    if not cur.closed and silent_for > t.silent_after_s:
        return [("AmpRankSilent", None, None, silent_for)]
    return ()


RANK_CONDITIONS: Mapping[str, Callable[[RankReading, AlertThresholds], Iterable[Finding]]] = {
    "AmpConsecutiveSkippedSteps": _streak,
    "AmpLossScaleCollapsed": _collapsed,
    "AmpHighSkippedStepRatio": _skip_ratio,
    "AmpRankSilent": _silent,
    "AmpSchedulerStepsOnSkipped": _rose_per_optimizer("AmpSchedulerStepsOnSkipped", "scheduler_steps_after_skip"),
    "AmpPoisonedStep": _rose_per_optimizer("AmpPoisonedStep", "poisoned_steps"),
    "AmpRankConflict": _conflict,
}
"""The condition of each alert of one rank (scope ``optimizer`` or ``rank``): the instances that hold now, as
:data:`Finding` s."""


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
    fact: Optional[Callable[[RankReading, AlertThresholds], Any]] = None
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
        yield _alert("AmpSustainedLossScaleBackoff", {"run": run}, share, t)


def _desync(run: str, ranks: list[RankFacts], open_ranks: list[RankFacts], t: AlertThresholds) -> Iterable[ActiveAlert]:
    scales = [f.current.loss_scale for f in open_ranks
              if f.current.scaler_enabled and f.current.loss_scale is not None]
    if len(scales) >= 2:
        # max / min as PromQL computes it: a rank at 0 or +Inf beside a finite one is apart by +Inf.
        spread = promql_divide(promql_max(scales), promql_min(scales))
        if spread >= t.desync_scale_ratio:
            yield _alert("AmpLossScaleDesync", {"run": run}, spread, t)


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
            yield _alert("AmpSkipOriginRank", labels, f.facts["AmpSkipOriginRank"], t)


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
                yield _alert(name, {"run": run}, share, t, severity.level)
    return judge


RUN_CONDITIONS: Mapping[str, RunCondition] = {
    **{speaker: RunCondition(_most_ranks(speaker), idle=frozenset()) for speaker in SPEAKERS.values()},
    "AmpSustainedLossScaleBackoff": RunCondition(_sustained_backoff, _backing_off, idle=False),
    "AmpLossScaleDesync": RunCondition(_desync),
    "AmpSkipOriginRank": RunCondition(_origin, _origin_started, idle=0),
}
"""The condition of each alert judged across a run (scope ``run``, or ``host``: a rank judged beside its run)."""

if set(RANK_CONDITIONS) | set(RUN_CONDITIONS) != set(ALERTS) or any(
        ALERTS[name].scope in ("run", "host") for name in RANK_CONDITIONS) or any(
        ALERTS[name].scope not in ("run", "host") for name in RUN_CONDITIONS):
    raise RuntimeError("every alert of ampwatch.contract.alerts needs exactly one built-in condition here: one of "
                       "RANK_CONDITIONS for scope optimizer or rank, RUN_CONDITIONS for run or host; missing: "
                       f"{sorted(set(ALERTS) - set(RANK_CONDITIONS) - set(RUN_CONDITIONS))}")

# A quiet rank's windowed conditions cannot hold (none of their triggers moved, none of their gauges is above 0):
# only those without a window are read. Derived once from the definitions.
_EVERY = tuple(RANK_CONDITIONS.values())
_UNWINDOWED = tuple(condition for name, condition in RANK_CONDITIONS.items() if not ALERTS[name].window)
_FACTS = tuple((name, c.fact) for name, c in RUN_CONDITIONS.items() if c.fact is not None)
_IDLE: Mapping[str, Any] = {name: c.idle for name, c in RUN_CONDITIONS.items()}


_UNSPOKEN = tuple(condition for name, condition in RANK_CONDITIONS.items() if name not in SPEAKERS)


def rank_alerts(h: RankHistory, now: float, t: AlertThresholds, quiet: bool = False) -> list[ActiveAlert]:
    """Return the alerts of one rank that hold at ``now`` (each condition of :data:`RANK_CONDITIONS`).

    ``quiet`` (the rank is :meth:`~.history.RankHistory.quiet`): only the conditions without a window are read.
    """
    reading = RankReading(h, now, still=quiet)
    return [_built(reading.current, f, t) for f in _findings(reading, t)]


def unspoken_rank_alerts(h: RankHistory, now: float, t: AlertThresholds) -> list[ActiveAlert]:
    """Return the alerts of one rank that hold at ``now``, but for those a run-wide alert may speak for
    (``SPEAKERS``: in a run of several ranks the periodic pass decides them, having read the whole run)."""
    reading = RankReading(h, now)
    return [_built(reading.current, f, t) for f in _findings(reading, t, _UNSPOKEN)]


def _findings(reading: RankReading, t: AlertThresholds, conditions: Optional[tuple] = None) -> list[Finding]:
    """What holds of ``conditions`` (default: every rank condition, or a quiet rank's unwindowed ones)."""
    found: list[Finding] = []
    for condition in conditions or (_UNWINDOWED if reading.still else _EVERY):
        found.extend(condition(reading, t))
    return found


def rank_facts(h: RankHistory, now: float, t: AlertThresholds, quiet: bool = False) -> RankFacts:
    """Read from one rank's history what the run-wide conditions need (a quiet rank: at its latest moment)."""
    reading = RankReading(h, now, still=quiet)
    return _rank_facts(reading, t, _findings(reading, t))


def _rank_facts(reading: RankReading, t: AlertThresholds, findings: list[Finding]) -> RankFacts:
    """The rank's facts; ``findings``, its per-rank alerts that hold now, say where those spoken for hold."""
    if reading.still and not findings:
        return RankFacts(reading.current, _IDLE)
    facts = dict(_IDLE)
    if not reading.still:
        facts.update((name, fact(reading, t)) for name, fact in _FACTS)
    for name, _, level, _ in findings:
        speaker = SPEAKERS.get(name)
        if speaker is not None:
            facts[speaker] = facts.get(speaker, frozenset()) | {_SEVERITY[name, level]}
    return RankFacts(reading.current, facts)


def run_alerts(run: str, ranks: Iterable[RankHistory], now: float, t: AlertThresholds) -> list[ActiveAlert]:
    """Return the alerts of one run across its open ranks (each condition of :data:`RUN_CONDITIONS`).

    Open means not closed cleanly (a silent rank still counts until the collector expires it), as in the rules.
    """
    return run_alerts_of(run, [rank_facts(h, now, t) for h in ranks], t)


def _speaking(run_alerts: Iterable[ActiveAlert]) -> set[tuple[str, str, str]]:
    """``(run, per-rank alert, severity)`` that the run-wide alerts which hold speak for (their ``speaks_for``)."""
    return {(a.labels["run"], ALERTS[a.name].speaks_for, a.labels["severity"])  # type: ignore[misc]
            for a in run_alerts if ALERTS[a.name].speaks_for}


def held_back(rank_alerts: Iterable[ActiveAlert], run_alerts: Iterable[ActiveAlert]) -> set[tuple]:
    """Return the :func:`spoken_key` s of the per-rank alerts that a run-wide alert which holds speaks for (its
    ``speaks_for``), at its severity: on the ranks that are in it, where the per-rank alert holds at that severity,
    which is every instance of it that holds."""
    speaking = _speaking(run_alerts)
    return {spoken_key(a) for a in rank_alerts if (a.labels["run"], a.name, a.labels["severity"]) in speaking}


def run_alerts_of(run: str, ranks: list[RankFacts], t: AlertThresholds) -> list[ActiveAlert]:
    """Return the run-wide alerts of ``run`` from its ranks' :func:`rank_facts` (pure: no history read)."""
    open_ranks = [f for f in ranks if not f.current.closed]
    found: list[ActiveAlert] = []
    for condition in RUN_CONDITIONS.values():
        found.extend(condition.judge(run, ranks, open_ranks, t))
    return found


def evaluate(histories: Sequence[RankHistory], now: float, t: AlertThresholds,
             hold: Callable[[], ContextManager] = contextlib.nullcontext, slice_size: int = 16,
             between: Callable[[], object] = lambda: None, skip_quiet: bool = True) -> list[ActiveAlert]:
    """Return every alert that holds at ``now`` over all ranks and runs; O(ranks), ~20 us a rank, less if quiet.

    The histories are read in slices of ``slice_size`` ranks, each inside ``hold()`` (the
    evaluator's lock), so whoever records into a history waits for one slice, not the whole pass;
    ``between()`` runs between two slices, outside the lock (a pass in a worker thread sleeps there,
    handing the GIL to the event loop); the run-wide alerts are then judged from what the slices
    read, outside it. ``skip_quiet=False`` reads every rank's windows (what quiet ranks spare, measured).
    """
    return evaluate_with_facts(histories, now, t, hold, slice_size, between, skip_quiet)[0]


def evaluate_with_facts(histories: Sequence[RankHistory], now: float, t: AlertThresholds,
                        hold: Callable[[], ContextManager] = contextlib.nullcontext, slice_size: int = 16,
                        between: Callable[[], object] = lambda: None, skip_quiet: bool = True) \
        -> tuple[list[ActiveAlert], dict[str, list[RankFacts]], set[tuple]]:
    """Return :func:`evaluate`'s alerts (per-rank ones a run-wide alert speaks for held back), each run's facts,
    and the :func:`spoken_key` s of the per-rank alerts held back."""
    by_run: dict[str, list[RankFacts]] = {}
    findings: list[tuple[RankSnapshot, list[Finding]]] = []
    for first in range(0, len(histories), slice_size):
        if first:
            between()
        with hold():
            for h in histories[first:first + slice_size]:
                reading = RankReading(h, now, still=skip_quiet and h.quiet(now))
                found = _findings(reading, t)
                if found:
                    findings.append((reading.current, found))
                by_run.setdefault(h.run, []).append(_rank_facts(reading, t, found))
    run_wide = [a for run, ranks in by_run.items() for a in run_alerts_of(run, ranks, t)]
    # Only now is it known which per-rank alerts a run-wide one speaks for: those are held back without being
    # built (in a whole-job storm, several per rank), the others built.
    speaking = _speaking(run_wide)
    alerts: list[ActiveAlert] = []
    held: set[tuple] = set()
    for cur, found in findings:
        for finding in found:
            name, optimizer, level, _ = finding
            severity = _SEVERITY[name, level]
            if (cur.run, name, severity) in speaking:
                held.add((name, cur.run, cur.rank, optimizer, severity))  # its spoken_key()
            else:
                alerts.append(_built(cur, finding, t))
    return alerts + run_wide, by_run, held
