"""The Hugging Face Trainer on CPU, watched by ampwatch's callback: float16 with a real GradScaler, or bf16.

    python examples/transformers_cpu.py            # float16 + a real GradScaler: update 2 skips
    python examples/transformers_cpu.py --bf16     # bf16=True, no scaler: update 2 is a poisoned step

Accelerate makes a GradScaler only for fp16 on a GPU; with fp16=True on CPU the Trainer trains in
float32. To get the GPU's code path on CPU, give the Trainer's Accelerator what it gets on a GPU:
``native_amp`` and a ``torch.amp.GradScaler("cpu")`` (:class:`CpuFp16Trainer` below). On a GPU,
TrainingArguments(fp16=True) is all it takes. Set AMPWATCH_URL to send it to a collector.
"""

from __future__ import annotations

import argparse

import torch
from transformers import Trainer, TrainingArguments

from ampwatch.agent.transformers import AmpWatchCallback


class Regressor(torch.nn.Module):
    """A regression model in the Trainer's calling convention (keyword inputs, a dict with the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x).float().squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels)}


class CpuFp16Trainer(Trainer):
    """fp16 with a real GradScaler on CPU, as Accelerate sets it up on a GPU."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.native_amp = True
        self.accelerator.scaler = torch.amp.GradScaler("cpu")


def main(argv: list[str] | None = None) -> AmpWatchCallback:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bf16", action="store_true", help="bf16=True, no GradScaler")
    parser.add_argument("--output-dir", default="out-transformers-cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randn(32)
    x[9, 0] = float("inf")  # in update 2 (4 examples per update)
    data = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    training = TrainingArguments(output_dir=args.output_dir, use_cpu=True, per_device_train_batch_size=4,
                                 num_train_epochs=1, learning_rate=1e-3, report_to="none", save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, train_sampling_strategy="sequential",
                                 **({"bf16": True} if args.bf16 else {"fp16": True}))
    callback = AmpWatchCallback(run="transformers-cpu")
    trainer_class = Trainer if args.bf16 else CpuFp16Trainer
    trainer_class(model=Regressor(), args=training, train_dataset=data, callbacks=[callback]).train()
    print(callback.watch.summary())
    return callback


if __name__ == "__main__":
    main()
