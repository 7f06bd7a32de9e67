"""Hugging Face Trainer integration: ``Trainer(..., callbacks=[AmpWatchCallback()])`` reports every skipped step.

>>> from ampwatch.agent.transformers import AmpWatchCallback         # doctest: +SKIP
>>> trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[AmpWatchCallback()])  # doctest: +SKIP

``pip install "ampwatch-agent[transformers]"``. What it hooks and how it
behaves on resume: docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ._framework_samples import BatchPositions
from ._frameworks import attach, check_options, require, say_unscaled
from ._watch import DisabledWatch, Watch

__all__ = ["AmpWatchCallback"]

_transformers = require("transformers", integration="ampwatch.agent.transformers", extra="transformers")

_CPU_RECIPE = "a Trainer whose Accelerator is given a GradScaler, as examples/transformers_cpu.py does"


_TrainerCallback: Any = _transformers.TrainerCallback  # a base class mypy cannot see through require()


class AmpWatchCallback(_TrainerCallback):
    """Attach the ampwatch agent when training begins, detach when it ends.

    Watches the GradScaler behind the Trainer's optimizer (Accelerate's, made
    for ``fp16=True`` on a GPU), the optimizer itself (named ``name``, default:
    its class) and the LR scheduler, which the Trainer steps once per update.
    Without a scaler (``bf16=True``, float32, fp16 on CPU) every optimizer step
    is checked for inf/NaN gradients instead; no callback event sees the loss, so
    ``began`` says whether it was finite only if ``training_step`` passes it to
    ``callback.watch.loss`` (docs/integrations.md).
    ``collector``, ``run``, ``token``, ``push_interval``: as for
    :func:`ampwatch.agent.watch`.
    """

    def __init__(self, name: str | None = None, **options: Any) -> None:
        self.name = name
        self.watch: Watch | DisabledWatch | None = None
        """The agent's handle while training, and after (closed): ``summary()``, ``snapshot()``, ``stepped()``."""
        self._options = check_options(options, "AmpWatchCallback()")
        self._said_no_scaler = False
        self._positions = BatchPositions("the Trainer")
        self._epoch_start = 0  # global_step when the epoch began

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        """Attach to the optimizer's scaler, the optimizer and the LR scheduler (after a resume has loaded them)."""
        self._detach()
        scaler = getattr(optimizer, "scaler", None)
        if scaler is None and not self._said_no_scaler and state.is_world_process_zero:
            on_cpu = getattr(args, "device", None) is not None and args.device.type == "cpu"
            if args.fp16:
                what = ("fp16=True, but Accelerate makes a GradScaler only on a GPU: this Trainer trains in float32 "
                        "on CPU" if on_cpu else "fp16=True")
            else:
                what = "bf16=True" if args.bf16 else "float32"
            say_unscaled("this Trainer", what, _CPU_RECIPE if on_cpu and args.fp16 else None, asked_fp16=args.fp16)
            self._said_no_scaler = True
        schedulers = []
        if lr_scheduler is not None:
            per_update = not isinstance(lr_scheduler, _stepped_on_metrics())
            schedulers.append({"scheduler": lr_scheduler, "interval": "step" if per_update else "epoch"})
        module = model if isinstance(model, torch.nn.Module) else None
        self.watch = attach(scaler, [optimizer], names=[self.name] if self.name else None, module=module,
                            schedulers=schedulers, **self._options)
        self._positions.follow(self.watch, train_dataloader)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Note where the epoch begins: its updates' batches are counted from here."""
        self._epoch_start = state.global_step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the sample ids of the update's micro-batches (the Trainer fetched them all before this)."""
        accumulation = max(1, int(args.gradient_accumulation_steps))
        first = (state.global_step - self._epoch_start) * accumulation
        for position in range(first, first + accumulation):
            self._positions.trained(self.watch, position, int(state.epoch or 0))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Detach and send what is left."""
        self._detach()

    def _detach(self) -> None:
        self._positions.close()
        if self.watch is not None:
            self.watch.close()


def _stepped_on_metrics() -> tuple[type, ...]:
    """The scheduler classes the Trainer steps after an evaluation, on its metrics, instead of once per update."""
    greedy = getattr(_transformers, "GreedyLR", None)  # newer releases only
    return (torch.optim.lr_scheduler.ReduceLROnPlateau, *([greedy] if isinstance(greedy, type) else []))
