"""Host overhead of the agent per training iteration, as a ratio to a bare loop, plus sync counts.

Two identical setups (small MLP, GradScaler("cpu"), bfloat16 autocast) live in
one process; one is watched (no collector: recording only). Blocks of
iterations alternate between them so drift affects both alike. Reported: the
median per-iteration time of each, their ratio, and the number of
``aten._local_scalar_dense`` calls (host-device syncs) per iteration. On a
busy machine the ratio is within noise; ``agent_hot_path_us_per_iter`` times
the agent's own per-iteration work alone (best of 5), which noise cannot hide.

    python bench/agent_overhead.py            # full run
    python bench/agent_overhead.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampwatch import agent


class SyncCounter(TorchDispatchMode):
    """Count host-device scalar reads."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


class Setup:
    """A model, two optimizers and a scaler; optionally watched."""

    def __init__(self, fused: bool, watched: bool, width: int) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                   nn.Linear(width, 8))
        kw = {"fused": True} if fused else {"foreach": True}
        self.opts = [torch.optim.AdamW(self.model[0].parameters(), lr=1e-3, **kw),
                     torch.optim.AdamW(list(self.model[2].parameters()) + list(self.model[4].parameters()),
                                       lr=1e-3, **kw)]
        self.scaler = torch.amp.GradScaler("cpu")
        self.watch = (agent.watch(self.scaler, {"body": self.opts[0], "head": self.opts[1]},
                                  model=self.model, collector=(), run="bench") if watched else None)
        self.x = torch.randn(32, width)

    def iterate(self, n: int) -> None:
        for _ in range(n):
            for opt in self.opts:
                opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.model(self.x).float().pow(2).mean()
            self.scaler.scale(loss).backward()
            for opt in self.opts:
                self.scaler.step(opt)
            self.scaler.update()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def measure(fused: bool, blocks: int, block: int, width: int) -> dict:
    bare, watched = Setup(fused, False, width), Setup(fused, True, width)
    try:
        bare.iterate(20)
        watched.iterate(20)  # warm-up
        times = {"bare": [], "watched": []}
        for i in range(blocks):
            order = (("bare", bare), ("watched", watched)) if i % 2 == 0 else (("watched", watched), ("bare", bare))
            for name, setup in order:
                start = time.perf_counter()
                setup.iterate(block)
                times[name].append((time.perf_counter() - start) / block)
        syncs = {}
        for name, setup in (("bare", bare), ("watched", watched)):
            with SyncCounter() as counter:
                setup.iterate(10)
            syncs[name] = counter.syncs / 10
        b, w = statistics.median(times["bare"]), statistics.median(times["watched"])
        return {"optimizer": "AdamW(fused=True)" if fused else "AdamW(foreach=True)", "width": width,
                "bare_us_per_iter": round(b * 1e6, 1), "watched_us_per_iter": round(w * 1e6, 1),
                "ratio": round(w / b, 4), "overhead_us_per_iter": round((w - b) * 1e6, 1),
                "syncs_per_iter_bare": syncs["bare"], "syncs_per_iter_watched": syncs["watched"]}
    finally:
        bare.close()
        watched.close()


def agent_hot_path_us(repeats: int = 5, n: int = 5000) -> float:
    """Time the agent's own per-iteration work (two optimizers) on a real, attached recorder; best of repeats."""
    setup = Setup(False, True, 4)
    try:
        setup.iterate(2)
        recorder = setup.watch._recorder
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(n):
                for record in recorder.records:  # what the step wrapper and pre-hook do on a clean step
                    recorder.before_step(record)
                    recorder.on_optimizer_step(record)
                    recorder.after_step(record)
                recorder.after_update(False)  # what the update wrapper does
            best = min(best, (time.perf_counter() - start) / n)
        return round(best * 1e6, 2)
    finally:
        setup.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (a few seconds)")
    parser.add_argument("--width", type=int, default=64,
                        help="MLP width; a small width makes the agent's fixed host cost stand out")
    args = parser.parse_args()
    torch.set_num_threads(1)  # less scheduler noise; both setups alike
    blocks, block = (6, 20) if args.quick else (30, 50)
    print(json.dumps({"agent_hot_path_us_per_iter": agent_hot_path_us()}))
    for fused in (False, True):
        print(json.dumps(measure(fused, blocks, block, args.width)))


if __name__ == "__main__":
    main()
