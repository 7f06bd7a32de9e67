"""Overhead: wall time per iteration of the bare loop vs the agent vs the ``get_scale()`` recipe (and Accelerate).

The loops are ``bench.overhead.Setup``'s (two AdamW optimizers, one scaler, float16 autocast on a GPU),
timed in rotating blocks (``bench.overhead.rotate``) with the device synchronised at each block's start and
end. Two models: the 64-wide MLP of the CPU benchmark, whose GPU iteration is bound by host-side launches
(about a millisecond), and a transformer sized so that the GPU is the bottleneck (tens of ms on an H100/H200).
Variants: ``bare``; ``ampwatch_unasked`` (the agent attached, nothing asked); ``ampwatch`` (also
``watch.stepped()`` for both optimizers every iteration, which waits for fused answers on a GPU);
``forum`` (``get_scale()`` before and after ``update()``); ``accelerate`` (its ``AcceleratedOptimizer``)
when installed. Reported, never asserted; the target is ampwatch within 1% of bare.
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from bench._loops import compare, rotate
from bench.gpu._amp import Amp
from bench.gpu._checks import check
from bench.overhead import Setup

__all__ = ["run", "transformer_builder"]

TARGET = 1.01


def transformer_builder(amp: Amp, quick: bool) -> Callable:
    """Return a ``Setup`` model builder: a pre-norm transformer encoder and a head, two parameter groups."""
    if amp.cuda:  # ~75M parameters, 16k tokens: about 8 TFLOP per iteration
        d, heads, layers, batch, seq = 1024, 16, 2 if quick else 6, 8 if quick else 32, 512
    else:
        d, heads, layers, batch, seq = 64, 4, 2, 4, 32

    def transformer(device: torch.device):
        with torch.device(device):
            layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            head = nn.Linear(d, 64)
            x = torch.randn(batch, seq, d)
        model = nn.ModuleDict({"body": body, "head": head})
        return model, [list(body.parameters()), list(head.parameters())], lambda: head(body(x)).float().pow(2).mean()

    transformer.__name__ = f"transformer_d{d}_l{layers}_b{batch}x{seq}"
    return transformer


def _measure(amp: Amp, model, fused: bool, rounds: int, block: int, variants: tuple[str, ...],
             base: str = "bare") -> dict:
    setups = {v: Setup(v, model, fused, collector=(), device=amp.device) for v in variants}
    try:
        for s in setups.values():
            s.iterate(3)  # warm-up: allocator, cuBLAS handles and autotuning, the agent's first reads
        amp.sync()
        cpu, wall = rotate(setups, rounds, block, settle=amp.sync)
        return {"variants": compare(cpu, wall, base), "rounds": rounds, "block": block}
    finally:
        for s in setups.values():
            s.close()
        del setups
        gc.collect()
        if amp.cuda:
            torch.cuda.empty_cache()


def _detail(name: str, measured: dict, primary: str) -> str:
    v = measured["variants"]
    key = "wall_ratio" if primary == "wall" else "ratio"
    parts = [f"bare {v['bare']['wall_us_per_iter'] / 1000:.3f} ms/iter"]
    for variant, label in (("ampwatch_unasked", "ampwatch"), ("ampwatch", "ampwatch+stepped()"),
                           ("forum", "get_scale() recipe"), ("accelerate", "Accelerate")):
        if variant in v:
            e = v[variant]
            parts.append(f"{label} {e[key]:.3f} [{e[key + '_p25']:.3f}-{e[key + '_p75']:.3f}]")
    within = v["ampwatch_unasked"][key] <= TARGET
    return (f"{name}: " + ", ".join(parts) + f" ({primary} time vs bare; ampwatch "
            f"{'within' if within else 'NOT within'} 1% of bare)")


def run(amp: Amp, quick: bool) -> list[dict]:
    """Time every variant on both models with fused and foreach AdamW; one info check per measurement."""
    variants = ("bare", "ampwatch_unasked", "ampwatch", "forum")
    notes = []
    if importlib.util.find_spec("accelerate") is not None:
        variants += ("accelerate",)
    else:
        notes.append("Accelerate is not installed: its AcceleratedOptimizer is left out")
    if amp.cuda:
        plans = [("mlp", (8, 20) if quick else (30, 40)),
                 (transformer_builder(amp, quick), (4, 3) if quick else (10, 6))]
    else:
        plans = [("mlp", (4, 5) if quick else (20, 20)),
                 (transformer_builder(amp, quick), (3, 2) if quick else (10, 5))]
    primary = "wall" if amp.cuda else "cpu"  # on a shared CPU machine, process CPU time drifts less than wall
    checks = [check("overhead", "note", "info", n) for n in notes]
    for model, (rounds, block) in plans:
        name = model if isinstance(model, str) else model.__name__
        for fused in (True, False):
            bound = "host-bound " if name == "mlp" else "device-bound " if amp.cuda else ""
            label = f"{bound}{name}, AdamW({'fused' if fused else 'foreach'})"
            measured = _measure(amp, model, fused, rounds, block, variants)
            checks.append(check("overhead", f"{name}-{'fused' if fused else 'foreach'}", "info",
                                _detail(label, measured, primary), primary=primary, **measured))
    return checks
