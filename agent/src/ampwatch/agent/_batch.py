"""Build and encode one protocol-v1 batch (docs/protocol.md)."""

from __future__ import annotations

import json
import math
import time
from typing import Any, Mapping

from ._identity import Identity

__all__ = ["PROTOCOL_VERSION", "MAX_BATCH_EVENTS", "DELIVERY_COUNTERS", "build_batch", "encode_batch"]

PROTOCOL_VERSION = 1
MAX_BATCH_EVENTS = 10_000
"""The protocol's cap on events per batch."""
DELIVERY_COUNTERS = ("dropped_events", "send_failures", "rejected_batches", "agent_errors")
"""Keys of ``state.delivery``, the agent's own health counters."""


def build_batch(identity: Identity, *, seq: int, snapshot: Mapping[str, Any], delivery: Mapping[str, int],
                events: list[dict[str, Any]], closed: bool = False) -> dict[str, Any]:
    """Return the batch for ``seq``: identity, ``snapshot()`` with delivery counters, and events."""
    state = dict(snapshot.get("state") or {})
    state["delivery"] = {key: int(delivery.get(key, 0)) for key in DELIVERY_COUNTERS}
    return {
        "protocol": PROTOCOL_VERSION,
        "agent": _agent_versions(),
        "run": identity.run,
        "rank": identity.rank,
        "world_size": identity.world_size,
        "local_rank": identity.local_rank,
        "host": identity.host,
        "pid": identity.pid,
        "incarnation": identity.incarnation,
        "seq": seq,
        "sent_at": time.time(),
        "scaler": dict(snapshot.get("scaler") or {}),
        "state": state,
        "events": events,
        "closed": closed,
    }


def encode_batch(batch: Mapping[str, Any]) -> bytes:
    """Encode ``batch`` as compact UTF-8 JSON; non-finite floats become ``null`` (JSON has no inf/NaN).

    Values JSON cannot represent (a stray tensor, a path) are sent as their ``str``
    rather than failing the whole batch.
    """
    return json.dumps(_finite(batch), separators=(",", ":"), allow_nan=False, default=str).encode()


def _finite(value: Any) -> Any:
    """Return ``value`` with every non-finite float replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


_VERSIONS: dict[str, str] | None = None


def _agent_versions() -> dict[str, str]:
    """Return the agent's and torch's versions (looked up once)."""
    global _VERSIONS
    if _VERSIONS is None:
        from importlib import metadata
        try:
            agent = metadata.version("ampwatch-agent")
        except metadata.PackageNotFoundError:  # running from a source tree
            agent = "0.0.0"
        try:
            import torch
            torch_version = str(torch.__version__)
        except ImportError:  # pragma: no cover - the agent depends on torch
            torch_version = "unknown"
        _VERSIONS = {"version": agent, "torch": torch_version}
    return dict(_VERSIONS)
