"""The wire protocol v1 batch as pydantic models: docs/protocol.md, with the limits of ``ampwatch.contract.protocol``."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, field_validator,
                      model_validator)

from ampwatch.contract.protocol import (MAX_BATCH_EVENTS, MAX_PARAMS, PROTOCOL_VERSION, SCALE_CAUSES, STREAK_LADDER,
                                        TEXT_LIMITS)

from ._floats import NONFINITE_STRINGS

__all__ = ["Batch", "WireRankState", "WireOptimizerCounters", "Event", "parse_batch", "describe_errors",
           "ValidationError", "stored_event", "event_of_row"]

LADDER_KEYS: tuple[str, ...] = tuple(map(str, STREAK_LADDER))  # "1", "2", ..., "1024": JSON object keys

# SQLite stores integers as 64-bit signed: a larger one would fail at COMMIT (a 500) instead of a 422.
MAX_INT = 2 ** 63 - 1
# Integers are strict: a JSON true or 3.0 is not a count (lax mode would read them as 1 and 3).
Count = Annotated[int, Field(ge=0, le=MAX_INT, strict=True)]
Positive = Annotated[int, Field(ge=1, le=MAX_INT, strict=True)]
Label = Annotated[str, Field(min_length=1, max_length=TEXT_LIMITS["label"])]
LadderKey = Literal[LADDER_KEYS]  # type: ignore[valid-type]


# JSON has no NaN or infinity, yet a GradScaler's float32 scale can hold them (and 0.0, after ~166 backoffs
# in a row). Fields that carry what the scaler holds (ScaleFloat) take the strings "NaN", "Infinity" and
# "-Infinity"; the bare tokens NaN/Infinity that Python's json module writes are accepted too. Every other
# float must be finite.
def _scale_value(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return NONFINITE_STRINGS[value]
        except KeyError:
            raise ValueError('must be a number, null, or one of the strings "NaN", "Infinity", "-Infinity"') \
                from None
    return value


ScaleFloat = Annotated[float, Field(allow_inf_nan=True), BeforeValidator(_scale_value)]
"""A value a GradScaler holds (scale, growth/backoff factor): any float, non-finite ones as strings."""


class _Model(BaseModel):
    # Unknown fields from a newer agent are ignored; floats must be finite except ScaleFloat fields, which
    # serialise NaN/infinities as the protocol's strings (so a stored batch or event reads back the same).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True, ser_json_inf_nan="strings")


class AgentInfo(_Model):
    version: str = Field(max_length=TEXT_LIMITS["version"])
    torch: Optional[str] = Field(default=None, max_length=TEXT_LIMITS["version"])


class ScalerInfo(_Model):
    enabled: bool
    kind: str = Field(max_length=TEXT_LIMITS["scaler_kind"])
    init_scale: Optional[ScaleFloat] = None
    growth_factor: Optional[ScaleFloat] = None
    backoff_factor: Optional[ScaleFloat] = None
    growth_interval: Optional[Annotated[int, Field(strict=True)]] = None


class WireOptimizerCounters(_Model):
    """``state.optimizers[name]``: one optimizer's cumulative counters and current streak, as sent."""

    steps: Count
    skipped: Count
    consecutive_skipped: Count
    longest_streak: Count
    streaks: Count
    streaks_reached: dict[LadderKey, Count] = Field(default_factory=dict)
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
    loss_scale: Optional[ScaleFloat]  # any value the scaler holds: 0, subnormal, negative, NaN, infinite
    backoffs: Count
    growths: Count
    manual_sets: Count = 0
    optimizers: dict[Label, WireOptimizerCounters]
    origin_iterations: Optional[Count] = None  # absent: the rank does not watch DDP's all-reduce (ddp=)
    delivery: Delivery = Field(default_factory=Delivery)


class ParamDetail(_Model):
    name: str = Field(max_length=TEXT_LIMITS["param_name"])
    inf: Count = 0
    nan: Count = 0


class _EventBase(_Model):
    id: Positive
    time: float
    iteration: Count


class SkipEvent(_EventBase):
    kind: Literal["skip"]
    optimizer: Label
    streak: Positive
    params: list[ParamDetail] = Field(default_factory=list, max_length=MAX_PARAMS)
    params_total: Optional[Count] = None
    inspected: bool = True
    # With ddp=: whether this rank's own gradients held inf/NaN before the all-reduce (absent: not watched).
    origin: Optional[bool] = None
    origin_buckets: list[Count] = Field(default_factory=list, max_length=MAX_PARAMS)
    origin_params: list[Annotated[str, Field(max_length=TEXT_LIMITS["param_name"])]] = Field(
        default_factory=list, max_length=MAX_PARAMS)
    origin_params_total: Optional[Count] = None


class StreakEndEvent(_EventBase):
    kind: Literal["streak_end"]
    optimizer: Label
    start_iteration: Count
    length: Positive


class ScaleChangeEvent(_EventBase):
    kind: Literal["scale_change"]
    cause: Literal[SCALE_CAUSES]  # type: ignore[valid-type]
    before: Optional[ScaleFloat]
    after: Optional[ScaleFloat]
    # Backoffs in consecutive iterations this event stands for (the agent folds a storm's backoffs); 1 otherwise.
    count: Positive = 1


class SchedulerAfterSkipEvent(_EventBase):
    kind: Literal["scheduler_after_skip"]
    optimizer: Label
    scheduler: str = Field(max_length=TEXT_LIMITS["scheduler"])


class PoisonedStepEvent(_EventBase):
    kind: Literal["poisoned_step"]
    optimizer: Label
    params: list[ParamDetail] = Field(default_factory=list, max_length=MAX_PARAMS)
    params_total: Optional[Count] = None
    reason: Literal["nonfinite_grad", "nonfinite_param"]
    # From a rank without a GradScaler: the position in its run of consecutive poisoned steps (sent at 1, 2, 4,
    # ... as skips are), and exact false when inf/nan only say whether a gradient held any (read on a GPU late).
    streak: Optional[Positive] = None
    exact: bool = True


class WarningEvent(_EventBase):
    kind: Literal["warning"]
    code: str = Field(max_length=TEXT_LIMITS["warning_code"])
    message: str = Field(max_length=TEXT_LIMITS["warning_message"])
    optimizer: Optional[Label] = None


class ScalerDisabledEvent(_EventBase):
    kind: Literal["scaler_disabled"]


class CloseEvent(_EventBase):
    kind: Literal["close"]


Event = Annotated[
    Union[SkipEvent, StreakEndEvent, ScaleChangeEvent, SchedulerAfterSkipEvent, PoisonedStepEvent,
          WarningEvent, ScalerDisabledEvent, CloseEvent],
    Field(discriminator="kind"),
]


class Batch(_Model):
    """One POST /v1/ingest body (docs/protocol.md)."""

    protocol: Annotated[int, Field(strict=True)]
    agent: AgentInfo
    run: Label
    rank: Count
    world_size: Positive
    local_rank: Count
    host: str = Field(max_length=TEXT_LIMITS["host"])
    pid: Count
    incarnation: str = Field(min_length=8, max_length=64, pattern=r"^[0-9a-zA-Z_-]+$")
    seq: Positive
    sent_at: float
    scaler: ScalerInfo
    state: WireRankState
    events: list[Event] = Field(default_factory=list, max_length=MAX_BATCH_EVENTS)
    closed: bool = False

    @field_validator("protocol")
    @classmethod
    def _supported_protocol(cls, value: int) -> int:
        if value != PROTOCOL_VERSION:
            raise ValueError(f"protocol version {value} is not supported; this collector speaks "
                             f"version {PROTOCOL_VERSION} (and version 2 only as node batches laid out as "
                             "docs/protocol.md says): upgrade the collector or pin the agent")
        return value

    @field_validator("run", "host")
    @classmethod
    def _printable(cls, value: str) -> str:
        if not value.isprintable():
            raise ValueError("must not contain control characters")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Batch":
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
        return self


# An event's row keeps these in columns (docs/collector.md#storage), and its body only the fields that are not
# their default: a storm's events are mostly defaults ([] and null), so the history grows about 2.5x slower.
_EVENT_COLUMNS = frozenset({"id", "kind", "time", "iteration", "optimizer"})
_EVENT_MODELS = {m.model_fields["kind"].annotation.__args__[0]: m for m in  # type: ignore[union-attr]
                 (SkipEvent, StreakEndEvent, ScaleChangeEvent, SchedulerAfterSkipEvent, PoisonedStepEvent,
                  WarningEvent, ScalerDisabledEvent, CloseEvent)}
_EVENT_DEFAULTS = {kind: {name: f.get_default(call_default_factory=True) for name, f in m.model_fields.items()
                          if not f.is_required() and name not in _EVENT_COLUMNS}
                   for kind, m in _EVENT_MODELS.items()}
_OPTIONAL_OPTIMIZER = {kind for kind, m in _EVENT_MODELS.items() if "optimizer" in m.model_fields}


def stored_event(event: Any) -> str:
    """Return the body an event's row keeps: its fields that are neither columns nor defaults, as JSON."""
    defaults = _EVENT_DEFAULTS[event.kind]
    # Through JSON: non-finite scales become the protocol's strings, and nested defaults stay (params' "nan": 0).
    fields = json.loads(event.model_dump_json(exclude=_EVENT_COLUMNS))
    return json.dumps({k: v for k, v in fields.items() if k not in defaults or v != defaults[k]},
                      separators=(",", ":"))


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


_BATCH = TypeAdapter(Batch)


def parse_batch(body: bytes) -> Batch:
    """Parse and validate a raw request body in one pass (raises ``ValidationError``)."""
    return _BATCH.validate_json(body)


def describe_errors(error: ValidationError, limit: int = 10) -> list[str]:
    """Turn a pydantic error into short ``"field.path: message"`` lines a user can act on."""
    lines = []
    for item in error.errors(include_url=False)[:limit]:
        where = ".".join(str(p) for p in item["loc"]) or "body"
        lines.append(f"{where}: {item['msg']}")
    if error.error_count() > limit:
        lines.append(f"... and {error.error_count() - limit} more errors")
    return lines
