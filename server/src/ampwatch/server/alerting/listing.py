"""The body of ``GET /v1/alerts``: every alert, or per-rank alerts of one alert, run and severity as one entry.

A whole-job storm fires thousands of per-rank alerts (about 3 MB of JSON at 1,024 ranks x 2
optimizers); the status page asks for them collapsed (``collapse=5``): five or more alerts of
one alert name, run and severity become one entry with their count and ranks, and it asks for a
group's members (``alertname=`` and ``run=``) only while the reader has it open. O(alerts).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._rank_ranges import rank_ranges
from .alert import Alert

__all__ = ["alert_list"]


def _group_key(alert: Alert) -> tuple[str, str, str]:
    return alert.name, str(alert.labels.get("run", "")), str(alert.labels.get("severity", ""))


def _listed(alerts: Iterable[Alert], collapse_from: int | None) -> list[dict[str, Any]]:
    alerts = list(alerts)
    groups: dict[tuple[str, str, str], list[Alert]] = {}
    for alert in alerts:
        groups.setdefault(_group_key(alert), []).append(alert)
    out: list[dict[str, Any]] = []
    for (name, run, severity), members in groups.items():
        if collapse_from is None or len(members) < collapse_from:
            out.extend(a.to_json() for a in members)
            continue
        first = members[0]
        ranks = [int(r) for a in members if str(r := a.labels.get("rank", "")).isdigit()]
        ends = [a.ends_at for a in members if a.ends_at is not None]
        out.append({"name": name, "status": first.status, "group": True, "count": len(members),
                    "labels": {"run": run, "severity": severity}, "annotations": dict(first.annotations),
                    "starts_at": min(a.starts_at for a in members), "ends_at": max(ends) if ends else None,
                    "ranks": len(set(ranks)), "rank_ranges": rank_ranges(ranks)})
    return out


def alert_list(firing: Iterable[Alert], resolved: Iterable[Alert], *, collapse_from: int | None = None,
               alertname: str | None = None, run: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Return ``{"firing": [...], "resolved": [...]}``: the alerts matching ``alertname`` and ``run`` (when given),
    those of one alert, run and severity collapsed into one entry from ``collapse_from`` alerts (when given)."""
    def wanted(alert: Alert) -> bool:
        return (alertname is None or alert.name == alertname) and (run is None or alert.labels.get("run") == run)

    return {"firing": _listed(filter(wanted, firing), collapse_from),
            "resolved": _listed(filter(wanted, resolved), collapse_from)}
