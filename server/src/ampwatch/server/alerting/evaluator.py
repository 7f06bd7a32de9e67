"""The collector's built-in alert evaluator: rank histories, the conditions, and the firing state machine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping

from ampwatch.contract.alerts import SPEAKERS
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds

from .._state import RankSnapshot
from .alert import Alert
from .annotations import BlockTexts
from .conditions import evaluate_with_facts, rank_alerts, unspoken_rank_alerts
from .early import EarlyStreaks
from .history import HistoryLayout, RankHistory
from .rank_conditions import ActiveAlert, spoken_key
from .states import AlertStates

__all__ = ["BuiltinAlerts"]

# Per-rank alerts a run-wide alert may speak for (its speaks_for): in a run of several ranks, the periodic pass
# decides them, after it judged whether most of the run's ranks are in the same trouble.
_FOLDABLE = frozenset(SPEAKERS)

_SLICE = 256  # ranks read per taking of the lock by recent_skips()


class BuiltinAlerts:
    """Evaluate the ampwatch alerts inside the collector, as batches arrive and on a periodic tick.

    >>> alerts = BuiltinAlerts()
    >>> alerts.observe(RankSnapshot(run="r", rank=0, last_seen=0.0))
    []

    :meth:`observe` (call it after each applied batch) evaluates that rank's
    own alerts at once, so a skip streak of a one-rank run fires at the ingest
    that crosses the threshold. :meth:`evaluate` (call it every second or so)
    evaluates everything, including run-wide alerts and silent ranks; it costs
    O(ranks), so it is kept off the ingest path. In a run of several ranks, the
    per-rank alerts a run-wide alert may speak for (``speaks_for``: a streak, a
    high skip ratio, a collapsed scale) are decided by the pass, which fires them once two passes in
    a row found one, and ``storm_edge_for_s`` after the run-wide alert last held it
    back, and resolves them (:meth:`observe` does not read them). A whole-job storm is
    then one alert, not one per rank, from its first batches to its last. One exception: a rank's streak
    alert fires with its batch when the last pass found the run calm long enough after the streak began
    (:mod:`.early`, whose table is the rule).
    """

    def __init__(self, thresholds: AlertThresholds = DEFAULT_THRESHOLDS, *, resolved_retention_s: float = 900.0,
                 resolution_s: float | None = None, clock: Callable[[], float] = time.time,
                 pacer: Callable[[], Callable[[], object]] | None = None,
                 blocks: Callable[[str], tuple[str, Mapping[str, str]] | None] = lambda run: None) -> None:
        self.thresholds = thresholds
        # run -> what its alerts add when the run is split over several collectors: their block label and texts (its
        # block here, the others' replicas: ``_placement_view.Placements.alert_block``), else None.
        self._blocks = blocks
        # Makes what each pass calls between two slices of ranks (a _pacing.Pacer): a pass run in a worker thread
        # otherwise holds the GIL for all its CPU time (~0.3 s at the default max_ranks_per_run, ~0.07 s in a storm
        # at 1,024 ranks), and the event loop's answers wait for it (an I/O-bound thread beside a CPU-bound one gets
        # the GIL back only every switch interval). None: no pauses.
        self._pacer = pacer
        # What each rank's history keeps (counters, rungs, how far back), from the alert definitions.
        self._layout = HistoryLayout(thresholds)
        # A window's baseline may be up to resolution_s older than the window: 5 s is noise against the
        # default 10-30 min windows, but not against the seconds-long windows of a demo or a test.
        self._resolution_s = resolution_s if resolution_s is not None else \
            min(5.0, min(self._layout.windows.values()) / 10)
        self._clock = clock
        self._ranks: dict[tuple[str, int], RankHistory] = {}
        self._states = AlertStates(resolved_retention_s, outward=self._outward)
        self._lock = threading.Lock()
        self._observed_during: set[tuple[str, str]] | None = None  # rank groups observed while evaluate() runs
        self._run_sizes: dict[str, int] = {}  # run -> ranks watched
        self._waiting: set[tuple] = set()  # per-rank alerts the last pass held for a second look
        # per-rank alert (its conditions.spoken_key) -> when a pass last held it back (a run-wide one held)
        self._spoken: dict[tuple, float] = {}
        self._early = EarlyStreaks(thresholds)
        self._early_during: set[tuple] = set()  # alerts batches fired (.early) while evaluate() runs

    def _outward(self, a: ActiveAlert) -> tuple[Mapping[str, str], Mapping[str, str]]:
        """The labels and annotations alert ``a`` fires with: its own, and of a split run its block's."""
        block = self._blocks(a.labels["run"])
        if block is None:
            return a.labels, a.annotations
        label, texts = block
        return {**a.labels, "block": label}, BlockTexts(a.annotations, texts)

    def observe(self, snapshot: RankSnapshot, now: float | None = None) -> list[Alert]:
        """Record a rank's new state and return the transitions of that rank's alerts."""
        now = snapshot.last_seen if now is None else now
        key = (snapshot.run, snapshot.rank)
        with self._lock:
            history = self._ranks.get(key)
            if history is None:
                history = self._ranks[key] = RankHistory(snapshot.run, snapshot.rank, self._layout,
                                                         self._resolution_s)
                self._run_sizes[snapshot.run] = self._run_sizes.get(snapshot.run, 0) + 1
            previous = history.current
            history.record(snapshot, self.thresholds.calibration_iterations)
            self._early.seen(snapshot)
            group = (snapshot.run, str(snapshot.rank))
            if self._observed_during is not None:
                self._observed_during.add(group)
            if self._run_sizes[snapshot.run] == 1:
                return self._states.advance(rank_alerts(history, now, self.thresholds), now, group)
            # In a run of several ranks the pass decides the alerts a run-wide one may speak for (fires and
            # resolves them): they are not even read here, which in a whole-job storm is most of the work. But for
            # a streak alert whose run the last pass found calm (.early).
            early = self._early.alerts(history, previous, now)
            if early and self._observed_during is not None:
                self._early_during.update(a.key for a in early)
            return self._states.advance(unspoken_rank_alerts(history, now, self.thresholds) + early, now, group,
                                        leave_names=_FOLDABLE)

    def evaluate(self, now: float | None = None) -> list[Alert]:
        """Evaluate every alert of every rank and run; return the transitions.

        O(ranks): about 0.2-0.3 s at the default ``max_ranks_per_run``, 0.04 s once they are quiet (nothing a
        window alert reads moved within the longest window: :meth:`~.history.RankHistory.quiet`, a healthy job's
        ranks half an hour after their calibration skips; ``python -m bench.experiments.alert_pass``), so the
        collector calls it from a worker thread. The lock is held a slice of ranks at a time
        (:func:`~.conditions.evaluate`), so :meth:`observe` on the event loop waits milliseconds, not the whole
        pass; a rank observed during the pass keeps what its observation decided (it saw newer data than the pass
        did), but for the alerts only the pass judges (:meth:`_pass_decides`).
        """
        now = self._clock() if now is None else now
        with self._lock:
            histories = list(self._ranks.values())
            self._observed_during = observed = set[tuple[str, str]]()
            self._early_during = early = set[tuple]()
        try:
            found, by_run, held = evaluate_with_facts(histories, now, self.thresholds, hold=lambda: self._lock,
                                                      between=self._pacer() if self._pacer else lambda: None)
            with self._lock:
                self._observed_during = None
                found = self._judged_whole(found, held, now)
                self._early.judge(by_run, {key[1] for key in self._spoken}, now)
                if observed:
                    found = [a for a in found if a.group not in observed or self._pass_decides(a.name, a.group)]
                # A streak alert a batch fired meanwhile (.early) saw newer data than this pass: kept.
                return self._states.advance(found, now, keep=observed,
                                            unless=lambda key, group: self._pass_decides(key[0], group)
                                            and key not in early)
        finally:
            self._observed_during = None  # also when the pass failed
            self._early_during = set()

    def _pass_decides(self, name: str, group: tuple) -> bool:
        """Whether only the pass judges alert ``name`` of evaluation group ``group``: one a run-wide alert may speak
        for, in a run of several ranks (a batch observed while the pass ran did not judge it: the pass's does)."""
        return name in _FOLDABLE and self._run_sizes.get(group[0], 0) > 1

    def _judged_whole(self, found: list, held: set[tuple], now: float) -> list:
        """Hold back the per-rank alerts a run-wide one may speak for, in a run of several ranks, at the edges of a
        whole-job event: one not firing yet for one pass (the first ranks' batches of a storm may come a pass
        before the others'), and one the run-wide alert held back for ``storm_edge_for_s`` after it last did (the
        ranks' windows end a few seconds apart). The event is then judged whole, not announced rank by rank and
        withdrawn a second later; a rank that stands out once it is over fires after that wait."""
        for key in held:
            self._spoken[key] = now
        edge = now - self.thresholds.storm_edge_for_s
        self._spoken = {key: at for key, at in self._spoken.items() if at > edge}
        waiting = {a.key for a in found if a.name in _FOLDABLE and not self._states.is_firing(a.key)
                   and self._run_sizes.get(a.labels["run"], 0) > 1}
        found = [a for a in found if (a.key not in waiting or a.key in self._waiting)
                 and not (a.name in _FOLDABLE and spoken_key(a) in self._spoken)]
        self._waiting = waiting
        return found

    def forget(self, run: str, rank: int, now: float | None = None) -> list[Alert]:
        """Drop an expired rank; its alerts resolve; return the transitions."""
        now = self._clock() if now is None else now
        with self._lock:
            if self._ranks.pop((run, rank), None) is not None:
                self._early.forget(run, rank)
                self._run_sizes[run] -= 1
                if not self._run_sizes[run]:
                    del self._run_sizes[run]
            group = (run, str(rank))
            return self._states.advance((), now, group)

    def recent_skips(self, run: str, ranks: Iterable[int], window_s: float, now: float | None = None) \
            -> dict[int, tuple[int, int]]:
        """Return ``{rank: (skipped, step calls)}`` of the ranks' optimizers over the last ``window_s`` (ranks not
        watched left out).

        Read from each rank's history (as the skip-ratio alert reads it); O(ranks x optimizers), the lock taken
        once per slice of ranks, as the periodic pass takes it.
        """
        now = self._clock() if now is None else now
        wanted, found = list(ranks), {}
        for start in range(0, len(wanted), _SLICE):
            with self._lock:
                for rank in wanted[start:start + _SLICE]:
                    history = self._ranks.get((run, rank))
                    if history is None or history.current is None:
                        continue
                    base = history.baseline(now, window_s)
                    skipped = stepped = 0
                    for name, o in history.current.optimizers.items():
                        skipped += o.skipped - base.count("skipped", name)
                        stepped += o.steps - base.count("steps", name)
                    found[rank] = (skipped, skipped + stepped)
        return found

    def ranks(self) -> list[tuple[str, int]]:
        """Return the ``(run, rank)`` pairs being watched."""
        with self._lock:
            return list(self._ranks)

    def firing(self) -> list[Alert]:
        """Return the alerts firing now."""
        with self._lock:
            return self._states.firing()

    def resolved(self) -> list[Alert]:
        """Return the alerts resolved recently, latest first."""
        with self._lock:
            return self._states.resolved()

    def fired(self, run: str, by_rank: bool = False) -> tuple[list[dict], dict[int, tuple[str, ...]]]:
        """Return the alerts that fired in ``run`` since the collector started (see :class:`~.fired.FiredAlerts`)
        and, with ``by_rank``, their names by rank (else an empty dict)."""
        with self._lock:
            fired = self._states.fired
            return fired.of_run(run), (fired.by_rank(run) if by_rank else {})

    def keep_runs(self, runs: Collection[str]) -> None:
        """Forget which alerts fired in runs not in ``runs`` (runs the collector no longer holds)."""
        with self._lock:
            self._states.fired.keep(runs)

    def to_json(self) -> dict:
        """Return the body of ``GET /v1/alerts``: firing now and recently resolved."""
        with self._lock:
            return {"firing": [a.to_json() for a in self._states.firing()],
                    "resolved": [a.to_json() for a in self._states.resolved()]}
