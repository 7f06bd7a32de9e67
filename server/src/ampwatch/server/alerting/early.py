"""The streak alerts a batch fires at once in a run of several ranks: when the last pass found the run calm.

In a run of several ranks the periodic pass decides the per-rank alerts a run-wide one may speak for
(:meth:`~.evaluator.BuiltinAlerts._judged_whole`): one fires once two passes in a row found it, so that a whole-job
storm's leading edge, while its ranks' news is still spread over up to ``NEWS_WITHIN_S``, is one ``AmpRunSkipStorm``
and not a rank alert per rank withdrawn a second later. That wait put a lone rank's streak alert 2-3.5 s after its
16th skip. A streak alert can be judged sooner, because its streak began 15 skips before it: a pass that started
well after that beginning has seen every rank whose streak began with it. If that pass found the run calm (too few
of its ranks in any streak for a storm), the rank's streak is its own, and its alert fires with the batch that
shows it.

The rule, for an instance of ``AmpConsecutiveSkippedSteps`` that holds on rank R of run U when R's batch lands
(P: when U's last pass started; B: when the batch came that first counted R's streak of that optimizer begun;
``MARGIN_S``: twice ``NEWS_WITHIN_S``; *troubled*: U's ranks in a streak or holding the streak alert at P, plus
those whose batches since P counted a streak begun):

====  ==========  ===================================================  ======================  ==============
case  U           its last pass (at P) found, and batches since        R's streak began (B)    decided by
====  ==========  ===================================================  ======================  ==============
1     one rank    (any)                                                (any)                   the batch
2     several     nothing yet: U came after it                         (any)                   the pass
3     several     troubled: a storm's share (``storm_rank_share``,     (any)                   the pass
                  two ranks at least)
4     several     a run-wide alert held one of U's back within         (any)                   the pass
                  ``storm_edge_for_s`` (a storm's edge)
5     several     calm (neither 3 nor 4)                               after P - ``MARGIN_S``  the pass
                                                                       (or never seen begin)
6     several     calm                                                 at P - ``MARGIN_S`` or  the batch: it
                                                                       before                  fires at once
====  ==========  ===================================================  ======================  ==============

Case 1 is the evaluator's own (a one-rank run has no run-wide alert to speak for it). What follows a case 6 alert
is the pass's, as for one the pass fired: a pass that read R before that batch (it ran meanwhile) does not resolve
it; a later pass that finds a run-wide alert speaking for it holds it back (it resolves). Case 5 is a streak too
young for P to have seen a whole-job start with it: a job of 0.25 s iterations reaches 16 skips 4 s after the
first, so a faster one's streak alerts wait for the pass, as all did before. One edge is left to the pass's
judgement after the fact: R in a streak of its own before a whole-job storm began, its 16th skip's news in before
most of the storm's first news (at most ``NEWS_WITHIN_S`` after it). R's alert then fires, and resolves at the
pass that finds the storm: one rank's, not the storm's thousands.
"""

from __future__ import annotations

from collections.abc import Mapping

from ampwatch.contract.alerts import SPEAKERS
from ampwatch.contract.protocol import NEWS_WITHIN_S
from ampwatch.contract.thresholds import AlertThresholds

from .._state import RankSnapshot
from .._totals import OptimizerTotals
from .history import RankHistory
from .rank_conditions import HAND_WRITTEN, ActiveAlert, RankReading, built
from .run_conditions import RankFacts

__all__ = ["EARLY", "MARGIN_S", "EarlyStreaks"]

EARLY = "AmpConsecutiveSkippedSteps"
"""The per-rank alert a batch may fire in a run of several ranks: the one whose trouble began well before it holds."""

MARGIN_S = 2 * NEWS_WITHIN_S
"""Seconds from a streak's first batch to the start of a pass that has seen every rank whose streak began with it:
the agents' promise, twice (news is late on a collector that falls behind in a storm)."""

_SPEAKER = SPEAKERS[EARLY]
_STREAK = HAND_WRITTEN[EARLY]
_NONE = OptimizerTotals()


class EarlyStreaks:
    """What case 6 of the rule needs: when each rank's latest streak was first seen, and the runs found calm.

    Not thread-safe: the evaluator calls it under its lock.

    >>> from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
    >>> early = EarlyStreaks(DEFAULT_THRESHOLDS)
    >>> early.calm_since("r") is None  # no pass judged run "r" yet
    True
    """

    __slots__ = ("_t", "_began", "_calm", "_fresh")

    def __init__(self, t: AlertThresholds) -> None:
        self._t = t
        # (run, rank) -> optimizer -> (its skip streaks begun, when the batch came that first counted the latest)
        self._began: dict[tuple[str, int], dict[str, tuple[int, float]]] = {}
        # run -> (start of the last pass, its ranks then, the troubled ones), for the runs that pass found calm
        self._calm: dict[str, tuple[float, int, int]] = {}
        self._fresh: dict[str, dict[int, float]] = {}  # run -> rank -> when a batch counted a streak begun

    def seen(self, s: RankSnapshot) -> None:
        """Note a rank's batch: an optimizer whose count of streaks begun rose began its latest one in this batch's
        wake (a rank first seen in a streak: now, as far as the collector knows)."""
        key = (s.run, s.rank)
        began = self._began.get(key)
        for name, o in s.optimizers.items():
            if not o.streaks:
                continue
            if began is None:
                began = self._began[key] = {}
            known = began.get(name)
            if known is None or o.streaks != known[0]:
                began[name] = (o.streaks, s.last_seen)
                if s.run in self._calm:
                    self._fresh.setdefault(s.run, {})[s.rank] = s.last_seen

    def forget(self, run: str, rank: int) -> None:
        """Drop a rank the collector expired."""
        self._began.pop((run, rank), None)

    def judge(self, by_run: Mapping[str, list[RankFacts]], edged: set[str], at: float) -> None:
        """Take a pass's reading (``by_run``: each run's ranks' facts; ``edged``: the runs a run-wide alert held a rank
        alert of back within ``storm_edge_for_s``) as of ``at``, when it started: the runs it found calm."""
        calm: dict[str, tuple[float, int, int]] = {}
        for run, ranks in by_run.items():
            if len(ranks) < 2 or run in edged:
                continue
            troubled = sum(1 for f in ranks if f.facts[_SPEAKER] or any(f.current.consecutive_skipped.values()))
            if not self._storm(troubled, len(ranks)):
                calm[run] = (at, len(ranks), troubled)
        self._calm = calm
        # Streaks begun before the pass started are in its reading; those since, in none yet (some in both: safe).
        self._fresh = {run: kept for run, ranks in self._fresh.items() if run in calm
                       if (kept := {rank: b for rank, b in ranks.items() if b >= at})}

    def _storm(self, troubled: int, ranks: int) -> bool:
        """Whether that many troubled ranks of a run of ``ranks`` are a storm's share (``_most_ranks``'s rule)."""
        return troubled >= 2 and troubled / ranks >= self._t.storm_rank_share

    def calm_since(self, run: str) -> float | None:
        """When the last pass started, if it found ``run`` calm and no storm's share began a streak since (None:
        it did not)."""
        calm = self._calm.get(run)
        if calm is None:
            return None
        at, ranks, troubled = calm
        return None if self._storm(troubled + len(self._fresh.get(run, ())), ranks) else at

    def alerts(self, history: RankHistory, previous: RankSnapshot | None, now: float) -> list[ActiveAlert]:
        """The rank's streak alerts that its batch (``history.current``, after ``previous``) fires at once: case 6."""
        cur = history.current
        assert cur is not None  # recorded before
        began = self._began.get((cur.run, cur.rank))
        at = self.calm_since(cur.run) if began is not None else None
        if at is None or began is None:
            return []
        warning = self._t.skip_streak_warning
        before = previous.optimizers if previous is not None else {}
        old = [name for name, (_, b) in began.items() if b <= at - MARGIN_S and (
            cur.consecutive_skipped.get(name, 0) >= warning
            or cur.optimizers.get(name, _NONE).reached(warning) != before.get(name, _NONE).reached(warning))]
        if not old:
            return []
        return [built(cur, f, self._t) for f in _STREAK(RankReading(history, now), self._t) if f[1] in old]
