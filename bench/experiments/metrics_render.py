"""CPU time of one ``/metrics`` render at 16,384 ranks x 2 optimizers, beside an earlier commit in one run.

Each side runs in a child process (the earlier commit's ``server/src`` first on its path): the ranks are put
straight into a real collector app's state, then rendered three times, as three scrapes would find them:
every rank new (the first scrape), half the ranks changed since (a 30 s heartbeat under 15 s scrapes), none
changed. Thread CPU time of ``Exposition.render_ranks``, one compute thread, no pauses, the ranks' heap
frozen as the collector keeps it (``_gc.py``). About a minute.

    python -m bench.experiments.metrics_render --before bfdf94c~1 [--ranks 16384]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

from bench._before_after import ROOT, source_of

__all__ = ["main"]

PHASES = ("every rank new", "half changed", "none changed")


def _child(ranks: int) -> dict[str, float]:
    from fastapi.testclient import TestClient

    from ampwatch.server._app import create_app
    from ampwatch.server._batch_parse import parse_batch
    from ampwatch.server._config import ServerConfig
    from ampwatch.server._incarnation import next_incarnation
    from ampwatch.server._metrics import Exposition
    from ampwatch.server._state import RankState
    from ampwatch_support.batches import make_batch, optimizer

    with tempfile.TemporaryDirectory() as tmp, \
            TestClient(create_app(ServerConfig(db=f"{tmp}/r.db", allowed_hosts=("testserver",)))) as client:
        state, own = client.app.state.collector_state, client.app.state.own

        def put(rank: int, steps: int, seq: int) -> None:
            batch = parse_batch(json.dumps(make_batch(
                rank=rank, world_size=ranks, incarnation=f"{rank:032x}", seq=seq,
                optimizers={"gen": optimizer(steps=steps, skipped=rank % 3), "disc": optimizer(steps=2 * steps)})))
            held = state.get(batch.run, batch.rank)
            if held is None:
                held = RankState(batch.run, batch.rank)
                state.adopt(held)
            held.install(next_incarnation(held.view.current, batch, time.time(), 128))

        for rank in range(ranks):
            put(rank, rank + 5, 1)
        gc.collect()
        gc.freeze()  # as the collector process keeps its live heap frozen (_gc.py): no collection walks it
        exposition, times = Exposition(state, own, 60.0), {}
        for phase in PHASES:
            if phase == "half changed":
                for rank in range(0, ranks, 2):
                    put(rank, rank + 50, 2)
            start = time.thread_time()
            exposition.render_ranks(1e9)
            times[phase] = round(time.thread_time() - start, 3)
        return times


def main(argv: list[str] | None = None) -> int:
    """Render on both sides; print a row per side."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.metrics_render",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the earlier commit to measure beside this tree")
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.ranks)))
        return 0
    print("| side | " + " | ".join(f"{phase}, CPU s" for phase in PHASES) + " |\n|---|" + "---|" * len(PHASES))
    with tempfile.TemporaryDirectory() as tmp:
        for side, path in ((f"before ({args.before})", source_of(args.before, tmp)), ("after", None)):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p))
            out = subprocess.run([sys.executable, "-m", "bench.experiments.metrics_render", "--before", args.before,
                                  "--child", "--ranks", str(args.ranks)], cwd=ROOT, env=env, check=True,
                                 capture_output=True, text=True).stdout
            times = json.loads(out.strip().splitlines()[-1])
            print(f"| {side} | " + " | ".join(str(times[phase]) for phase in PHASES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
