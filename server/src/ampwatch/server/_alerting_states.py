"""Turn successive alert evaluations into firing / resolved transitions, honouring each rule's ``for:``."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Iterable, Optional

from ampwatch.contract.alerts import ALERTS
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds

from ._alert import Alert
from ._alerting import ActiveAlert, RankHistory, RankSnapshot, evaluate, rank_alerts

__all__ = ["AlertStates", "BuiltinAlerts"]

# The thresholds fields that are windows the conditions look back over (each alert's ``increase(x[w])``).
_WINDOWS = tuple(dict.fromkeys(p for d in ALERTS.values() for p in d.parameters if p.endswith("_window_s")))


class AlertStates:
    """Hold pending, firing and recently resolved alerts, as Prometheus's rule manager does.

    An alert whose condition holds goes pending, then fires once it has held for
    its ``for_s`` (at once when 0); it resolves at the first evaluation of its
    group where the condition no longer holds.
    """

    def __init__(self, resolved_retention_s: float = 900.0, max_resolved: int = 1000) -> None:
        self._pending: dict[tuple, tuple[float, ActiveAlert]] = {}
        self._firing: dict[tuple, Alert] = {}
        self._groups: dict[tuple, tuple] = {}
        self._resolved: collections.deque[Alert] = collections.deque(maxlen=max_resolved)
        self._retention_s = resolved_retention_s

    def advance(self, active: Iterable[ActiveAlert], now: float,
                groups: Optional[Callable[[tuple], bool]] = None) -> list[Alert]:
        """Apply one evaluation and return the alerts that started firing or resolved.

        ``groups`` says which evaluation groups (``(run, rank)`` or ``(run,)``) were
        evaluated; alerts of other groups are left as they are. None: all of them.
        """
        changes: list[Alert] = []
        seen = set()
        for a in active:
            key = a.key
            seen.add(key)
            if key in self._firing:
                # Still firing: keep its value and text current, but that is no transition to announce.
                self._firing[key] = dataclasses.replace(self._firing[key], value=a.value, annotations=a.annotations)
                continue
            since, _ = self._pending.get(key, (now, a))
            if now - since >= a.for_s:
                self._pending.pop(key, None)
                alert = Alert(name=a.name, labels=dict(a.labels), annotations=dict(a.annotations),
                              starts_at=now, value=a.value)
                self._firing[key] = alert
                self._groups[key] = a.group
                changes.append(alert)
            else:
                self._pending[key] = (since, a)
        in_scope = groups or (lambda group: True)
        for key in [k for k, (_, a) in self._pending.items() if k not in seen and in_scope(a.group)]:
            del self._pending[key]
        for key in [k for k in self._firing if k not in seen and in_scope(self._groups[k])]:
            alert = self._firing.pop(key).resolved(now)
            del self._groups[key]
            self._resolved.append(alert)
            changes.append(alert)
        while self._resolved and self._resolved[0].ends_at < now - self._retention_s:  # type: ignore[operator]
            self._resolved.popleft()
        return changes

    def firing(self) -> list[Alert]:
        """Return the alerts firing now, oldest first."""
        return sorted(self._firing.values(), key=lambda a: a.starts_at)

    def resolved(self) -> list[Alert]:
        """Return the alerts resolved within the retention, latest first."""
        return list(reversed(self._resolved))


class BuiltinAlerts:
    """Evaluate the ampwatch alerts inside the collector, as batches arrive and on a periodic tick.

    >>> alerts = BuiltinAlerts()
    >>> alerts.observe(RankSnapshot(run="r", rank=0, last_seen=0.0))
    []

    :meth:`observe` (call it after each applied batch) evaluates that rank's
    own alerts at once, so a skip streak fires at the ingest that crosses the
    threshold. :meth:`evaluate` (call it every second or so) evaluates
    everything, including run-wide alerts and silent ranks; it costs
    O(ranks), so it is kept off the ingest path.
    """

    def __init__(self, thresholds: AlertThresholds = DEFAULT_THRESHOLDS, *, resolved_retention_s: float = 900.0,
                 resolution_s: Optional[float] = None, clock: Callable[[], float] = time.time) -> None:
        self.thresholds = thresholds
        windows = [getattr(thresholds, name) for name in _WINDOWS]
        self._horizon_s = max(windows)
        # A window's baseline may be up to resolution_s older than the window: 5 s is noise against the
        # default 10-30 min windows, but not against the seconds-long windows of a demo or a test.
        self._resolution_s = resolution_s if resolution_s is not None else min(5.0, min(windows) / 10)
        self._clock = clock
        self._ranks: dict[tuple[str, int], RankHistory] = {}
        self._states = AlertStates(resolved_retention_s)
        self._lock = threading.Lock()

    def observe(self, snapshot: RankSnapshot, now: Optional[float] = None) -> list[Alert]:
        """Record a rank's new state and return the transitions of that rank's alerts."""
        now = snapshot.last_seen if now is None else now
        key = (snapshot.run, snapshot.rank)
        with self._lock:
            history = self._ranks.get(key)
            if history is None:
                history = self._ranks[key] = RankHistory(snapshot.run, snapshot.rank, self._horizon_s,
                                                         self._resolution_s)
            history.record(snapshot, self.thresholds.calibration_iterations)
            group = (snapshot.run, str(snapshot.rank))
            active = rank_alerts(history, now, self.thresholds)
            return self._states.advance(active, now, lambda g: g == group)

    def evaluate(self, now: Optional[float] = None) -> list[Alert]:
        """Evaluate every alert of every rank and run; return the transitions."""
        now = self._clock() if now is None else now
        with self._lock:
            return self._states.advance(evaluate(self._ranks.values(), now, self.thresholds), now)

    def forget(self, run: str, rank: int, now: Optional[float] = None) -> list[Alert]:
        """Drop an expired rank; its alerts resolve; return the transitions."""
        now = self._clock() if now is None else now
        with self._lock:
            self._ranks.pop((run, rank), None)
            group = (run, str(rank))
            return self._states.advance((), now, lambda g: g == group)

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

    def to_json(self) -> dict:
        """Return the body of ``GET /v1/alerts``: firing now and recently resolved."""
        with self._lock:
            return {"firing": [a.to_json() for a in self._states.firing()],
                    "resolved": [a.to_json() for a in self._states.resolved()]}
