"""What the collector's rows keep of a batch, and the events read back from them (docs/collector.md#storage)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import Struct

from ._schema import EVENT_MODELS, Batch, encode_hook

__all__ = ["wire_document", "encode_batch_state", "stored_event", "event_of_row"]

_ENCODER = msgspec.json.Encoder(enc_hook=encode_hook)


def wire_document(part: Struct) -> dict[str, Any]:
    """Return a part of a batch (its ``scaler``, its ``agent``) as the protocol writes it, as a dict."""
    return msgspec.to_builtins(part, enc_hook=encode_hook)


def encode_batch_state(batch: Batch) -> str:
    """Return ``batch`` without its events as the JSON the protocol writes (what an incarnation's row keeps)."""
    return _ENCODER.encode(msgspec.structs.replace(batch, events=[])).decode()


# An event's row keeps these in columns (docs/collector.md#storage), and its body only the fields that are not
# their default: a storm's events are mostly defaults ([] and null), so the history grows about 2.5x slower.
_EVENT_COLUMNS = frozenset({"id", "kind", "time", "iteration", "optimizer"})
_NO_DEFAULT = object()


def _default(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return _NO_DEFAULT


_EVENT_FIELDS = {m.kind: tuple((f.name, _default(f)) for f in msgspec.structs.fields(m)
                               if f.name not in _EVENT_COLUMNS) for m in EVENT_MODELS}
_EVENT_DEFAULTS = {kind: {name: default for name, default in fields if default is not _NO_DEFAULT}
                   for kind, fields in _EVENT_FIELDS.items()}
_OPTIONAL_OPTIMIZER = {m.kind for m in EVENT_MODELS if "optimizer" in m.__struct_fields__}


def stored_event(event: Any) -> str:
    """Return the body an event's row keeps: its fields that are neither columns nor defaults, as JSON."""
    body = {}
    for name, default in _EVENT_FIELDS[event.kind]:
        value = getattr(event, name)
        if default is not _NO_DEFAULT and (value is default or value == default):
            continue
        body[name] = value
    # Nested defaults stay (params' "nan": 0): a parameter is written whole.
    return _ENCODER.encode(body).decode()


def event_of_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """Return the event a row holds, every field present (rows written before bodies were trimmed too)."""
    kind = row["kind"]
    event = {"id": row["id"], "kind": kind, "time": row["time"], "iteration": row["iteration"]}
    if kind in _OPTIONAL_OPTIMIZER:
        event["optimizer"] = row["optimizer"]
    defaults = _EVENT_DEFAULTS.get(kind, {})
    event.update({k: (list(v) if isinstance(v, list) else v) for k, v in defaults.items()})
    event.update(json.loads(row["body"]))
    return event
