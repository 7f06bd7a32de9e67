"""What the agent-overhead benchmarks share: the models, rotating blocks (and the sync counter, from ampwatch_support).

``bench.overhead`` (one process), ``bench.ddp_origin`` (a DDP group), ``bench.instructions`` and
``bench.gpu`` all use these, so each is written once. The agent's tests count syncs with the same
``ampwatch_support.syncs.SyncCounter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

__all__ = ["MODELS", "Loop", "ModelBuilder", "compare", "pct", "rotate"]


class Loop(Protocol):
    """A training loop set up once, run ``n`` iterations at a time (``bench.overhead.Setup``, ``DdpSetup``)."""

    def iterate(self, n: int) -> None: ...


ModelBuilder = Callable[[torch.device], tuple[nn.Module, list[list[nn.Parameter]], Callable[[], torch.Tensor]]]


def _mlp(device: torch.device) -> tuple[nn.Module, list[list[nn.Parameter]], Callable[[], torch.Tensor]]:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    x = torch.randn(32, 64).to(device)
    groups = [list(model[0].parameters()), list(model[2].parameters()) + list(model[4].parameters())]
    return model, groups, lambda: model(x).float().pow(2).mean()


def _transformer(device: torch.device) -> tuple[nn.Module, list[list[nn.Parameter]], Callable[[], torch.Tensor]]:
    block = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
    head = nn.Linear(64, 8)
    model = nn.ModuleDict({"block": block, "head": head}).to(device)
    x = torch.randn(8, 16, 64).to(device)
    return model, [list(block.parameters()), list(head.parameters())], lambda: head(block(x)).float().pow(2).mean()


def _tiny(device: torch.device) -> tuple[nn.Module, list[list[nn.Parameter]], Callable[[], torch.Tensor]]:
    # Compute so small that the agent's fixed host cost per iteration stands out.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(device)
    x = torch.randn(2, 4).to(device)
    return model, [list(model[0].parameters()), list(model[1].parameters())], lambda: model(x).float().sum()


MODELS: dict[str, ModelBuilder] = {"mlp": _mlp, "transformer": _transformer, "tiny": _tiny}

def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rotate(setups: dict[str, Loop], rounds: int, block: int,
           settle: Callable[[], None] = lambda: None) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run ``block`` iterations of each setup per round, in an order that rotates every round.

    Returns per-iteration process CPU seconds and wall seconds, one value per round, per variant.
    ``settle`` runs before each clock starts and before it stops (on a GPU: ``torch.cuda.synchronize``,
    so a block's time includes its queued device work).
    """
    names = list(setups)
    cpu: dict[str, list[float]] = {v: [] for v in names}
    wall: dict[str, list[float]] = {v: [] for v in names}
    for i in range(rounds):
        for v in names[i % len(names):] + names[:i % len(names)]:
            settle()
            c, w = time.process_time(), time.perf_counter()
            setups[v].iterate(block)
            settle()
            cpu[v].append((time.process_time() - c) / block)
            wall[v].append((time.perf_counter() - w) / block)
    return cpu, wall


def compare(cpu: dict[str, list[float]], wall: dict[str, list[float]], base: str = "bare") -> dict[str, dict]:
    """Per variant: median per-iteration times and the median [p25-p75] of per-round ratios to ``base``."""
    out = {}
    for v in cpu:
        ratios = [t / b for t, b in zip(cpu[v], cpu[base], strict=True)]
        wall_ratios = [t / b for t, b in zip(wall[v], wall[base], strict=True)]
        out[v] = {"cpu_us_per_iter": round(statistics.median(cpu[v]) * 1e6, 1),
                  "wall_us_per_iter": round(statistics.median(wall[v]) * 1e6, 1),
                  "wall_ratio": round(statistics.median(wall_ratios), 4),
                  "wall_ratio_p25": round(pct(wall_ratios, .25), 4),
                  "wall_ratio_p75": round(pct(wall_ratios, .75), 4),
                  "ratio": round(statistics.median(ratios), 4),
                  "ratio_p25": round(pct(ratios, .25), 4), "ratio_p75": round(pct(ratios, .75), 4),
                  "extra_us_per_iter": round((statistics.median(cpu[v]) - statistics.median(cpu[base])) * 1e6, 1)}
    return out
