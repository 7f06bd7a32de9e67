"""With ``watch(ddp=model)``: this rank's own gradient norm per optimizer, before DDP's all-reduce, and its spikes.

The norm is the infinity norm: the largest absolute value of this rank's own gradients of the optimizer's
parameters (with accumulation, of every micro-batch's gradient), max(|min|, |max|) of the extremes the per-parameter
hook of :class:`~._origin.LocalGradients` already writes (``torch.aminmax``, to find the rank that started a skip).
So it costs no kernel per gradient: at the iteration's end (where the notes end: ``scaler.update()``, or without a
scaler the first step after a backward) :class:`LocalNorms` takes, on the device, the largest absolute extreme of
each optimizer's columns (an ``abs`` and an ``amax`` per optimizer, device and dtype; NaN stays NaN, inf inf), divides
it by the loss scale the gradients were scaled by, and judges the result with the spike rule
(:class:`~._spikes.SpikeSeries`). What it is for loses nothing by it: a faulty device's corruption, or one rank's
bad batch, raises max |g| at least as far against its usual level as it raises the L2 norm (values pushed up
reach the largest one first), and the collector compares each rank only with the others' levels of the same norm.
Read without a sync: on the CPU at once; on a device copied to pinned memory and read once the copy landed (an
iteration later).

| the iteration, for one optimizer | its local norm |
|---|---|
| none of its parameters took a gradient | no value (the rule's row 1) |
| the scaler skipped its step (its norm is of gradients that were never applied) | no value |
| on a device, the loss scale read changed before its norm was read | no value (the divisor is not known) |
| else | judged: a spike is a ``grad_norm_spike`` event with ``local: true`` (below) |

A spike is sent at its streak's rungs (1, 2, 4, 8, ... in consecutive iterations), with the iteration's samples:
an isolated spike, the transient outlier the collector looks for, is always the first of its streak, so it is
always sent; a lasting one folds as skips do.

The level goes in ``state`` as ``optimizers[name].local_grad_norm``; local spikes are not counted in
``grad_norm_spikes`` (that counts the norm the optimizer stepped with): the collector compares them across ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ampwatch.contract.batch import GradNormSpikeEvent
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS

from . import _device
from ._origin import LocalGradients
from ._spikes import SpikeSeries

__all__ = ["LocalNorms", "NormSet", "largest_magnitudes", "norm_set"]

_MAX_PENDING = 64  # device reads in flight before the oldest is waited for (only if the device lags far behind)
_ALL = torch.empty(0, dtype=torch.long)  # a set that holds every column of a group


@dataclasses.dataclass(slots=True)
class NormSet:
    """Some watched parameters (an optimizer's): their columns in each group of :class:`~._origin.LocalGradients`
    (None: none of that group, :data:`_ALL`: all of it), and their slots."""

    columns: list[torch.Tensor | None]
    slots: list[int]
    slot_set: frozenset[int] = frozenset()
    whole: bool = False
    """It holds every watched parameter."""


def norm_set(local: LocalGradients, params: Iterable[torch.Tensor]) -> NormSet:
    """Return the parameters of ``local`` among ``params`` (an optimizer's, for its norm)."""
    wanted = {id(p) for p in params}
    columns: list[torch.Tensor | None] = []
    slots: list[int] = []
    for group in local._groups:
        picked = [c for c, slot in enumerate(group.slots) if id(local.parameters[slot]) in wanted]
        slots += [group.slots[c] for c in picked]
        columns.append(None if not picked else _ALL if len(picked) == len(group.slots) else
                       torch.tensor(picked, dtype=torch.long, device=group.extremes.device))
    return NormSet(columns, slots, frozenset(slots), len(slots) == len(local.parameters))


def largest_magnitudes(local: LocalGradients, sets: list[NormSet]) -> list[torch.Tensor | None]:
    """Return, per set, the largest absolute value of its gradients ``local`` noted in this iteration (every
    backward's), as a 0-d tensor on a device of its parameters (no sync; NaN if one held a NaN, else inf if one
    held an inf); None when none of them was noted.

    Rows not written in this iteration are zeroed first (:meth:`~._origin.LocalGradients.forget_unwritten`, which
    the origin's flags read after this would do anyway: a zero is finite, and no larger than any magnitude). An
    ``abs`` and an ``amax`` per group and set (two kernels in all for one optimizer of one device and dtype), no
    Python per parameter unless some parameter wrote fewer rows than the others.
    """
    local.forget_unwritten()
    counts, groups, extras = local._counts, local._groups, local._extras
    maxima: list[torch.Tensor | None] = []
    for chosen in sets:
        if not (any(counts) if chosen.whole else any(counts[s] for s in chosen.slots)):
            maxima.append(None)
            continue
        parts = []
        for group, picked in zip(groups, chosen.columns, strict=True):
            if picked is not None:
                some = group.extremes if picked is _ALL else group.extremes.index_select(1, picked)
                parts.append(some.abs().amax())  # amax propagates NaN
        if extras:
            parts += [pair.abs().amax() for slot, pair in extras if slot in chosen.slot_set]
        device = parts[0].device
        maxima.append(parts[0] if len(parts) == 1 else
                      torch.stack([p.to(device=device, dtype=torch.float64) for p in parts]).amax())
    return maxima


class LocalNorms:
    """The local gradient norm of each watched optimizer of ``recorder`` (a :class:`~._recorder.Recorder`)."""

    def __init__(self, local: LocalGradients, recorder: Any, *,
                 window: int = DEFAULT_THRESHOLDS.spike_window_iterations,
                 sigma: float = DEFAULT_THRESHOLDS.spike_sigma) -> None:
        # Weakly: the model's hooks hold the notes, which hold this; the watch must not live as long as the model.
        self.local, self._recorder = local, weakref.ref(recorder)
        self.records = list(recorder.records)
        self._sets = [norm_set(local, (p for g in r.optimizer.param_groups for p in g["params"]))
                      for r in self.records]
        self.series = [SpikeSeries(window, sigma) for _ in self.records]
        # (the read, its iteration, which optimizers it holds a value of, the loss scale then)
        self._pending: collections.deque[tuple[_device.PendingRead, int, list[bool], float | None]] = \
            collections.deque()

    def end_iteration(self, iteration: int) -> None:
        """Take ``iteration``'s norms (its notes are still in place); judge them now on CPU, later on a device."""
        recorder = self._recorder()
        if recorder is None:
            return
        unscaled = recorder.unscaled is not None
        scale = 1.0 if unscaled else recorder.scale.value
        maxima: list[Any] = []  # per optimizer: None (no value), a float (read), or a tensor on a device
        later = False
        for largest, record in zip(largest_magnitudes(self.local, self._sets), self.records, strict=True):
            if largest is None or not (unscaled or record.stepped_this_iteration or record.pending):
                maxima.append(None)  # no gradient, or a step the scaler skipped (a pending one may have gone)
            elif largest.device.type == "cpu":
                maxima.append(_device.host_scalar(largest))  # no sync exists on the CPU
            else:
                maxima.append(largest)
                later = True
        if not later:
            self._judge(recorder, iteration, maxima, scale, current=True)
        else:
            taken = [t for t in maxima if t is not None]
            device = taken[0].device
            read = _device.read_later(torch.stack([t.to(device=device, dtype=torch.float64) for t in taken]))
            self._pending.append((read, iteration, [t is not None for t in maxima], scale))
        if self._pending:
            self._resolve(recorder, wait=len(self._pending) > _MAX_PENDING)

    def close(self) -> None:
        """Judge what is still on its way (may sync once on a device)."""
        recorder = self._recorder()
        while self._pending and recorder is not None:
            self._resolve(recorder, wait=True)

    def levels(self, optimizers: dict[str, Any]) -> None:
        """Put each optimizer's level in its ``state`` counters (``local_grad_norm``), once it has one."""
        for record, series in zip(self.records, self.series, strict=True):
            level = series.level()
            if level is not None and record.name in optimizers:
                optimizers[record.name]["local_grad_norm"] = level

    def _resolve(self, recorder: Any, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][0].done()):
            read, iteration, went, scale = self._pending.popleft()
            values = iter(read.wait())
            now = recorder.scale.value if recorder.unscaled is None else 1.0
            known = now == scale  # a changed scale read: which one scaled these gradients is not known for sure
            maxima = [next(values) if w else None for w in went]
            self._judge(recorder, iteration, maxima if known else [None] * len(went), scale, current=False)
            wait = False

    def _judge(self, recorder: Any, iteration: int, maxima: list[Any], scale: float | None, current: bool) -> None:
        for record, series, largest in zip(self.records, self.series, maxima, strict=True):
            value = largest / scale if largest is not None and scale else None  # NaN stays NaN, inf inf
            spike = series.observe(value)
            if spike is None or not spike.rung:
                continue
            event: GradNormSpikeEvent = {"kind": "grad_norm_spike", "iteration": iteration, "optimizer": record.name,
                                         "local": True, **spike.fields()}  # type: ignore[typeddict-item]
            samples = recorder.samples
            if samples is not None:
                samples.describe(event, iteration, current=current, first=False)
            recorder.events.append(event)
