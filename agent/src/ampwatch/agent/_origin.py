"""Which rank's local gradients were non-finite before DDP's all-reduce: a wrapping DDP communication hook.

DDP averages every rank's gradients, so one rank's inf or NaN reaches every rank and every rank skips.
:class:`OriginHook` wraps the all-reduce (DDP's default, or the user's own hook) and notes, per bucket, on
the device and without a sync, whether the bucket held inf/NaN before it was reduced, in storage kept for
that bucket. Two ways:

- **fused** (DDP's own ``allreduce_hook``: at any world size where DDP's built-in all-reduce would
  MULTIPLY each gradient by 1/world size, as with ``gradient_as_bucket_view=False``, DDP's default
  (:func:`._device.ddp_builtin_multiplies`); otherwise at a power of two, where multiplying by the
  reciprocal is exactly dividing): the hook scales the bucket itself by the float32 reciprocal in
  GradScaler's one-pass kernel, which also sets the bucket's flag (:func:`._device.scale_and_flag_nonfinite`),
  then the same all-reduce. No extra pass over the gradients; bit for bit the built-in's
  ``mul_out(bucket, grad, 1/world_size)`` (float32, bfloat16 and float16 compute it in float32) and, at a
  power of two, ``allreduce_hook``'s ``div_(world_size)`` too. A bucket the kernel does not take (in the
  autograd graph, on another device, float64 at a world size that is not a power of two) keeps one aminmax
  pass, then, at a world size that is not a power of two, ``mul_(1 / world_size)`` as the built-in does
  (at a power of two the wrapped hook divides).
- **aminmax** (every other case: a user's hook, ``gradient_as_bucket_view=True`` or ``batched_grad_copy``
  at a world size that is not a power of two, the kernel missing): one ``torch.aminmax`` pass over the
  bucket into two numbers, then the wrapped hook.

They are turned into flags and read only on an iteration where some optimizer skipped
(:meth:`OriginFlags.report`), with the same read as the fused ``found_inf``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _device
from ._params import MAX_NAMED_PARAMS, ParameterNames

__all__ = ["OriginFlags", "OriginHook", "OriginReport", "attach_origin_hook"]

_FLOAT32_OPMATH = frozenset({torch.float32, torch.bfloat16, torch.float16})
"""Bucket dtypes whose built-in scaling is a float32 multiplication (the kernel's; float64 computes in float64)."""
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
    """One iteration's notes, by bucket index: the bucket's flag or extremes, and the bucket itself.

    Fused buckets: ``flags[i]`` is a one-element view of ``found`` (float32, one element per bucket, on the
    buckets' device), set to 1.0 by the kernel when bucket ``i`` held inf/NaN, zeroed at :meth:`clear`.
    aminmax buckets (``flags[i]`` None): ``extremes[i]`` is a 2-element tensor on the bucket's device, in
    its dtype, written in place (``outs[i]`` are its two 0-d views, ``aminmax``'s ``out=``).
    ``buckets[i]`` is the GradBucket noted for it this iteration, None when not noted (asked for its
    parameters only on a skip). The storage is made on a bucket's first note and reused by every later
    iteration that gets this object.
    """

    __slots__ = ("buckets", "extremes", "flags", "found", "outs")

    def __init__(self) -> None:
        self.buckets: list[Any] = []
        self.extremes: list[torch.Tensor | None] = []
        self.outs: list[tuple[torch.Tensor, ...]] = []  # () until placed: aminmax(out=()) raises, never writes
        self.flags: list[torch.Tensor | None] = []
        self.found: torch.Tensor | None = None

    def noted(self) -> list[int]:
        """Return the indices of the buckets noted since the last :meth:`clear`."""
        return [index for index, bucket in enumerate(self.buckets) if bucket is not None]

    def clear(self) -> None:
        """Forget which buckets were noted (and let go of them), zero the fused flags; keep the storage."""
        buckets = self.buckets
        for index in range(len(buckets)):
            buckets[index] = None
        if self.found is not None:
            self.found.zero_()  # one small kernel per iteration, not per bucket

    def _grow(self, index: int) -> None:
        grow = index + 1 - len(self.buckets)
        if grow > 0:
            self.buckets += [None] * grow
            self.extremes += [None] * grow
            self.outs += [()] * grow
            self.flags += [None] * grow

    def place(self, index: int, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make (or remake, for a new dtype or device) bucket ``index``'s extremes; return its ``out=`` pair."""
        self._grow(index)
        extremes = torch.empty(2, dtype=buffer.dtype, device=buffer.device)
        self.extremes[index], self.outs[index] = extremes, (extremes[0], extremes[1])
        self.flags[index] = None
        return self.outs[index]

    def place_flag(self, index: int, device: torch.device) -> torch.Tensor | None:
        """Return bucket ``index``'s fused flag (made on first use), or None when ``found`` is on another device."""
        self._grow(index)
        found = self.found
        if found is not None and found.device != device:
            return None
        if self.flags[index] is not None:
            return self.flags[index]
        if found is None or found.numel() <= index:
            grown = torch.zeros(len(self.buckets), dtype=torch.float32, device=device)
            if found is not None:  # flags already set this iteration are kept
                grown[:found.numel()] = found
            self.found = found = grown
            self.flags = [None if flag is None else found[i:i + 1] for i, flag in enumerate(self.flags)]
        flag = self.flags[index] = found[index:index + 1]
        return flag


class OriginFlags:
    """Each bucket's local flag or extremes, written by the comm hook during backward, until the iteration ends.

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
        self._scale_and_flag: Callable[..., Any] | None = None  # set by fuse(): the fused path
        self._inv_scale_value = 1.0
        self._inv_scale: torch.Tensor | None = None  # 1/world size, 0-d float32 on the buckets' device
        self._kernel_dtypes: frozenset[torch.dtype] | None = None  # fused: the kernel's dtypes; None: any
        self._multiply: float | None = None  # fused, not a power of two: the slow path multiplies by this

    @property
    def enabled(self) -> bool:
        """Whether the hook still notes buckets (False after :meth:`close`)."""
        return self.notes is not None

    @property
    def fused(self) -> bool:
        """Whether buckets are noted on the fused path (the hook then does DDP's division itself)."""
        return self._scale_and_flag is not None

    def fuse(self, world_size: int, *, multiplies: bool = False) -> bool:
        """Take the fused path from now on, when the kernel is there and the world size allows it.

        Only for DDP's own ``allreduce_hook`` (the caller's check): a note on the fused path scales the
        bucket by ``1/world_size`` and the hook must then all-reduce it without dividing again. At a power
        of two at all: there multiplying by the reciprocal is exactly dividing, in every float dtype. At
        another world size only when ``multiplies`` (DDP's built-in all-reduce, which the hook replaces,
        would multiply by ``1/world_size``: :func:`._device.ddp_builtin_multiplies`): the hook then
        multiplies as it does, by the kernel's float32 reciprocal for float32, bfloat16 and float16 buckets
        (the built-in's scalar for them: they compute in float32), by ``mul_`` for any other bucket (float64
        computes in float64).
        Returns whether it did.
        """
        op = _device.scale_and_flag_nonfinite()
        exact = world_size >= 1 and not world_size & (world_size - 1)
        if op is None or world_size < 1 or not (exact or multiplies):
            return False
        self._scale_and_flag, self._inv_scale_value = op, 1.0 / world_size
        self._kernel_dtypes = None if exact else _FLOAT32_OPMATH
        self._multiply = None if exact else 1.0 / world_size
        return True

    def note(self, bucket: Any) -> torch.Tensor | None:
        """Note one bucket: return its buffer, already divided by the world size, when noted on the fused path.

        Fused: one kernel call that divides the bucket and sets its flag (a bucket the kernel does not take,
        at a world size that is not a power of two: an ``aminmax`` and a multiplication); aminmax: one
        ``aminmax`` kernel into the bucket's extremes, the bucket untouched (None returned, as when not
        noted). No sync, no
        allocation. Called by the hook for every bucket of every synchronising backward; its Python cost is
        two calls on the GradBucket (``index()``, ``buffer()``), the kernel launch and a list store. The
        kernel is the last thing that can raise: once the bucket is divided nothing here fails.
        """
        notes = self.notes
        if notes is None:
            return None
        try:
            index = bucket.index()
            buffer = bucket.buffer()
            flag = notes.flags[index]
            kernel_dtypes = self._kernel_dtypes  # a bucket index changes dtype if DDP rebuilds its buckets
            if flag is not None and not buffer.requires_grad and (kernel_dtypes is None
                                                                  or buffer.dtype in kernel_dtypes):
                self._scale_and_flag([buffer], flag, self._inv_scale)
                notes.buckets[index] = bucket
                return buffer
            if self._scale_and_flag is None:
                torch.aminmax(buffer, out=notes.outs[index])
                notes.buckets[index] = bucket
                return None
        except (IndexError, TypeError, RuntimeError, NotImplementedError):  # a first note, or not this path
            pass
        return self._note_first(notes, bucket)  # also a bucket the fused path does not take this time

    def _note_first(self, notes: _Notes, bucket: Any) -> torch.Tensor | None:
        # The slow path: storage for a bucket index not seen by these notes (or whose dtype or device
        # changed when DDP rebuilt its buckets), a buffer in the autograd graph (backward(create_graph=True):
        # the kernel records nothing for autograd, so aminmax of it detached, and the wrapped hook divides;
        # the next backward outside the graph is fused again), a bucket on another device than the first
        # fused one (aminmax), a fused bucket of a dtype the kernel's float32 reciprocal would scale unlike
        # the built-in (float64 at a world size not a power of two: aminmax), or one neither can reduce
        # (empty, complex: not noted, so never named an origin). Fused at a world size that is not a power of
        # two, a bucket noted by aminmax is then multiplied by the reciprocal here, as the built-in does
        # (allreduce_hook would divide), and the hook all-reduces it.
        buffer = bucket.buffer()
        if not buffer.numel() or not buffer.is_floating_point():
            return None
        index = bucket.index()
        kernel_dtypes = self._kernel_dtypes
        if self._scale_and_flag is not None and not buffer.requires_grad and (kernel_dtypes is None
                                                                              or buffer.dtype in kernel_dtypes):
            inv_scale = self._inv_scale
            if inv_scale is None:  # made once, on the first bucket's device; a bucket elsewhere takes aminmax
                inv_scale = self._inv_scale = torch.full((), self._inv_scale_value, dtype=torch.float32,
                                                         device=buffer.device)
            if inv_scale.device == buffer.device:
                flag = notes.place_flag(index, buffer.device)
                if flag is not None:
                    self._scale_and_flag([buffer], flag, inv_scale)
                    notes.buckets[index] = bucket
                    return buffer
        scaled = buffer
        if buffer.requires_grad:
            buffer = buffer.detach()
        outs = notes.outs[index] if index < len(notes.outs) else ()
        if not outs or outs[0].dtype != buffer.dtype or outs[0].device != buffer.device:
            outs = notes.place(index, buffer)
        else:
            notes.flags[index] = None
        torch.aminmax(buffer, out=outs)
        if self._multiply is None:
            notes.buckets[index] = bucket
            return None
        scaled.mul_(self._multiply)  # a Python float: the built-in's double reciprocal, in the bucket's opmath
        notes.buckets[index] = bucket
        return scaled

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

        ``new`` is True the first time an iteration is reported. Cost: one small op per noted bucket (a
        comparison of its flag, or ``isfinite`` of its extremes), one ``stack`` and one device-to-host copy
        of one bool per bucket (a sync on a GPU, only on a skipped iteration).
        """
        known = self._reports.get(iteration)
        if known is not None:
            return known, False
        notes = self.notes if current else self._kept.get(iteration)
        noted = notes.noted() if notes is not None else []
        if not noted:
            return None, False
        with torch.no_grad():  # buckets may differ in dtype and path: one bool each, then one read
            flags = torch.stack([notes.flags[i][0] != 0 if notes.flags[i] is not None
                                 else torch.isfinite(notes.extremes[i]).all().logical_not() for i in noted])
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
    """The comm hook DDP calls per bucket: note the bucket, then all-reduce it as the wrapped hook does.

    On the fused path the note has already divided the bucket by the world size, so the hook runs the rest of
    DDP's ``allreduce_hook`` itself (``_allreduce_fut`` in ``default_hooks.py`` after its ``div_``: the same
    group, ``process_group`` or the default group when None, the same asynchronous all-reduce and the same
    future, ``.then`` returning the reduced tensor); otherwise it runs the wrapped hook unchanged. Pickles
    (with the DDP model) as the wrapped hook, so nothing of the agent travels in a copy. DDP cannot
    unregister a hook: after ``close()`` this one only passes through to the wrapped hook.
    """

    def __init__(self, flags: OriginFlags, hook: Callable[..., Any], errors: Any) -> None:
        self.flags, self.hook, self.errors = flags, hook, errors
        self.note = flags.note  # bound once: one attribute lookup per bucket instead of two
        self._all_reduce, self._groups = dist.all_reduce, dist.group
        self.__name__ = self.__qualname__ = f"ampwatch_origin({getattr(hook, '__qualname__', 'hook')})"

    def __call__(self, state, bucket):  # unannotated: DDP checks the annotations of a hook it is given
        try:
            divided = self.note(bucket)
        except Exception as error:  # noqa: BLE001 - the all-reduce must run whatever happens here
            self.errors.report("DDP comm hook", error)
            divided = None  # note() raises only before it divides: the wrapped hook's own division is due
        if divided is None:
            return self.hook(state, bucket)
        group_to_use = state if state is not None else self._groups.WORLD
        return self._all_reduce(divided, group=group_to_use, async_op=True).get_future().then(_reduced)

    def __reduce__(self) -> tuple:
        return (_same, (self.hook,))


def _reduced(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


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
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if hook is None:
        hook, state = allreduce_hook, model.process_group
    elif not callable(hook):
        raise TypeError(f"comm_hook must be a DDP communication hook (a callable), got {type(hook).__name__}")
    if hook is allreduce_hook:  # DDP's own: its division can carry the check (see OriginFlags.fuse)
        flags.fuse((state if state is not None else dist.group.WORLD).size(),
                   multiplies=_device.ddp_builtin_multiplies(model))
    try:
        model.register_comm_hook(state, OriginHook(flags, hook, errors))
    except RuntimeError as error:
        raise ValueError(f"DDP refused ampwatch's communication hook ({error}); a model takes one hook, "
                         "registered before training: pass yours as watch(..., comm_hook=hook, "
                         "comm_state=state) instead of registering it") from None
