"""Build the JSON bodies of alert notifications: Alertmanager webhook, Alertmanager v2 API, Slack."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence

from .._rank_ranges import rank_ranges as numbered_ranges
from .alert import Alert
from .grouping import GROUP_BY

__all__ = ["rfc3339", "webhook_body", "alertmanager_body", "slack_body", "rank_ranges", "group_summary", "RECEIVER",
           "ZERO_TIME"]

RECEIVER = "ampwatch"
"""The receiver name the generic webhook payload carries."""

ZERO_TIME = "0001-01-01T00:00:00Z"
"""Go's zero time: what Alertmanager's webhook puts in ``endsAt`` while an alert fires."""


def rfc3339(seconds: float) -> str:
    """Format Unix seconds as RFC 3339 UTC with milliseconds (``2026-11-29T12:00:00.250Z``)."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _labels(alert: Alert) -> dict[str, str]:
    return {"alertname": alert.name, **{k: str(v) for k, v in alert.labels.items()}}


def _common(maps: Sequence[dict[str, str]]) -> dict[str, str]:
    first = maps[0]
    return {k: v for k, v in first.items() if all(m.get(k) == v for m in maps[1:])}


def webhook_body(alerts: Sequence[Alert], external_url: str = "") -> dict:
    """Return Alertmanager's webhook payload (version 4) for alerts that share one status."""
    if not alerts:
        raise ValueError("a webhook notification needs at least one alert")
    labels = [_labels(a) for a in alerts]
    status = "firing" if any(a.ends_at is None for a in alerts) else "resolved"
    common = _common(labels)
    group_labels = {k: common[k] for k in GROUP_BY if k in common}
    group_key = "{}:{" + ",".join(f'{k}="{v}"' for k, v in group_labels.items()) + "}"
    return {
        "version": "4",
        "groupKey": group_key,
        "truncatedAlerts": 0,
        "status": status,
        "receiver": RECEIVER,
        "groupLabels": group_labels,
        "commonLabels": common,
        "commonAnnotations": _common([dict(a.annotations) for a in alerts]),
        "externalURL": external_url,
        "alerts": [
            {
                "status": a.status,
                "labels": lab,
                "annotations": dict(a.annotations),
                "startsAt": rfc3339(a.starts_at),
                "endsAt": ZERO_TIME if a.ends_at is None else rfc3339(a.ends_at),
                "generatorURL": external_url,
                "fingerprint": a.fingerprint,
            }
            for a, lab in zip(alerts, labels, strict=True)
        ],
    }


def alertmanager_body(alerts: Iterable[Alert], now: float, valid_for_s: float, external_url: str = "") -> list:
    """Return the body of ``POST /api/v2/alerts``: postable alerts, as Prometheus sends them.

    A firing alert is sent with ``endsAt`` ``valid_for_s`` ahead (Prometheus uses
    4 x its resend interval), so Alertmanager resolves it by itself if the
    collector dies; a resolved one carries its real end.
    """
    body = []
    for a in alerts:
        item = {
            "labels": _labels(a),
            "annotations": dict(a.annotations),
            "startsAt": rfc3339(a.starts_at),
            "endsAt": rfc3339(now + valid_for_s if a.ends_at is None else a.ends_at),
        }
        if external_url:
            item["generatorURL"] = external_url
        body.append(item)
    return body


def rank_ranges(ranks: Iterable[str]) -> str:
    """Return rank labels as short ranges: ``0-39, 44, 512``; names that are not numbers follow as they are."""
    labels = list(ranks)
    numbered = numbered_ranges(int(r) for r in labels if r.isdigit())
    return ", ".join(filter(None, [numbered, *sorted({r for r in labels if not r.isdigit()})]))


def group_summary(alerts: Sequence[Alert]) -> str:
    """Return one line for a group of alerts: ``[FIRING:1020, RESOLVED:4] AmpX in run r: ranks 0-1023``."""
    firing = sum(a.ends_at is None for a in alerts)
    counts = ", ".join(f"{word}:{n}" for word, n in (("FIRING", firing), ("RESOLVED", len(alerts) - firing)) if n)
    names = sorted({a.name for a in alerts})
    runs = sorted({a.labels.get("run", "") for a in alerts})
    line = f"[{counts}] {', '.join(names)}" + (f" in run {runs[0]}" if len(runs) == 1 else "")
    ranks = [a.labels["rank"] for a in alerts if "rank" in a.labels]
    return line + (f": ranks {rank_ranges(ranks)}" if ranks else "")


_SLACK_DETAILS = 10  # alerts shown in full in one Slack message; the summary line lists the ranks of all


def slack_body(alerts: Sequence[Alert], external_url: str = "") -> dict:
    """Return a Slack incoming-webhook message: ``text`` for any client, ``blocks`` for Slack itself.

    A group of several alerts starts with :func:`group_summary` and details the first few.
    """
    lines = [group_summary(alerts)] if len(alerts) > 1 else []
    blocks: list[dict] = [{"type": "section", "text": {"type": "mrkdwn", "text": _escape(lines[0])[:3000]}}] \
        if lines else []
    for a in alerts[:_SLACK_DETAILS]:
        severity = a.labels.get("severity", "")
        head = f"[{a.status.upper()}] {a.name}" + (f" ({severity})" if severity else "")
        summary = a.annotations.get("summary", "")
        lines.append(f"{head}: {summary}" if summary else head)
        detail = a.annotations.get("description", "")
        runbook: str | None = a.annotations.get("runbook_url")
        text = f"*{_escape(head)}*\n{_escape(summary)}"
        if detail:
            text += f"\n{_escape(detail)}"
        # Where the skip began and on which samples, when the agent knew; of a split run, which block this is and
        # where the others are.
        for key in ("began", "samples", "block", "other_blocks"):
            if key in a.annotations:
                text += f"\n{key}: {_escape(a.annotations[key])}"
        if runbook:
            text += f"\n<{runbook}|runbook>"
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": text[:3000]}})
    if external_url:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{external_url}|ampwatch>"}]})
    if len(alerts) > _SLACK_DETAILS:
        lines.append(f"... and {len(alerts) - _SLACK_DETAILS} more")
    return {"text": "\n".join(lines), "blocks": blocks[:50]}


def _escape(text: str) -> str:
    # Slack's mrkdwn treats &, < and > as control characters; user strings (run ids, names) must not link or ping.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
