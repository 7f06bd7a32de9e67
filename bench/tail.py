"""Where the collector's ingest tail goes at 1,024 ranks, and before/after figures for a change.

``--profile`` runs the collector in this process (the load generator in another) and records what
can stall an answer: garbage-collector pauses (thread CPU time per generation), event-loop lag (a
10 ms ticker's overshoot), SQLite commit time and group size in the writer thread, the built-in alert
tick, and the load generator's own lateness and CPU. ``--before DIR`` runs a collector from another
source tree (e.g. ``git archive`` of an older commit: ``DIR`` = its ``server/src``) alternately with
this one, under the same paced load, for a before/after comparison in one run.

    python -m bench.tail --profile
    mkdir /tmp/before && git archive <commit> server/src | tar -x -C /tmp/before
    python -m bench.tail --before /tmp/before/server/src
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench import _servers

__all__ = ["profile", "compare", "main"]


def _summary(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(ordered), "total_ms": round(sum(ordered) * scale, 1), "p50_ms": round(ordered[len(ordered) // 2]
            * scale, 2), "max_ms": round(ordered[-1] * scale, 1)}


def profile(ranks: int = 1024, seconds: int = 10, tuned_gc: bool = True) -> dict:
    """Run a collector in-process under paced load and record its stalls; return them with the load result."""
    import uvicorn

    from ampwatch.server import _store
    from ampwatch.server.__main__ import build_parser
    from ampwatch.server._app import create_app
    from ampwatch.server._config import config_from_args
    from ampwatch.server._gc import tune_gc
    from ampwatch.server.alerting.service import AlertService

    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            pauses[info["generation"]].append(time.thread_time() - started[0])

    commits: list[tuple[float, int]] = []
    commit = _store.Store._commit

    def timed_commit(self, jobs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return commit(self, jobs)
        finally:
            commits.append((time.perf_counter() - t, len(jobs)))

    ticks: list[float] = []
    tick = AlertService.tick

    def timed_tick(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.thread_time()
        try:
            return tick(self, *args, **kwargs)
        finally:
            ticks.append(time.thread_time() - t)

    lags: list[float] = []

    async def ticker() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    with tempfile.TemporaryDirectory() as tmp:
        port = _servers.free_port()
        config = config_from_args(build_parser().parse_args(["--db", os.path.join(tmp, "tail.db"),
                                                             "--port", str(port), "--log-level", "warning"]))
        app = create_app(config)
        if tuned_gc:
            tune_gc()
        else:
            gc.set_threshold(700, 10, 10)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False))
        startup = server.startup

        async def startup_with_ticker(sockets=None):  # type: ignore[no-untyped-def]
            asyncio.get_running_loop().create_task(ticker())
            return await startup(sockets)
        server.startup = startup_with_ticker  # type: ignore[method-assign]
        result: dict = {}

        def drive() -> None:
            try:
                while not server.started:
                    time.sleep(0.05)
                for values in (*pauses.values(), commits, ticks, lags):
                    values.clear()
                out = subprocess.run([sys.executable, "-m", "bench._loadgen", "--target", "ampwatch", "--port",
                                      str(port), "--ranks", str(ranks), "--seconds", str(seconds)],
                                     capture_output=True, text=True, timeout=seconds + 120)
                result.update(json.loads(out.stdout))
            finally:
                server.should_exit = True

        gc.callbacks.append(on_gc)
        _store.Store._commit = timed_commit  # type: ignore[method-assign]
        AlertService.tick = timed_tick  # type: ignore[method-assign]
        try:
            threading.Thread(target=drive, daemon=True).start()
            server.run()
        finally:
            gc.callbacks.remove(on_gc)
            _store.Store._commit = commit  # type: ignore[method-assign]
            AlertService.tick = tick  # type: ignore[method-assign]
            gc.unfreeze()
            gc.set_threshold(700, 10, 10)
    return {"load": result, "gc_tuned": tuned_gc, "loadavg_1m": round(os.getloadavg()[0], 2),
            "gc_pauses_cpu": {f"gen{g}": _summary(p) for g, p in pauses.items()},
            "loop_lag": _summary(lags) | {"over_50ms": sum(1 for x in lags if x > 0.05)},
            "commits": _summary([d for d, _ in commits]) | {
                "mean_group": round(statistics.mean([g for _, g in commits]), 1) if commits else None},
            "alert_tick_cpu": _summary(ticks)}


def compare(before: str, ranks: int = 1024, seconds: int = 10, rounds: int = 2, saturate: int = 0) -> list[dict]:
    """Alternate a collector from ``before`` (a source dir put first on PYTHONPATH) with this one."""
    out = []
    for i in range(rounds):
        for name, env in ((("before", {"PYTHONPATH": before}), ("after", None)) if i % 2 == 0 else
                          (("after", None), ("before", {"PYTHONPATH": before}))):
            with _servers.collector(env=env) as srv:
                r = _servers.load(srv, ranks, seconds, saturate)
            out.append({"version": name, "round": i, **{k: r[k] for k in (
                "mode", "updates_per_s", "p50_ms", "p99_ms", "max_ms", "server_cpu_pct", "server_cpu_us_per_update",
                "generator_cpu_s", "lag_p99_ms", "loadavg_1m")}})
    return out


def main(argv: list[str] | None = None) -> int:
    """Profile the tail or compare two versions; print JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.tail", description=__doc__.split("\n")[0])
    parser.add_argument("--profile", action="store_true", help="in-process stall profile (tuned and default GC)")
    parser.add_argument("--before", metavar="DIR", help="source dir of the collector to compare against")
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--saturate", type=int, default=0, metavar="CONNECTIONS")
    args = parser.parse_args(argv)
    if args.before:
        print(json.dumps(compare(args.before, args.ranks, args.seconds, args.rounds, args.saturate), indent=1))
    else:
        print(json.dumps([profile(args.ranks, args.seconds, tuned) for tuned in (False, True)], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
