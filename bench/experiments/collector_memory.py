"""The whole collector's memory per rank after a full 30-minute alert window, on a simulated clock.

One real collector app (``create_app`` with a simulated clock, its lifespan, its SQLite store, its
built-in alerts and retirement loop) runs in this process; N ranks x 2 optimizers push a protocol v1
batch every ``--push-s`` simulated seconds through the app's own ingest handler (the ASGI call, without
the socket), 64 at a time so commits group as under real load; the alert pass ticks every 5 simulated
seconds. A skip (and its backoff) every 50th push of a rank, and in the last simulated minute a
whole-job skip storm (every rank skips every step: streak counters and ladders move, the streak
alerts fire on every rank). ``/metrics`` is rendered once a simulated minute, as a scraper would.

The figure is the process's resident memory after the run minus that of the started collector
before the first batch, per rank:
rank state, the alert histories and states, label caches, SQLite's page cache, the allocator's
slack. The alert histories keep one moment per 5 s whatever the push interval, so 5 s pushes give the
figure of 2 s pushes in less time.

    python -m bench.experiments.collector_memory [--ranks 1024] [--minutes 31] [--push-s 5] [--out FILE]

Takes about 16 minutes at the defaults on a shared 2-core machine (most of it waiting for commits).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time

from bench._before_after import store
from bench.experiments._inprocess import SimulatedRank, collector_app, post
from bench.experiments._resident import resident_kib

__all__ = ["KEY", "measure", "main"]

KEY = "collector_memory"
CONCURRENT = 64
TICK_S = 5.0


async def _run(ranks: int, minutes: float, push_s: float, db: str) -> dict:
    now = [1_800_000_000.0]
    job = [SimulatedRank("memory", r, ranks) for r in range(ranks)]
    steps = int(4 * push_s)
    pushes = int(minutes * 60 / push_s)
    storm_from = pushes - int(60 / push_s)
    statuses: dict[int, int] = {}
    started, cpu0 = time.perf_counter(), time.process_time()
    scrape_bytes = 0
    async with collector_app(db, clock=lambda: now[0]) as app:
        ingest, alerts, state = app.state.ingest, app.state.alert_service, app.state.collector_state
        await asyncio.to_thread(app.state.exposition.render)  # the render's own start-up (a thread, a registry)
        gc.collect()
        rss0 = resident_kib()  # a started collector holding nothing yet
        next_tick = next_scrape = now[0]
        for push in range(pushes):
            storm = push >= storm_from
            for first in range(0, ranks, CONCURRENT):
                bodies = [r.body(now[0], steps, storm) for r in job[first:first + CONCURRENT]]
                for status in await asyncio.gather(*(post(ingest, b) for b in bodies)):
                    statuses[status] = statuses.get(status, 0) + 1
            now[0] += push_s
            if now[0] >= next_tick:
                next_tick += TICK_S
                await asyncio.to_thread(alerts.tick, state, now[0])
            if now[0] >= next_scrape:
                next_scrape += 60
                scrape_bytes = len(await asyncio.to_thread(app.state.exposition.render))
        gc.collect()
        rss = resident_kib()
        firing = len(alerts.alerts.firing())
        held = state.rank_count()
    return {"ranks": ranks, "optimizers": 2, "minutes": minutes, "push_s": push_s, "pushes_per_rank": pushes,
            "answers": statuses, "rss_kib": rss - rss0, "kib_per_rank": round((rss - rss0) / ranks, 1),
            "rss_kib_total": rss, "ranks_held": held, "firing_at_end": firing, "metrics_bytes": scrape_bytes,
            "db_bytes": os.path.getsize(db), "wall_s": round(time.perf_counter() - started, 1),
            "cpu_us_per_batch": round(1e6 * (time.process_time() - cpu0) / max(1, ranks * pushes), 1)}


def measure(ranks: int = 1024, minutes: float = 31.0, push_s: float = 5.0) -> dict:
    """Run the simulated job against a fresh collector app in this process; return its memory and costs."""
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_run(ranks, minutes, push_s, os.path.join(tmp, "memory.db")))


def main(argv: list[str] | None = None) -> dict:
    """Measure in a fresh process (so the figure is this run's alone) and print it; ``--out`` also stores it."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.collector_memory",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--minutes", type=float, default=31.0, help="simulated minutes (the longest window is 30)")
    parser.add_argument("--push-s", type=float, default=5.0, help="simulated seconds between two pushes of a rank")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    args = parser.parse_args(argv)
    result = measure(args.ranks, args.minutes, args.push_s)
    print(f"{result['kib_per_rank']} KiB/rank ({result['rss_kib'] / 1024:.1f} MiB over {result['ranks']} ranks x 2 "
          f"optimizers after {result['minutes']} simulated min, pushes every {result['push_s']} s; process "
          f"{result['rss_kib_total'] / 1024:.1f} MiB), {result['cpu_us_per_batch']} us CPU/batch, answers "
          f"{result['answers']}, {result['firing_at_end']} alerts firing at the end, {result['wall_s']} s")
    if args.out:
        store(args.out, KEY, {"after": result}, sys.argv)
    return result


if __name__ == "__main__":
    main()
