"""Simulated jobs whose ranks skip, posting protocol v1 batches with origin flags, samples and devices to a real
collector: the evidence ``GET /v1/suspects`` judges (docs/suspects.md), for its tests and the status page's."""

from __future__ import annotations

import hashlib
from typing import Any

from ampwatch_support.batches import make_batch, optimizer, post_batch, samples, skip_event

__all__ = ["SkippingJobs", "unique"]


def unique(prefix: str, n: int = 4) -> list[str]:
    """``n`` sample ids no other call with another prefix gives."""
    return [f"{prefix}-{i}" for i in range(n)]


class SkippingJobs:
    """Ranks of simulated jobs posting skip events to the collector at ``url``, each rank one process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seq: dict[tuple[str, int], int] = {}
        self.rows = 0
        """Evidence rows the collector should hold by now: the first events of a streak posted."""

    def post(self, run: str, rank: int, events: list[dict], *, world_size: int, host: str,
             device: dict | None = None, **fields: Any) -> None:
        """Post one batch of ``rank`` (local rank = rank) with ``events`` (their ids are set here)."""
        key = (run, rank)
        seq = self.seq[key] = self.seq.get(key, 0) + 1
        numbered = [dict(e, id=(seq - 1) * 100 + i + 1) for i, e in enumerate(events)]
        batch = make_batch(run=run, rank=rank, world_size=world_size, host=host, local_rank=rank, seq=seq,
                           incarnation=hashlib.md5(repr(key).encode()).hexdigest(),
                           iteration=max([e["iteration"] for e in events] or [0]),
                           optimizers={"gen": optimizer(steps=10 * seq, skipped=len(events) * seq)}, events=numbered,
                           **({"device": device} if device else {}), **fields)
        post_batch(self.url, batch)
        self.rows += sum(1 for e in events if e.get("streak", 1) == 1)

    def skip_everywhere(self, run: str, iteration: int, world_size: int, host: str, *, origins: set[int] | None,
                        ids: dict[int, list] | None = None, **more: Any) -> None:
        """Every rank skips ``iteration`` (DDP all-reduces the inf): the ranks in ``origins`` say ``origin: true``,
        the others false (None: no rank carries the flag, as without ``ddp=``); ``ids``: each rank's samples;
        ``more``: other fields of each skip event."""
        for rank in range(world_size):
            extra = dict(more)
            if origins is not None:
                extra["origin"] = rank in origins
            if ids is not None and rank in ids:
                extra["samples"] = samples(ids[rank])
            self.post(run, rank, [skip_event(0, iteration=iteration, **extra)], world_size=world_size, host=host)

    def data_scenario(self, run: str = "data", host: str = "data-host") -> None:
        """4 ranks, ``ddp=``: the sample ``bad`` lands on rank 0 three times and on ranks 1 and 2 once over five
        epochs; every other id is trained once."""
        for epoch, rank in enumerate([0, 0, 0, 1, 2]):
            ids = {r: unique(f"{run}-e{epoch}-r{r}") for r in range(4)}
            ids[rank][1] = "bad"
            self.skip_everywhere(run, 100 * epoch + 7, 4, host, origins={rank}, ids=ids)

    def device_scenario(self, runs: tuple[str, ...] = ("device-a", "device-b"), host: str = "dev-host",
                        uuid: str = "GPU-faulty") -> None:
        """Over ``runs``, local rank 1 of ``host`` (GPU ``uuid``, named only by each process's first batch) is the
        sole origin of two skips per run, each on different samples; rank 0 trains cleanly beside it."""
        gpu = {"type": "cuda", "index": 1, "uuid": uuid, "pci_bus_id": "0000:3b:00.0"}
        for run in runs:
            self.post(run, 1, [], world_size=2, host=host, device=gpu)
            self.post(run, 0, [], world_size=2, host=host, device=dict(gpu, index=0, uuid=uuid + "-clean"))
            for iteration in (11, 53):
                self.skip_everywhere(run, iteration, 2, host, origins={1},
                                     ids={r: unique(f"{run}-{iteration}-r{r}") for r in range(2)})
