"""Which rank's own gradients held inf/NaN before DDP reduced them: observed, never re-implemented.

DDP averages every rank's gradients, so one rank's inf or NaN reaches every rank and every rank skips.
:class:`LocalGradients` puts one tensor hook on each parameter that DDP does not ignore (one frozen at
``watch()``: at the first forward after it is unfrozen, :func:`observe_ddp`). Autograd calls it with the
gradient this backward computed for that parameter on this rank, as the hooks registered on the parameter
before it leave it (those registered after it are not seen: docs/agent.md), before that gradient is
accumulated into ``.grad`` and before DDP's reducer (a hook that runs after the accumulation) takes it into
a bucket. The hook returns nothing, so the gradient goes on unchanged, to whatever reduces it: DDP's
built-in C++ reduction with its own divisor (``join()``, bucket views, static graphs, unused parameters), a
communication hook the job registered itself, or ``torch.compile``'s reducers. ampwatch registers no
communication hook and changes nothing of the reduction; its hooks come off at :meth:`LocalGradients.close`.

The hook writes one ``torch.aminmax`` of the gradient into two numbers kept for that parameter (a row per
backward of the iteration, so an inf in any micro-batch is kept), on the device, without a sync and, after the
first iterations, without allocating; nothing else. The extremes are read as flags only on an iteration where some
optimizer skipped, or without a scaler was poisoned (:meth:`LocalGradients.report`);
:meth:`LocalGradients.nonfinite` makes them one on-device flag for any other reader. With ``ddp=``, they also make
this rank's own gradient norm per optimizer: the largest of their absolute values, taken at the iteration's end
(``_local_norm``), with no kernel of its own per gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from . import _device
from ._params import MAX_NAMED_PARAMS

__all__ = ["LocalGradients", "OriginReport", "observe_ddp"]

_KEPT_ITERATIONS = 64  # iterations whose flags are kept while a deferred (fused, on-device) outcome is pending
_aminmax = torch.aminmax


@dataclasses.dataclass(slots=True)
class OriginReport:
    """Whether this rank's own gradients held inf/NaN before DDP reduced them, in one iteration."""

    origin: bool
    params: list[str]
    """Names of the parameters whose own gradients did, at most :data:`MAX_NAMED_PARAMS`, in model order."""
    params_total: int
    """How many parameters' own gradients did (named or not)."""
    slots: list[int] = dataclasses.field(default_factory=list)
    """All of them, as positions in :attr:`LocalGradients.parameters`, sorted."""


class _Group:
    """The notes of the parameters of one device and dtype: ``extremes[row, column]`` is a (min, max) pair.

    Row ``k`` holds the ``k``-th note of each parameter (column) in the current iteration (how many it wrote:
    :attr:`LocalGradients._counts`; the rows after those hold older notes until
    :meth:`LocalGradients.forget_unwritten` zeroes them). ``slots`` are the parameters' positions in
    :class:`LocalGradients`.
    """

    __slots__ = ("extremes", "slots")

    def __init__(self, extremes: torch.Tensor, slots: list[int]) -> None:
        self.extremes, self.slots = extremes, slots


class LocalGradients:
    """Each parameter's own gradient in this iteration, noted on the way in: did it hold inf/NaN?

    ``params`` are ``(name, parameter)`` pairs; :meth:`attach` puts the hooks on. The hooks run on the
    autograd threads, the rest on the training thread: :meth:`end_iteration` (at ``scaler.update()``; without a
    scaler, at the first optimizer step after a backward) starts the next iteration's notes (Python only), or,
    while a deferred outcome may still ask about the iteration, first keeps one flag per parameter for it.
    """

    def __init__(self, params: Iterable[tuple[str, torch.Tensor]], errors: Any) -> None:
        self.errors = errors
        self.names: list[str] = []
        self._params: list[torch.Tensor] = []
        for name, param in params:
            self.names.append(name)
            self._params.append(param)
        keys: dict[tuple, list[int]] = {}
        for slot, param in enumerate(self._params):
            keys.setdefault((param.device, _real_dtype(param)), []).append(slot)
        self._groups = [_Group(torch.zeros(1, len(slots), 2, dtype=dtype, device=device), slots)
                        for (device, dtype), slots in keys.items()]
        self._group_of = [0] * len(self._params)
        self._outs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self._params]
        for index, group in enumerate(self._groups):
            for slot in group.slots:
                self._group_of[slot] = index
            self._place(group)
        self._counts = [0] * len(self._params)  # notes of each parameter this iteration (rows written)
        self._zeros = [0] * len(self._params)
        self._extras: list[tuple[int, torch.Tensor]] = []  # notes of a gradient unlike its parameter's storage
        self._unwritten_zeroed = False  # the rows not written in this iteration were zeroed (none written since)
        self._handles: list[Any] = []
        self._hooked = [False] * len(self._params)  # a slot without a hook never writes a note
        self._frozen: list[int] = []  # slots frozen at attach(), hooked once they take a gradient
        self._forward_hook: Any = None
        self._kept: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        self._reports: dict[int, OriginReport] = {}
        self.enabled = True
        self.norms: Any = None  # a _local_norm.LocalNorms: takes each iteration's norm before its notes are cleared

    def attach(self, forward_of: torch.nn.Module | None = None) -> None:
        """Put one hook on each parameter that takes a gradient; all or none.

        A parameter frozen now (``requires_grad`` False: torch takes no hook on it) gets its hook at the
        first forward of ``forward_of`` after it was unfrozen (a forward pre-hook, there only while some
        parameter is still frozen, so a job that freezes nothing pays for none); without ``forward_of``, never.
        """
        try:
            for slot, param in enumerate(self._params):
                if param.requires_grad:
                    self._put_hook(slot)
                else:
                    self._frozen.append(slot)
            if self._frozen and forward_of is not None:
                self._forward_hook = forward_of.register_forward_pre_hook(self._hook_unfrozen)
        except BaseException:
            self.close()
            raise

    def _put_hook(self, slot: int) -> None:
        self._handles.append(self._params[slot].register_hook(self._hook(slot)))
        self._hooked[slot] = True

    def _hook_unfrozen(self, module: Any, args: Any) -> None:
        """Hook the parameters frozen at :meth:`attach` that take a gradient now (a forward pre-hook; Python,
        one ``requires_grad`` read per parameter still frozen). The last one hooked takes this pre-hook off."""
        try:
            params = self._params
            unfrozen = [slot for slot in self._frozen if params[slot].requires_grad]
            if not unfrozen:
                return
            for slot in unfrozen:
                self._put_hook(slot)
                self._frozen.remove(slot)
            if not self._frozen:
                self._forward_hook.remove()
                self._forward_hook = None
        except Exception as error:  # noqa: BLE001 - never fail the forward
            self.errors.report("DDP gradient note", error)

    def _hook(self, slot: int):
        counts, outs, slow = self._counts, self._outs[slot], self._note_slowly

        def note(grad):
            # The fast path: one aminmax into this parameter's next row. Anything else (a sparse or complex
            # gradient, one inside the autograd graph, a row not made yet) raises before counting it.
            try:
                row = counts[slot]
                _aminmax(grad, out=outs[row])
                counts[slot] = row + 1
            except Exception:  # noqa: BLE001 - the slow path says what failed; the gradient goes on
                slow(slot, grad)
        return note

    def _note_slowly(self, slot: int, grad: torch.Tensor) -> None:
        if not self.enabled:
            return
        try:
            values = grad._values() if grad.is_sparse else grad  # uncoalesced: an inf anywhere is in the sum
            values = values.detach()
            if values.is_complex():
                values = torch.view_as_real(values.resolve_conj())
            if not values.is_floating_point() or not values.numel():
                return
            row = self._counts[slot]
            group = self._groups[self._group_of[slot]]
            extremes = group.extremes
            if values.dtype == extremes.dtype and values.device == extremes.device:
                if row >= extremes.shape[0]:  # one more backward in this iteration than any before
                    self._grow(group)
                _aminmax(values, out=self._outs[slot][row])
            else:  # e.g. a float8 gradient (no aminmax kernel): widened, noted apart
                if values.element_size() == 1:
                    values = values.float()
                pair = torch.empty(2, dtype=values.dtype, device=values.device)
                _aminmax(values, out=(pair[0], pair[1]))
                self._extras.append((slot, pair))
            self._counts[slot] = row + 1
        except Exception as error:  # noqa: BLE001 - never fail the backward
            self.errors.report("DDP gradient note", error)

    def _place(self, group: _Group) -> None:
        extremes = group.extremes
        for column, slot in enumerate(group.slots):
            self._outs[slot][:] = [(extremes[row, column, 0], extremes[row, column, 1])
                                   for row in range(extremes.shape[0])]

    def _grow(self, group: _Group) -> None:
        old = group.extremes
        grown = torch.zeros(old.shape[0] * 2, *old.shape[1:], dtype=old.dtype, device=old.device)
        grown[:old.shape[0]] = old
        group.extremes = grown
        self._place(group)

    def forget_unwritten(self) -> None:
        """Zero the rows a parameter did not write in this iteration: they still hold an earlier one's notes.

        Done by the readers of the current iteration's extremes (the local norm at each iteration's end, the
        flags), once per iteration (a row zeroed stays zero until it is written): one small kernel per such
        parameter, none when every parameter wrote every row (checked without a loop where there is one device
        and dtype).
        """
        counts, hooked, groups = self._counts, self._hooked, self._groups
        if self._unwritten_zeroed or (len(groups) == 1 and counts.count(groups[0].extremes.shape[0]) == len(counts)):
            return
        for group in groups:
            extremes = group.extremes
            rows = extremes.shape[0]
            for column, slot in enumerate(group.slots):
                if counts[slot] < rows and hooked[slot]:  # one never hooked holds zeros
                    extremes[counts[slot]:, column].zero_()
        self._unwritten_zeroed = True

    def _flags(self) -> tuple[list[int], list[torch.Tensor]]:
        """The current iteration's flags, on the device: slots, and per group one bool per parameter
        (one per extra note last), True where its own gradient held inf/NaN."""
        slots: list[int] = []
        flags: list[torch.Tensor] = []
        self.forget_unwritten()
        for group in self._groups:
            slots += group.slots
            flags.append(torch.isfinite(group.extremes).all(dim=2).all(dim=0).logical_not_())
        for slot, pair in self._extras:
            slots.append(slot)
            flags.append(torch.isfinite(pair).all().logical_not_().reshape(1))
        return slots, flags

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The parameters watched, in their slots' order."""
        return self._params

    def noted(self) -> bool:
        """Tell whether some gradient was noted since the last :meth:`end_iteration` (Python only)."""
        return any(self._counts)

    def nonfinite(self) -> torch.Tensor | None:
        """Whether this rank's own gradients held inf/NaN in this iteration so far, as a 0-d bool tensor on the
        gradients' device (no sync; read it with ``_device.read_later``); None when none was noted yet.

        Valid until :meth:`end_iteration`. A few small kernels per device and dtype.
        """
        if not any(self._counts):
            return None
        _, flags = self._flags()
        first = flags[0].device
        return torch.cat([f if f.device == first else f.to(first) for f in flags]).any()

    def end_iteration(self, iteration: int, keep: bool) -> None:
        """Start the next iteration's notes (``keep``: first keep the flags of ``iteration`` while its outcome is
        still on the device), after :attr:`norms` took the iteration's gradient norms. Python only, unless
        ``keep``, but for the norms' few kernels per optimizer."""
        if not self.enabled:
            return
        if any(self._counts):
            if self.norms is not None:
                try:
                    self.norms.end_iteration(iteration)
                except Exception as error:  # noqa: BLE001 - never fail the training step
                    self.errors.report("the local gradient norm", error)
            if keep:
                self._kept[iteration] = self._flags()
                while len(self._kept) > _KEPT_ITERATIONS:
                    del self._kept[next(iter(self._kept))]
            self._counts[:] = self._zeros
            self._unwritten_zeroed = False
            self._extras.clear()
        if not keep:
            self._kept.clear()
            self._reports.clear()
        while len(self._reports) > _KEPT_ITERATIONS:
            del self._reports[next(iter(self._reports))]

    def close(self) -> None:
        """Take the hooks off and let go of every tensor: the model is as it was before :meth:`attach`."""
        if self.enabled and self.norms is not None:
            try:
                self.norms.close()
            except Exception as error:  # noqa: BLE001 - closing must never fail
                self.errors.report("the local gradient norm", error)
        self.enabled = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._kept, self._reports, self._extras = {}, {}, []

    def report(self, iteration: int, current: bool) -> tuple[OriginReport | None, bool]:
        """Return ``(report, new)`` for ``iteration``: None when nothing was noted in it.

        ``new`` is True the first time an iteration is reported. Cost: a few small ops per device and dtype
        and one device-to-host copy of one bool per parameter (a sync on a GPU, only on a skipped iteration).
        """
        known = self._reports.get(iteration)
        if known is not None:
            return known, False
        if current and any(self._counts):
            flagged: tuple[list[int], list[torch.Tensor]] | None = self._flags()
        else:  # an ended iteration's, kept (or none)
            flagged = self._kept.get(iteration)
        if flagged is None:
            return None, False
        slots, flags = flagged
        values: list[float] = []
        devices = {f.device for f in flags}
        if len(devices) == 1:
            values = _device.read_later(torch.cat(flags)).wait()
        else:
            for f in flags:
                values += _device.read_later(f).wait()
        bad = sorted({slot for slot, flag in zip(slots, values, strict=True) if flag})
        report = OriginReport(origin=bool(bad), params=[self.names[s] for s in bad[:MAX_NAMED_PARAMS]],
                              params_total=len(bad), slots=bad)
        self._reports[iteration] = report
        return report, True


def _real_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype a parameter's gradient is noted in: its own; a complex one's real part's; float32 for float8."""
    dtype = param.real.dtype if param.is_complex() else param.dtype
    return torch.float32 if torch.empty(0, dtype=dtype).element_size() == 1 else dtype


def observe_ddp(model: Any, names: Any, errors: Any) -> LocalGradients:
    """Watch the own gradients of every parameter the DistributedDataParallel ``model`` does not ignore.

    Whatever ``requires_grad`` says now: DDP reduces the parameters that took gradients when it was built, so
    one frozen since and unfrozen later (a fine-tuning schedule) is hooked at the first forward it takes a
    gradient in (:meth:`LocalGradients.attach`). One frozen when DDP was built and unfrozen later is hooked
    too: DDP leaves it out of its reduction, so its gradient never leaves this rank, and an inf in it is this
    rank's own. Parameters are named by ``names`` (a :class:`._params.ParameterNames`) when it
    knows them, else by their name in ``model.module``. Raises TypeError, attaching nothing, when ``model`` is
    not a DDP model.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"ddp must be the torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(model).__name__}")
    ignored = _device.ddp_ignored_names(model)
    params = [(names.known(param) or name, param) for name, param in model.module.named_parameters()
              if name not in ignored]
    local = LocalGradients(params, errors)
    local.attach(forward_of=model)
    return local
