"""A plain training loop on CPU, watched by ampwatch: float16 with a real GradScaler, or bf16 without one.

    python examples/plain_loop_cpu.py            # float16 + torch.amp.GradScaler("cpu"): batch 3 skips (and the first)
    python examples/plain_loop_cpu.py --bf16     # bf16 autocast, no scaler: batch 3 is a poisoned step

Batch 3 holds an inf. With a GradScaler the step is skipped and the scale backs off: training goes
on (the first step skips too: the scale starts at 2**16 and calibrates, which is normal). In bf16 nothing
skips: the inf reaches the weights, and every step after it applies NaN.
Set AMPWATCH_URL (and AMPWATCH_TOKEN, if the collector asks for one) to send it to a collector.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from ampwatch import agent


def main(argv: list[str] | None = None) -> agent.Watch:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bf16", action="store_true", help="bf16 without a GradScaler")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = torch.bfloat16 if args.bf16 else torch.float16
    scaler = None if args.bf16 else torch.amp.GradScaler("cpu")   # on a GPU: GradScaler("cuda")
    watch = agent.watch(scaler, opt, model=model, run="plain-loop-cpu")
    for i in range(8):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        if i == 3:
            x[0, 0] = float("inf")
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    watch.close()
    print(watch.summary())
    return watch


if __name__ == "__main__":
    main()
