"""One alert state change (firing or resolved), shared by the built-in evaluator and notification delivery."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

from .._floats import wire_float

__all__ = ["Alert", "fingerprint"]


def fingerprint(name: str, labels: Mapping[str, str]) -> str:
    """Return a stable 16-hex-digit id of an alert's identity (its name and labels, as Alertmanager does)."""
    digest = hashlib.sha256(name.encode())
    for key in sorted(labels):
        # NUL separators: no label value can forge a different key/value split.
        digest.update(b"\0" + key.encode() + b"\0" + str(labels[key]).encode())
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Alert:
    """An alert as it stands after a transition; ``ends_at`` is set once it resolved.

    >>> a = Alert(name="AmpLossScaleCollapsed", labels={"run": "r", "rank": "0", "severity": "critical"},
    ...           annotations={"summary": "..."}, starts_at=10.0)
    >>> a.status, len(a.fingerprint)
    ('firing', 16)
    """

    name: str
    """Alert name, e.g. ``AmpConsecutiveSkippedSteps`` (Prometheus's ``alertname``)."""
    labels: Mapping[str, str]
    """Identifying labels (run, rank, optimizer, severity), without ``alertname``."""
    annotations: Mapping[str, str]
    """Human text: summary, description, runbook_url."""
    starts_at: float
    """Unix time the alert started firing."""
    ends_at: float | None = None
    """Unix time it resolved; None while firing."""
    value: float | None = None
    """The value that made the condition true (as Prometheus's ``$value``)."""
    fingerprint: str = ""
    """Stable id of name + labels; computed when left empty."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Alert.name must not be empty")
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", fingerprint(self.name, self.labels))

    @property
    def status(self) -> str:
        """Return ``"firing"`` or ``"resolved"``."""
        return "firing" if self.ends_at is None else "resolved"

    def resolved(self, at: float) -> Alert:
        """Return this alert resolved at time ``at``."""
        return dataclasses.replace(self, ends_at=at)

    def to_json(self) -> dict:
        """Return the alert as the JSON object of ``GET /v1/alerts``."""
        return {
            "name": self.name, "status": self.status, "labels": dict(self.labels),
            "annotations": dict(self.annotations), "starts_at": self.starts_at, "ends_at": self.ends_at,
            "value": wire_float(self.value), "fingerprint": self.fingerprint,
        }
