"""Built-in alerts of a running collector: evaluate as batches land and on a tick, and notify; never raise."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds

from .. import _trace
from .._pacing import Pacer
from .._state import CollectorState, RankState
from .evaluator import BuiltinAlerts
from .notifications import Notifier, NotifyConfig, Target

__all__ = ["AlertService"]

log = logging.getLogger("ampwatch.server.alerts")

# The periodic pass runs in a worker thread and sleeps PASS_BREATHER_S after each PASS_WORK_S of work, so that the
# event loop gets the GIL at once rather than a switch interval (5 ms) later, and about half of it while the
# pass lasts. In a whole-job storm at 1,024 ranks a pass cost ~0.15 s of CPU (~0.07 s since it builds only the
# alerts no run-wide one holds back); paused every 128 ranks it held the GIL ~20 ms at a time and batches that
# came meanwhile waited ~200 ms (python -m bench.experiments.storm).
# Paused by time, not only while ingest requests are in flight: requests the event loop has not read yet are
# not in flight, and a pass paused only then left the storm's ingest p99 ~40 ms higher (two runs beside each
# other). A pass costs one pause per 2 ms of its CPU: ~40 ms more at the default max_ranks_per_run, all quiet.
PASS_WORK_S = 0.002
PASS_BREATHER_S = 0.002


class AlertService:
    """Own the evaluator and the notifier of one collector; nothing here ever raises into ingest."""

    def __init__(self, targets: Sequence[Target] = (), thresholds: AlertThresholds = DEFAULT_THRESHOLDS,
                 notify_config: NotifyConfig | None = None, period_s: float = 1.0,
                 clock: Callable[[], float] = time.time,
                 blocks: Callable[[str], tuple[str, Mapping[str, str]] | None] = lambda run: None) -> None:
        """``blocks``: run -> what its alerts add when it is split over several collectors: their ``block`` label and
        texts (else None)."""
        self.alerts = BuiltinAlerts(thresholds, clock=clock, pacer=lambda: Pacer(PASS_WORK_S, PASS_BREATHER_S),
                                    blocks=blocks)
        self.clock = clock
        self.notifier = Notifier(targets, notify_config)
        self.period_s = period_s
        self.errors = 0
        self.suspect_devices: frozenset[str] = frozenset()
        """The devices now suspected (set by the app as it judges them): a rank on one holds AmpSuspectDevice."""

    def observe(self, rank: RankState) -> None:
        """Evaluate a rank's own alerts right after its batch was applied (a streak fires at this ingest)."""
        try:
            self.notifier.submit(self.alerts.observe(rank.view.snapshot(self.suspect_devices), now=self.clock()))
        except Exception:
            self._failed("evaluating the alerts of a batch")

    def tick(self, state: CollectorState, now: float | None = None) -> None:
        """Evaluate everything (run-wide alerts, silent ranks, for: durations); forget ranks that left."""
        now = self.clock() if now is None else now
        try:
            for run, rank in self.alerts.ranks():
                if state.get(run, rank) is None:
                    self.notifier.submit(self.alerts.forget(run, rank, now))
            self.alerts.keep_runs(set(state.runs))  # a copy, one C call: safe beside ingest
            self.notifier.submit(self.alerts.evaluate(now))
        except Exception:
            self._failed("the periodic alert evaluation")

    async def run(self, state: CollectorState) -> None:
        """Tick every ``period_s`` until cancelled, each tick in a worker thread (O(ranks): ingest goes on).

        Ticks start ``period_s`` apart (the next one at once if a tick took longer): a second *between* ticks made
        the cadence a second plus the pass, which at the default ``max_ranks_per_run`` lasts about a second too,
        and the alerts the pass decides (a streak fires once two passes in a row found it; a silent rank) came
        seconds late.
        """
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.to_thread(_trace.timed, "pass", lambda: self.tick(state))
            await asyncio.sleep(max(0.0, self.period_s - (loop.time() - started)))

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver queued notifications within ``timeout_s`` and stop."""
        self.notifier.close(timeout_s)

    def _failed(self, what: str) -> None:
        self.errors += 1
        if self.errors == 1:  # once: a bug here must not flood the log at every batch
            log.exception("built-in alerts: %s failed (logged once; ingest continues)", what)
