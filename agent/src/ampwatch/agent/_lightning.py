"""The Lightning callback's behaviour, written once for ``lightning.pytorch`` and ``pytorch_lightning``.

Imports neither: :mod:`ampwatch.agent.lightning` and
:mod:`ampwatch.agent.pytorch_lightning` mix it into each package's ``Callback``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._framework_samples import BatchPositions
from ._frameworks import attach, check_options, pass_loss, say_unscaled
from ._watch import DisabledWatch, Watch

__all__ = ["LightningWatch"]

_CPU_RECIPE = ("Trainer(plugins=[MixedPrecision('16-mixed', 'cpu')]) instead of precision='16-mixed' "
               "(examples/lightning_cpu.py)")


class LightningWatch:
    """Attach the ampwatch agent at fit start, detach at fit end or on an exception.

    ``names``: one name per optimizer, in ``configure_optimizers`` order
    (default: the submodule each optimizer owns, else its class).
    ``log_metrics``: also send the loss scale and each optimizer's skipped
    and poisoned steps to the Trainer's loggers every ``log_every_n_steps`` batches (one
    snapshot of a few counters each time). ``collector``, ``run``, ``token``,
    ``push_interval``: as for :func:`ampwatch.agent.watch`.
    """

    def __init__(self, names: Sequence[str] | None = None, *, log_metrics: bool = False, **options: Any) -> None:
        super().__init__()
        self.names = list(names) if names is not None else None
        self.log_metrics = log_metrics
        self.watch: Watch | DisabledWatch | None = None
        """The agent's handle while fitting, and after (closed): ``summary()``, ``snapshot()``, ``stepped()``."""
        self._options = check_options(options, "AmpWatchCallback()")
        self._said_no_scaler = False
        self._batches = 0
        self._positions = BatchPositions("Lightning")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Attach to the precision plugin's scaler, every optimizer and the LR schedulers with their interval.

        Without a scaler (bf16, float32) every optimizer step is checked for inf/NaN gradients instead.
        """
        self._detach()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None and not self._said_no_scaler and trainer.is_global_zero:
            on_cpu = getattr(getattr(trainer.strategy, "root_device", None), "type", None) == "cpu"
            what = f"precision {trainer.precision!r}"
            if on_cpu and trainer.precision == "bf16-mixed":
                what += "; on CPU Lightning runs precision='16-mixed' as 'bf16-mixed'"
            say_unscaled("this Lightning Trainer", what, _CPU_RECIPE if on_cpu else None)
            self._said_no_scaler = True
        self._batches = 0
        self.watch = attach(scaler, list(trainer.optimizers), names=self.names, module=pl_module,
                            schedulers=list(trainer.lr_scheduler_configs), **self._options)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Follow the epoch's training DataLoader (Lightning may have made it anew), for each batch's sample ids."""
        self._positions.follow(self.watch, trainer.train_dataloader)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Record the sample ids of the batch about to be trained on: the ``batch_idx``-th of the epoch."""
        self._positions.trained(self.watch, batch_idx, trainer.current_epoch)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Without a GradScaler (bf16, float32), pass the loss about to be backpropagated to ``watch.loss`` (with a
        scaler, ``scaler.scale`` notes it): whether it was finite says where a poisoned step's inf/NaN began."""
        pass_loss(self.watch, loss)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """With ``log_metrics``: log the loss scale and skipped steps beside the loss curve."""
        if not self.log_metrics or not isinstance(self.watch, Watch) or not trainer.loggers:
            return
        self._batches += 1
        if self._batches % max(1, trainer.log_every_n_steps) or not trainer.is_global_zero:
            return
        state = self.watch.snapshot()["state"]
        metrics = {f"ampwatch/{name}/{metric}": counters[key] for name, counters in state["optimizers"].items()
                   for metric, key in (("skipped_steps", "skipped"), ("poisoned_steps", "poisoned_steps"))}
        if state["loss_scale"] is not None:
            metrics["ampwatch/loss_scale"] = state["loss_scale"]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Detach and send what is left."""
        self._detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Detach and send what is left; the exception goes on as before."""
        self._detach()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Detach if fitting ended some way the hooks above did not see."""
        if stage == "fit":
            self._detach()

    def _detach(self) -> None:
        self._positions.close()
        if self.watch is not None:
            self.watch.close()

    def __getstate__(self) -> dict[str, Any]:
        # A Trainer may be pickled (ddp_spawn); a live watch holds a thread and locks and stays in this process.
        state = dict(self.__dict__)
        state["watch"] = None
        state["_positions"] = BatchPositions("Lightning")
        return state
