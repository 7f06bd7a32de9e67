"""Train a small model with AMP on 2 CPU ranks (DDP over gloo) and watch GradScaler skips with ampwatch.

One rank's input is set to inf for a window of iterations (``--inject-at``,
``--inject-for``); DDP's all-reduce spreads the inf to every rank's gradients,
so every rank skips those steps, the loss scale backs off, and training
recovers. At the end each rank prints what the agent saw.

    python examples/ddp_train.py                                  # spawns 2 ranks, records locally
    python examples/ddp_train.py --collector http://127.0.0.1:9457 --run demo
    torchrun --nproc-per-node 2 examples/ddp_train.py            # torchrun works too

The agent reads AMPWATCH_URL, AMPWATCH_RUN, ... when the flags are not given
(see docs/agent.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampwatch import agent


class Regressor(nn.Module):
    """A small MLP: a ``body`` and a ``head``, each with its own optimizer."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="AMP training on CPU ranks over gloo, with injected overflow, watched by ampwatch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--iterations", type=int, default=60, help="training iterations")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per iteration")
    parser.add_argument("--inject-rank", type=int, default=0,
                        help="rank whose input is set to inf during the injection window")
    parser.add_argument("--inject-at", type=int, default=20, help="first iteration with injected overflow")
    parser.add_argument("--inject-for", type=int, default=4, help="iterations with overflow (0: none)")
    parser.add_argument("--growth-interval", type=int, default=10,
                        help="GradScaler growth_interval: clean iterations before the scale grows")
    parser.add_argument("--collector", default=None,
                        help="collector URL(s), comma-separated (default: AMPWATCH_URL; none: record only)")
    parser.add_argument("--run", default=None,
                        help="run id (default: AMPWATCH_RUN, else the launcher's, else agreed among ranks)")
    parser.add_argument("--push-interval", type=float, default=None,
                        help="seconds between batches to the collector (default: AMPWATCH_PUSH_INTERVAL or 15; "
                             "news goes at once)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (the same on every rank)")
    parser.add_argument("--sleep", type=float, default=0.0,
                        help="seconds to pause after each iteration (paces the job so a collector sees it live)")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.iterations < 1 or args.inject_for < 0:
        parser.error("--ranks and --iterations must be >= 1, --inject-for >= 0")
    return args


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Run one rank: DDP model, two optimizers, a GradScaler watched by ampwatch."""
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(Regressor())
    opt_body = torch.optim.AdamW(model.module.body.parameters(), lr=1e-3)
    opt_head = torch.optim.SGD(model.module.head.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(opt_body, step_size=20, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", growth_interval=args.growth_interval)
    watch = agent.watch(scaler, {"body": opt_body, "head": opt_head}, model=model.module,
                        collector=args.collector, run=args.run, push_interval=args.push_interval)
    data = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own shard
    target_weights = torch.randn(16, 1, generator=torch.Generator().manual_seed(args.seed))
    inject = range(args.inject_at, args.inject_at + args.inject_for)
    started = time.perf_counter()
    for iteration in range(args.iterations):
        x = torch.randn(args.batch_size, 16, generator=data)
        y = torch.sin(x @ target_weights)
        if rank == args.inject_rank and iteration in inject:
            x[0, 0] = float("inf")  # one bad sample on one rank: all-reduce spreads it to every rank
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt_body.zero_grad(set_to_none=True)
        opt_head.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt_body)  # clip per optimizer: one shared clip would spread NaN across them
        norm = torch.nn.utils.clip_grad_norm_(model.module.body.parameters(), 1.0)
        watch.grad_norm(norm, opt_body)  # watched for spikes, read without a sync
        scaler.step(opt_body)
        scaler.step(opt_head)
        scaler.update()
        if watch.stepped(opt_body):  # a skipped step must not advance the LR schedule
            schedule.step()
        if args.sleep:
            time.sleep(args.sleep)
    elapsed = time.perf_counter() - started
    watch.close()
    _print_in_rank_order(rank, world_size, f"rank {rank} ({elapsed:.1f} s, {args.iterations} iterations)\n"
                         + "  " + watch.summary().replace("\n", "\n  "))


def _print_in_rank_order(rank: int, world_size: int, text: str) -> None:
    """Print ``text`` from every rank, rank 0 first."""
    for turn in range(world_size):
        if turn == rank:
            print(text, flush=True)
        dist.barrier()


def _spawned(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """Entry point of a spawned rank."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        train(rank, world_size, args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Run under torchrun when launched by it, else spawn ``--ranks`` processes."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks share a few CPU cores
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_spawned, args=(args.ranks, port, args), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
