"""Real FSDP2 over gloo with a plain gradient before the ``DTensor`` ones: a scaler-less bf16 job, two ranks.

Run as ``python -m ampwatch_support.fsdp_plain_first_worker OUT_DIR PORT``; each rank writes
``OUT_DIR/rank{r}.json`` with, per scenario, the ground truth (the steps whose gradients on this rank held
inf/NaN), what the agent reported and the bits of this rank's parameters at the end. Used by
agent/tests/test_fsdp.py, which owns the time limit and the cleanup.

The first layer's parameters stay plain tensors and come first in the optimizer, the others are sharded:

- ``ignored``: ``fully_shard(net, ignored_params=<the first layer's>)``;
- ``unsharded``: the first layer never passed to ``fully_shard`` (only the later layers are).

Each layout trains watched by ``watch(None, ...)``, watched with a disabled GradScaler (``enabled=False``, the
usual bf16 recipe; ``scaler.step(opt)``) and unwatched. An inf is planted into rank 0's plain gradient of
``0.weight`` at one step and into rank 1's shard of ``2.weight``'s gradient at another (an ignored parameter's
gradient is not reduced, and a shard is this rank's own: each poisons that rank's step only). After every step
the non-finite values are put back to 0 in the weights and Adam's moments, the same way in every run, so that
each planted step is a poisoned step of its own.
"""

from __future__ import annotations

import sys

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from ampwatch_support.ddp_harness import rank_results
from ampwatch_support.fsdp_worker import _result, grads_finite, local, shard_bits

STEPS = 6
PLANTED = {1: (0, "0.weight"), 4: (1, "2.weight")}  # step -> (rank, the parameter whose gradient gets an inf)
LAYOUTS = ("ignored", "unsharded")
WORLD_SIZE = 2


def _net(layout: str) -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (net[2], net[4]):
        fully_shard(layer)
    if layout == "ignored":
        fully_shard(net, ignored_params={net[0].weight, net[0].bias})
    return net


def repair(net: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Put 0 for every inf/NaN in this rank's weights and Adam's moments (the same in every run)."""
    with torch.no_grad():
        for param in net.parameters():
            local(param).nan_to_num_(0.0, 0.0, 0.0)
        for state in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                local(state[key]).nan_to_num_(0.0, 0.0, 0.0)


def run(rank: int, layout: str, watched: str | None) -> dict:
    """Train ``layout``; ``watched``: ``"none"`` (``watch(None)``), ``"disabled"`` (a disabled scaler) or None."""
    from ampwatch import agent

    net = _net(layout)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False) if watched == "disabled" else None
    w = agent.watch(scaler, {"net": opt}, model=net, collector=(), run="fsdp-plain-first") if watched else None
    poisoned, grad_types = [], []
    try:
        for step in range(STEPS):
            opt.zero_grad()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + step))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(x).float().pow(2).mean()
            loss.backward()
            grad_types = grad_types or [type(p.grad).__name__ for p in net.parameters()]
            if PLANTED.get(step, (None,))[0] == rank:
                local(net.get_parameter(PLANTED[step][1]).grad)[0, 0] = float("inf")
            if not grads_finite(net):
                poisoned.append(step)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            repair(net, opt)
    finally:
        result = _result(w)
    return {**result, "poisoned": poisoned, "bits": shard_bits(net), "grad_types": grad_types}


def main(rank: int, out_dir: str, port: int) -> None:
    with rank_results(rank, WORLD_SIZE, out_dir, port) as results:
        results.update({f"{layout}/{watched}": run(rank, layout, None if watched == "plain" else watched)
                        for layout in LAYOUTS for watched in ("none", "disabled", "plain")})


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD_SIZE, join=True)
