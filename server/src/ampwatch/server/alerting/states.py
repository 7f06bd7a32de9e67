"""Turn successive alert evaluations into firing / resolved transitions, honouring each rule's ``for:``."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Set

from .alert import Alert
from .fired import FiredAlerts
from .rank_conditions import ActiveAlert

__all__ = ["AlertStates"]


class AlertStates:
    """Hold pending, firing and recently resolved alerts, as Prometheus's rule manager does.

    An alert whose condition holds goes pending, then fires once it has held for
    its ``for_s`` (at once when 0); it resolves at the first evaluation of its
    group where the condition no longer holds.

    Alerts are indexed by evaluation group, so evaluating one rank costs O(that
    rank's alerts), not O(every alert held): in a whole-job storm thousands fire.
    """

    def __init__(self, resolved_retention_s: float = 900.0, max_resolved: int = 1000,
                 outward: Callable[[ActiveAlert], tuple[Mapping[str, str], Mapping[str, str]]] =
                 lambda a: (a.labels, a.annotations)) -> None:
        """``outward``: the labels and annotations an alert fires with (default: its own; a split run's add its block:
        its identity here, ``a.key``, stays its own)."""
        self._outward = outward
        self._pending: dict[tuple, tuple[float, ActiveAlert]] = {}
        self._firing: dict[tuple, Alert] = {}
        self._groups: dict[tuple, tuple] = {}  # firing alert -> its evaluation group
        self._by_group: dict[tuple, dict[tuple, None]] = {}  # evaluation group -> its pending and firing alerts
        self._resolved: collections.deque[Alert] = collections.deque(maxlen=max_resolved)
        self._retention_s = resolved_retention_s
        self.fired = FiredAlerts()  # every alert that fired, by run: what a finished run's summary lists

    def advance(self, active: Iterable[ActiveAlert], now: float, group: tuple | None = None,
                keep: Set[tuple] = frozenset(), leave_names: Set[str] = frozenset(),
                unless: Callable[[tuple, tuple], bool] = lambda key, group: False) -> list[Alert]:
        """Apply one evaluation and return the alerts that started firing or resolved.

        ``group`` is the one evaluation group (``(run, rank)`` or ``(run,)``) that was
        evaluated; alerts of other groups are left as they are. None: all of them, but for
        the groups in ``keep`` (observed anew while a pass ran: the pass's reading is older), except the
        alerts, pending or firing, for which ``unless(key, group)`` is true (``key[0]`` is the name; judged by this
        evaluation alone: one it no longer finds ends, as a pending one must, or it would fire later on its first
        finding's time).
        ``leave_names``: alerts this evaluation of one group does not judge (left as they are; ``active`` holds none).
        """
        changes: list[Alert] = []
        seen = set()
        for a in active:
            key = a.key
            seen.add(key)
            firing = self._firing.get(key)
            if firing is not None:
                # Still firing: keep its value and text current, but that is no transition to announce. The
                # texts follow the value (a.annotations renders only when read): same value, nothing to do.
                if not _same(firing.value, a.value):
                    self._firing[key] = dataclasses.replace(firing, value=a.value, annotations=self._outward(a)[1])
                continue
            since, _ = self._pending.get(key, (now, a))
            self._by_group.setdefault(a.group, {})[key] = None
            if now - since >= a.for_s:
                self._pending.pop(key, None)
                labels, annotations = self._outward(a)
                alert = Alert(name=a.name, labels=dict(labels), annotations=annotations,
                              starts_at=now, value=a.value)
                self._firing[key] = alert
                self._groups[key] = a.group
                self.fired.note(alert)
                changes.append(alert)
            else:
                self._pending[key] = (since, a)
        if group is None:
            gone = [k for k, (_, a) in self._pending.items()
                    if k not in seen and (a.group not in keep or unless(k, a.group))] + \
                   [k for k in self._firing
                    if k not in seen and (self._groups[k] not in keep or unless(k, self._groups[k]))]
        else:
            gone = [k for k in self._by_group.get(group, ()) if k not in seen and k[0] not in leave_names]
        for key in gone:
            pending = self._pending.pop(key, None)
            if pending is not None:
                self._unindex(key, pending[1].group)
                continue
            alert = self._firing.pop(key).resolved(now)
            self._unindex(key, self._groups.pop(key))
            self._resolved.append(alert)
            changes.append(alert)
        while self._resolved and \
                self._resolved[0].ends_at < now - self._retention_s:  # type: ignore[operator]  # resolved: it ended
            self._resolved.popleft()
        return changes

    def _unindex(self, key: tuple, group: tuple) -> None:
        keys = self._by_group[group]
        del keys[key]
        if not keys:
            del self._by_group[group]

    def is_firing(self, key: tuple) -> bool:
        """Return whether the alert of that key fires now."""
        return key in self._firing

    def firing(self) -> list[Alert]:
        """Return the alerts firing now, oldest first."""
        return sorted(self._firing.values(), key=lambda a: a.starts_at)

    def resolved(self) -> list[Alert]:
        """Return the alerts resolved within the retention, latest first."""
        return list(reversed(self._resolved))


def _same(old: float | None, new: float) -> bool:
    """Return whether an alert's value did not change (NaN stays NaN)."""
    return old == new or (old != old and new != new)
