"""Which rank's local gradients were non-finite before DDP's all-reduce: a wrapping DDP communication hook.

DDP averages every rank's gradients, so one rank's inf or NaN reaches every rank and every rank skips.
:class:`OriginHook` wraps the all-reduce (DDP's default, or the user's own hook): before a bucket is
reduced it writes, on the device and without a sync, the bucket's local minimum and maximum (one
``torch.aminmax`` pass over the bucket) into storage kept for that bucket. They are turned into flags and
read only on an iteration where some optimizer skipped (:meth:`OriginFlags.report`), with the same read as
the fused ``found_inf``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from . import _device
from ._params import MAX_NAMED_PARAMS, ParameterNames

__all__ = ["OriginFlags", "OriginHook", "OriginReport", "attach_origin_hook"]

_KEPT_ITERATIONS = 64  # iterations whose flags are kept while a deferred (fused, on-device) outcome is pending


@dataclasses.dataclass(slots=True)
class OriginReport:
    """Whether this rank's own gradients held inf/NaN before the all-reduce of one iteration."""

    origin: bool
    buckets: list[int]
    """Indices of the DDP buckets that held inf/NaN locally, at most 16 (empty when not an origin)."""
    params: list[str]
    """Names of the parameters of those buckets, at most :data:`MAX_NAMED_PARAMS`."""
    params_total: int
    """How many parameters those buckets hold (named or not)."""


class _Notes:
    """One iteration's notes, by bucket index: the bucket's extremes and the bucket itself.

    ``extremes[i]`` is a 2-element tensor on bucket ``i``'s device, in its dtype, written in place
    (``outs[i]`` are its two 0-d views, ``aminmax``'s ``out=``); ``buckets[i]`` is the GradBucket noted
    for it this iteration, None when not noted (asked for its parameters only on a skip). The storage is
    made on a bucket's first note and reused by every later iteration that gets this object.
    """

    __slots__ = ("buckets", "extremes", "outs")

    def __init__(self) -> None:
        self.buckets: list[Any] = []
        self.extremes: list[torch.Tensor | None] = []
        self.outs: list[tuple[torch.Tensor, ...]] = []  # () until placed: aminmax(out=()) raises, never writes

    def noted(self) -> list[int]:
        """Return the indices of the buckets noted since the last :meth:`clear`."""
        return [index for index, bucket in enumerate(self.buckets) if bucket is not None]

    def clear(self) -> None:
        """Forget which buckets were noted (and let go of them); keep the storage."""
        buckets = self.buckets
        for index in range(len(buckets)):
            buckets[index] = None

    def place(self, index: int, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make (or remake, for a new dtype or device) bucket ``index``'s storage; return its ``out=`` pair."""
        grow = index + 1 - len(self.buckets)
        if grow > 0:
            self.buckets += [None] * grow
            self.extremes += [None] * grow
            self.outs += [()] * grow
        extremes = torch.empty(2, dtype=buffer.dtype, device=buffer.device)
        self.extremes[index], self.outs[index] = extremes, (extremes[0], extremes[1])
        return self.outs[index]


class OriginFlags:
    """Each bucket's local extremes, written by the comm hook during backward, until the iteration ends.

    The hook writes (from the autograd thread) into the current iteration's :class:`_Notes`; the training
    thread reads them at a skip and, at ``update()``, reuses them for the next iteration, or, while a
    deferred outcome may still claim them, keeps them for the last few iterations and takes spare ones.
    After the first iterations nothing is allocated per bucket or per iteration.
    """

    def __init__(self, names: ParameterNames) -> None:
        self.names = names
        self.notes: _Notes | None = _Notes()
        """The current iteration's notes; None once closed (the hook then only passes through)."""
        self._kept: dict[int, _Notes] = {}
        self._spare: list[_Notes] = []
        self._reports: dict[int, OriginReport] = {}

    @property
    def enabled(self) -> bool:
        """Whether the hook still notes buckets (False after :meth:`close`)."""
        return self.notes is not None

    def note(self, bucket: Any) -> None:
        """Write one bucket's local extremes into its storage: one ``aminmax`` kernel, no sync, no allocation.

        Called by the hook for every bucket of every synchronising backward. Its Python cost is two
        calls on the GradBucket (``index()``, ``buffer()``), the kernel launch and a list store.
        """
        notes = self.notes
        if notes is None:
            return
        try:
            index = bucket.index()
            torch.aminmax(bucket.buffer(), out=notes.outs[index])
            notes.buckets[index] = bucket
        except (IndexError, TypeError, RuntimeError):  # a first note, or a bucket the fast path cannot take
            self._note_first(notes, bucket)

    def _note_first(self, notes: _Notes, bucket: Any) -> None:
        # The slow path: storage for a bucket index not seen by these notes (or whose dtype or device
        # changed when DDP rebuilt its buckets), a buffer in the autograd graph (backward(create_graph=True))
        # or one aminmax cannot reduce (empty, complex: not noted, so never named an origin).
        buffer = bucket.buffer()
        if not buffer.numel() or not buffer.is_floating_point():
            return
        if buffer.requires_grad:
            buffer = buffer.detach()
        index = bucket.index()
        outs = notes.outs[index] if index < len(notes.outs) else ()
        if not outs or outs[0].dtype != buffer.dtype or outs[0].device != buffer.device:
            outs = notes.place(index, buffer)
        torch.aminmax(buffer, out=outs)
        notes.buckets[index] = bucket

    def end_iteration(self, iteration: int, keep: bool) -> None:
        """Drop the notes of ``iteration`` (``keep``: hold them while its outcome is still on the device)."""
        notes = self.notes
        if notes is None:
            return
        if not keep:
            notes.clear()
            if self._kept or self._reports:
                self._release(list(self._kept))
                self._reports.clear()
            return
        if any(bucket is not None for bucket in notes.buckets):
            self._kept[iteration] = notes
            self._release(list(self._kept)[:-_KEPT_ITERATIONS])
            self.notes = self._spare.pop() if self._spare else _Notes()
        while len(self._reports) > _KEPT_ITERATIONS:
            del self._reports[next(iter(self._reports))]

    def _release(self, iterations: list[int]) -> None:
        for iteration in iterations:
            notes = self._kept.pop(iteration)
            notes.clear()
            self._spare.append(notes)

    def close(self) -> None:
        """Stop noting and let go of every tensor (the hook stays on the model, passing through)."""
        self.notes = None
        self._kept, self._spare, self._reports = {}, [], {}

    def report(self, iteration: int, current: bool) -> tuple[OriginReport | None, bool]:
        """Return ``(report, new)`` for ``iteration``: None when no bucket was noted for it.

        ``new`` is True the first time an iteration is reported. Cost: one ``isfinite`` per noted bucket
        and one device-to-host copy of one flag per bucket (a sync on a GPU, only on a skipped iteration).
        """
        known = self._reports.get(iteration)
        if known is not None:
            return known, False
        notes = self.notes if current else self._kept.get(iteration)
        noted = notes.noted() if notes is not None else []
        if not noted:
            return None, False
        with torch.no_grad():  # buckets may differ in dtype: one flag each, then one read
            flags = torch.stack([torch.isfinite(notes.extremes[i]).all().logical_not() for i in noted])
        bad = [notes.buckets[i] for i, flag in zip(noted, _device.read_later(flags).wait()) if flag]
        params = [p for bucket in bad for p in bucket.parameters()]
        report = OriginReport(origin=bool(bad), buckets=sorted(bucket.index() for bucket in bad)[:MAX_NAMED_PARAMS],
                              params=[self._name(p, k) for k, p in enumerate(params[:MAX_NAMED_PARAMS])],
                              params_total=len(params))
        self._reports[iteration] = report
        return report, True

    def _name(self, param: torch.Tensor, position: int) -> str:
        known = self.names.known(param)
        return known if known is not None else f"bucket parameter {position} {list(param.shape)}"


class OriginHook:
    """The comm hook DDP calls per bucket: note the bucket's extremes, then run the wrapped hook unchanged.

    Pickles (with the DDP model) as the wrapped hook, so nothing of the agent travels in a copy. DDP
    cannot unregister a hook: after ``close()`` this one only passes through.
    """

    def __init__(self, flags: OriginFlags, hook: Callable[..., Any], errors: Any) -> None:
        self.flags, self.hook, self.errors = flags, hook, errors
        self.note = flags.note  # bound once: one attribute lookup per bucket instead of two
        self.__name__ = self.__qualname__ = f"ampwatch_origin({getattr(hook, '__qualname__', 'hook')})"

    def __call__(self, state, bucket):  # unannotated: DDP checks the annotations of a hook it is given
        try:
            self.note(bucket)
        except Exception as error:  # noqa: BLE001 - the all-reduce must run whatever happens here
            self.errors.report("DDP comm hook", error)
        return self.hook(state, bucket)

    def __reduce__(self) -> tuple:
        return (_same, (self.hook,))


def _same(value: Any) -> Any:
    return value


def attach_origin_hook(model: Any, flags: OriginFlags, errors: Any, hook: Callable[..., Any] | None,
                       state: Any) -> None:
    """Register an :class:`OriginHook` on the DDP ``model``, wrapping ``hook`` (default: DDP's all-reduce).

    Raises TypeError or ValueError, registering nothing, when ``model`` is not a DistributedDataParallel
    or already has a communication hook (DDP allows one per model and cannot remove it).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"ddp must be the torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(model).__name__}")
    if hooks := _device.ddp_comm_hooks(model):
        existing = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks)
        raise ValueError(f"this DistributedDataParallel model already has a communication hook ({existing}); "
                         "DDP takes one hook per model and cannot remove it. Do not register it yourself: "
                         "pass it to ampwatch instead, watch(..., ddp=model, comm_hook=hook, comm_state=state), "
                         "and ampwatch wraps it (it still runs, unchanged).")
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        hook, state = allreduce_hook, model.process_group
    elif not callable(hook):
        raise TypeError(f"comm_hook must be a DDP communication hook (a callable), got {type(hook).__name__}")
    try:
        model.register_comm_hook(state, OriginHook(flags, hook, errors))
    except RuntimeError as error:
        raise ValueError(f"DDP refused ampwatch's communication hook ({error}); a model takes one hook, "
                         "registered before training: pass yours as watch(..., comm_hook=hook, "
                         "comm_state=state) instead of registering it") from None
