"""Hugging Face Trainer integration: ``Trainer(..., callbacks=[AmpWatchCallback()])`` reports every skipped step.

>>> from ampwatch.agent.transformers import AmpWatchCallback         # doctest: +SKIP
>>> trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[AmpWatchCallback()])  # doctest: +SKIP

``pip install "ampwatch-agent[transformers]"``. What it hooks and how it
behaves on resume: docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ._frameworks import Unwatched, attach, check_options, no_scaler, require
from ._watch import DisabledWatch, Watch

__all__ = ["AmpWatchCallback"]

_transformers = require("transformers", integration="ampwatch.agent.transformers", extra="transformers")

_HINT = "TrainingArguments(fp16=True) on a GPU"


class AmpWatchCallback(_transformers.TrainerCallback):
    """Attach the ampwatch agent when training begins, detach when it ends.

    Watches the GradScaler behind the Trainer's optimizer (Accelerate's, made
    for ``fp16=True`` on a GPU), the optimizer itself (named ``name``, default:
    its class) and the LR scheduler, which the Trainer steps once per update.
    ``collector``, ``run``, ``token``, ``push_interval``: as for
    :func:`ampwatch.agent.watch`.
    """

    def __init__(self, name: str | None = None, **options: Any) -> None:
        self.name = name
        self.watch: Watch | DisabledWatch | None = None
        """The agent's handle while training, and after (closed): ``summary()``, ``snapshot()``, ``stepped()``."""
        self._options = check_options(options, "AmpWatchCallback()")
        self._said_no_scaler = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        """Attach to the optimizer's scaler, the optimizer and the LR scheduler (after a resume has loaded them)."""
        self._detach()
        scaler = getattr(optimizer, "scaler", None)
        if scaler is None:
            precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
            self.watch = no_scaler("this Trainer", precision, _HINT,
                                   say=not self._said_no_scaler and state.is_world_process_zero)
            self._said_no_scaler = True
            return
        schedulers = []
        if lr_scheduler is not None:
            per_update = not isinstance(lr_scheduler, _stepped_on_metrics())
            schedulers.append({"scheduler": lr_scheduler, "interval": "step" if per_update else "epoch"})
        module = model if isinstance(model, torch.nn.Module) else None
        self.watch = attach(scaler, [optimizer], names=[self.name] if self.name else None, module=module,
                            schedulers=schedulers, **self._options)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Detach and send what is left."""
        self._detach()

    def _detach(self) -> None:
        if self.watch is not None and not isinstance(self.watch, Unwatched):
            self.watch.close()


def _stepped_on_metrics() -> tuple[type, ...]:
    """The scheduler classes the Trainer steps after an evaluation, on its metrics, instead of once per update."""
    greedy = getattr(_transformers, "GreedyLR", None)  # newer releases only
    return (torch.optim.lr_scheduler.ReduceLROnPlateau, *([greedy] if isinstance(greedy, type) else []))
