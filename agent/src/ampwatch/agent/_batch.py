"""Build and encode one protocol-v1 batch (docs/protocol.md), within every limit the protocol sets."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ampwatch.contract.batch import OPTIMIZER_LEVELS, RANK_LEVELS
from ampwatch.contract.protocol import DELIVERY_COUNTERS, PROTOCOL_VERSION

from ._identity import Identity
from ._limits import MAX_BATCH_EVENTS, MAX_PARAMS, TEXT_LIMITS, cut

__all__ = ["PROTOCOL_VERSION", "MAX_BATCH_EVENTS", "DELIVERY_COUNTERS", "build_batch", "encode_batch", "fit_event",
           "holds_levels"]


def build_batch(identity: Identity, *, seq: int, snapshot: Mapping[str, Any], delivery: Mapping[str, int],
                events: Sequence[Mapping[str, Any]], closed: bool = False,
                device: Mapping[str, Any] | None = None, levels: bool = True) -> dict[str, Any]:
    """Return the batch for ``seq``: identity, ``snapshot()`` with delivery counters, and events (and ``device``,
    the accelerator the rank trains on, when given: the sender gives it until a batch carrying it is accepted).
    ``levels`` false leaves the rolling levels out (the sender sends them one heartbeat in
    ``protocol.LEVEL_HEARTBEATS``; the collector keeps the last ones).

    Strings are cut to the protocol's limits here (ending in ``…``), so the collector
    never refuses a batch for a long name; the cost is a length check per string.
    """
    state = dict(snapshot.get("state") or {})
    if not levels:
        _leave_levels_out(state)
    state["delivery"] = {key: int(delivery.get(key, 0)) for key in DELIVERY_COUNTERS}
    scaler = dict(snapshot.get("scaler") or {})
    if isinstance(scaler.get("kind"), str):
        scaler["kind"] = cut(scaler["kind"], TEXT_LIMITS["scaler_kind"])
    batch = {
        "protocol": PROTOCOL_VERSION,
        "agent": _agent_versions(),
        "run": identity.run,
        "rank": identity.rank,
        "world_size": identity.world_size,
        "local_rank": identity.local_rank,
        "host": cut(identity.host, TEXT_LIMITS["host"]),
        "pid": identity.pid,
        "incarnation": identity.incarnation,
        "process_key": identity.process_key,
        "seq": seq,
        "sent_at": time.time(),
        "scaler": scaler,
        "state": state,
        "events": [fit_event(event) for event in events],
        "closed": closed,
    }
    if device:
        batch["device"] = dict(device)  # cut to the protocol's limits where it is read (_device_info)
    return batch


def holds_levels(state: Mapping[str, Any] | None) -> bool:
    """Whether a snapshot's ``state`` holds any rolling level (its own or an optimizer's)."""
    if not state:
        return False
    return any(name in state for name in RANK_LEVELS) or any(
        name in counters for counters in (state.get("optimizers") or {}).values() for name in OPTIMIZER_LEVELS)


def _leave_levels_out(state: dict[str, Any]) -> None:
    """Take the rolling levels out of ``state`` (a copy of the snapshot's: its optimizers are copied where cut)."""
    for name in RANK_LEVELS:
        state.pop(name, None)
    optimizers = state.get("optimizers")
    if optimizers and any(name in counters for counters in optimizers.values() for name in OPTIMIZER_LEVELS):
        state["optimizers"] = {optimizer: {key: value for key, value in counters.items()
                                           if key not in OPTIMIZER_LEVELS}
                               for optimizer, counters in optimizers.items()}


def fit_event(event: Mapping[str, Any]) -> Mapping[str, Any]:
    """Return ``event`` within the protocol's limits: a copy with long strings cut, or ``event`` itself."""
    kind = event.get("kind")
    if kind in ("skip", "poisoned_step"):
        params = event.get("params") or []
        limit = TEXT_LIMITS["param_name"]
        if len(params) > MAX_PARAMS or any(len(str(p.get("name", ""))) > limit for p in params):
            fitted = dict(event, params=[dict(p, name=cut(str(p.get("name", "")), limit)) for p in params[:MAX_PARAMS]])
            if fitted.get("params_total") is None and len(params) > MAX_PARAMS:
                fitted["params_total"] = len(params)
            event = fitted
        origin_params = event.get("origin_params") or []
        if any(len(name) > limit for name in origin_params):
            event = dict(event, origin_params=[cut(name, limit) for name in origin_params])
        if "samples" in event or "samples_before" in event:
            event = _fit_samples(event)
        began = event.get("began")
        if began:
            fitted_began = _cut_fields(began, param=limit, module=TEXT_LIMITS["module"],
                                       module_type=TEXT_LIMITS["module_type"])
            if fitted_began is not began:
                event = dict(event, began=fitted_began)
        return event
    elif kind in ("loss_spike", "grad_norm_spike"):
        return _fit_samples(event) if "samples" in event else event
    elif kind == "scheduler_after_skip":
        return _cut_fields(event, scheduler=TEXT_LIMITS["scheduler"])
    elif kind == "warning":
        return _cut_fields(event, code=TEXT_LIMITS["warning_code"], message=TEXT_LIMITS["warning_message"])
    return event


def _fit_samples(event: Mapping[str, Any]) -> Mapping[str, Any]:
    """Return ``event`` with each string sample id (``samples``, ``samples_before``) cut to its limit.

    Cut here, when the batch is built, not when the ids are recorded: the digest covers the whole ids.
    """
    limit = TEXT_LIMITS["sample_id"]

    def fit(samples: Mapping[str, Any]) -> Mapping[str, Any]:
        ids = samples["ids"]
        if not any(type(i) is str and len(i) > limit for i in ids):
            return samples
        return dict(samples, ids=[cut(i, limit) if type(i) is str else i for i in ids])

    fitted = dict(event)
    if "samples" in event:
        fitted["samples"] = fit(event["samples"])
    if "samples_before" in event:
        fitted["samples_before"] = [dict(e, samples=fit(e["samples"])) for e in event["samples_before"]]
    return fitted


def _cut_fields(event: Mapping[str, Any], **limits: int) -> Mapping[str, Any]:
    """Return ``event`` (or a part of one), or a copy with each named string field cut to its limit."""
    long = {k: cut(event[k], n) for k, n in limits.items() if isinstance(event.get(k), str) and len(event[k]) > n}
    return dict(event, **long) if long else event


NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}
"""How the protocol writes infinities (NaN is "NaN"): JSON has no such numbers."""


def encode_batch(batch: Mapping[str, Any]) -> bytes:
    """Encode ``batch`` as compact UTF-8 JSON; NaN and infinities become "NaN", "Infinity", "-Infinity".

    A scale of NaN or +Inf is what a broken scaler holds and must reach the collector as
    such (docs/protocol.md). Values JSON cannot represent (a stray tensor, a path) are
    sent as their ``str`` rather than failing the whole batch.
    """
    return json.dumps(_jsonable(batch), separators=(",", ":"), allow_nan=False, default=str).encode()


def _jsonable(value: Any) -> Any:
    """Return ``value`` with every non-finite float replaced by the protocol's string for it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else NONFINITE.get(value, "NaN")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
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
        _VERSIONS = {"version": cut(agent, TEXT_LIMITS["version"]), "torch": cut(torch_version, TEXT_LIMITS["version"])}
    return dict(_VERSIONS)
