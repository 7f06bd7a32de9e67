"""Watch a job without a GradScaler: every optimizer step is checked for gradients holding inf or NaN.

bf16 and float32 training never skip a step for overflow: an inf or NaN gradient goes straight into
the weights (and into Adam's moments, where it stays). ``watch(None, optimizers)`` registers the
usual step pre-hook on each optimizer; the recorder counts the step and :class:`PoisonCheck` starts
one batched check of the gradients that step is about to apply (:func:`check_nonfinite`).
A step whose gradients held inf/NaN is a poisoned step (``reason: nonfinite_grad``), counted and
named as with a scaler. Nothing is skipped and nothing in training changes: the check only reads.

On CPU the answer is there at once and the offenders are named from the very gradients the step
applied, with exact counts. On a GPU it travels to the host without a sync (pinned memory and an
event) and is read at a later step once it has landed, normally the next iteration's; the event names
the iteration of the poisoned step, and its parameters from what the check kept on the device (which
gradients held inf, which NaN: ``exact`` false), since by then the gradients are a later iteration's.
"""

from __future__ import annotations

import collections
import ctypes
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ampwatch.contract.batch import ParamCount
from ampwatch.contract.protocol import is_rung

from . import _device
from ._params import MAX_NAMED_PARAMS, NonfiniteReport, scan_optimizers
from ._shards import local

if TYPE_CHECKING:  # the recorder imports this module
    from ._inspection import SkipInspection
    from ._record import OptimizerRecord
    from ._recorder import Recorder

Origin = Callable[[dict[str, Any], int, bool], None]
"""Adds to a poisoned step's fields whether this rank's own gradients held the inf/NaN (``ddp=``)."""

__all__ = ["KernelFlag", "NonfiniteCheck", "PoisonCheck", "check_nonfinite", "gradients"]

_MAX_PENDING = 64  # checks in flight before we wait for the oldest (only if the device lags far behind)


def gradients(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Return the gradients ``optimizer`` is about to apply (a sharded one: this rank's shard), and their params.

    Each gradient is judged by its own type: under FSDP2 a parameter left out of the sharding
    (``ignored_params``, a module never passed to ``fully_shard``) keeps a plain gradient beside the
    ``DTensor`` ones, in any order.
    """
    grads, params = [], []
    plain, subclassed = torch.Tensor, False
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad  # read once: on a Parameter each read is a Python-level attribute lookup
            if grad is not None:
                grads.append(grad)
                params.append(param)
                if type(grad) is not plain:
                    subclassed = True
    if subclassed:  # only then a call per gradient: a plain one stays as it is
        with torch.no_grad():
            grads = [local(g) for g in grads]
    return grads, params


class NonfiniteCheck:
    """Whether some tensors held inf/NaN when :func:`check_nonfinite` looked: answered at once, or on the device.

    On a device, ``max_abs`` (one value per tensor: inf or NaN exactly for the tensors that held inf or
    NaN) stays there and only one bool travels to the host, through a :class:`~._device.PendingRead`.
    """

    __slots__ = ("_found", "_read", "_max_abs")

    def __init__(self, found: bool | None = None, read: _device.PendingRead | None = None,
                 max_abs: torch.Tensor | None = None) -> None:
        self._found, self._read, self._max_abs = found, read, max_abs

    def done(self) -> bool:
        """Tell, without blocking, whether :meth:`any` can be answered without a sync."""
        return self._found is not None or self._read.done()  # type: ignore[union-attr] # one or the other

    def any(self) -> bool:
        """Return whether some tensor held inf or NaN (waits for the device if the answer has not landed)."""
        if self._found is None:
            self._found = bool(self._read.wait()[0])  # type: ignore[union-attr] # one or the other
        return self._found

    def positions(self) -> list[tuple[int, str]]:
        """Return ``(position, "inf" or "nan")`` of each tensor that held inf/NaN (a NaN may hide infs).

        Reads one value per tensor from the device (one sync on a GPU): call it only when :meth:`any` is true.
        """
        values = _device.read_later(self._max_abs).wait()  # type: ignore[arg-type] # kept with a read
        return [(k, "nan" if v != v else "inf") for k, v in enumerate(values) if not math.isfinite(v)]


_SUMMED = frozenset({torch.float32, torch.bfloat16, torch.float64})
_WRITTEN_BACK = frozenset({torch.float32, torch.float64})  # the kernel stores these back unconverted
_CLEAN = NonfiniteCheck(found=False)  # the answer of every clean check on CPU: one object, never changed
_ONE = torch.ones(1)  # an inverse scale of 1: GradScaler's kernel then stores each value back as it read it


_kernel = torch._amp_foreach_non_finite_check_and_unscale_


class KernelFlag:
    """A ``found_inf`` for GradScaler's kernel (one per thread that checks), read without an operator call.

    Only a check that found inf/NaN sets it, and that check clears it again: a clean check calls the
    kernel and reads a 0 through ``cell``, nothing else.
    """

    __slots__ = ("tensor", "cell")

    def __init__(self) -> None:
        self.tensor = torch.zeros(1)
        self.cell = ctypes.c_float.from_address(self.tensor.data_ptr())  # valid while self.tensor lives


def _kernel_finds(tensors: list[torch.Tensor], flag: KernelFlag) -> bool | None:
    """Ask GradScaler's own CPU kernel, with an inverse scale of 1, whether ``tensors`` hold inf/NaN.

    ``_amp_foreach_non_finite_check_and_unscale_`` is what ``scaler.unscale_()`` runs: one operator call
    for all of them, about half the instructions of one ``sum`` per tensor. It works in place, but with an
    inverse scale of 1 it stores each float32/float64 value back exactly as it read it (no arithmetic:
    the same bits, NaN payloads and all), and it bumps no version counter and records nothing for
    autograd, so nothing the job can observe changes. Returns None, having called nothing, for a tensor it
    must not be given: another dtype (bfloat16/float16 values go through float32 and back, which may
    change a NaN's bits), a tensor subclass; and None if the kernel refused one (sparse, overlapping
    memory, an inference tensor), having stored back only what it read.
    """
    written_back, plain = _WRITTEN_BACK, torch.Tensor
    for tensor in tensors:
        if type(tensor) is not plain or tensor.dtype not in written_back:
            return None
    cell = flag.cell
    try:
        _kernel(tensors, flag.tensor, _ONE)
    except (RuntimeError, TypeError):
        cell.value = 0.0
        return None
    if not cell.value:
        return False
    cell.value = 0.0
    return True


def check_nonfinite(tensors: list[torch.Tensor], flag: KernelFlag) -> NonfiniteCheck:
    """Start checking whether any of ``tensors`` (one device) holds an inf or a NaN; no sync.

    On a GPU (any device but the CPU): one batched reduction of all of them
    (:func:`._device.max_abs`), ``isfinite().all()`` and a copy of that one bool to the host without
    blocking. On CPU, where each operator call costs more than the pass over a small tensor: float32
    and float64 gradients go to GradScaler's own kernel in one call (:func:`_kernel_finds`); others
    take one ``sum`` per tensor, whose values are added on the host (a sum is finite unless the tensor
    held inf/NaN or its finite values overflowed). Only when either says so, the exact check
    (:func:`._device.nonfinite_indices`). Tensors neither takes (several devices, sparse, complex,
    8-bit floats) take that exact check at once (one sync on a GPU).
    """
    if not tensors[0].is_cpu:
        try:
            values = _device.max_abs(tensors)  # under no_grad of its own
            if values.is_floating_point():
                return NonfiniteCheck(read=_device.read_later(~torch.isfinite(values).all()), max_abs=values)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
        return NonfiniteCheck(found=bool(_device.nonfinite_indices(tensors)))
    found = _kernel_finds(tensors, flag)
    if found is False:
        return _CLEAN
    if found is None and math.isfinite(_sum(tensors)):
        return _CLEAN
    return NonfiniteCheck(found=bool(_device.nonfinite_indices(tensors)))


def _sum(tensors: list[torch.Tensor]) -> float:
    """Return the sum of all values of ``tensors`` (inf/NaN if one held inf/NaN), or NaN if one cannot be summed."""
    # No ``no_grad`` here: entering and leaving it costs about as much as three of these sums, and a sum
    # only reads (a gradient that requires grad, after ``backward(create_graph=True)``, gets a graph
    # node that is dropped with the 0-d result at once).
    total, strided, summed, half = 0.0, torch.strided, _SUMMED, torch.float16
    for tensor in tensors:
        if tensor.layout is strided and tensor.dtype in summed:
            total += tensor.sum().tolist()  # type: ignore[operator] # a 0-d tensor: one float, read without a scalar op
        elif tensor.layout is strided and tensor.dtype is half:
            total += tensor.sum(dtype=torch.float32).tolist()  # type: ignore[operator] # float16 sums overflow past 65504
        else:
            return math.nan
    return total


class PoisonCheck:
    """Start a check of each step's gradients; count the steps whose gradients held inf/NaN, and report them.

    Once a job's weights hold NaN every later step's gradients do too: consecutive poisoned steps of an
    optimizer are a run, reported like a skip streak, by events at its 1st, 2nd, 4th, 8th, ... step
    (``streak``), each named; every one is counted in ``poisoned_steps``. Checks still on their way
    from a device are kept in step order and resolved at later steps as they land (never waiting,
    unless more than :data:`_MAX_PENDING` are in flight), and all at :meth:`close`.
    """

    def __init__(self, inspection: SkipInspection) -> None:
        self.inspection = inspection
        self._flag = KernelFlag()  # the recorder's hooks run on the thread that steps, one step at a time
        self._pending: collections.deque[tuple[OptimizerRecord, NonfiniteCheck, list, int]] = \
            collections.deque()

    def on_step(self, recorder: Recorder, record: OptimizerRecord, closure: bool) -> None:
        """Count a step of ``record``'s optimizer (its pre-hook); check its gradients now, or after the step
        when it was given a closure, which makes them inside (:meth:`after_step`)."""
        # Every step updates the parameters; an iteration ends when an optimizer that already stepped in
        # it steps again (one iteration: each optimizer's step, in whatever order).
        if record.stepped_this_iteration:
            for other in recorder.records:
                other.stepped_this_iteration = False
            recorder.iteration += 1
        if recorder.samples is not None:
            recorder.samples.assign(recorder.iteration)  # the ids recorded since the last step are this iteration's
        recorder.open_iteration = True
        if recorder.began is not None:  # the losses and probes noted since the last step are this iteration's
            recorder.began.assign(recorder.iteration)
        spikes = recorder.spikes
        if spikes is not None and spikes.compute and not closure:  # grad_norm=True: the gradients it applies
            spikes.compute_norm(record.name, recorder.iteration, record.optimizer)
        recorder.count_update(record)
        record.check_after = closure
        if not closure:
            self._check_step(recorder, record)

    def after_step(self, recorder: Recorder, record: OptimizerRecord) -> None:
        """Check the gradients a step given a closure made and applied (its post-hook)."""
        if record.check_after:
            record.check_after = False
            if recorder.began is not None:  # the closure's losses
                recorder.began.assign(recorder.iteration)
            spikes = recorder.spikes
            if spikes is not None and spikes.compute:  # the gradients the closure made and the step applied
                spikes.compute_norm(record.name, recorder.iteration, record.optimizer)
            self._check_step(recorder, record)

    def _check_step(self, recorder: Recorder, record: OptimizerRecord) -> None:
        self.check(record, recorder.iteration, recorder.poisoned_origin)
        # No update() ends an iteration: the first step after a backward ends the DDP notes of its iteration,
        # before the next backward adds to them. Its flags stay on the device while another optimizer may
        # still step in it or a check is on its way (else Python only).
        origin = recorder.origin
        if origin is not None and origin.noted():
            origin.end_iteration(recorder.iteration, keep=len(recorder.records) > 1 or bool(self._pending))

    def check(self, record: OptimizerRecord, iteration: int, origin: Origin | None = None) -> None:
        """Check the gradients ``record``'s optimizer is about to apply in ``iteration`` (its step pre-hook)."""
        pending = self._pending
        while pending and pending[0][1].done():
            self._outcome(*pending.popleft(), now=False, origin=origin)
        grads, params = gradients(record.optimizer)
        if not grads:
            return
        found = check_nonfinite(grads, self._flag)
        if found is _CLEAN and not pending:  # the common case on CPU, in the fewest calls
            record.poison_run = 0
            return
        if found.done() and not pending:  # on CPU: now, while the gradients are the very ones the step applies
            self._outcome(record, found, params, iteration, now=True, origin=origin)
            return
        pending.append((record, found, params, iteration))
        if len(pending) > _MAX_PENDING:
            self._outcome(*pending.popleft(), now=False, origin=origin)

    def close(self, origin: Origin | None = None) -> None:
        """Resolve every check still in flight (may wait for the device once)."""
        while self._pending:
            self._outcome(*self._pending.popleft(), now=False, origin=origin)

    def _outcome(self, record: OptimizerRecord, found: NonfiniteCheck, params: list, iteration: int,
                 now: bool, origin: Origin | None) -> None:
        if not found.any():
            record.poison_run = 0
            return
        record.poison_run += 1
        fields: dict[str, Any] = {}
        if origin is not None:
            origin(fields, iteration, now)
        if not is_rung(record.poison_run):
            record.poisoned += 1  # counted; the run's events go at its rungs
            return
        if now:  # the gradients the step applied: exact counts
            (report,) = scan_optimizers([(record.optimizer, "grads")], self.inspection.names)
            self.inspection.report_poisoned(record, iteration, report, "nonfinite_grad", current=True,
                                            streak=record.poison_run, **fields)
            return
        # Read late, the gradients may be a later iteration's: name from what the check kept (one read).
        positions = found.positions()
        names = self.inspection.names
        entries: list[ParamCount] = [{"name": names.name(params[k], *_group_index(record.optimizer, params[k])),
                    "inf": int(kind == "inf"), "nan": int(kind == "nan")} for k, kind in positions[:MAX_NAMED_PARAMS]]
        report = NonfiniteReport(params=entries, total=len(positions), flagged=[params[k] for k, _ in positions])
        self.inspection.report_poisoned(record, iteration, report, "nonfinite_grad", streak=record.poison_run,
                                        exact=False, **fields)


def _group_index(optimizer: torch.optim.Optimizer, param: Any) -> tuple[int, int]:
    """Return ``(group, index)`` of ``param`` in ``optimizer.param_groups`` (for a parameter the model did not name)."""
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p is param:
                return g, i
    return -1, -1
