"""A 2-process Lightning DDP fit over gloo with AmpWatchCallback; each rank writes its ground truth.

Run by tests/test_integration_lightning.py as ``python tests/lightning_ddp_job.py OUT_DIR``
with ``AMPWATCH_URL`` set and no run id: Lightning's launcher starts rank 1 by running
this script again, and the ranks agree on a run id by themselves. Rank 0's input
holds an inf at batches 1 and 2, rank 1's at batch 4: DDP's all-reduce makes both
ranks skip at all three. The callback's ``log_metrics`` logs to a logger that, unlike
Lightning's own, is not limited to rank 0: what reaches it is what the callback sent.

``python tests/lightning_ddp_job.py OUT_DIR ddp fsdp2``: that fit, then in the same processes the same module
sharded with FSDP2
(``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``) in bf16 without a scaler:
rank 0's inf at batch 1 reaches both ranks' gradient shards, so each rank's steps from there
on are poisoned.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings

import torch
from lightning.pytorch.loggers import Logger

from ampwatch.agent.lightning import AmpWatchCallback
from ampwatch_support.framework_truth import watch_counts
from ampwatch_support.lightning_job import OneOptimizer, data, fp16_plugin, trainer

POISON = {1: (0,), 2: (0,), 4: (1,)}


class Sharded(OneOptimizer):
    """:class:`OneOptimizer` with each layer and the whole net sharded by FSDP2 over the data-parallel ranks."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class EveryRankLogger(Logger):
    """Counts the metrics logged under ``ampwatch/`` on this rank (Lightning's loggers log on rank 0 only)."""

    name, version = "every-rank", 0
    ampwatch_calls = 0

    def log_metrics(self, metrics, step=None):
        if any(key.startswith("ampwatch/") for key in metrics):
            self.ampwatch_calls += 1

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def main(out_dir: str, *kinds: str) -> None:
    for kind in kinds or ("ddp",):
        fit_one(out_dir, kind)
    # Lightning leaves the process group up after a fit. The fits' modules and trainers, left in
    # reference cycles, would be freed at interpreter exit with it still up, and gloo then aborts
    # the rank now and then ('terminate called without an active exception'): free them first.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def fit_one(out_dir: str, kind: str) -> None:
    """One fit; its results in ``rank{r}.json`` (``ddp``) or ``rank{r}-fsdp2.json``."""
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging
    torch.manual_seed(0)
    logger = EveryRankLogger()
    if kind == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        callback = AmpWatchCallback(collector=())  # counts only: the ddp fit is the one a collector follows
        module: OneOptimizer = Sharded({1: (0,)})
        fit = trainer(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), devices=2,
                      max_epochs=1, callbacks=[callback], precision="bf16-mixed")
    else:
        callback = AmpWatchCallback(log_metrics=True)
        module = OneOptimizer(POISON)
        fit = trainer(strategy="ddp", devices=2, max_epochs=2, callbacks=[callback], logger=logger,
                      log_every_n_steps=1, plugins=[fp16_plugin(init_scale=1024.0, growth_interval=2)])
    fit.fit(module, data(batches=12))  # 6 per rank and epoch
    name = f"rank{fit.global_rank}.json" if kind == "ddp" else f"rank{fit.global_rank}-{kind}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        snapshot = callback.watch.snapshot()
        json.dump({"truth": module.truth.counts(), "watch": watch_counts(snapshot),
                   "closed": callback.watch.closed, "scheduler_steps": module.scheduler_steps,
                   "scaler": snapshot["scaler"], "agent_errors": snapshot["state"]["delivery"]["agent_errors"],
                   "sharded": type(next(module.parameters())).__name__ == "DTensor",
                   "ampwatch_logged": logger.ampwatch_calls}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
