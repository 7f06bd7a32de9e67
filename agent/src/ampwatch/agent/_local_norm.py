"""With ``watch(ddp=model)``: this rank's own gradient norm per optimizer, before DDP's all-reduce, and its spikes.

The per-parameter hook of :class:`~._origin.LocalGradients` already writes each gradient's norm as it comes in;
at the iteration's end (where its notes end: ``scaler.update()``, or without a scaler the first step after a
backward) :class:`LocalNorms` sums their squares per optimizer on the device (with accumulation, every
micro-batch's: the norm is the root of the sum of their squared norms), divides by the loss scale the gradients
were scaled by, and judges the result with the spike rule (:class:`~._spikes.SpikeSeries`). Read without a sync:
on the CPU at once; on a device copied to pinned memory and read once the copy landed (an iteration later).

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
import math
from typing import Any

import torch

from ampwatch.contract.batch import GradNormSpikeEvent
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS

from . import _device
from ._origin import LocalGradients
from ._spikes import SpikeSeries

__all__ = ["LocalNorms"]

_MAX_PENDING = 64  # device reads in flight before the oldest is waited for (only if the device lags far behind)


class LocalNorms:
    """The local gradient norm of each watched optimizer of ``recorder`` (a :class:`~._recorder.Recorder`)."""

    def __init__(self, local: LocalGradients, recorder: Any, *,
                 window: int = DEFAULT_THRESHOLDS.spike_window_iterations,
                 sigma: float = DEFAULT_THRESHOLDS.spike_sigma) -> None:
        self.local, self.recorder = local, recorder
        self.records = list(recorder.records)
        self._sets = [local.norm_set(p for g in r.optimizer.param_groups for p in g["params"]) for r in self.records]
        self.series = [SpikeSeries(window, sigma) for _ in self.records]
        self._pending: collections.deque[tuple[_device.PendingRead, int, list[bool], float | None]] = \
            collections.deque()

    def end_iteration(self, iteration: int) -> None:
        """Take ``iteration``'s norms (its notes are still in place); judge them now on CPU, later on a device."""
        sums = self.local.squared_norms(self._sets)
        recorder = self.recorder
        through = [s is not None and (recorder.unscaled is not None or r.stepped_this_iteration or bool(r.pending))
                   for s, r in zip(sums, self.records, strict=True)]
        scale = recorder.scale.value if recorder.unscaled is None else 1.0
        taken = [s for s, went in zip(sums, through, strict=True) if went and s is not None]
        if not taken or taken[0].device.type == "cpu":  # read now: no sync exists on the CPU
            values = iter([_device.host_scalar(t) for t in taken])
            self._judge(iteration, [next(values) if went else None for went in through], through, scale, current=True)
        else:
            device = taken[0].device
            read = _device.read_later(torch.stack([t.to(device) for t in taken]))
            self._pending.append((read, iteration, through, scale))
        if self._pending:
            self._resolve(wait=len(self._pending) > _MAX_PENDING)

    def close(self) -> None:
        """Judge what is still on its way (may sync once on a device)."""
        while self._pending:
            self._resolve(wait=True)

    def levels(self, optimizers: dict[str, Any]) -> None:
        """Put each optimizer's level in its ``state`` counters (``local_grad_norm``), once it has one."""
        for record, series in zip(self.records, self.series, strict=True):
            level = series.level()
            if level is not None and record.name in optimizers:
                optimizers[record.name]["local_grad_norm"] = level

    def _resolve(self, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][0].done()):
            read, iteration, through, scale = self._pending.popleft()
            values = iter(read.wait())
            now = self.recorder.scale.value if self.recorder.unscaled is None else 1.0
            known = now == scale  # a changed scale read: which one scaled these gradients is not known
            self._judge(iteration, [next(values) if went else None for went in through],
                        [went and known for went in through], scale, current=False)
            wait = False

    def _judge(self, iteration: int, squares: list[float | None], through: list[bool], scale: float | None,
               current: bool) -> None:
        for record, series, square, went in zip(self.records, self.series, squares, through, strict=True):
            value = None
            if went and square is not None and scale:
                value = math.sqrt(square) / scale if square >= 0 else math.nan
            spike = series.observe(value)
            if spike is None or not spike.rung:
                continue
            event: GradNormSpikeEvent = {"kind": "grad_norm_spike", "iteration": iteration, "optimizer": record.name,
                                         "local": True, **spike.fields()}  # type: ignore[typeddict-item]
            samples = self.recorder.samples
            if samples is not None:
                samples.describe(event, iteration, current=current, first=False)
            self.recorder.events.append(event)
