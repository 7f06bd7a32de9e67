"""Built-in alerts of a running collector: evaluate as batches land, tick, notify, serve ``GET /v1/alerts``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterator, Optional, Sequence

from fastapi import APIRouter, Request
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ampwatch.contract.metrics import COLLECTOR_NOTIFICATIONS
from ampwatch.contract.protocol import STREAK_LADDER
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds

from ._alerting import OptimizerCounters, RankSnapshot
from ._alerting_states import BuiltinAlerts
from ._notify import Notifier, NotifyConfig, Target
from ._state import CollectorState, RankState

__all__ = ["AlertService", "snapshot_of", "router", "NotificationMetrics"]

log = logging.getLogger("ampwatch.server.alerts")
router = APIRouter(prefix="/v1", tags=["alerts"])
_LADDER = tuple((length, f"reached_{length}") for length in STREAK_LADDER)  # (rung, totals key)


def snapshot_of(rank: RankState) -> RankSnapshot:
    """Return what the evaluator needs of a rank: totals over its processes, gauges of the newest one."""
    batch = rank.current.batch  # type: ignore[union-attr]
    totals = rank.totals.get("", {})
    optimizers = {}
    for name in rank.optimizers():
        t = rank.totals.get(name, {})
        now = batch.state.optimizers.get(name)
        optimizers[name] = OptimizerCounters(
            steps=t.get("steps", 0), skipped=t.get("skipped", 0),
            consecutive_skipped=now.consecutive_skipped if now else 0,
            streaks_reached={n: t[key] for n, key in _LADDER if t.get(key)},
            scheduler_steps_after_skip=t.get("scheduler_steps_after_skip", 0),
            poisoned_steps=t.get("poisoned_steps", 0))
    return RankSnapshot(run=rank.run, rank=rank.rank, last_seen=rank.last_seen, iteration=batch.state.iteration,
                        loss_scale=batch.state.loss_scale, scaler_enabled=batch.scaler.enabled,
                        backoffs=totals.get("backoffs", 0), growths=totals.get("growths", 0), closed=rank.closed,
                        optimizers=optimizers)


class NotificationMetrics(Collector):
    """Expose ``ampwatch_collector_notifications_total{target,outcome}`` read at scrape time."""

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self._notifier.counts()
        if not counts:  # no target configured: no family at all, rather than an empty one
            return
        family = CounterMetricFamily(COLLECTOR_NOTIFICATIONS.name.removesuffix("_total"), COLLECTOR_NOTIFICATIONS.help,
                                     labels=list(COLLECTOR_NOTIFICATIONS.labels))
        for (target, outcome), value in sorted(counts.items()):
            family.add_metric([target, outcome], value)
        yield family

    def describe(self) -> list:
        return []


class AlertService:
    """Own the evaluator and the notifier of one collector; nothing here ever raises into ingest."""

    def __init__(self, targets: Sequence[Target] = (), thresholds: AlertThresholds = DEFAULT_THRESHOLDS,
                 notify_config: Optional[NotifyConfig] = None, period_s: float = 1.0) -> None:
        self.alerts = BuiltinAlerts(thresholds)
        self.notifier = Notifier(targets, notify_config)
        self.period_s = period_s
        self.errors = 0

    def observe(self, rank: RankState) -> None:
        """Evaluate a rank's own alerts right after its batch was applied (a streak fires at this ingest)."""
        try:
            self.notifier.submit(self.alerts.observe(snapshot_of(rank), now=time.time()))
        except Exception:
            self._failed("evaluating the alerts of a batch")

    def tick(self, state: CollectorState, now: Optional[float] = None) -> None:
        """Evaluate everything (run-wide alerts, silent ranks, for: durations); forget ranks that left."""
        now = time.time() if now is None else now
        try:
            for run, rank in self.alerts.ranks():
                if state.get(run, rank) is None:
                    self.notifier.submit(self.alerts.forget(run, rank, now))
            self.notifier.submit(self.alerts.evaluate(now))
        except Exception:
            self._failed("the periodic alert evaluation")

    async def run(self, state: CollectorState) -> None:
        """Tick every ``period_s`` until cancelled."""
        while True:
            self.tick(state)
            await asyncio.sleep(self.period_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver queued notifications within ``timeout_s`` and stop."""
        self.notifier.close(timeout_s)

    def _failed(self, what: str) -> None:
        self.errors += 1
        if self.errors == 1:  # once: a bug here must not flood the log at every batch
            log.exception("built-in alerts: %s failed (logged once; ingest continues)", what)


@router.get("/alerts", summary="Built-in alerts: firing now and recently resolved")
async def list_alerts(request: Request) -> dict[str, Any]:
    """Return ``{"firing": [...], "resolved": [...]}``, each alert with name, labels, annotations and times."""
    service: Optional[AlertService] = getattr(request.app.state, "alert_service", None)
    if service is None:
        return {"firing": [], "resolved": []}
    return service.alerts.to_json()
