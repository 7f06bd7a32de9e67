"""Evaluate every ampwatch alert condition over ranks' histories, as the Prometheus rules do, without Prometheus.

Each alert's condition is one function: in :data:`~.rank_conditions.RANK_CONDITIONS` (alerts of one rank,
:mod:`.rank_conditions`, those of a common alert compiled from its declared condition by :mod:`.forms`) or
:data:`~.run_conditions.RUN_CONDITIONS` (judged across a run, :mod:`.run_conditions`); :func:`check_conditions`
refuses to load otherwise. This module is the pass over both: it reads each rank once (a quiet one,
:meth:`~.history.RankHistory.quiet`, at its latest moment), judges the run-wide alerts from what it
read, and builds only the per-rank alerts no run-wide one speaks for. Pure, as the conditions are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ampwatch.contract.alerts import ALERTS, SPEAKERS, AlertDefinition, check_hand_written
from ampwatch.contract.thresholds import AlertThresholds

from .._state import RankSnapshot
from .history import RankHistory
from .rank_conditions import HAND_WRITTEN as RANK_WRITTEN
from .rank_conditions import RANK_CONDITIONS, SEVERITY, ActiveAlert, Finding, RankReading, built, spoken_key
from .run_conditions import HAND_WRITTEN as RUN_WRITTEN
from .run_conditions import RUN_CONDITIONS, RankFacts

__all__ = ["check_conditions", "rank_alerts", "unspoken_rank_alerts", "rank_facts", "run_alerts", "run_alerts_of",
           "held_back", "evaluate", "evaluate_with_facts"]


def check_conditions(rank: Mapping[str, Any], run: Mapping[str, Any], hand_written: Iterable[str],
                     alerts: Mapping[str, AlertDefinition] = ALERTS) -> None:
    """Raise a RuntimeError unless each alert of ``alerts`` has exactly one built-in condition, in the registry of how
    it is judged (``run``: across a run, ``AlertDefinition.across_run``; ``rank``: on one rank's values), and
    ``hand_written`` names exactly the bespoke ones; the error names each alert missing, each entry extra, and why."""
    check_hand_written("rank_conditions.HAND_WRITTEN and run_conditions.HAND_WRITTEN", hand_written, alerts)
    missing = sorted(set(alerts) - set(rank) - set(run))
    extra = sorted((set(rank) | set(run)) - set(alerts))
    twice = sorted(set(rank) & set(run))
    misplaced = sorted(name for name in set(alerts) & (set(rank) ^ set(run))
                       if (name in run) != alerts[name].across_run)
    if missing or extra or twice or misplaced:
        raise RuntimeError(
            "every alert of ampwatch.contract.alerts needs exactly one built-in condition: in "
            "rank_conditions.RANK_CONDITIONS for one rank's (scope optimizer or rank, or host declared), "
            "run_conditions.RUN_CONDITIONS for one judged across a run (scope run, or host bespoke); missing: "
            f"{missing}, extra (no such alert): {extra}, in both: {twice}, in the other's registry: {misplaced}")


check_conditions(RANK_CONDITIONS, RUN_CONDITIONS, {*RANK_WRITTEN, *RUN_WRITTEN})

# A quiet rank's windowed conditions cannot hold (none of their triggers moved, none of their gauges is above 0):
# only those without a window are read. Derived once from the definitions.
_EVERY = tuple(RANK_CONDITIONS.values())
_UNWINDOWED = tuple(condition for name, condition in RANK_CONDITIONS.items() if not ALERTS[name].window)
_FACTS = tuple((name, c.fact) for name, c in RUN_CONDITIONS.items() if c.fact is not None)
_IDLE: Mapping[str, Any] = {name: c.idle for name, c in RUN_CONDITIONS.items()}


_UNSPOKEN = tuple(condition for name, condition in RANK_CONDITIONS.items() if name not in SPEAKERS)


def rank_alerts(h: RankHistory, now: float, t: AlertThresholds, quiet: bool = False) -> list[ActiveAlert]:
    """Return the alerts of one rank that hold at ``now`` (each condition of :data:`~.rank_conditions.RANK_CONDITIONS`).

    ``quiet`` (the rank is :meth:`~.history.RankHistory.quiet`): only the conditions without a window are read.
    """
    reading = RankReading(h, now, still=quiet)
    return [built(reading.current, f, t) for f in _findings(reading, t)]


def unspoken_rank_alerts(h: RankHistory, now: float, t: AlertThresholds) -> list[ActiveAlert]:
    """Return the alerts of one rank that hold at ``now``, but for those a run-wide alert may speak for
    (``SPEAKERS``: in a run of several ranks the periodic pass decides them, having read the whole run)."""
    reading = RankReading(h, now)
    return [built(reading.current, f, t) for f in _findings(reading, t, _UNSPOKEN)]


def _findings(reading: RankReading, t: AlertThresholds, conditions: tuple | None = None) -> list[Finding]:
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
            facts[speaker] = facts.get(speaker, frozenset()) | {SEVERITY[name, level]}
    return RankFacts(reading.current, facts)


def run_alerts(run: str, ranks: Iterable[RankHistory], now: float, t: AlertThresholds) -> list[ActiveAlert]:
    """Return the alerts of one run across its open ranks (each condition of :data:`~.run_conditions.RUN_CONDITIONS`).

    Open means not closed cleanly (a silent rank still counts until the collector expires it), as in the rules.
    """
    return run_alerts_of(run, [rank_facts(h, now, t) for h in ranks], t)


def _speaking(run_alerts: Iterable[ActiveAlert]) -> set[tuple[str, str, str]]:
    """``(run, per-rank alert, severity)`` that the run-wide alerts which hold speak for (their ``speaks_for``)."""
    return {(a.labels["run"], speaks_for, a.labels["severity"])
            for a in run_alerts if (speaks_for := ALERTS[a.name].speaks_for)}


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
             hold: Callable[[], AbstractContextManager] = contextlib.nullcontext, slice_size: int = 16,
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
                        hold: Callable[[], AbstractContextManager] = contextlib.nullcontext, slice_size: int = 16,
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
            severity = SEVERITY[name, level]
            if (cur.run, name, severity) in speaking:
                held.add((name, cur.run, cur.rank, optimizer, severity))  # its spoken_key()
            else:
                alerts.append(built(cur, finding, t))
    return alerts + run_wide, by_run, held
