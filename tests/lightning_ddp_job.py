"""A 2-process Lightning DDP fit over gloo with AmpWatchCallback; each rank writes its ground truth.

Run by tests/test_integration_lightning.py as ``python tests/lightning_ddp_job.py OUT_DIR``
with ``AMPWATCH_URL`` set and no run id: Lightning's launcher starts rank 1 by running
this script again, and the ranks agree on a run id by themselves. Rank 0's input
holds an inf at batches 1 and 2, rank 1's at batch 4: DDP's all-reduce makes both
ranks skip at all three. The callback's ``log_metrics`` logs to a logger that, unlike
Lightning's own, is not limited to rank 0: what reaches it is what the callback sent.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))

import torch  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402

from ampwatch.agent.lightning import AmpWatchCallback  # noqa: E402
from framework_truth import watch_counts  # noqa: E402
from lightning_job import OneOptimizer, data, fp16_plugin, trainer  # noqa: E402

POISON = {1: (0,), 2: (0,), 4: (1,)}


class EveryRankLogger(Logger):
    """Counts the metrics logged under ``ampwatch/`` on this rank (Lightning's loggers log on rank 0 only)."""

    name, version = "every-rank", 0
    ampwatch_calls = 0

    def log_metrics(self, metrics, step=None):
        if any(key.startswith("ampwatch/") for key in metrics):
            self.ampwatch_calls += 1

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def main(out_dir: str) -> None:
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging
    torch.manual_seed(0)
    module = OneOptimizer(POISON)
    callback = AmpWatchCallback(log_metrics=True)
    logger = EveryRankLogger()
    fit = trainer(strategy="ddp", devices=2, max_epochs=2, callbacks=[callback], logger=logger, log_every_n_steps=1,
                  plugins=[fp16_plugin(init_scale=1024.0, growth_interval=2)])
    fit.fit(module, data(batches=12))  # 6 per rank and epoch
    with open(os.path.join(out_dir, f"rank{fit.global_rank}.json"), "w") as f:
        json.dump({"truth": module.truth.counts(), "watch": watch_counts(callback.watch.snapshot()),
                   "closed": callback.watch.closed, "scheduler_steps": module.scheduler_steps,
                   "ampwatch_logged": logger.ampwatch_calls}, f)


if __name__ == "__main__":
    main(sys.argv[1])
