"""Group alert notifications as Alertmanager does: one per alert name and run, listing its ranks, paced.

A whole-job skip storm on 1,024 ranks raises thousands of per-rank alerts within a minute; one
POST each is a storm of its own. Grouped by ``(alertname, run)``, a new group waits ``wait_s``
(Alertmanager's ``group_wait``) to gather the rest, then goes out as one notification listing every
alert of the group; later changes (more ranks firing, ranks resolving) go out at most once per
``interval_s`` (``group_interval``), each notification with every alert still firing plus those
resolved since the last one. A group that keeps firing with nothing new is sent again every
``repeat_s`` (Alertmanager's ``repeat_interval``: a reminder that it still fires). A group whose
alerts have all resolved and been sent is forgotten. An alert that resolves before any notification
announced it firing is never sent at all: no receiver hears RESOLVED for an alert it was never told of
(a flap shorter than the group's wait or interval).

>>> from .alert import Alert
>>> groups = AlertGroups(wait_s=5, interval_s=60)
>>> for rank in range(3):
...     groups.add(Alert(name="AmpPoisonedStep", labels={"run": "r", "rank": str(rank)}, annotations={},
...                      starts_at=0.0), now=0.0)
>>> groups.next_due(), groups.take_due(4.0)
(5.0, [])
>>> [[a.labels["rank"] for a in n] for n in groups.take_due(5.0)]
[['0', '1', '2']]
>>> groups.next_due()  # still firing, nothing new: reminded after the repeat interval (4 h by default)
14405.0

Memory is one entry per alert that fires or resolved since the last notification of its group;
each call costs O(groups) plus the alerts it returns.
"""

from __future__ import annotations

import dataclasses

from .alert import Alert

__all__ = ["AlertGroups", "GROUP_BY", "REPEAT_INTERVAL_S"]

GROUP_BY = ("alertname", "run")
"""The labels a notification groups by (Alertmanager's ``group_by``)."""
REPEAT_INTERVAL_S = 4 * 3600.0
"""A group still firing with nothing new is notified again this often (Alertmanager's default repeat_interval)."""


@dataclasses.dataclass(slots=True)
class _Group:
    alerts: dict[str, Alert] = dataclasses.field(default_factory=dict)  # fingerprint -> latest state
    announced: set[str] = dataclasses.field(default_factory=set)  # sent firing, not yet sent resolved
    changed: set[str] = dataclasses.field(default_factory=set)  # new since the last notification
    due: float | None = None  # when the next notification goes out; None: nothing new to send
    sent_at: float | None = None
    repeat_at: float | None = None  # with nothing new: when the group, still firing, is sent again

    def next_at(self) -> float | None:
        return self.due if self.due is not None else self.repeat_at


def _rank_order(alert: Alert) -> tuple:
    rank = alert.labels.get("rank", "")
    return (0, int(rank), alert.fingerprint) if rank.isdigit() else (1, 0, alert.fingerprint)


class AlertGroups:
    """The notifications of one target, grouped by :data:`GROUP_BY` and paced (not thread-safe: one owner)."""

    def __init__(self, wait_s: float, interval_s: float, repeat_s: float = REPEAT_INTERVAL_S) -> None:
        if wait_s < 0 or interval_s < 0:
            raise ValueError(f"group wait ({wait_s!r}) and interval ({interval_s!r}) must be >= 0 seconds")
        if repeat_s <= 0:
            raise ValueError(f"group repeat interval ({repeat_s!r}) must be > 0 seconds")
        self.wait_s, self.interval_s, self.repeat_s = wait_s, interval_s, repeat_s
        self._groups: dict[tuple[str, str], _Group] = {}

    def add(self, alert: Alert, now: float) -> None:
        """Put an alert's new state into its group and schedule the group's next notification."""
        key = (alert.name, str(alert.labels.get("run", "")))
        group = self._groups.setdefault(key, _Group())
        fp = alert.fingerprint
        if alert.ends_at is not None and fp not in group.announced:
            # Resolved before it was announced: forget it, and the notification it alone was due for.
            group.alerts.pop(fp, None)
            group.changed.discard(fp)
            if not group.changed:
                group.due = None
            if not group.alerts:
                del self._groups[key]
            return
        group.alerts[fp] = alert
        group.changed.add(fp)
        if group.due is None:
            group.due = now + self.wait_s if group.sent_at is None else max(now, group.sent_at + self.interval_s)

    def next_due(self) -> float | None:
        """Return when the next notification is due (None: nothing to send)."""
        return min((at for g in self._groups.values() if (at := g.next_at()) is not None), default=None)

    def take_due(self, now: float, everything: bool = False) -> list[list[Alert]]:
        """Return the notifications due at ``now`` (all of them if ``everything``), each a group's alerts by rank."""
        out = []
        for key, group in list(self._groups.items()):
            at = group.next_at()
            if at is None or (at > now and not everything):
                continue
            if group.due is None and everything:
                continue  # closing: a reminder is not owed
            out.append(sorted(group.alerts.values(), key=_rank_order))
            group.alerts = {fp: a for fp, a in group.alerts.items() if a.ends_at is None}
            group.announced = set(group.alerts)
            group.changed = set()
            group.due, group.sent_at = None, now
            group.repeat_at = now + self.repeat_s
            if not group.alerts:
                del self._groups[key]
        return out

    def __len__(self) -> int:
        """Return the number of alerts held (firing, or resolved and not sent yet)."""
        return sum(len(g.alerts) for g in self._groups.values())
