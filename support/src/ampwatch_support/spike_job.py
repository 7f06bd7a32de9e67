"""A gloo DDP job watched for spikes: a planted loss spike, one rank's gradients x1,000, or a healthy run.

Run by tests/test_spikes_e2e.py as a separate process:

    python -m ampwatch_support.spike_job --collector URL --run RUN --ranks 2 --scenario loss --iterations 200

Every rank regresses a fixed random target through a small MLP on fresh batches of its own (a seeded generator
per rank: ordinary noise), under ``torch.autocast("cpu", dtype=torch.bfloat16)`` with a real
``GradScaler("cpu")``, a linear learning-rate warm-up over ``--warmup`` iterations, the job's own
``clip_grad_norm_`` handed to the agent (``watch.grad_norm``) and ``ddp=model`` watched (each rank's own
gradient norm before DDP's all-reduce). Scenarios:

- ``loss``: rank ``--odd-rank``'s inputs are multiplied by 100 at iteration ``--at`` (one bad batch).
- ``gradient``: rank ``--odd-rank``'s gradients are multiplied by 1,000 at ``--count`` seeded random iterations
  after the spike window filled, by tensor hooks on its parameters put on before ``watch()`` (so they come first:
  the agent sees the gradients a faulty device made).
- ``healthy``: nothing planted.

Each rank writes ``--out/rank{r}.json``: the iterations planted, and every iteration's loss and gradient norm as the
job itself read them (after training: never a read in the loop the agent could be blamed for).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampwatch import agent
from ampwatch_support.ports import free_port

FEATURES = 16
BATCH = 64
TARGET_SEED = 11


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def _planted(args: argparse.Namespace, rank: int) -> list[int]:
    if rank != args.odd_rank or args.scenario == "healthy":
        return []
    if args.scenario == "loss":
        return [args.at]
    draw = random.Random(f"{args.run}/{args.seed}")
    return sorted(draw.sample(range(args.after, args.iterations), args.count))


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # 4 ranks on 2 cores: each of torch's threads more would only wait for a core
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    net = _net()
    planted = _planted(args, rank)
    glitch = {"on": False}
    if args.scenario == "gradient" and planted:
        for param in net.parameters():  # before watch(): these hooks run before the agent's
            param.register_hook(lambda grad: grad * 1000.0 if glitch["on"] else grad)
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=100_000)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1.0, (it + 1) / args.warmup))
    watch = agent.watch(scaler, opt, ddp=model, collector=args.collector, run=args.run, push_interval=0.5)
    target = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(TARGET_SEED))
    data = torch.Generator().manual_seed(1000 * args.seed + rank)
    losses: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []
    for iteration in range(args.iterations):
        x = torch.randn(BATCH, FEATURES, generator=data)
        y = torch.tanh(x @ target) + 0.1 * torch.randn(BATCH, 1, generator=data)
        if args.scenario == "loss" and iteration in planted:
            x = x * 100.0
        glitch["on"] = args.scenario == "gradient" and iteration in planted
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (model(x).float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=args.max_norm)
        watch.grad_norm(norm)
        scaler.step(opt)
        scaler.update()
        warmup.step()
        losses.append(loss.detach())
        norms.append(norm.detach())
    watch.close()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"planted": planted, "losses": torch.stack(losses).tolist(),
                   "grad_norms": torch.stack(norms).tolist()}, f)
    gc.collect()  # DDP objects in reference cycles freed now: at interpreter exit, gloo aborts
    dist.destroy_process_group()


def main() -> int:
    """Spawn the ranks and wait for them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collector", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--out", required=True, help="folder for each rank's rank{r}.json")
    parser.add_argument("--scenario", choices=("loss", "gradient", "healthy"), required=True)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--odd-rank", type=int, default=1, help="the rank whose batch or gradients are planted")
    parser.add_argument("--at", type=int, default=150, help="loss: the iteration of the bad batch")
    parser.add_argument("--count", type=int, default=3, help="gradient: how many iterations are multiplied")
    parser.add_argument("--after", type=int, default=140, help="gradient: planted iterations are drawn from here on")
    parser.add_argument("--seed", type=int, default=0, help="the data's seed (each rank's is derived from it)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=200, help="iterations of the linear learning-rate warm-up")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip_grad_norm_'s max_norm")
    args = parser.parse_args()
    if not 0 <= args.odd_rank < args.ranks:
        parser.error(f"--odd-rank {args.odd_rank} is not a rank of {args.ranks}")
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    mp.spawn(_rank, args=(free_port(), args), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
