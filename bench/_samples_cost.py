"""What recording sample ids costs on the host (issue 39): ``watch.batch()`` per iteration, a followed loader per batch.

Measured as the difference to a baseline timed in the same process, in rotating blocks (a shared machine's drift
hits both alike), never asserted in a test:

- ``batch``: the recorder's calls of a clean iteration (two optimizers, as ``agent_hot_path_us``) with and without
  ``watch.batch(ids)`` of 32 ids, as a list and as a CPU tensor; the extra is what ``batch()`` and the update's
  taking of the ids add.
- ``loader``: one epoch of a DataLoader (batches of 32 ints, ``num_workers=0``: the loop's own thread does all of
  it) plain (torch's iterator class as shipped), beside another loader that a watch follows (the wrappers are
  on the class; this loader is not followed), and followed; the extra per batch of each.

    python -m bench._samples_cost
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader

from bench._loops import pct

__all__ = ["sample_recording_us"]


def _rotate(variants: dict[str, Callable[[], int]], rounds: int) -> dict[str, list[float]]:
    """Run each variant once per round, in rotating order; return each one's CPU seconds per unit, per round."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.process_time()
            units = variants[name]()
            times[name].append((time.process_time() - start) / units)
    return times


def _extra(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    out = {}
    for name, values in times.items():
        diffs = [v - b for v, b in zip(values, times[base], strict=True)]
        out[name] = {"us": round(statistics.median(values) * 1e6, 2),
                     "extra_us": round(statistics.median(diffs) * 1e6, 2),
                     "extra_us_p25": round(pct(diffs, .25) * 1e6, 2), "extra_us_p75": round(pct(diffs, .75) * 1e6, 2)}
    return out


def _batch_cost(rounds: int, n: int) -> dict[str, dict[str, float]]:
    from ampwatch import agent

    model = torch.nn.Linear(4, 4)
    opts = [torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)]
    w = agent.watch(torch.amp.GradScaler("cpu"), {"a": opts[0], "b": opts[1]}, collector=())
    recorder = w._recorder
    ids_list, ids_tensor = list(range(32)), torch.arange(32)

    def iterations(record_ids: Callable[[], None] | None) -> Callable[[], int]:
        def run() -> int:
            for _ in range(n):
                if record_ids is not None:
                    record_ids()
                for record in recorder.records:  # what the step wrapper and pre-hook do on a clean step
                    recorder.before_step(record)
                    recorder.on_optimizer_step(record)
                    recorder.after_step(record)
                recorder.after_update(False)
            return n
        return run

    try:
        times = _rotate({"iteration": iterations(None), "batch(list of 32)": iterations(lambda: w.batch(ids_list)),
                         "batch(tensor of 32)": iterations(lambda: w.batch(ids_tensor))}, rounds)
    finally:
        w.close()
    return _extra(times, "iteration")


def _loader_cost(rounds: int, batches: int) -> dict[str, dict[str, float]]:
    from ampwatch import agent

    def loader() -> DataLoader:
        return DataLoader(list(range(32 * batches)), batch_size=32, shuffle=True,
                          generator=torch.Generator().manual_seed(0))

    def epoch(data: DataLoader) -> Callable[[], int]:
        def run() -> int:
            count = 0
            for _ in data:
                count += 1
            return count
        return run

    plain = _rotate({"plain": epoch(loader())}, rounds)["plain"]
    model = torch.nn.Linear(4, 4)
    followed, other = loader(), loader()
    w = agent.watch(None, torch.optim.SGD(model.parameters(), lr=0.1), collector=(), loader=followed)
    try:
        times = _rotate({"another loader followed": epoch(other), "followed": epoch(followed)}, rounds)
    finally:
        w.close()
    again = _rotate({"plain": epoch(loader())}, rounds)["plain"]  # after close: the class as shipped again
    times["plain"] = [min(a, b) for a, b in zip(plain, again, strict=True)]
    return _extra(times, "plain")


def sample_recording_us(rounds: int = 15, n: int = 2000, batches: int = 200) -> dict:
    """Return the host CPU of recording sample ids: per iteration for ``batch()``, per batch for a loader."""
    return {"batch": _batch_cost(rounds, n), "loader": _loader_cost(rounds, batches),
            "rounds": rounds, "iterations": n, "loader_batches": batches}


def main() -> int:
    torch.set_num_threads(1)
    print(json.dumps(sample_recording_us(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
