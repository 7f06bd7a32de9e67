"""Issue 14's 1,024-rank job, staged against a real collector: trouble on a few ranks, then a whole-job storm.

Every rank has two optimizers and sends one protocol v1 batch per tick (the agent's 2 s) covering
``per_tick`` iterations, with cumulative counters, the streak ladder and events. Staged, as in the
issue: rank 40-43's scale collapses (every step skipped from tick 3), rank 777 skips 1 step in 8
(its scale backs off and grows back), rank 512 takes a poisoned step (tick 5), rank 900 steps its
scheduler after a skip (tick 6), rank 1000 is killed (no batch after tick 8); :meth:`storm` makes
every rank skip every step from then on. Events are sent as a streak-compressing agent sends them:
a skip event where a streak starts, one scale change per batch, the rare kinds each time.

    job = StagedJob(url)
    job.run_ticks(16)       # as fast as the collector answers
    job.storm()
    job.run_ticks(1, period_s=2.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from ampwatch_support.batches import OptimizerRun, make_batch

__all__ = ["COLLAPSED", "KILLED", "POISONED", "SCHEDULER", "SKIPPY", "StagedJob"]

COLLAPSED = range(40, 44)
SKIPPY = 777
POISONED = 512
SCHEDULER = 900
KILLED = 1000
_OPTIMIZERS = ("body", "head")


@dataclasses.dataclass
class _Rank:
    rank: int
    seq: int = 0
    iteration: int = 0
    scale: float = 65536.0
    good: int = 0  # steps since the last skip (growth after growth_interval)
    event_id: int = 0
    backoffs: int = 0
    growths: int = 0
    counters: dict[str, OptimizerRun] = dataclasses.field(
        default_factory=lambda: {name: OptimizerRun() for name in _OPTIMIZERS})


class StagedJob:
    """Drive the staged job's ranks against the collector at ``url`` (tick by tick; see the module doc)."""

    def __init__(self, url: str, run: str = "job-1024", ranks: int = 1024, per_tick: int = 20) -> None:
        self.url, self.run, self.world, self.per_tick = url, run, ranks, per_tick
        self.ranks = [_Rank(r) for r in range(ranks)]
        self.tick = 0
        self.storming = False
        self.storm_ticks = 0  # ticks sent whole since storm()
        self._held = threading.Event()  # between_ticks(): start no tick
        self._between = threading.Event()  # no tick in flight
        self._between.set()

    def storm(self) -> None:
        """From the next tick on, every rank skips every step (the everyday DDP failure)."""
        self.storming = True

    @contextlib.contextmanager
    def between_ticks(self, timeout_s: float) -> Iterator[None]:
        """Hold the ticks for the block, once the one in flight has landed: the collector holds whole ticks.

        A reader that must see one whole tick (a page refreshing every 3 s) needs this on a loaded machine,
        where a tick takes longer than the 2 s between ticks and another is always landing.
        """
        self._held.set()
        try:
            if not self._between.wait(timeout_s):
                raise TimeoutError(f"a tick still in flight after {timeout_s:.0f} s")
            yield
        finally:
            self._held.clear()

    def _skips(self, r: _Rank, iteration: int, storming: bool) -> bool:
        if storming or (r.rank in COLLAPSED and self.tick >= 3):
            return True
        if r.rank == SKIPPY:
            return iteration % 8 == 0
        return r.rank == SCHEDULER and self.tick == 6 and iteration % self.per_tick == 10

    def _event(self, r: _Rank, kind: str, iteration: int, **fields: Any) -> dict[str, Any]:
        r.event_id += 1
        return {"id": r.event_id, "kind": kind, "time": time.time(), "iteration": iteration, **fields}

    def batch(self, r: _Rank, storming: bool) -> dict[str, Any]:
        """Advance ``r`` by one tick (every step skipped if ``storming``) and return its batch."""
        growth_interval = 7 if r.rank == SKIPPY else 2000
        before, events = r.scale, []
        for iteration in range(r.iteration + 1, r.iteration + self.per_tick + 1):
            skipped = self._skips(r, iteration, storming)
            for name, c in r.counters.items():
                if skipped:
                    if c.skip(iteration) == 1:
                        events.append(self._event(r, "skip", iteration, optimizer=name, streak=1,
                                                  params=[{"name": f"{name}.fc.weight", "inf": 1, "nan": 0}],
                                                  params_total=1))
                else:
                    start, ended = c.start, c.step()
                    if ended:
                        events.append(self._event(r, "streak_end", iteration, optimizer=name,
                                                  start_iteration=start, length=ended))
            if skipped:
                r.scale, r.good, r.backoffs = r.scale * 0.5, 0, r.backoffs + 1
            else:
                r.good += 1
                if r.good >= growth_interval:
                    r.scale, r.good, r.growths = r.scale * 2.0, 0, r.growths + 1
        r.iteration += self.per_tick
        if r.scale != before:
            events.append(self._event(r, "scale_change", r.iteration,
                                      cause="backoff" if r.scale < before else "growth", before=before, after=r.scale))
        if r.rank == POISONED and self.tick == 5:
            r.counters["body"].poisoned_steps += 1
            events.append(self._event(r, "poisoned_step", r.iteration, optimizer="body", reason="nonfinite_grad",
                                      params_total=1, params=[{"name": "body.norm.weight", "inf": 0, "nan": 1}]))
        if r.rank == SCHEDULER and self.tick == 6:
            r.counters["body"].scheduler_steps_after_skip += 1
            events.append(self._event(r, "scheduler_after_skip", r.iteration, optimizer="body",
                                      scheduler="CosineAnnealingLR"))
        r.seq += 1
        return make_batch(run=self.run, rank=r.rank, world_size=self.world, local_rank=r.rank % 8,
                          host=f"node-{r.rank // 8}", pid=1000 + r.rank, incarnation=f"{r.rank + 1:032x}",
                          seq=r.seq, sent_at=time.time(), iteration=r.iteration, loss_scale=r.scale,
                          backoffs=r.backoffs, growths=r.growths,
                          optimizers={name: c.counters() for name, c in r.counters.items()}, events=events)

    def live(self) -> list[_Rank]:
        """The ranks still sending (rank 1000 is killed after tick 8)."""
        return [r for r in self.ranks if not (r.rank == KILLED and self.tick > 8)]

    def next_tick(self) -> tuple[bool, list[dict[str, Any]]]:
        """Whether the next tick storms, and its batches, one per live rank.

        :attr:`storming` is read once, before any batch is built: a :meth:`storm` called meanwhile starts at
        the tick after, on every rank at the same iteration.
        """
        storming = self.storming
        batches = [self.batch(r, storming) for r in self.live()]
        self.tick += 1
        return storming, batches

    async def _send(self, batches: list[dict[str, Any]], connections: int = 64) -> None:
        bodies = [json.dumps(batch).encode() for batch in batches]
        url = urllib.parse.urlsplit(self.url)

        # Raw keep-alive HTTP/1.1 (an HTTP client library's pool costs more CPU than the collector here).
        async def sender() -> None:
            reader, writer = await asyncio.open_connection(url.hostname, url.port)
            try:
                while bodies:
                    body = bodies.pop()
                    writer.write(b"POST /v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    status = int((await reader.readline()).split()[1])
                    length = 0
                    while (line := await reader.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    answer = await reader.readexactly(length)
                    if status != 200:
                        raise RuntimeError(f"HTTP {status}: {answer[:300]!r}")
            finally:
                writer.close()

        # Many ranks at once, as a job's agents send: the collector commits them in groups.
        await asyncio.gather(*(sender() for _ in range(connections)))

    async def _ticks(self, count: int | None, period_s: float, stop: threading.Event | None) -> None:
        sent = 0
        while (count is None or sent < count) and not (stop is not None and stop.is_set()):
            self._between.clear()  # before the look at _held: between_ticks() then waits for this tick
            if self._held.is_set():
                self._between.set()
                await asyncio.sleep(0.02)
                continue
            started = time.monotonic()
            try:
                storming, batches = self.next_tick()
                await self._send(batches)
            finally:
                self._between.set()
            self.storm_ticks += storming
            sent += 1
            await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started)))

    def run_ticks(self, count: int, period_s: float = 0.0) -> None:
        """Send ``count`` ticks, each at least ``period_s`` after the previous one started (0: back to back)."""
        asyncio.run(self._ticks(count, period_s, None))

    def run_live(self, stop: threading.Event, period_s: float = 2.0) -> None:
        """Send a tick every ``period_s`` (the agent's interval) until ``stop`` is set (run it in a thread)."""
        asyncio.run(self._ticks(None, period_s, stop))
