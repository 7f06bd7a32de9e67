"""Accelerate on CPU, watched by ampwatch: float16 with a real GradScaler, or bf16 without one.

    python examples/accelerate_cpu.py            # float16 + a real GradScaler: step 3 skips (and the first)
    python examples/accelerate_cpu.py --bf16     # mixed_precision="bf16", no scaler: step 3 is a poisoned step

Accelerate makes a GradScaler only for fp16 on a GPU; with mixed_precision="fp16" on CPU it
trains in float32. To get the GPU's code path on CPU, give the Accelerator what it gets on a GPU,
before ``prepare``: ``native_amp`` and a ``torch.amp.GradScaler("cpu")``. On a GPU,
Accelerator(mixed_precision="fp16") is all it takes. Set AMPWATCH_URL to send it to a collector.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator

from ampwatch.agent import accelerate as ampwatch


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bf16", action="store_true", help="mixed_precision='bf16', no GradScaler")
    args = parser.parse_args(argv)
    accelerator = Accelerator(mixed_precision="bf16" if args.bf16 else "fp16", cpu=True)
    if not args.bf16:  # what Accelerate does for fp16 on a GPU, here with a CPU GradScaler
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    watch = ampwatch.watch(accelerator, opt, schedulers=sched, model=model, run="accelerate-cpu")
    for step in range(8):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        if step == 3:
            x[0, 0] = float("inf")
        accelerator.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    watch.close()
    print(watch.summary())
    return watch


if __name__ == "__main__":
    main()
