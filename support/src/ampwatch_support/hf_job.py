"""A tiny Hugging Face Trainer job for the integration tests: a local model, in-memory data, fp16 as on a GPU."""

from __future__ import annotations

import torch
from transformers import Trainer

from ampwatch_support.framework_truth import INF, gpu_like_fp16

__all__ = ["CpuFp16Trainer", "Examples", "Tiny"]


class Tiny(torch.nn.Module):
    """A regression model in the Trainer's calling convention (keyword inputs, a dict with the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.head(torch.relu(self.body(x))).float().squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Examples(torch.utils.data.Dataset):
    """``count`` random examples; those numbered in ``poisoned`` hold an inf."""

    def __init__(self, count: int, poisoned: tuple[int, ...] = ()) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 8, generator=generator)
        self.y = torch.randn(count, generator=generator)
        self.x[list(poisoned), 0] = INF

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class CpuFp16Trainer(Trainer):
    """The Trainer with its Accelerator set up for fp16 as Accelerate sets it up on a GPU (see gpu_like_fp16)."""

    scaler_settings = {"init_scale": 1024.0, "growth_interval": 3}

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        gpu_like_fp16(self.accelerator, **self.scaler_settings)
