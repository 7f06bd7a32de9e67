"""The wire protocol v1 batch as msgspec structs: docs/protocol.md, with the limits of ``ampwatch.contract.protocol``.

Decoded and validated in one pass that stops at the first error and builds no object for a field it does not
know (a newer agent's fields, or a hostile body's bulk), so a batch costs a fraction of what a general JSON
parser and a validator after it cost, and a wide or deep body is refused at about the cost of reading it.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional, Union

import msgspec
from msgspec import Meta, Struct

from ampwatch.contract.protocol import (MAX_BATCH_EVENTS, MAX_PARAMS, PROTOCOL_VERSION, SCALE_CAUSES, STREAK_LADDER,
                                        TEXT_LIMITS)

from ._floats import NONFINITE_STRINGS, wire_float

__all__ = ["LARGE_BODY_BYTES", "Batch", "BatchError", "parse_large_batch", "WireRankState", "WireOptimizerCounters",
           "Event", "encode_batch_state", "wire_document", "parse_batch", "stored_event", "event_of_row"]

LADDER_KEYS: tuple[str, ...] = tuple(map(str, STREAK_LADDER))  # "1", "2", ..., "1024": JSON object keys

# SQLite stores integers as 64-bit signed: a larger one would fail at COMMIT (a 500) instead of a 422.
MAX_INT = 2 ** 63 - 1
# Integers are strict: a JSON true or 3.0 is not a count (msgspec never reads them as 1 and 3).
Count = Annotated[int, Meta(ge=0, le=MAX_INT)]
Positive = Annotated[int, Meta(ge=1, le=MAX_INT)]
Label = Annotated[str, Meta(min_length=1, max_length=TEXT_LIMITS["label"])]
LadderKey = Literal[LADDER_KEYS]  # type: ignore[valid-type]
# Every float but a scale must be finite: JSON can still spell an infinity (1e999).
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]


def _text(limit: str) -> Any:
    return Annotated[str, Meta(max_length=TEXT_LIMITS[limit])]


class ScaleValue(float):
    """A value a GradScaler holds (scale, growth/backoff factor): any float, NaN and infinities included.

    JSON has no NaN or infinity, yet a float32 scale can hold them (and 0.0, after ~166 backoffs in a row):
    the protocol writes them as the strings "NaN", "Infinity" and "-Infinity" (the bare tokens Python's
    json module writes are accepted too, see :func:`parse_batch`), and so does :func:`encode_batch_state`.
    """

    __slots__ = ()


def _decode_hook(kind: type, value: Any) -> Any:
    if kind is ScaleValue:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return ScaleValue(value)
        if isinstance(value, str) and value in NONFINITE_STRINGS:
            return ScaleValue(NONFINITE_STRINGS[value])
        raise ValueError('must be a number, null, or one of the strings "NaN", "Infinity", "-Infinity"')
    raise NotImplementedError(kind)


def _encode_hook(value: Any) -> Any:
    if isinstance(value, ScaleValue):
        return wire_float(float(value))
    raise NotImplementedError(type(value))


class _Model(Struct, frozen=True):
    """Unknown fields from a newer agent are ignored (never built into objects)."""


class AgentInfo(_Model):
    version: _text("version")  # type: ignore[valid-type]
    torch: Optional[_text("version")] = None  # type: ignore[valid-type]


class ScalerInfo(_Model):
    enabled: bool
    kind: _text("scaler_kind")  # type: ignore[valid-type]
    init_scale: Optional[ScaleValue] = None
    growth_factor: Optional[ScaleValue] = None
    backoff_factor: Optional[ScaleValue] = None
    growth_interval: Optional[int] = None


class WireOptimizerCounters(_Model):
    """``state.optimizers[name]``: one optimizer's cumulative counters and current streak, as sent."""

    steps: Count
    skipped: Count
    consecutive_skipped: Count
    longest_streak: Count
    streaks: Count
    streaks_reached: dict[LadderKey, Count] = {}
    scheduler_steps_after_skip: Count = 0
    poisoned_steps: Count = 0


class Delivery(_Model):
    dropped_events: Count = 0
    send_failures: Count = 0
    rejected_batches: Count = 0
    agent_errors: Count = 0


class WireRankState(_Model):
    """``state``: the rank's cumulative counters and gauges, as sent."""

    iteration: Count
    loss_scale: Optional[ScaleValue]  # any value the scaler holds: 0, subnormal, negative, NaN, infinite
    backoffs: Count
    growths: Count
    optimizers: dict[Label, WireOptimizerCounters]
    manual_sets: Count = 0
    origin_iterations: Optional[Count] = None  # absent: the rank does not watch DDP's all-reduce (ddp=)
    delivery: Delivery = Delivery()


class ParamDetail(_Model):
    name: _text("param_name")  # type: ignore[valid-type]
    inf: Count = 0
    nan: Count = 0


class _EventBase(_Model, tag_field="kind"):
    kind: ClassVar[str]
    id: Positive
    time: Finite
    iteration: Count


class SkipEvent(_EventBase, tag="skip"):
    kind: ClassVar[str] = "skip"
    optimizer: Label
    streak: Positive
    params: Annotated[list[ParamDetail], Meta(max_length=MAX_PARAMS)] = []
    params_total: Optional[Count] = None
    inspected: bool = True
    # With ddp=: whether this rank's own gradients held inf/NaN before the all-reduce (absent: not watched).
    origin: Optional[bool] = None
    origin_buckets: Annotated[list[Count], Meta(max_length=MAX_PARAMS)] = []
    origin_params: Annotated[list[_text("param_name")], Meta(max_length=MAX_PARAMS)] = []  # type: ignore
    origin_params_total: Optional[Count] = None


class StreakEndEvent(_EventBase, tag="streak_end"):
    kind: ClassVar[str] = "streak_end"
    optimizer: Label
    start_iteration: Count
    length: Positive


class ScaleChangeEvent(_EventBase, tag="scale_change"):
    kind: ClassVar[str] = "scale_change"
    cause: Literal[SCALE_CAUSES]  # type: ignore[valid-type]
    before: Optional[ScaleValue]
    after: Optional[ScaleValue]
    # Backoffs in consecutive iterations this event stands for (the agent folds a storm's backoffs); 1 otherwise.
    count: Positive = 1


class SchedulerAfterSkipEvent(_EventBase, tag="scheduler_after_skip"):
    kind: ClassVar[str] = "scheduler_after_skip"
    optimizer: Label
    scheduler: _text("scheduler")  # type: ignore[valid-type]


class PoisonedStepEvent(_EventBase, tag="poisoned_step"):
    kind: ClassVar[str] = "poisoned_step"
    optimizer: Label
    reason: Literal["nonfinite_grad", "nonfinite_param"]
    # From a rank without a GradScaler: the position in its run of consecutive poisoned steps (sent at 1, 2, 4,
    # ... as skips are), and exact false when inf/nan only say whether a gradient held any (read on a GPU late).
    streak: Optional[Positive] = None
    exact: bool = True
    params: Annotated[list[ParamDetail], Meta(max_length=MAX_PARAMS)] = []
    params_total: Optional[Count] = None
    # Without a scaler, with ddp=: whether this rank's own gradients held inf/NaN before the all-reduce.
    origin: Optional[bool] = None
    origin_params: Annotated[list[_text("param_name")], Meta(max_length=MAX_PARAMS)] = []  # type: ignore
    origin_params_total: Optional[Count] = None


class WarningEvent(_EventBase, tag="warning"):
    kind: ClassVar[str] = "warning"
    code: _text("warning_code")  # type: ignore[valid-type]
    message: _text("warning_message")  # type: ignore[valid-type]
    optimizer: Optional[Label] = None


class ScalerDisabledEvent(_EventBase, tag="scaler_disabled"):
    kind: ClassVar[str] = "scaler_disabled"


class CloseEvent(_EventBase, tag="close"):
    kind: ClassVar[str] = "close"


_EVENT_MODELS = (SkipEvent, StreakEndEvent, ScaleChangeEvent, SchedulerAfterSkipEvent, PoisonedStepEvent,
                 WarningEvent, ScalerDisabledEvent, CloseEvent)
Event = Union[SkipEvent, StreakEndEvent, ScaleChangeEvent, SchedulerAfterSkipEvent, PoisonedStepEvent,
              WarningEvent, ScalerDisabledEvent, CloseEvent]


class Batch(_Model):
    """One POST /v1/ingest body (docs/protocol.md)."""

    protocol: int
    agent: AgentInfo
    run: Label
    rank: Count
    world_size: Positive
    local_rank: Count
    host: _text("host")  # type: ignore[valid-type]
    pid: Count
    incarnation: Annotated[str, Meta(min_length=8, max_length=64, pattern=r"^[0-9a-zA-Z_-]+$")]
    seq: Positive
    sent_at: Finite
    scaler: ScalerInfo
    state: WireRankState
    events: Annotated[list[Event], Meta(max_length=MAX_BATCH_EVENTS)] = []
    closed: bool = False
    # Secret, shared by every watch() in one process; never shown (absent from agents before it).
    process_key: Optional[Annotated[str, Meta(min_length=16, max_length=64, pattern=r"^[0-9a-zA-Z_-]+$")]] = None

    def __post_init__(self) -> None:
        # Raised here, an error names no field: each message starts with the one it is about.
        if self.protocol != PROTOCOL_VERSION:
            raise ValueError(f"protocol: version {self.protocol} is not supported; this collector speaks "
                             f"version {PROTOCOL_VERSION} (and version 2 only as node batches laid out as "
                             "docs/protocol.md says): upgrade the collector or pin the agent")
        for name in ("run", "host"):
            if not getattr(self, name).isprintable():
                raise ValueError(f"{name}: must not contain control characters")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        last = 0
        for event in self.events:
            if event.id <= last:
                raise ValueError(f"events must be ordered by increasing id; id {event.id} follows {last}")
            last = event.id
        for name in self.state.optimizers:
            if not name.isprintable():
                raise ValueError(f"optimizer name {name!r} must not contain control characters")


class BatchError(ValueError):
    """A body that is not a protocol v1 batch: ``malformed`` when it is not JSON; ``lines`` say what and where."""

    def __init__(self, lines: list[str], malformed: bool) -> None:
        super().__init__(lines[0])
        self.lines, self.malformed = lines, malformed


_DECODER = msgspec.json.Decoder(Batch, dec_hook=_decode_hook)
_BARE_NONFINITE = (b"NaN", b"Infinity")
_EXPLAINED_UP_TO = 65_536  # bytes: a refused body this small is read twice to name the dict key an error is in

LARGE_BODY_BYTES = 65_536
"""Bodies larger than this (a batch is about 1 KiB, 16 optimizers without events about 6 KiB) are parsed by
:func:`parse_large_batch`, which the collector runs in a worker thread."""

STATE_BYTES_PER_OPTIMIZER = 2048
"""The most bytes of ``state`` a large body may hold per optimizer its collector allows (an optimizer's
counters take about 300), checked before the state is built into objects."""

# The large path's first pass: the batch with its events left as raw JSON, one slice each, and its state as one.
_PARTS = msgspec.defstruct("_BatchParts", [
    (f.name, {"state": msgspec.Raw, "events": Annotated[list[msgspec.Raw], Meta(max_length=MAX_BATCH_EVENTS)]}.get(
        f.name, f.type), msgspec.field(default=f.default) if f.default_factory is msgspec.NODEFAULT else
     msgspec.field(default_factory=f.default_factory)) for f in msgspec.structs.fields(Batch)], frozen=True)
_PARTS_DECODER = msgspec.json.Decoder(_PARTS, dec_hook=_decode_hook)
_STATE_DECODER = msgspec.json.Decoder(WireRankState, dec_hook=_decode_hook)
_EVENT_DECODER = msgspec.json.Decoder(Event, dec_hook=_decode_hook)


def parse_batch(body: Union[bytes, str]) -> Batch:
    """Parse and validate a raw request body in one pass (raises :class:`BatchError`)."""
    try:
        return _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise BatchError([_located(str(exc), body)], malformed=False) from None
    except msgspec.DecodeError as exc:
        raw = body.encode() if isinstance(body, str) else body
        if any(token in raw for token in _BARE_NONFINITE):
            return _parse_python_tokens(raw)
        raise BatchError([str(exc)], malformed=True) from None


def parse_large_batch(body: bytes, max_optimizers: int) -> Batch:
    """Parse and validate a large body (raises :class:`BatchError`), bounding what it may hold before it is built
    into objects: a first pass keeps each event and the state as a slice of the body (unknown fields are
    skipped), so that more events than a batch may hold, or a state too large for ``max_optimizers``
    optimizers, are refused before any of them is built; then each part is decoded on its own. The same
    batches pass or fail as with :func:`parse_batch` but for that bound; run it in a worker thread: a
    thread switch may come between two parts."""
    try:
        parts = _PARTS_DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise BatchError([_located(str(exc))], malformed=False) from None
    except msgspec.DecodeError:
        return parse_batch(body)  # not JSON, or Python's NaN tokens: said as parse_batch says it
    limit = 1024 + STATE_BYTES_PER_OPTIMIZER * max_optimizers
    if len(parts.state) > limit:
        raise BatchError([f"state: {len(parts.state)} bytes, more than the {limit} that the counters of "
                          f"{max_optimizers} optimizers (this collector's --max-optimizers-per-rank) take"],
                         malformed=False)
    try:
        state = _STATE_DECODER.decode(parts.state)
    except msgspec.ValidationError as exc:
        raise BatchError(["state." + _located(str(exc))], malformed=False) from None
    events = []
    for i, raw in enumerate(parts.events):
        try:
            events.append(_EVENT_DECODER.decode(raw))
        except msgspec.ValidationError as exc:
            raise BatchError([f"events[{i}]." + _located(str(exc))], malformed=False) from None
    fields = {name: getattr(parts, name) for name in parts.__struct_fields__}
    try:
        return Batch(**dict(fields, state=state, events=events))
    except ValueError as exc:  # Batch.__post_init__: consistency across fields
        raise BatchError([f"body: {exc}"], malformed=False) from None


def _parse_python_tokens(body: bytes) -> Batch:
    """A body with the bare NaN/Infinity tokens Python's json module writes (not JSON, but what a Python client
    sends by default): read by that module, then validated as any other."""
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise BatchError([str(exc)], malformed=True) from None
    try:
        return msgspec.convert(document, Batch, dec_hook=_decode_hook)
    except msgspec.ValidationError as exc:
        raise BatchError([_located(str(exc), document)], malformed=False) from None


def _located(message: str, body: Any = None) -> str:
    """``"<path>: <message>"`` from msgspec's ``"<message> - at `$.<path>`"``, a dict's key named where msgspec
    says ``[...]`` (found again in a small body; a large one keeps ``[...]``)."""
    text, _, where = message.rpartition(" - at `")
    if not text:
        return f"body: {message}"
    if "` in `" in where:  # an object's key: "<message> - at `key` in `$.path`"
        where = where.split("` in `", 1)[1]
        text += " (a key)"
    path = where.rstrip("`").removeprefix("$").lstrip(".")
    if "[...]" in path and body is not None and (not isinstance(body, (bytes, str)) or len(body) <= _EXPLAINED_UP_TO):
        path = _name_keys(body, path, message)
    return f"{path or 'body'}: {text}"


def _name_keys(body: Any, path: str, message: str) -> str:
    """Replace each ``[...]`` of ``path`` by the key whose entry alone makes the body fail with ``message``."""
    try:
        document = msgspec.json.decode(body) if isinstance(body, (bytes, str)) else body
    except msgspec.DecodeError:
        document = json.loads(body)
    head, _, rest = path.partition("[...]")
    node = document
    for part in filter(None, head.split(".")):
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return path
    entries = dict(node)
    try:
        for key in entries:
            node.clear()
            node[key] = entries[key]
            try:
                msgspec.convert(document, Batch, dec_hook=_decode_hook)
            except msgspec.ValidationError as exc:
                if str(exc) == message:
                    return f"{head}.{key}" + rest
    finally:
        node.clear()
        node.update(entries)
    return path


_ENCODER = msgspec.json.Encoder(enc_hook=_encode_hook)


def wire_document(part: Struct) -> dict[str, Any]:
    """Return a part of a batch (its ``scaler``, its ``agent``) as the protocol writes it, as a dict."""
    return msgspec.to_builtins(part, enc_hook=_encode_hook)


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
                               if f.name not in _EVENT_COLUMNS) for m in _EVENT_MODELS}
_EVENT_DEFAULTS = {kind: {name: default for name, default in fields if default is not _NO_DEFAULT}
                   for kind, fields in _EVENT_FIELDS.items()}
_OPTIONAL_OPTIMIZER = {m.kind for m in _EVENT_MODELS if "optimizer" in m.__struct_fields__}


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
