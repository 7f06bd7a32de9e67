"""Two real ranks over gloo train on a shuffled DistributedSampler whose sample 13 holds an inf: which batch was it?

Run as ``python -m ampwatch_support.samples_worker OUT_DIR PORT``; each rank writes ``OUT_DIR/rank{r}.json`` with
the indices of every batch it trained on (the truth, from the batch itself) and every skip the watch recorded,
``[iteration, origin, samples ids, samples_before iterations]``. The watch follows the loader (``loader=``) and
DDP (``ddp=``). Used by agent/tests/test_samples_across_ranks.py, which owns the time limit and the judging.
"""

from __future__ import annotations

import sys

import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ampwatch_support.ddp_harness import rank_results

WORLD_SIZE, BAD, EPOCHS = 2, 13, 4


class Indexed(Dataset):
    """24 samples of 8 values, each with its own index; sample 13 holds an inf."""

    def __init__(self) -> None:
        self.x = torch.randn(24, 8, generator=torch.Generator().manual_seed(1))
        self.x[BAD, 0] = float("inf")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.x[index], index


def main(rank: int, out_dir: str, port: int) -> None:
    from ampwatch import agent

    with rank_results(rank, WORLD_SIZE, out_dir, port) as results:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        data = Indexed()
        sampler = DistributedSampler(data, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=5)
        loader = DataLoader(data, batch_size=3, sampler=sampler, num_workers=1)
        watch = agent.watch(scaler, opt, model=model, ddp=ddp, loader=loader, collector=(), run="samples")
        trained = []
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, index in loader:
                trained.append(index.tolist())
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = ddp(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        results["trained"] = trained
        results["skips"] = [[e["iteration"], e.get("origin"), e["samples"]["ids"],
                             [b["iteration"] for b in e.get("samples_before", [])]]
                            for e in watch._recorder.events.drain() if e["kind"] == "skip"]
        watch.close()
        del ddp


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD_SIZE, join=True)
