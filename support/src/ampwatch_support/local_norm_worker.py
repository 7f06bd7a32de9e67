"""Real ranks over gloo: one rank's own gradients x1,000 at three random iterations, watched with ``ddp=``.

Run as ``python -m ampwatch_support.local_norm_worker OUT_DIR PORT``; each rank writes ``OUT_DIR/rank{r}.json``
with, per mode (a GradScaler with bf16 autocast; bf16 without a scaler, in two micro-batches, three at the
spiked iterations: the later iterations leave the third note's row unwritten, and it must not count), the local
``grad_norm_spike`` events the agent recorded, its ``local_grad_norm`` level, and the ground truth: this rank's
own gradient norm per iteration, the infinity norm (the largest absolute value of its gradients, unscaled; with
accumulation, of every micro-batch's), taken by a tensor hook on each parameter registered before the agent's (it
sees what the agent sees).
Used by agent/tests/test_local_grad_norm.py, which owns the time limit and the cleanup.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import sys

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampwatch_support.ddp_harness import rank_results

WORLD_SIZE = 3
SPIKED_RANK = 1
WINDOW = 32  # AMPWATCH_SPIKE_WINDOW: a short window, a short run
# Three random iterations, one in each of three windows.
SPIKED_AT = [start + offset for start, offset in zip((40, 80, 120), random.Random(40).sample(range(5), 3),
                                                     strict=True)]
ITERATIONS = 130
SKIPPED_AT = 60  # with the GradScaler, rank 0's input holds an inf: every rank skips, rank 0's own norm is inf
NAN_AT = ITERATIONS - 1  # without a scaler, a NaN in the spiked rank's own gradients: a step that goes through


def train(rank: int, scaled: bool) -> dict:
    from ampwatch import agent

    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    iteration = 0
    # The truth: this rank's own largest absolute gradient value (as scaled) per iteration (maximum: NaN wins).
    largest = [torch.zeros((), dtype=torch.float64) for _ in range(ITERATIONS)]

    def spike_and_measure(grad: torch.Tensor) -> torch.Tensor:
        if rank == SPIKED_RANK and iteration in SPIKED_AT:
            grad = grad * 1000.0
        if rank == SPIKED_RANK and scaler is None and iteration == NAN_AT:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
        largest[iteration] = torch.maximum(largest[iteration], grad.detach().abs().amax().double())
        return grad

    for param in net.parameters():  # before watch(): the agent's hook sees what these leave
        param.register_hook(spike_and_measure)
    w = agent.watch(scaler, {"net": opt}, ddp=model, collector=(), run="local-norm")
    norms = []
    for iteration in range(ITERATIONS):  # noqa: B007 - the hook reads it
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * rank + iteration))
        w.batch(range(1000 * rank + 8 * iteration, 1000 * rank + 8 * iteration + 8))  # the iteration's sample ids
        opt.zero_grad()
        if scaler is not None:
            if rank == 0 and iteration == SKIPPED_AT:
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:  # micro-batches, all but the last without DDP's all-reduce: the norm is of all their gradients
            scale = 1.0
            cuts = (0, 4, 6, 8) if iteration in SPIKED_AT else (0, 4, 8)
            for start, end in itertools.pairwise(cuts):
                with (model.no_sync() if end < 8 else contextlib.nullcontext()), \
                        torch.autocast("cpu", dtype=torch.bfloat16):
                    model(x[start:end]).float().pow(2).mean().backward()
            opt.step()
        norms.append(float(largest[iteration]) / scale)
    w.close()
    events = w._recorder.events.drain()
    return {"norms": norms, "events": [e for e in events if e["kind"] == "grad_norm_spike" and e.get("local")],
            "skipped": [e["iteration"] for e in events if e["kind"] == "skip"], "state": w.snapshot()["state"]}


def main(rank: int, out_dir: str, port: int) -> None:
    with rank_results(rank, WORLD_SIZE, out_dir, port, AMPWATCH_RUN="local-norm",
                      AMPWATCH_SPIKE_WINDOW=str(WINDOW)) as results:
        results["spiked_at"], results["skipped_at"], results["window"] = SPIKED_AT, SKIPPED_AT, WINDOW
        results["nan_at"] = NAN_AT
        results["scaled"], results["unscaled"] = train(rank, True), train(rank, False)


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD_SIZE, join=True)
