"""Accelerate integration: watch what ``accelerator.prepare`` returned.

>>> from ampwatch.agent import accelerate as ampwatch                  # doctest: +SKIP
>>> model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)  # doctest: +SKIP
>>> watch = ampwatch.watch(accelerator, opt, schedulers=sched, model=model)     # doctest: +SKIP

``pip install "ampwatch-agent[accelerate]"``. What it hooks, gradient
accumulation, ``load_state()`` resumes and schedulers: docs/integrations.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ._frameworks import attach, check_options, pass_loss, pass_norm, require, say_unscaled
from ._watch import DisabledWatch, Watch

__all__ = ["watch"]

require("accelerate", integration="ampwatch.agent.accelerate", extra="accelerate")

_CPU_RECIPE = "give the Accelerator a GradScaler yourself, as examples/accelerate_cpu.py does"


def watch(accelerator: Any, optimizers: Any | Sequence[Any] | Mapping[str, Any], schedulers: Any = None, *,
          model: Any = None, loader: Any = None, **options: Any) -> Watch | DisabledWatch:
    """Attach the agent to ``accelerator.scaler`` and the prepared optimizers; return the Watch.

    ``optimizers``: what ``prepare`` returned (``AcceleratedOptimizer``), one,
    a list, or ``{"name": optimizer}``. ``schedulers``: prepared schedulers
    (``AcceleratedScheduler``), one or a list; each is paired with the
    optimizer it drives, and the scheduler inside is watched, since that is
    the one that advances (Accelerate steps it only when gradients sync).
    ``model``: the prepared model, for parameter names. ``collector``,
    ``run``, ``token``, ``push_interval``: as for :func:`ampwatch.agent.watch`.
    Without a scaler (bf16, fp32, fp16 on CPU) it says so once and checks
    every optimizer step for inf/NaN gradients instead. ``loader``: the prepared training DataLoader, to record
    each iteration's sample ids (Accelerate's loader fetches one batch ahead: a batch's ids are the iteration's
    when the loop receives it, not when Accelerate fetched it). Without a scaler, every loss the loop hands
    ``accelerator.backward`` is passed to ``watch.loss``; with one optimizer, every norm
    ``accelerator.clip_grad_norm_`` returns is passed to ``watch.grad_norm`` (:class:`AcceleratorTap`, taken off at
    close), for the spike watch (docs/agent.md#spikes).
    """
    options = check_options(options, "ampwatch.agent.accelerate.watch()")
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None and getattr(accelerator, "is_main_process", True):
        precision = getattr(accelerator, "mixed_precision", None)
        on_cpu = getattr(getattr(accelerator, "device", None), "type", None) == "cpu"
        what = f"mixed_precision={precision!r}"
        if precision == "fp16" and on_cpu:
            what += ", but Accelerate makes a GradScaler only on a GPU: it trains in float32 on CPU"
        asked_fp16 = precision == "fp16"
        say_unscaled("this Accelerator", what, _CPU_RECIPE if on_cpu and asked_fp16 else None, asked_fp16=asked_fp16)
    if model is not None and callable(getattr(accelerator, "unwrap_model", None)):
        model = accelerator.unwrap_model(model)  # names without DDP's "module." prefix
    if schedulers is None:
        schedulers = []
    elif not isinstance(schedulers, (list, tuple)):
        schedulers = [schedulers]
    if not isinstance(optimizers, (list, tuple, Mapping)):
        optimizers = [optimizers]
    handle = attach(scaler, optimizers, schedulers=schedulers, module=model, **options)
    if isinstance(handle, Watch):
        try:
            if loader is not None:
                handle._follow(loader, lag=_lag_of(loader))
            if scaler is None:
                handle._close_with(AcceleratorTap(accelerator, "backward", handle))
            if len(handle._recorder.records) == 1:
                handle._close_with(AcceleratorTap(accelerator, "clip_grad_norm_", handle))
        except BaseException:
            handle.close()
            raise
    return handle


class AcceleratorTap:
    """Tell the watch what one method of the accelerator sees: ``backward`` passes each loss to ``watch.loss`` (a job
    without a GradScaler), ``clip_grad_norm_`` each norm it returns to ``watch.grad_norm``.

    The method becomes, on this accelerator only (an instance attribute), a :class:`_Tapped` that calls the
    accelerator's own with the same arguments, returning what it returns and raising what it raises.
    :meth:`close` (the watch's) takes it off. Nothing of it is in a model, an optimizer or a checkpoint
    (``save_state`` saves their states, never the accelerator), and an accelerator pickled meanwhile carries none
    of it away (a deep copy of an Accelerator is the accelerator itself).
    """

    def __init__(self, accelerator: Any, name: str, handle: Watch) -> None:
        own = vars(accelerator)
        self._name = name
        self._had, self._before = name in own, own.get(name)  # someone's own attribute: put back
        self._accelerator = weakref.ref(accelerator)
        self._tapped = _Tapped(accelerator, name, handle)
        setattr(accelerator, name, self._tapped)

    def close(self) -> None:
        """Put the accelerator's own method back (unless something replaced ours since: then leave it)."""
        accelerator = self._accelerator()
        if accelerator is None or vars(accelerator).get(self._name) is not self._tapped:
            return
        if self._had:
            setattr(accelerator, self._name, self._before)
        else:
            delattr(accelerator, self._name)


class _Tapped:
    """An accelerator's method while tapped. Holds the watch weakly; pickled with its accelerator, it becomes the
    copy's own method (a plain ``getattr``: nothing of ampwatch in the pickle, and the copy never calls into the
    original accelerator)."""

    def __init__(self, accelerator: Any, name: str, handle: Watch) -> None:
        self._name = name
        self._original = getattr(accelerator, name)
        self._accelerator = weakref.ref(accelerator)
        self._watch = weakref.ref(handle)
        self.__doc__ = self._original.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._name == "backward":
            pass_loss(self._watch(), args[0] if args else kwargs.get("loss"))
            return self._original(*args, **kwargs)
        norm = self._original(*args, **kwargs)
        pass_norm(self._watch(), norm)
        return norm

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return getattr, (self._accelerator(), self._name)


def _lag_of(loader: Any) -> int:
    """Return how many batches ``loader`` fetches ahead of the one it hands the loop (Accelerate's shards: one)."""
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard

    if isinstance(loader, DataLoaderDispatcher):
        raise ValueError("ampwatch.agent.accelerate.watch(loader=) cannot follow a DataLoaderDispatcher (made with "
                         "dispatch_batches=True): only the main process draws from the sampler. Call "
                         "watch.batch(ids) with each batch's ids instead")
    return 1 if isinstance(loader, DataLoaderShard) else 0
