"""A gloo DDP job over a real DataLoader, watched with ``loader=``: bad data, a faulty device, or a settling scale.

Run by tests/test_diagnosis_e2e.py as a separate process:

    python -m ampwatch_support.diagnosis_job --collector URL --run RUN --ranks 3 --epochs 4 --scenario data

Scenarios (each rank trains on its DistributedSampler share of 48 samples, reshuffled every epoch):

- ``data``: sample :data:`BAD_SAMPLE`'s input holds an inf, so the loss of whichever rank draws it is not finite
  (the forward made it) and the whole job skips that step; the rank that drew it is the origin.
- ``device``: rank ``--faulty-rank`` corrupts one of its own gradients at seeded random iterations, whatever the
  data, in backward (a simulated faulty GPU); the rest of the job's data is clean.
- ``calibration``: a scaler that starts at 2**127 with a loss 2**20 times larger (and a learning rate 2**20 times
  smaller: the same training), so every rank overflows until the scale settles (backing off 256x at a time, it
  settles well below any batch's overflow), and at
  the iterations ``--whole-job-at`` every rank's input holds an inf at once.

Each rank writes, to ``--out/rank{r}.json``, the sample ids it drew per iteration and the iterations it corrupted,
so the test computes the truth from what really ran.
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ampwatch import agent
from ampwatch_support.ports import free_port

SAMPLES = 48
BAD_SAMPLE = 13
BATCH = 4


class Numbers(Dataset):
    """Sample ``i`` is a fixed random vector; :data:`BAD_SAMPLE`'s holds an inf in the ``data`` scenario."""

    def __init__(self, poisoned: bool) -> None:
        self.x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(7))
        if poisoned:
            self.x[BAD_SAMPLE, 3] = float("inf")

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.x[index]


class _Glitch(torch.autograd.Function):
    """Identity forward; in backward, the gradient turned inf (a faulty device's arithmetic)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205 - autograd's signature
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad * float("inf")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.glitch = False  # set per iteration on the faulty rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        if self.glitch:
            h = _Glitch.apply(h)
        return self.head(torch.relu(self.block(h)))


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    net = Net()
    model = DistributedDataParallel(net)
    settling = args.scenario == "calibration"
    gain = 2.0 ** 20 if settling else 1.0
    opt = torch.optim.SGD(model.parameters(), lr=1e-3 / gain)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127 if settling else 2.0 ** 16,
                                  backoff_factor=2.0 ** -8 if settling else 0.5, growth_interval=100_000)
    sampler = DistributedSampler(Numbers(False), num_replicas=args.ranks, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(Numbers(args.scenario == "data"), batch_size=BATCH, sampler=sampler)
    watch = agent.watch(scaler, opt, ddp=model, loader=loader, collector=args.collector, run=args.run,
                        push_interval=0.2)
    faults = random.Random(f"{args.run}/{rank}")
    drawn: list[list[int]] = []
    glitched: list[int] = []
    iteration = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, x in loader:
            drawn.append(ids.tolist())
            net.glitch = args.scenario == "device" and rank == args.faulty_rank and iteration > 2 and \
                faults.random() < 0.25
            if net.glitch:
                glitched.append(iteration)
            if args.scenario == "calibration" and iteration in args.whole_job_at:
                x = x.clone()
                x[0, 0] = float("inf")
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean() * gain
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            iteration += 1
    watch.close()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"drawn": drawn, "glitched": glitched}, f)
    gc.collect()  # DDP objects in reference cycles freed now: at interpreter exit, gloo aborts
    dist.destroy_process_group()


def main() -> int:
    """Spawn the ranks and wait for them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collector", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--out", required=True, help="folder for each rank's rank{r}.json")
    parser.add_argument("--scenario", choices=("data", "device", "calibration"), required=True)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="the sampler's shuffle seed")
    parser.add_argument("--faulty-rank", type=int, default=1)
    parser.add_argument("--whole-job-at", type=lambda text: {int(i) for i in text.split(",")}, default={12},
                        help="iterations where every rank's input holds an inf, e.g. 14,26")
    args = parser.parse_args()
    torch.set_num_threads(1)
    mp.spawn(_rank, args=(free_port(), args), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
