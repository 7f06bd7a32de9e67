"""The database writer alone in a storm's bursts: where its checkpoints run (SQLite's own in a COMMIT, or the store's
thread), by turns.

A storm's write load without the HTTP and the event loop around it: bursts of ``--ranks`` store jobs (a rank's
incarnation row and three events with their evidence, about what a storm batch writes), each burst's jobs handed to
the store evenly over ``--spread`` seconds (the agent's news spread), a burst every ``--every`` seconds. Measured per
job: from its submit to its commit's answer. The two ways of checkpointing run by turns on fresh databases,
``--rounds`` times each:

- ``in-commit``: as before issue 41: SQLite checkpoints in the COMMIT that takes the WAL past 1,000 pages, and in
  every COMMIT after it while it stays past them;
- ``thread``: the collector's checkpoint thread (``ampwatch.server._checkpoints``), COMMITs never checkpoint.

    python -m bench.experiments.store_bursts                 # 1,024 jobs a burst, 8 bursts, 2 rounds: ~2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

from ampwatch.server._checkpoints import Checkpointer
from ampwatch.server._store import Store, Writes
from bench.experiments.fleet import ms_summary

__all__ = ["WAYS", "measure", "main"]

WAYS = ("in-commit", "thread")
_BATCH = json.dumps({"state": {"optimizers": {n: {"steps": 1, "skipped": 1} for n in ("gen", "disc")}},
                     "pad": "x" * 1200})
_COUNTERS = json.dumps({"pad": "y" * 700})


def _job(rank: int, burst: int) -> Writes:
    row = ("storm", rank, "i", 1.0, float(burst), burst, 3 * burst + 3, 0, _BATCH, _COUNTERS)
    events = [("storm", rank, "i", 3 * burst + k, "skip", 1.0, burst, "gen", '{"streak":' + str(burst) + ', "p": 1}')
              for k in (1, 2, 3)]
    evidence = [("storm", rank, "i", 3 * burst + k, "skip", 1.0, burst, "gen", 1024, "host", rank % 8, None, None, 0,
                 None) for k in (1, 2, 3)]
    return Writes(row, events, evidence)


async def _bursts(store: Store, ranks: int, bursts: int, spread: float, every: float) -> list[float]:
    latencies: list[float] = []

    async def one(rank: int, burst: int, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        began = time.perf_counter()
        await store.submit(_job(rank, burst))
        latencies.append(time.perf_counter() - began)

    start = time.perf_counter() + 0.1
    await asyncio.gather(*(one(rank, burst, start + burst * every + spread * rank / ranks)
                           for burst in range(bursts) for rank in range(ranks)))
    return latencies


def measure(way: str, ranks: int, bursts: int, spread: float, every: float) -> dict:
    """One run of ``way`` on a fresh database: per-job latency (ms), commits, and the database's pages."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(os.path.join(tmp, "bursts.db"))
        checkpoints = Checkpointer(store) if way == "thread" else None
        if way == "in-commit":
            store._writer.execute("PRAGMA wal_autocheckpoint=1000")  # SQLite's default, as before issue 41
        try:
            latencies = asyncio.run(_bursts(store, ranks, bursts, spread, every))
        finally:
            commits = store.commits
            if checkpoints is not None:
                checkpoints.close()
            store.close()
    return dict(ms_summary(latencies), commits=commits, loadavg=[round(x, 2) for x in os.getloadavg()])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.store_bursts",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024, help="jobs per burst")
    parser.add_argument("--bursts", type=int, default=8)
    parser.add_argument("--spread", type=float, default=1.5, help="seconds over which a burst's jobs come")
    parser.add_argument("--every", type=float, default=3.0, help="seconds from one burst to the next")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            r = measure(way, args.ranks, args.bursts, args.spread, args.every)
            runs[way].append(r)
            print(f"{way:>9}: p50 / p99 / max {r['p50_ms']} / {r['p99_ms']} / {r['max_ms']} ms, "
                  f"{r['commits']} commits, load {r['loadavg']}", flush=True)
    return runs


if __name__ == "__main__":
    main()
