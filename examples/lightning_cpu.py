"""Lightning on CPU, watched by ampwatch's callback: float16 with a real GradScaler, or bf16 without one.

    python examples/lightning_cpu.py            # float16 + a real GradScaler: batch 3 skips (and the first)
    python examples/lightning_cpu.py --bf16     # precision="bf16-mixed", no scaler: batch 3 is a poisoned step

On CPU, Trainer(precision="16-mixed") runs as "bf16-mixed" without a scaler; a real float16
GradScaler on CPU comes from Lightning's own plugin: plugins=[MixedPrecision("16-mixed", "cpu")].
On a GPU, precision="16-mixed" is all it takes. Set AMPWATCH_URL to send it to a collector.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from ampwatch.agent.lightning import AmpWatchCallback


class Regressor(pl.LightningModule):
    """A small regression model whose batch 3 holds an inf."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, y = batch[:, :8].clone(), batch[:, 8:]
        if batch_idx == 3:
            x[0, 0] = float("inf")
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> AmpWatchCallback:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bf16", action="store_true", help="precision='bf16-mixed', no GradScaler")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    precision = {"precision": "bf16-mixed"} if args.bf16 else {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    callback = AmpWatchCallback(run="lightning-cpu")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **precision)
    data = torch.utils.data.DataLoader(torch.randn(32, 9), batch_size=4)
    trainer.fit(Regressor(), data)
    print(callback.watch.summary())
    return callback


if __name__ == "__main__":
    main()
