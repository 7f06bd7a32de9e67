"""CPU per steady-state rank-update of the collector's ingest path, this tree beside an earlier commit, in one run.

Each side runs in a fresh process: a real collector app (``bench/experiments/_inprocess.py``: its ingest handler
called as uvicorn would, its SQLite store, built-in alerts and retirement loop; no HTTP parsing or
socket), N ranks x 2 optimizers with a skip every 50th batch. Two warm-up pushes per rank (first
contact and the first update), then ``--pushes`` more, 64 batches in flight at a time; the figure is
the process's CPU time (every thread: event loop, database writer) per update. The sides alternate
``--rounds`` times so drift on a shared machine hits both; each side's median is reported.
With ``--storm`` every measured push skips all its iterations on every rank (a whole-job storm:
the streak alerts fire at the second and stay firing, their values changing with every batch),
stored under ``ingest_cpu_storm``.

    python -m bench.experiments.ingest_cpu [--ranks 1024] [--pushes 8] [--rounds 3] [--storm] [--before REF]
                                           [--out FILE]

Takes about a minute at the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench._before_after import PATH_FIRST, ROOT, checked_side, source_of, store
from bench.experiments._inprocess import SimulatedRank, collector_app, post

__all__ = ["KEY", "measure", "main"]

KEY = "ingest_cpu"
CONCURRENT = 64


async def _run(ranks: int, pushes: int, db: str, storm: bool = False) -> dict:
    job = [SimulatedRank("cpu", r, ranks) for r in range(ranks)]
    async with collector_app(db) as app:
        ingest = app.state.ingest

        async def push(bodies: list[bytes]) -> list[int]:
            out = []
            for first in range(0, len(bodies), CONCURRENT):
                out += await asyncio.gather(*(post(ingest, b) for b in bodies[first:first + CONCURRENT]))
            return out

        for _ in range(2):
            await push([r.body(time.time(), 8) for r in job])
        # Built before the clock starts.
        bodies = [[r.body(time.time(), 8, storm=storm) for r in job] for _ in range(pushes)]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        statuses = [s for b in bodies for s in await push(b)]
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    updates = ranks * pushes
    return {"updates": updates, "ok": statuses.count(200), "cpu_us_per_update": round(1e6 * cpu / updates, 1),
            "wall_us_per_update": round(1e6 * wall / updates, 1)}


def measure(ranks: int, pushes: int, storm: bool = False) -> dict:
    """Run one side in this process; return its CPU per update."""
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_run(ranks, pushes, os.path.join(tmp, "cpu.db"), storm))


def _side(ranks: int, pushes: int, path: str | None, storm: bool = False) -> dict:
    code = (PATH_FIRST + "import json;"
            "import ampwatch.server; from bench.experiments.ingest_cpu import measure;"
            "r = measure(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == '1');"
            "r['server'] = ampwatch.server.__file__; print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, path or "", str(ranks), str(pushes), str(int(storm))],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return checked_side(json.loads(out.strip().splitlines()[-1]), path)


def main(argv: list[str] | None = None) -> dict:
    """Alternate both sides ``--rounds`` times; print and return each side's rounds and median."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.ingest_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--pushes", type=int, default=8, help="measured pushes per rank, after two warm-up ones")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--storm", action="store_true", help="every measured push skips on every rank")
    parser.add_argument("--before", default="main", help="the commit to compare with (default: main)")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    args = parser.parse_args(argv)
    rounds: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        old = source_of(args.before, tmp)
        for i in range(args.rounds):
            for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
                rounds[side].append(_side(args.ranks, args.pushes, old if side == "before" else None, args.storm))
    result = {}
    for side, runs in rounds.items():
        result[side] = {"ranks": args.ranks, "pushes": args.pushes, "storm": args.storm, "server": runs[0]["server"],
                        "cpu_us_per_update": statistics.median(r["cpu_us_per_update"] for r in runs),
                        "rounds": [r["cpu_us_per_update"] for r in runs]}
        print(f"{side:>6}: {result[side]['cpu_us_per_update']:>7.1f} us CPU per update (rounds "
              f"{result[side]['rounds']})  [{result[side]['server']}]")
    result["before"]["ref"] = args.before
    if args.out:
        store(args.out, KEY + ("_storm" if args.storm else ""), result, sys.argv)
    return result


if __name__ == "__main__":
    main()
