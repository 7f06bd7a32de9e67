"""What a protocol-v1 batch's ``state`` and ``events`` hold, field by field (docs/protocol.md#batch).

Each part is a ``TypedDict``: the agent builds its counters and events as these (a dict literal annotated
with one costs nothing at run time; a type checker checks its keys and values), the collector's schema
declares exactly these fields, and ``tests/test_contract_agent.py`` fails on a field that either side
sends or expects and this module does not declare. Keys a collector requires are the required keys;
the rest may be left out by an agent (an older one, or one that did not watch what they report).

Example::

    from ampwatch.contract.batch import EVENTS, fields
    fields(EVENTS["streak_end"])  # ('iteration', 'id', 'time', 'kind', 'optimizer', 'start_iteration', 'length')
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Literal, TypedDict

__all__ = ["SignalLevel", "LossSpikeEvent", "GradNormSpikeEvent",
           "OptimizerCounters", "DeliveryCounters", "RankState", "ParamCount", "ScaleCause", "PoisonReason", "Event",
           "Began", "BeganStage", "ForwardProbe", "Samples", "IterationSamples", "DeviceInfo", "samples_digest",
           "SkipEvent", "StreakEndEvent", "ScaleChangeEvent", "SchedulerAfterSkipEvent", "PoisonedStepEvent",
           "WarningEvent", "ScalerDisabledEvent", "CloseEvent", "EVENTS", "STAMPED", "OPTIMIZER_GAUGES",
           "RANK_GAUGES", "RANK_LEVELS", "OPTIMIZER_LEVELS", "fields", "required"]


class SignalLevel(TypedDict):
    """A watched signal's rolling level (the loss, a gradient norm): the mean and standard deviation of the finite
    values in its window (``thresholds.spike_window_iterations`` iterations), sent rounded to 4 significant digits
    once the window holds two values."""

    mean: float
    std: float


class _OptimizerCountersRequired(TypedDict):
    steps: int
    """``scaler.step()`` calls that updated the parameters."""
    skipped: int
    """``scaler.step()`` calls that skipped."""
    consecutive_skipped: int
    """The current skip streak (0 when the last step updated): a gauge."""
    longest_streak: int
    streaks: int
    """Skip streaks begun."""


class OptimizerCounters(_OptimizerCountersRequired, total=False):
    """``state.optimizers[name]``: one optimizer's cumulative counters and its current streak."""

    streaks_reached: dict[str, int]
    """Streaks that reached each rung of ``protocol.STREAK_LADDER`` (keys ``"1"``, ``"2"``, ...; rungs not
    reached left out)."""
    scheduler_steps_after_skip: int
    poisoned_steps: int
    """Updates with non-finite gradients or parameters."""
    grad_norm_spikes: int
    """Iterations whose gradient norm (the one the optimizer stepped with) spiked (absent: 0)."""
    grad_norm: SignalLevel
    """The gradient norm's rolling level (absent: no norm watched, or fewer than two values yet)."""
    local_grad_norm: SignalLevel
    """With ``ddp=``: the rolling level of this rank's own gradient norm before DDP's all-reduce, its infinity norm
    (the largest absolute value of this rank's own gradients of the optimizer's parameters, unscaled; with gradient
    accumulation, of every micro-batch's)."""


OPTIMIZER_GAUGES: tuple[str, ...] = ("consecutive_skipped", "longest_streak", "grad_norm", "local_grad_norm")
"""Values of :class:`OptimizerCounters` that are not cumulative counts: the collector keeps a process's own (the
rest it sums over a rank's processes, as it does the rank's counters)."""


class DeliveryCounters(TypedDict, total=False):
    """``state.delivery``: the agent's own health counters."""

    dropped_events: int
    send_failures: int
    rejected_batches: int
    agent_errors: int
    refused_spool_files: int
    """Entries of the agent's spool (``AMPWATCH_SPOOL_DIR``) it refused unread when it started: owned by another
    user, not a regular file or folder (a link, a fifo), or a file others may write; none is ever sent."""


class _RankStateRequired(TypedDict):
    iteration: int
    loss_scale: float | None
    """Any value the scaler holds (NaN and infinities as the strings "NaN", "Infinity"); null when disabled."""
    backoffs: int
    growths: int
    optimizers: dict[str, OptimizerCounters]


class RankState(_RankStateRequired, total=False):
    """``state``: the rank's cumulative counters and gauges."""

    manual_sets: int
    loss_spikes: int
    """Iterations whose loss spiked (absent: 0)."""
    loss: SignalLevel
    """The loss's rolling level (absent: no loss seen, or fewer than two values yet)."""
    origin_iterations: int
    """Skipped (without a scaler: poisoned) iterations whose inf/NaN started in this rank's own gradients (absent:
    ``ddp=`` not watched)."""
    delivery: DeliveryCounters


RANK_GAUGES: tuple[str, ...] = ("iteration", "loss_scale", "loss")

RANK_LEVELS: tuple[str, ...] = ("loss",)
"""The :class:`SignalLevel` fields of :class:`RankState`; an agent sends its levels in one batch every
``protocol.LEVEL_HEARTBEATS`` heartbeats, and a collector keeps a process's last ones in between."""
OPTIMIZER_LEVELS: tuple[str, ...] = ("grad_norm", "local_grad_norm")
"""The :class:`SignalLevel` fields of :class:`OptimizerCounters`, sent as :data:`RANK_LEVELS` are."""
"""Values of :class:`RankState` that are not cumulative counts (``optimizers`` and ``delivery`` hold counters)."""


class _ParamCountRequired(TypedDict):
    name: str


class ParamCount(_ParamCountRequired, total=False):
    """One parameter a skip or poisoned step names, with its counts of non-finite elements (absent: 0)."""

    inf: int
    nan: int


ScaleCause = Literal["backoff", "growth", "manual", "restored"]
"""Why the scale changed: by ``update()``'s backoff_factor or growth_factor, ``update(new_scale=...)``, or
outside ``update()`` (``load_state_dict()`` on resume, a new scaler bound with ``watch.rebind()``)."""


BeganStage = Literal["forward", "backward"]
"""Where a skipped or poisoned iteration's inf/NaN began: ``backward``, the loss was finite and a gradient went
non-finite; ``forward``, the loss itself was not finite."""

ForwardProbe = Literal["armed", "found", "unavailable"]
"""The forward probes of a ``forward`` start: ``armed``, put on now, to name the module at the next occurrence
(this event names none); ``found``, they named the module at this occurrence; ``unavailable``, this model
cannot take them (no model given, a compiled one): no module will be named."""


class Began(TypedDict, total=False):
    """``began`` of a skip or poisoned step: where this rank's inf/NaN began (docs/agent.md#where-it-began)."""

    loss_finite: bool | None
    """Whether every loss the iteration passed through ``scaler.scale()`` (or ``watch.loss()``) was finite;
    null when the agent saw no loss."""
    stage: BeganStage
    param: str
    """``backward``: the first parameter, in the order backward produced the gradients, whose gradient held
    inf/NaN on this rank."""
    module: str
    """The module's path in the model (``""`` for the model itself): ``backward``, the module that owns
    ``param``; ``forward``, the first module, in forward order, whose output held inf/NaN."""
    module_type: str
    """The class name of ``module``."""
    probe: ForwardProbe
    """``forward`` only: what the forward probes did (:data:`ForwardProbe`)."""


class Samples(TypedDict):
    """``samples`` of a skip or poisoned step: the sample ids this rank trained on in the iteration (every
    micro-batch of it), as ``watch.batch()`` or ``watch(loader=)`` recorded them."""

    ids: list[int | str]
    """The first ``protocol.MAX_SAMPLE_IDS`` ids, in the order they were trained on."""
    count: int
    """How many ids the iteration had (named or not)."""
    digest: str
    """:func:`samples_digest` of all of them: the same samples in any order give the same digest."""


class IterationSamples(TypedDict):
    """One entry of ``samples_before``: an earlier iteration's samples."""

    iteration: int
    samples: Samples


class DeviceInfo(TypedDict, total=False):
    """A batch's top-level ``device``: the accelerator this rank trains on, sent until a batch carrying it is
    accepted (with the batch's ``host`` and ``local_rank``, it names the device across runs)."""

    type: str
    """``cuda``, ``cpu``, ``xpu``, ``mps``, ...: the device type of the watched parameters."""
    index: int
    """The device index in this process (a GPU's ordinal)."""
    uuid: str
    """A GPU's UUID (``GPU-...``), where torch reads it: the same across processes, hosts and runs."""
    pci_bus_id: str
    """A GPU's PCI bus id (``0000:3b:00.0``), where torch reads it."""


def samples_digest(ids: Iterable[int | str]) -> str:
    """Return the digest of a set of sample ids: 16 hex digits, the same for the same ids in any order.

    >>> samples_digest([3, "a", 1]) == samples_digest(["a", 1, 3])
    True
    >>> samples_digest([1]) == samples_digest(["1"])  # an int and a string are different ids
    False
    """
    digest = hashlib.blake2b(digest_size=8)
    for encoded in sorted(json.dumps(i) for i in ids):
        digest.update(encoded.encode())
        digest.update(b"\n")
    return digest.hexdigest()


class _EventRequired(TypedDict):
    iteration: int


class _Event(_EventRequired, total=False):
    id: int
    time: float


STAMPED: tuple[str, ...] = ("id", "time")
"""Fields every event has that the agent's event buffer sets as it queues the event (the collector requires
them; the code that records an event leaves them out)."""


class _SkipRequired(_Event):
    kind: Literal["skip"]
    optimizer: str
    streak: int


class SkipEvent(_SkipRequired, total=False):
    params: list[ParamCount]
    params_total: int | None
    inspected: bool
    origin: bool | None
    """With ``ddp=``: whether this rank's own gradients held inf/NaN before the all-reduce."""
    origin_buckets: list[int]
    origin_params: list[str]
    origin_params_total: int | None
    began: Began
    """Where this rank's inf/NaN began in the skipped iteration."""
    samples: Samples
    """The sample ids this rank trained on in the iteration (with ``watch.batch()`` or ``watch(loader=)``)."""
    samples_before: list[IterationSamples]
    """The first skip of a streak: the samples of up to ``protocol.MAX_SAMPLES_BEFORE`` iterations before it."""
    calibration: bool
    """True when the skip is the scaler settling, not evidence of a fault: no step of this optimizer has gone
    through since the watch began (a fresh scale finding its level), or the skip is the first after a growth
    (the grown scale tried and backed off)."""


class StreakEndEvent(_Event):
    kind: Literal["streak_end"]
    optimizer: str
    start_iteration: int
    length: int


class _ScaleChangeRequired(_Event):
    kind: Literal["scale_change"]
    cause: ScaleCause
    before: float | None
    after: float | None


class ScaleChangeEvent(_ScaleChangeRequired, total=False):
    count: int
    """Backoffs in consecutive iterations the event stands for (absent: 1)."""


class SchedulerAfterSkipEvent(_Event):
    kind: Literal["scheduler_after_skip"]
    optimizer: str
    scheduler: str


PoisonReason = Literal["nonfinite_grad", "nonfinite_param"]
"""What made a step poisoned: its gradients, or the weights it left, held inf/NaN."""


class _PoisonedStepRequired(_Event):
    kind: Literal["poisoned_step"]
    optimizer: str
    reason: PoisonReason


class PoisonedStepEvent(_PoisonedStepRequired, total=False):
    params: list[ParamCount]
    params_total: int | None
    streak: int
    """Without a scaler: the step's position in the optimizer's run of consecutive poisoned steps."""
    exact: bool
    """Without a scaler (absent: true): false when ``inf``/``nan`` are 1 or 0, whether a gradient held any, not
    counts (the check was read on a GPU after the gradients moved on)."""
    origin: bool | None
    """Without a scaler, with ``ddp=``: whether this rank's own gradients held inf/NaN before the all-reduce."""
    origin_params: list[str]
    origin_params_total: int | None
    began: Began
    samples: Samples
    samples_before: list[IterationSamples]


class _SpikeRequired(_Event):
    value: float
    """The iteration's value (non-finite as the strings "NaN", "Infinity", as a loss scale)."""
    mean: float | None
    """The window's mean before this value (null: the window held no finite value yet)."""
    std: float | None
    z: float | None
    """``(value - mean) / std``: how many deviations above the window's mean; null for a non-finite value."""
    streak: int
    """Its position in the signal's run of spikes in consecutive iterations (1 = first); such a run is sent at its
    1st, 2nd, 4th, 8th, ... spike, the counters count every one."""


class _LossSpikeRequired(_SpikeRequired):
    kind: Literal["loss_spike"]


class LossSpikeEvent(_LossSpikeRequired, total=False):
    """``loss_spike``: the iteration's loss (the sum of the losses passed through ``scaler.scale()`` or
    ``watch.loss()`` in it) was non-finite, or at least ``spike_sigma`` deviations above its window's mean."""

    samples: Samples


class _GradNormSpikeRequired(_SpikeRequired):
    kind: Literal["grad_norm_spike"]
    optimizer: str


class GradNormSpikeEvent(_GradNormSpikeRequired, total=False):
    """``grad_norm_spike``: an optimizer's gradient norm spiked: the norm it stepped with (``local`` false), or, with
    ``ddp=``, this rank's own before DDP's all-reduce (``local`` true: what the collector compares across ranks for
    a ``gradient_outlier``)."""

    local: bool
    """True: this rank's own gradients before DDP's all-reduce (absent: false)."""
    samples: Samples


class _WarningRequired(_Event):
    kind: Literal["warning"]
    code: str
    message: str


class WarningEvent(_WarningRequired, total=False):
    optimizer: str


class ScalerDisabledEvent(_Event):
    kind: Literal["scaler_disabled"]


class CloseEvent(_Event):
    kind: Literal["close"]


EVENTS: Mapping[str, type] = {
    "skip": SkipEvent, "streak_end": StreakEndEvent, "scale_change": ScaleChangeEvent,
    "scheduler_after_skip": SchedulerAfterSkipEvent, "poisoned_step": PoisonedStepEvent, "warning": WarningEvent,
    "scaler_disabled": ScalerDisabledEvent, "close": CloseEvent, "loss_spike": LossSpikeEvent,
    "grad_norm_spike": GradNormSpikeEvent,
}
"""Each event kind an agent sends, and what its events hold."""

Event = (SkipEvent | StreakEndEvent | ScaleChangeEvent | SchedulerAfterSkipEvent | PoisonedStepEvent | WarningEvent
         | ScalerDisabledEvent | CloseEvent | LossSpikeEvent | GradNormSpikeEvent)
"""Any event an agent sends."""


def fields(part: type) -> tuple[str, ...]:
    """Return every field ``part`` (one of this module's TypedDicts) declares, in order."""
    return tuple(part.__annotations__)


def required(part: type) -> frozenset[str]:
    """Return the fields of ``part`` an agent must set (a collector also requires an event's :data:`STAMPED`)."""
    return frozenset(part.__required_keys__)  # type: ignore[attr-defined]
