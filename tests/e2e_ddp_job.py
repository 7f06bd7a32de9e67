"""A 2-rank gloo DDP job watched by the ampwatch agent, with overflow injected at chosen iterations.

Run by tests/test_prometheus_e2e.py as a separate process:

    python tests/e2e_ddp_job.py --collector URL --run RUN --iterations 150 --overflow-at 30-37 --sleep 0.05

On an overflow iteration rank 0's input holds an inf; DDP's all-reduce spreads it to
both ranks' gradients, so both ranks skip both optimizers and back the scale off; rank 0 alone is
reported as the origin. On a spike iteration (``--spike-at``) rank 0's input is 100 times larger,
finite: its loss spikes, its own gradient norm before the all-reduce stands out from rank 1's (a
gradient outlier), and the all-reduced norm both ranks step with spikes. The agent watches each
optimizer's gradient norm (``grad_norm=True``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampwatch import agent
from ampwatch_support.ports import free_port


def _iterations(spec: str) -> set[int]:
    # "30-37,50,60" -> {30, ..., 37, 50, 60}
    found: set[int] = set()
    for part in filter(None, spec.split(",")):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)))
    body, head = model.module[0], model.module[2]
    opt_body = torch.optim.AdamW(body.parameters(), lr=1e-3)
    opt_head = torch.optim.SGD(head.parameters(), lr=1e-2)
    # A long growth interval: the scale only moves by backoffs here.
    scaler = torch.amp.GradScaler("cpu", growth_interval=100_000)
    # ddp=: the agent also reports which rank's own gradients held the inf before the all-reduce (rank 0).
    watch = agent.watch(scaler, {"body": opt_body, "head": opt_head}, ddp=model, grad_norm=True,
                        collector=args.collector, run=args.run, push_interval=0.2)
    overflow, spikes = _iterations(args.overflow_at), _iterations(args.spike_at)
    data = torch.Generator().manual_seed(rank)
    for iteration in range(args.iterations):
        x = torch.randn(16, 8, generator=data)
        if rank == 0 and iteration in overflow:
            x[0, 0] = float("inf")
        if rank == 0 and iteration in spikes:
            x *= 100
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        opt_body.zero_grad(set_to_none=True)
        opt_head.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt_body)
        scaler.step(opt_head)
        scaler.update()
        # Pace the job so that Prometheus scrapes it while it runs, and its streaks while they last.
        time.sleep(args.overflow_sleep if iteration in overflow else args.sleep)
    watch.close()
    gc.collect()  # DDP/FSDP objects in reference cycles freed now: at interpreter exit, gloo aborts
    dist.destroy_process_group()


def main() -> int:
    """Spawn the two ranks and wait for them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collector", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--overflow-at", default="", help="iterations with an inf input, e.g. 30-37,50")
    parser.add_argument("--spike-at", default="", help="iterations whose input on rank 0 is 100 times larger")
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds to sleep after each iteration")
    parser.add_argument("--overflow-sleep", type=float, default=None,
                        help="seconds to sleep after an overflow iteration (default: --sleep)")
    args = parser.parse_args()
    if args.overflow_sleep is None:
        args.overflow_sleep = args.sleep
    torch.set_num_threads(1)
    mp.spawn(_rank, args=(free_port(), args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
