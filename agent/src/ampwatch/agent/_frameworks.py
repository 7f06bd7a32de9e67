"""What the framework integrations share: importing the framework, naming optimizers, pairing schedulers, no scaler.

Lightning, the Hugging Face Trainer and Accelerate each hold the GradScaler,
the optimizers (maybe wrapped) and the LR schedulers (maybe wrapped, maybe with
a cadence) in their own way; each integration finds them and hands them to
:func:`attach`, which turns them into one ordinary :func:`ampwatch.agent.watch`.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from ._arguments import named_optimizers, scheduler_and_interval
from ._watch import DisabledWatch, Watch, watch

__all__ = ["OPTIONS", "attach", "check_options", "pass_loss", "pass_norm", "require", "say_unscaled"]

log = logging.getLogger("ampwatch.agent")

OPTIONS = ("collector", "run", "token", "push_interval", "grad_norm")
"""Keyword arguments every integration passes through to ``watch()`` (each defaults to its AMPWATCH_* variable)."""


def require(module: str, *, integration: str, extra: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that says what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{integration} needs the {module.split('.')[0]!r} package, which is not installed here: "
                          f'pip install "ampwatch-agent[{extra}]"') from error


def check_options(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Return ``options`` if every key is a ``watch()`` option; raise a TypeError naming the wrong one."""
    for key in options:
        if key not in OPTIONS:
            raise TypeError(f"{where} got an unexpected keyword argument {key!r} "
                            f"(the options passed on to ampwatch.agent.watch() are {', '.join(OPTIONS)})")
    return dict(options)


def say_unscaled(framework: str, what: str, cpu_recipe: str | None = None, *, asked_fp16: bool = False) -> None:
    """Log, once per job on rank 0, that the framework made no GradScaler and what the watch does instead.

    ``what``: what the framework does (its precision, and what it made of the one asked for);
    ``cpu_recipe``: how to train float16 with a real GradScaler on CPU, said when given. A warning when
    float16 was asked for (``asked_fp16``) and the framework made no scaler; otherwise information.
    """
    message = (f"ampwatch: {framework} made no GradScaler ({what}), so no step is ever skipped and there is no "
               "loss scale to report; ampwatch checks every optimizer step for inf/NaN gradients instead "
               "(poisoned steps).")
    if cpu_recipe:
        message += f" To train float16 with a real GradScaler on CPU: {cpu_recipe}."
    log.log(logging.WARNING if asked_fp16 else logging.INFO, "%s", message)


def attach(scaler: torch.amp.GradScaler | None, optimizers: Sequence[Any] | Mapping[str, Any], *,
           schedulers: Iterable[Any] = (), module: torch.nn.Module | None = None,
           names: Sequence[str] | None = None, **options: Any) -> Watch | DisabledWatch:
    """Watch ``scaler`` (None: the framework made none) and ``optimizers`` as a framework holds them.

    Optimizers are named by ``names`` (in order), else by the submodule of
    ``module`` each one owns when there are several and they own distinct
    submodules, else as ``watch()`` names a list (by class). Each scheduler is
    paired with the optimizer it drives; see :func:`_scheduler_entry` for the
    forms accepted. Costs what ``watch()`` costs (once per job).
    """
    if isinstance(optimizers, Mapping):
        by_name = dict(optimizers)
    else:
        items = list(optimizers)
        default = named_optimizers(items)  # checks them, names them by class, unwraps them
        chosen = list(names) if names is not None else _names_from_module(module, [o for o, _ in default.values()])
        if chosen is not None and len(chosen) != len(items):
            raise ValueError(f"names: got {len(chosen)} names for {len(items)} optimizers; "
                             "give one name per optimizer, in the order the framework holds them")
        by_name = dict(zip(chosen or default, items, strict=True))
        if len(by_name) != len(items):
            raise ValueError(f"names: each optimizer needs its own name, got {list(chosen or ())}")
    aliases = {id(alias): name for name, (opt, wrappers) in named_optimizers(by_name).items()
               for alias in (opt, *wrappers)}
    return watch(scaler, by_name, model=module, schedulers=_pair_schedulers(schedulers, aliases) or None, **options)


def pass_loss(handle: Watch | DisabledWatch | None, loss: Any) -> None:
    """Note ``loss`` for a watch without a GradScaler (``watch.loss``), as the integrations do for every micro-batch.

    With a scaler the framework scales every loss it backpropagates, and the watched ``scaler.scale()`` notes it
    already (in Lightning the loss handed on is the scaled one; Accelerate divides it for accumulation first): it
    is left alone, so no loss is noted twice. Free: a type check and an attribute read; never raises.
    """
    if isinstance(handle, Watch) and handle._recorder.scaler is None:
        handle.loss(loss)


def pass_norm(handle: Watch | DisabledWatch | None, norm: Any) -> None:
    """Hand ``norm`` (the framework's own ``clip_grad_norm_`` result) to the watch of one optimizer
    (``watch.grad_norm``), for the spike watch. Free: no read of it here; never raises (a framework that returns
    no norm, as Accelerate under DeepSpeed, hands over nothing)."""
    if isinstance(handle, Watch) and isinstance(norm, (torch.Tensor, float)):
        try:
            handle.grad_norm(norm)
        except (TypeError, ValueError) as error:
            handle._recorder.internal_error("framework grad_norm", error)


def _names_from_module(module: torch.nn.Module | None, optimizers: list[torch.optim.Optimizer]) -> list[str] | None:
    """Name each optimizer by the submodule holding all its parameters, if there are several and all differ."""
    if module is None or len(optimizers) < 2:
        return None
    owner = {id(p): name for name, p in module.named_parameters()}
    prefixes = []
    for opt in optimizers:
        found = [owner.get(id(p)) for group in opt.param_groups for p in group["params"]]
        paths = [path for path in found if path is not None]
        if not paths or len(paths) < len(found):
            return None
        common = os.path.commonprefix([path.split(".")[:-1] for path in paths])
        prefixes.append(".".join(common)[:128])
    # Distinct and readable: positions in an nn.Sequential ("0", "2") say less than the class names.
    if all(p and not p.isdigit() for p in prefixes) and len(set(prefixes)) == len(prefixes):
        return prefixes
    return None


def _pair_schedulers(schedulers: Iterable[Any], aliases: dict[int, str]) -> dict[str, list[dict[str, Any]]]:
    """Group schedulers by the name of the optimizer each one drives (``aliases``: id of it or a wrapper -> name)."""
    paired: dict[str, list[dict[str, Any]]] = {}
    for item in schedulers or ():
        entry = _scheduler_entry(item)
        owner = getattr(entry["scheduler"], "optimizer", None)
        name = aliases.get(id(owner))
        if name is None and owner is None and len(set(aliases.values())) == 1:
            name = next(iter(aliases.values()))
        if name is None:
            log.warning("ampwatch: not watching the %s: it drives no optimizer this watch knows",
                        type(entry["scheduler"]).__name__)
            continue
        paired.setdefault(name, []).append(entry)
    return paired


def _scheduler_entry(item: Any) -> dict[str, Any]:
    """Return ``{"scheduler": the one that really steps, "interval": ...}`` for a scheduler as a framework holds it."""
    scheduler, interval = scheduler_and_interval(item, f"the {type(item).__name__}")
    return {"scheduler": scheduler, "interval": interval}
