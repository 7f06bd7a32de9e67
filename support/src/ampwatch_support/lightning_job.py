"""Tiny real Lightning jobs for the integration tests: fp16 autocast with a real CPU GradScaler, overflow on cue.

On CPU, ``Trainer(precision="16-mixed")`` silently becomes bf16 without a scaler;
``plugins=[MixedPrecision("16-mixed", "cpu", scaler)]`` runs float16 autocast
with a real ``torch.amp.GradScaler("cpu")``, the way a GPU job runs on CUDA.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from ampwatch_support.framework_truth import INF, Truth, params_of

__all__ = ["OneOptimizer", "TwoOptimizers", "data", "fp16_plugin", "trainer"]

BATCHES = 6  # per epoch


def data(batches: int = BATCHES, seed: int = 0) -> torch.utils.data.DataLoader:
    """``batches`` batches of 4 random inputs, in a fixed order."""
    inputs = torch.randn(4 * batches, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader(inputs, batch_size=4, shuffle=False)


def fp16_plugin(**scaler_kwargs) -> MixedPrecision:
    """float16 autocast on CPU with a real GradScaler (``scaler_kwargs``: its settings)."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kwargs))


def trainer(**kwargs) -> pl.Trainer:
    """A quiet CPU Trainer; ``kwargs`` override or add Trainer arguments."""
    settings = dict(accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                    enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    settings.update(kwargs)
    return pl.Trainer(**settings)


class TwoOptimizers(pl.LightningModule):
    """Manual optimization: one optimizer per part (``a``, ``b``), a per-step and a per-epoch LR scheduler.

    ``poison``: {batch number over the whole fit: part} puts an inf into that
    part's gradients before its optimizer steps. ``truth`` records what really
    happened; the per-step scheduler of ``a`` is stepped every batch, skip or
    not, as a naive loop does.
    """

    def __init__(self, poison: dict[int, str] | None = None, truth: Truth | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.poison = poison or {}
        self.truth = truth or Truth()
        self.epoch_ends_after_b_skipped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

    def training_step(self, x: torch.Tensor, batch_idx: int) -> None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        number = self.current_epoch * self.trainer.num_training_batches + batch_idx
        optimizers = self.optimizers()
        for name, opt in zip("ab", optimizers, strict=True):
            for each in optimizers:
                each.zero_grad()
            self.manual_backward(self(x).float().pow(2).mean())
            if self.poison.get(number) == name:
                getattr(self, name).weight.grad.view(-1)[0] = INF
            self.truth.step(name, params_of(opt), scaler, opt.step)
        self.lr_schedulers()[0].step()
        self.truth.scheduler_stepped("a")

    def on_train_epoch_end(self) -> None:
        self.epoch_ends_after_b_skipped += self.truth.last_stepped.get("b") is False
        self.lr_schedulers()[1].step()  # declared per epoch: not a step that runs ahead of the updates

    def configure_optimizers(self):
        opt_a = torch.optim.SGD(self.a.parameters(), lr=0.05)
        opt_b = torch.optim.AdamW(self.b.parameters(), lr=1e-3)
        return [opt_a, opt_b], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt_a, 1, 0.99), "interval": "step"},
                                {"scheduler": torch.optim.lr_scheduler.ExponentialLR(opt_b, 0.9),
                                 "interval": "epoch"}]


class OneOptimizer(pl.LightningModule):
    """Automatic optimization with one optimizer and a per-step scheduler, which Lightning steps even after a skip.

    ``poison``: {batch number: ranks} makes those ranks' input hold an inf at
    that batch (under DDP the all-reduce spreads it to every rank). The truth
    names the optimizer ``SGD``, as ampwatch names a lone optimizer.
    """

    def __init__(self, poison: dict[int, tuple[int, ...]] | None = None, truth: Truth | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        self.poison = poison or {}
        self.truth = truth or Truth()
        self.scheduler_steps = 0

    def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
        number = self.current_epoch * self.trainer.num_training_batches + batch_idx
        if self.global_rank in self.poison.get(number, ()):
            x = x.clone()
            x[0, 0] = INF
        return self.net(x).float().pow(2).mean()

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.truth.step("SGD", params_of(optimizer), scaler,
                        lambda: super(OneOptimizer, self).optimizer_step(epoch, batch_idx, optimizer,
                                                                         optimizer_closure))

    def lr_scheduler_step(self, scheduler, metric) -> None:
        self.truth.scheduler_stepped("SGD")  # Lightning calls this for every scheduler step it takes
        self.scheduler_steps += 1
        super().lr_scheduler_step(scheduler, metric)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.99),
                                                   "interval": "step"}}
