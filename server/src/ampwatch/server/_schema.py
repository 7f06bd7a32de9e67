"""The wire protocol v1 batch as msgspec structs: docs/protocol.md, with the limits of ``ampwatch.contract.protocol``.

Read from a body by :mod:`._batch_parse`, kept in rows as :mod:`._stored_form` writes it. Decoded and validated in
one pass that stops at the first error and builds no object for a field it does not
know (a newer agent's fields, or a hostile body's bulk), so a batch costs a fraction of what a general JSON
parser and a validator after it cost, and a wide or deep body is refused at about the cost of reading it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from msgspec import Meta, Struct

from ampwatch.contract.protocol import (
    MAX_BATCH_EVENTS,
    MAX_PARAMS,
    MAX_SAMPLE_IDS,
    MAX_SAMPLES_BEFORE,
    PROTOCOL_VERSION,
    SCALE_CAUSES,
    STREAK_LADDER,
    TEXT_LIMITS,
)

from ._floats import NONFINITE_STRINGS, wire_float

__all__ = ["Batch", "WireRankState", "WireOptimizerCounters", "Event", "EVENT_MODELS", "ScaleValue", "decode_hook",
           "encode_hook"]

LADDER_KEYS: tuple[str, ...] = tuple(map(str, STREAK_LADDER))  # "1", "2", ..., "1024": JSON object keys

# SQLite stores integers as 64-bit signed: a larger one would fail at COMMIT (a 500) instead of a 422.
MAX_INT = 2 ** 63 - 1
# Integers are strict: a JSON true or 3.0 is not a count (msgspec never reads them as 1 and 3).
Count = Annotated[int, Meta(ge=0, le=MAX_INT)]
Positive = Annotated[int, Meta(ge=1, le=MAX_INT)]
Label = Annotated[str, Meta(min_length=1, max_length=TEXT_LIMITS["label"])]
# Every float but a scale must be finite: JSON can still spell an infinity (1e999).
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
# Free text, each as long as the contract allows.
VersionText = Annotated[str, Meta(max_length=TEXT_LIMITS["version"])]
ScalerKind = Annotated[str, Meta(max_length=TEXT_LIMITS["scaler_kind"])]
ParamName = Annotated[str, Meta(max_length=TEXT_LIMITS["param_name"])]
SchedulerName = Annotated[str, Meta(max_length=TEXT_LIMITS["scheduler"])]
WarningCode = Annotated[str, Meta(max_length=TEXT_LIMITS["warning_code"])]
WarningMessage = Annotated[str, Meta(max_length=TEXT_LIMITS["warning_message"])]
HostName = Annotated[str, Meta(max_length=TEXT_LIMITS["host"])]
ModulePath = Annotated[str, Meta(max_length=TEXT_LIMITS["module"])]
ModuleType = Annotated[str, Meta(max_length=TEXT_LIMITS["module_type"])]
DeviceText = Annotated[str, Meta(max_length=TEXT_LIMITS["device_text"])]
# A sample id: an int (any SQLite integer) or a short string.
SampleId = Annotated[int, Meta(ge=-MAX_INT - 1, le=MAX_INT)] | Annotated[str, Meta(max_length=TEXT_LIMITS["sample_id"])]
if TYPE_CHECKING:  # a Literal built from the contract's tuples at run time is no type to mypy: plain text to it
    LadderKey = str
    ScaleCause = str
else:  # msgspec refuses any other value
    LadderKey = Literal[LADDER_KEYS]
    ScaleCause = Literal[SCALE_CAUSES]


class ScaleValue(float):
    """A value a GradScaler holds (scale, growth/backoff factor): any float, NaN and infinities included.

    JSON has no NaN or infinity, yet a float32 scale can hold them (and 0.0, after ~166 backoffs in a row):
    the protocol writes them as the strings "NaN", "Infinity" and "-Infinity" (the bare tokens Python's
    json module writes are accepted too, see :func:`~._batch_parse.parse_batch`), and so does
    :func:`~._stored_form.encode_batch_state`.
    """

    __slots__ = ()


def decode_hook(kind: type, value: Any) -> Any:
    """msgspec's ``dec_hook`` for the models: a :class:`ScaleValue` from a number or one of the protocol's strings."""
    if kind is ScaleValue:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return ScaleValue(value)
        if isinstance(value, str) and value in NONFINITE_STRINGS:
            return ScaleValue(NONFINITE_STRINGS[value])
        raise ValueError('must be a number, null, or one of the strings "NaN", "Infinity", "-Infinity"')
    raise NotImplementedError(kind)


def encode_hook(value: Any) -> Any:
    """msgspec's ``enc_hook`` for the models: a :class:`ScaleValue` as the protocol writes it."""
    if isinstance(value, ScaleValue):
        return wire_float(float(value))
    raise NotImplementedError(type(value))


class _Model(Struct, frozen=True):
    """Unknown fields from a newer agent are ignored (never built into objects).

    Each model says ``frozen=True`` again: msgspec hands it down, but a type checker reads it per class.
    """


class AgentInfo(_Model, frozen=True):
    version: VersionText
    torch: VersionText | None = None


class ScalerInfo(_Model, frozen=True):
    enabled: bool
    kind: ScalerKind
    init_scale: ScaleValue | None = None
    growth_factor: ScaleValue | None = None
    backoff_factor: ScaleValue | None = None
    growth_interval: int | None = None


class SignalLevel(_Model, frozen=True):
    """A signal's rolling level (the loss, a gradient norm): its window's mean and standard deviation."""

    mean: Finite
    std: Annotated[float, Meta(ge=0)]


class WireOptimizerCounters(_Model, frozen=True):
    """``state.optimizers[name]``: one optimizer's cumulative counters and current streak, as sent."""

    steps: Count
    skipped: Count
    consecutive_skipped: Count
    longest_streak: Count
    streaks: Count
    streaks_reached: dict[LadderKey, Count] = {}
    scheduler_steps_after_skip: Count = 0
    poisoned_steps: Count = 0
    grad_norm_spikes: Count = 0
    grad_norm: SignalLevel | None = None
    local_grad_norm: SignalLevel | None = None  # absent: the rank does not watch DDP's all-reduce (ddp=)


class Delivery(_Model, frozen=True):
    dropped_events: Count = 0
    send_failures: Count = 0
    rejected_batches: Count = 0
    agent_errors: Count = 0
    refused_spool_files: Count = 0


class WireRankState(_Model, frozen=True):
    """``state``: the rank's cumulative counters and gauges, as sent."""

    iteration: Count
    loss_scale: ScaleValue | None  # any value the scaler holds: 0, subnormal, negative, NaN, infinite
    backoffs: Count
    growths: Count
    optimizers: dict[Label, WireOptimizerCounters]
    manual_sets: Count = 0
    loss_spikes: Count = 0
    loss: SignalLevel | None = None
    origin_iterations: Count | None = None  # absent: the rank does not watch DDP's all-reduce (ddp=)
    delivery: Delivery = Delivery()


class ParamDetail(_Model, frozen=True):
    name: ParamName
    inf: Count = 0
    nan: Count = 0


class Began(_Model, frozen=True):
    """``began`` of a skip or poisoned step: where this rank's inf/NaN began (docs/protocol.md#events)."""

    loss_finite: bool | None = None
    stage: Literal["forward", "backward"] | None = None
    param: ParamName | None = None
    module: ModulePath | None = None
    module_type: ModuleType | None = None
    probe: Literal["armed", "found", "unavailable"] | None = None


class Samples(_Model, frozen=True):
    """The sample ids of one iteration: the first ones, how many, and a digest of all."""

    ids: Annotated[list[SampleId], Meta(max_length=MAX_SAMPLE_IDS)]
    count: Count
    digest: Annotated[str, Meta(pattern=r"^[0-9a-f]{16}$")]


class IterationSamples(_Model, frozen=True):
    iteration: Count
    samples: Samples


SamplesBefore = Annotated[list[IterationSamples], Meta(max_length=MAX_SAMPLES_BEFORE)]


class DeviceInfo(_Model, frozen=True):
    """A batch's ``device``: the accelerator the rank trains on."""

    type: DeviceText
    index: Count | None = None
    uuid: DeviceText | None = None
    pci_bus_id: DeviceText | None = None


class _EventBase(_Model, tag_field="kind", frozen=True):
    kind: ClassVar[str]
    id: Positive
    time: Finite
    iteration: Count


class SkipEvent(_EventBase, tag="skip", frozen=True):
    kind: ClassVar[str] = "skip"
    optimizer: Label
    streak: Positive
    params: Annotated[list[ParamDetail], Meta(max_length=MAX_PARAMS)] = []
    params_total: Count | None = None
    inspected: bool = True
    # With ddp=: whether this rank's own gradients held inf/NaN before the all-reduce (absent: not watched).
    origin: bool | None = None
    origin_buckets: Annotated[list[Count], Meta(max_length=MAX_PARAMS)] = []
    origin_params: Annotated[list[ParamName], Meta(max_length=MAX_PARAMS)] = []
    origin_params_total: Count | None = None
    began: Began | None = None
    samples: Samples | None = None
    samples_before: SamplesBefore = []
    calibration: bool = False


class StreakEndEvent(_EventBase, tag="streak_end", frozen=True):
    kind: ClassVar[str] = "streak_end"
    optimizer: Label
    start_iteration: Count
    length: Positive


class ScaleChangeEvent(_EventBase, tag="scale_change", frozen=True):
    kind: ClassVar[str] = "scale_change"
    cause: ScaleCause
    before: ScaleValue | None
    after: ScaleValue | None
    # Backoffs in consecutive iterations this event stands for (the agent folds a storm's backoffs); 1 otherwise.
    count: Positive = 1


class SchedulerAfterSkipEvent(_EventBase, tag="scheduler_after_skip", frozen=True):
    kind: ClassVar[str] = "scheduler_after_skip"
    optimizer: Label
    scheduler: SchedulerName


class PoisonedStepEvent(_EventBase, tag="poisoned_step", frozen=True):
    kind: ClassVar[str] = "poisoned_step"
    optimizer: Label
    reason: Literal["nonfinite_grad", "nonfinite_param"]
    # From a rank without a GradScaler: the position in its run of consecutive poisoned steps (sent at 1, 2, 4,
    # ... as skips are), and exact false when inf/nan only say whether a gradient held any (read on a GPU late).
    streak: Positive | None = None
    exact: bool = True
    params: Annotated[list[ParamDetail], Meta(max_length=MAX_PARAMS)] = []
    params_total: Count | None = None
    # Without a scaler, with ddp=: whether this rank's own gradients held inf/NaN before the all-reduce.
    origin: bool | None = None
    origin_params: Annotated[list[ParamName], Meta(max_length=MAX_PARAMS)] = []
    origin_params_total: Count | None = None
    began: Began | None = None
    samples: Samples | None = None
    samples_before: SamplesBefore = []


class WarningEvent(_EventBase, tag="warning", frozen=True):
    kind: ClassVar[str] = "warning"
    code: WarningCode
    message: WarningMessage
    optimizer: Label | None = None


class _SpikeEvent(_EventBase, kw_only=True, frozen=True):
    # A value may be non-finite (a non-finite value is always a spike), written as a loss scale is.
    value: ScaleValue
    mean: Finite | None
    std: Annotated[float, Meta(ge=0)] | None
    z: Finite | None
    streak: Positive
    samples: Samples | None = None


class LossSpikeEvent(_SpikeEvent, tag="loss_spike", frozen=True):
    kind: ClassVar[str] = "loss_spike"


class GradNormSpikeEvent(_SpikeEvent, tag="grad_norm_spike", kw_only=True, frozen=True):
    kind: ClassVar[str] = "grad_norm_spike"
    optimizer: Label
    local: bool = False


class ScalerDisabledEvent(_EventBase, tag="scaler_disabled", frozen=True):
    kind: ClassVar[str] = "scaler_disabled"


class CloseEvent(_EventBase, tag="close", frozen=True):
    kind: ClassVar[str] = "close"


EVENT_MODELS = (SkipEvent, StreakEndEvent, ScaleChangeEvent, SchedulerAfterSkipEvent, PoisonedStepEvent,
                 WarningEvent, ScalerDisabledEvent, CloseEvent, LossSpikeEvent, GradNormSpikeEvent)
Event = (SkipEvent | StreakEndEvent | ScaleChangeEvent | SchedulerAfterSkipEvent | PoisonedStepEvent | WarningEvent
         | ScalerDisabledEvent | CloseEvent | LossSpikeEvent | GradNormSpikeEvent)


class Batch(_Model, frozen=True):
    """One POST /v1/ingest body (docs/protocol.md)."""

    protocol: int
    agent: AgentInfo
    run: Label
    rank: Count
    world_size: Positive
    local_rank: Count
    host: HostName
    pid: Count
    incarnation: Annotated[str, Meta(min_length=8, max_length=64, pattern=r"^[0-9a-zA-Z_-]+$")]
    seq: Positive
    sent_at: Finite
    scaler: ScalerInfo
    state: WireRankState
    events: Annotated[list[Event], Meta(max_length=MAX_BATCH_EVENTS)] = []
    closed: bool = False
    # Secret, shared by every watch() in one process; never shown (absent from agents before it).
    process_key: Annotated[str, Meta(min_length=16, max_length=64, pattern=r"^[0-9a-zA-Z_-]+$")] | None = None
    # Sent by another process than the batch's own, from a dead process's spool: its history, no sign of life.
    replayed: bool = False
    # The accelerator the rank trains on, sent until a batch with it is accepted (absent: an older agent, or sent).
    device: DeviceInfo | None = None

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
