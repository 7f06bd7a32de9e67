"""Two real ranks over gloo: run the agent under DDP, independent models and ShardedGradScaler.

Run as ``python -m ampwatch_support.ddp_worker OUT_DIR PORT``; each rank writes
``OUT_DIR/rank{r}.json`` with, per scenario and iteration, the ground truth
(did this rank's parameters change?) and what the agent reported. Used by
agent/tests/test_recording_ddp.py, which owns the time limit and the cleanup.
"""

from __future__ import annotations

import sys

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel

from ampwatch_support.ddp_harness import rank_results, scaled_backward

ITERATIONS = 4
INJECT_AT = 2  # iteration at which rank 1 feeds an inf into its input
WORLD_SIZE = 2


def bits(params):
    return [p.detach().view(torch.int32).clone() for p in params]


def scenario(rank: int, kind: str) -> dict:
    from ampwatch import agent

    torch.manual_seed(0)  # same initial weights on both ranks
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = DistributedDataParallel(net) if kind == "ddp" else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu") if kind == "sharded" else torch.amp.GradScaler("cpu")
    truth, reported = [], []
    with agent.watch(scaler, {"net": opt}, model=net, collector=(), run=f"ddp-{kind}") as w:
        for i in range(ITERATIONS):
            scaled_backward(model, opt, scaler, rank=rank, iteration=i, inject=rank == 1 and i == INJECT_AT)
            before = bits(net.parameters())
            scaler.step(opt)
            truth.append(any(not torch.equal(b, p.detach().view(torch.int32))
                             for b, p in zip(before, net.parameters(), strict=True)))
            reported.append(w.stepped(opt))
            scaler.update()
        snapshot = w.snapshot()
    return {"truth": truth, "reported": reported, "state": snapshot["state"], "scaler": snapshot["scaler"],
            "scale": scaler.get_scale()}


def unscaled(rank: int, watched: bool) -> dict:
    """DDP in bf16 without a GradScaler (``watch(None, ..., ddp=model)``): rank 1's inf reaches both ranks."""
    from ampwatch import agent

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = agent.watch(None, {"net": opt}, ddp=model, collector=(), run="ddp-bf16") if watched else None
    poisoned = []  # ground truth: the iterations whose all-reduced gradients held inf/NaN
    for i in range(ITERATIONS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + i))
        if rank == 1 and i == INJECT_AT:
            x[0, 0] = float("inf")
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().pow(2).mean().backward()
        if not all(bool(torch.isfinite(p.grad).all()) for p in net.parameters()):
            poisoned.append(i)
        opt.step()
    result = {"poisoned": poisoned, "bits": [b.reshape(-1).tolist() for b in bits(net.parameters())]}
    if w is not None:
        w.close()
        result.update(state=w.snapshot()["state"],
                      events=[e for e in w._recorder.events.drain() if e["kind"] == "poisoned_step"])
    return result


def main(rank: int, out_dir: str, port: int) -> None:
    with rank_results(rank, WORLD_SIZE, out_dir, port, AMPWATCH_RUN="ddp-test") as results:
        results.update({kind: scenario(rank, kind) for kind in ("ddp", "independent", "sharded")})
        results["unscaled"], results["unscaled_plain"] = unscaled(rank, True), unscaled(rank, False)


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD_SIZE, join=True)
