"""Which alerts fired in each run, over its whole life: what a finished run's summary lists.

The state machine keeps firing alerts and, for a while, resolved ones; a run that finished an hour
ago needs more: every alert that fired in it, however long ago. :class:`FiredAlerts` counts each
alert's start of firing by run, alert name and severity, and the ranks it fired on (O(1) per
transition; a whole-job storm's thousands of per-rank alerts are a set entry per rank and alert),
for the most recent ``max_runs`` runs that fired anything, as long as the collector holds the run.
Memory only: a restarted collector starts afresh.
"""

from __future__ import annotations

import collections
from collections.abc import Collection
from typing import Any

from .alert import Alert

__all__ = ["FiredAlerts"]

_SEVERITY_ORDER = {"critical": 0, "warning": 1}


class _Run:
    """One run's fired alerts."""

    __slots__ = ("alerts", "ranks")

    def __init__(self) -> None:
        self.alerts: dict[tuple[str, str], dict[str, Any]] = {}  # (name, severity) -> its entry of of_run()
        self.ranks: dict[int, set[tuple[str, str]]] = {}  # rank -> the (name, severity) that fired on it


class FiredAlerts:
    """Count, per run, the alerts that started firing: by name and severity, and on which ranks.

    >>> fired = FiredAlerts()
    >>> fired.note(Alert(name="AmpPoisonedStep", labels={"run": "r", "rank": "3", "severity": "critical"},
    ...                  annotations={}, starts_at=5.0))
    >>> fired.of_run("r")[0]["instances"], fired.by_rank("r")
    (1, {3: ('AmpPoisonedStep',)})
    """

    def __init__(self, max_runs: int = 1000) -> None:
        self.max_runs = max_runs
        self._runs: collections.OrderedDict[str, _Run] = collections.OrderedDict()  # least recently fired first

    def note(self, alert: Alert) -> None:
        """Count ``alert``, which just started firing; O(1)."""
        run_id = alert.labels.get("run")
        if run_id is None:
            return
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run()
            while len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(run_id)
        key = (alert.name, alert.labels.get("severity", ""))
        entry = run.alerts.get(key)
        if entry is None:
            entry = run.alerts[key] = {"name": key[0], "severity": key[1], "instances": 0, "ranks": 0,
                                       "first_at": alert.starts_at, "latest_at": alert.starts_at}
        entry["instances"] += 1
        entry["latest_at"] = alert.starts_at
        rank = alert.labels.get("rank")
        if rank is not None:
            seen = run.ranks.setdefault(int(rank), set())
            if key not in seen:
                seen.add(key)
                entry["ranks"] += 1

    def keep(self, runs: Collection[str]) -> None:
        """Forget the runs not in ``runs`` (those the collector no longer holds): a run that comes back under the same
        name starts afresh. O(runs remembered)."""
        for run in [run for run in self._runs if run not in runs]:
            del self._runs[run]

    def of_run(self, run: str) -> list[dict[str, Any]]:
        """The run's alerts that fired, critical first: name, severity, instances (starts of firing), ranks (how
        many it fired on; 0 for an alert of the whole run), first and latest start; O(alert names)."""
        held = self._runs.get(run)
        entries = [dict(e) for e in held.alerts.values()] if held is not None else []
        return sorted(entries, key=lambda e: (_SEVERITY_ORDER.get(e["severity"], 2), e["name"]))

    def by_rank(self, run: str) -> dict[int, tuple[str, ...]]:
        """The names of the alerts that fired on each of the run's ranks; O(ranks that had one)."""
        held = self._runs.get(run)
        if held is None:
            return {}
        return {rank: tuple(sorted({name for name, _ in keys})) for rank, keys in held.ranks.items()}
