"""Which rank's local gradients were non-finite before DDP's all-reduce: a wrapping DDP communication hook.

DDP averages every rank's gradients, so one rank's inf or NaN reaches every rank and every rank skips.
:class:`OriginHook` wraps the all-reduce (DDP's default, or the user's own hook): before a bucket is
reduced it notes, on the device and without a sync, the bucket's local minimum and maximum (one
``torch.aminmax`` pass over the bucket). They are turned into flags and read only on an iteration
where some optimizer skipped (:meth:`OriginFlags.report`), with the same read as the fused ``found_inf``.
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


class OriginFlags:
    """Each bucket's local extremes, noted by the comm hook during backward, until the iteration ends.

    The hook appends (from the autograd thread; a list append); the training thread reads at a skip
    and drops the notes at ``update()``. Holds tensors of the current iteration only, or of the last
    few while a deferred outcome may still claim them.
    """

    def __init__(self, names: ParameterNames) -> None:
        self.names = names
        self.enabled = True
        # (bucket, its local min, its local max): the GradBucket is kept (not its parameters() list, a copy made
        # per call) and asked for its index and parameters only on a skipped iteration.
        self._current: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        self._kept: dict[int, list[tuple[Any, torch.Tensor, torch.Tensor]]] = {}
        self._reports: dict[int, OriginReport] = {}

    def note(self, bucket: Any) -> None:
        """Note one bucket's local extremes (one ``aminmax`` kernel, no sync, a few us); called by the hook."""
        if not self.enabled:
            return
        buffer = bucket.buffer()
        if not buffer.numel() or not buffer.is_floating_point():
            return
        if buffer.requires_grad:  # only under backward(create_graph=True): record no graph
            buffer = buffer.detach()
        low, high = torch.aminmax(buffer)
        self._current.append((bucket, low, high))

    def end_iteration(self, iteration: int, keep: bool) -> None:
        """Drop the notes of ``iteration`` (``keep``: hold them while its outcome is still on the device)."""
        current, self._current = self._current, []
        if not keep:
            self._kept.clear()
            self._reports.clear()
            return
        if current:
            self._kept[iteration] = current
        for held in (self._kept, self._reports):
            while len(held) > _KEPT_ITERATIONS:
                del held[next(iter(held))]

    def close(self) -> None:
        """Stop noting and let go of every tensor (the hook stays on the model, passing through)."""
        self.enabled = False
        self._current, self._kept, self._reports = [], {}, {}

    def report(self, iteration: int, current: bool) -> tuple[OriginReport | None, bool]:
        """Return ``(report, new)`` for ``iteration``: None when no bucket was noted for it.

        ``new`` is True the first time an iteration is reported. Cost: one stack of the extremes and
        one device-to-host copy of one flag per bucket (a sync on a GPU, only on a skipped iteration).
        """
        known = self._reports.get(iteration)
        if known is not None:
            return known, False
        notes = self._current if current else self._kept.get(iteration)
        if not notes:
            return None, False
        with torch.no_grad():
            extremes = torch.stack([n[1] for n in notes] + [n[2] for n in notes]).view(2, -1)
            flags = (~torch.isfinite(extremes)).any(0)
        bad = [note[0] for note, flag in zip(notes, _device.read_later(flags).wait()) if flag]
        params = [p for bucket in bad for p in bucket.parameters()]
        report = OriginReport(origin=bool(bad), buckets=sorted({bucket.index() for bucket in bad})[:MAX_NAMED_PARAMS],
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
        self.__name__ = self.__qualname__ = f"ampwatch_origin({getattr(hook, '__qualname__', 'hook')})"

    def __call__(self, state, bucket):  # unannotated: DDP checks the annotations of a hook it is given
        if self.flags.enabled:
            try:
                self.flags.note(bucket)
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
