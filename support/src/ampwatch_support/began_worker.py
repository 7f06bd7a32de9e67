"""Two real ranks over gloo: where a skip's inf/NaN began, named only by the rank where it began.

Run as ``python -m ampwatch_support.began_worker OUT_DIR PORT``; each rank writes ``OUT_DIR/rank{r}.json`` with,
per scenario, the watched run and its unwatched twin (:func:`ampwatch_support.began_job.run` over a
DistributedDataParallel :class:`~ampwatch_support.began_job.Tower`, GradScaler("cpu"), bf16 autocast). Used by
agent/tests/test_where_it_began.py, which owns the time limit and the judging.

- ``backward``: rank 0's gradient goes inf at ``p3`` in iteration 1 (every rank skips: DDP averages it);
- ``forward``: rank 1's ``spike`` returns inf in iterations 1 and 3.
"""

from __future__ import annotations

import sys

import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from ampwatch_support.began_job import run
from ampwatch_support.ddp_harness import rank_results

WORLD_SIZE = 2

SCENARIOS = {"backward": {"backward_at": {0: frozenset({1})}},
             "forward": {"forward_at": {1: frozenset({1, 3})}}}


def _watch(scaler, opt, model):
    from ampwatch import agent

    return agent.watch(scaler, opt, collector=(), run="began", ddp=model)


def main(rank: int, out_dir: str, port: int) -> None:
    torch.set_num_threads(1)
    with rank_results(rank, WORLD_SIZE, out_dir, port) as results:
        for name, planted in SCENARIOS.items():
            where = {key: at.get(rank, frozenset()) for key, at in planted.items()}
            results[name] = {kind: run(_watch if kind == "watched" else None, scaled=True, iterations=5, rank=rank,
                                       wrap=DistributedDataParallel, **where)
                             for kind in ("watched", "twin")}


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD_SIZE, join=True)
