"""Check and normalise ``watch()``'s arguments: the scaler, named optimizers (unwrapped), parameters, schedulers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import _device
from ._record import OptimizerRecord

__all__ = ["check_scaler", "named_optimizers", "named_params", "peel", "per_step_schedulers",
           "scheduler_and_interval"]


def check_scaler(scaler: Any, *, none: bool = False) -> None:
    """Raise a TypeError unless ``scaler`` is a GradScaler (or, with ``none``, None: a job without one)."""
    if scaler is None and none:
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        also = " or None for a job without one (bf16, float32)" if none else ""
        raise TypeError(f"scaler must be a torch.amp.GradScaler (or a subclass such as ShardedGradScaler){also}, "
                        f"got {type(scaler).__name__}")


def named_optimizers(optimizers: Any) -> dict[str, tuple[torch.optim.Optimizer, list[Any]]]:
    """Return ``{name: (optimizer that steps, [wrappers around it])}``."""
    if isinstance(optimizers, Mapping):
        named = {}
        for name, opt in optimizers.items():
            if not isinstance(name, str) or not 1 <= len(name) <= 128 or not name.isprintable():
                raise ValueError(f"optimizers: names must be printable strings of 1-128 characters, got {name!r}")
            named[name] = _unwrap_optimizer(opt, f"optimizers[{name!r}]")
    elif isinstance(optimizers, (list, tuple)) or _looks_like_optimizer(optimizers):
        items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        single = not isinstance(optimizers, (list, tuple))
        unwrapped = [_unwrap_optimizer(o, "optimizers" if single else f"optimizers[{i}]")
                     for i, o in enumerate(items)]
        classes = [type(o).__name__ for o, _ in unwrapped]
        unique = len(set(classes)) == len(classes)
        named = {(c if unique else f"optimizer{i}"): pair
                 for i, (c, pair) in enumerate(zip(classes, unwrapped, strict=True))}
    else:
        raise TypeError("optimizers must be a torch.optim.Optimizer, a list of them, or a dict "
                        f"{{name: optimizer}}, got {type(optimizers).__name__}")
    if not named:
        raise ValueError("optimizers is empty: pass at least one optimizer to watch")
    if len({id(o) for o, _ in named.values()}) != len(named):
        raise ValueError("optimizers: the same optimizer is listed twice; pass each optimizer once")
    return named


def _looks_like_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer) or isinstance(getattr(value, "optimizer", None),
                                                                  torch.optim.Optimizer)


def _unwrap_optimizer(value: Any, where: str) -> tuple[torch.optim.Optimizer, list[Any]]:
    """Return the optimizer that actually steps behind ``value`` and the wrappers around it.

    Framework wrappers (Accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer, anything exposing the real optimizer as ``.optimizer``)
    are unwrapped: the scaler steps the optimizer inside them.
    """
    value, wrappers = peel(value)
    if not isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"{where} must be a torch.optim.Optimizer (or a wrapper exposing one as .optimizer), "
                        f"got {type(value).__name__}")
    if not _device.has_step_hooks(value):
        raise TypeError(f"{where} is a {type(value).__name__} whose Optimizer.__init__ never ran, so it cannot be "
                        "hooked: pass the torch.optim.Optimizer that actually steps (the one it wraps)")
    return value, wrappers


def named_params(model: Any, named_parameters: Any) -> list[tuple[str, torch.Tensor]]:
    if model is not None and named_parameters is not None:
        raise ValueError("pass either model= or named_parameters=, not both")
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        return list(model.named_parameters())
    if named_parameters is None:
        return []
    pairs = list(named_parameters)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError("named_parameters must yield (name, tensor) pairs, as model.named_parameters() does")
    return pairs


_INTERVALS = ("step", "epoch")


def per_step_schedulers(schedulers: Any, records: dict[str, OptimizerRecord]) -> list[tuple[OptimizerRecord, str, Any]]:
    """Return ``(record, label, scheduler)`` for each per-step scheduler; per-epoch ones are checked, not watched."""
    if schedulers is None:
        return []
    if not isinstance(schedulers, Mapping) or _is_scheduler_config(schedulers):
        if len(records) != 1:
            raise ValueError("schedulers must be a dict {optimizer name: scheduler} when watching several "
                             f"optimizers (names: {', '.join(records)})")
        schedulers = {next(iter(records)): schedulers}
    result = []
    for name, value in schedulers.items():
        if name not in records:
            raise ValueError(f"schedulers: {name!r} is not the name of a watched optimizer "
                             f"(names: {', '.join(records)})")
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        entries = [scheduler_and_interval(item, f"schedulers[{name!r}]") for item in items]
        classes = [type(s).__name__ for s, _ in entries]
        for i, (scheduler, interval) in enumerate(entries):
            owner = peel(getattr(scheduler, "optimizer", None))[0]  # e.g. built on an AcceleratedOptimizer
            if owner is not None and owner is not records[name].optimizer:
                raise ValueError(f"schedulers[{name!r}] schedules a different optimizer than optimizers[{name!r}]")
            if interval == "step":  # a per-epoch scheduler stepped after a skip ran nothing ahead
                label = classes[i] if classes.count(classes[i]) == 1 else f"{classes[i]}{i}"
                result.append((records[name], label, scheduler))
    return result


def peel(value: Any) -> tuple[Any, list[Any]]:
    """Return what is inside wrappers exposing an optimizer as ``.optimizer``, and the wrappers (outermost first)."""
    wrappers: list[Any] = []
    while len(wrappers) < 8:
        inner = getattr(value, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is value:
            break
        wrappers.append(value)
        value = inner
    return value, wrappers


def _is_scheduler_config(value: Any) -> bool:
    return isinstance(value, Mapping) and "scheduler" in value


def scheduler_and_interval(item: Any, where: str) -> tuple[Any, str]:
    """Return the scheduler that really steps behind ``item``, and its cadence ("step" or "epoch").

    Accepted: a scheduler (per step); ``{"scheduler": s, "interval": "step" |
    "epoch", ...}`` (Lightning's dict); an object with ``.scheduler`` and
    ``.interval`` (Lightning's ``LRSchedulerConfig``); a wrapper exposing the
    scheduler as ``.scheduler`` (Accelerate's ``AcceleratedScheduler``, which
    steps the inner one only when the optimizers really stepped and gradients
    synced: the inner one is watched, so micro-batches are not counted).
    """
    if _is_scheduler_config(item):
        scheduler, interval = item["scheduler"], item.get("interval", "step")
    elif hasattr(item, "scheduler") and hasattr(item, "interval") and not callable(getattr(item, "step", None)):
        scheduler, interval = item.scheduler, item.interval
    else:
        scheduler, interval = item, "step"
    for _ in range(8):  # wrappers: watch the scheduler that actually advances
        inner = getattr(scheduler, "scheduler", None)
        if inner is None or inner is scheduler or not callable(getattr(inner, "step", None)):
            break
        scheduler = inner
    if interval not in _INTERVALS:
        raise ValueError(f"{where}: interval must be 'step' or 'epoch', got {interval!r}")
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"{where} must be an LR scheduler with a step() method, got {type(scheduler).__name__}")
    return scheduler, interval
