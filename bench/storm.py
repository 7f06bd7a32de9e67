"""A whole-job skip storm at 1,024 ranks: ingest latency and database growth, this tree beside an earlier commit.

Each side starts a fresh collector (the earlier side's from ``git archive <ref>``, first on
PYTHONPATH) and drives it with the load generator (``bench/_loadgen.py --storm``): N ranks x 2
optimizers push every 2 s; after a clean warm-up every rank skips every iteration (10 per push)
for the storm's length, then steps again. The earlier side gets the events its agent sent
(``per-skip``: one per skipped step per optimizer, one per backoff), this side those of this tree's
agent (``streaks``: bench/_storm.py). Reported: ingest p50/p99/max during the storm, answers
slower than the agent's 2 s timeout, collector CPU, and growth of the database (pages in use, WAL
included) and of its event rows per storm-minute. About 2 x (warm-up + storm + 15 s) plus start-up.

    python -m bench.storm [--ranks 1024] [--storm-seconds 60] [--before a95d20e] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time

from bench._before_after import ROOT as _ROOT, before_after, print_and_store

__all__ = ["measure", "main"]

KEY = "storm"
INTERVAL_S = 2.0
TAIL_S = 10  # clean pushes after the storm: every streak ends


def _logical_bytes(db: sqlite3.Connection) -> int:
    """Bytes of the database's pages in use as a reader sees it now (WAL included, free pages not): what the
    history takes, without the WAL file's size, which depends on when SQLite last checkpointed."""
    pages, free, size = (db.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count",
                                                                         "page_size"))
    return (pages - free) * size


def measure(ranks: int, warmup: int, storm_seconds: int, pattern: str) -> dict:
    """Run one storm against a fresh collector of the ``ampwatch.server`` on sys.path; return the figures."""
    from bench import _servers

    with _servers.collector() as srv:
        sizes: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:
            db = sqlite3.connect(f"file:{srv.db}?mode=ro", uri=True, isolation_level=None)
            while not stop.wait(0.5):
                sizes.append((time.time(), _logical_bytes(db)))
            db.close()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cpu0 = srv.stats.cpu_s()
        seconds = warmup + storm_seconds + TAIL_S
        out = subprocess.run([sys.executable, "-m", "bench._loadgen", "--target", "ampwatch", "--port",
                              str(srv.port), "--ranks", str(ranks), "--seconds", str(seconds), "--interval",
                              str(INTERVAL_S), "--storm", f"{warmup},{storm_seconds}", "--pattern", pattern],
                             capture_output=True, text=True, timeout=seconds + 180, cwd=_ROOT)
        stop.set()
        sampler.join()
        if out.returncode != 0:
            raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
        load = json.loads(out.stdout)
        cpu = srv.stats.cpu_s() - cpu0
        memory = srv.stats.memory_kib()
        start, end = load["storm_wall"]
        at_start = max((s for t, s in sizes if t <= start), default=0)
        at_end = max((s for t, s in sizes if t <= end + INTERVAL_S), default=0)
        with sqlite3.connect(f"file:{srv.db}?mode=ro", uri=True) as db:
            rows, body = db.execute("SELECT count(*), coalesce(sum(length(body)), 0) FROM events "
                                    "WHERE time >= ? AND time < ?", (start, end + INTERVAL_S)).fetchone()
            kinds = dict(db.execute("SELECT kind, count(*) FROM events GROUP BY kind").fetchall())
    per_minute = 60.0 / storm_seconds
    return {"ranks": ranks, "optimizers": 2, "interval_s": INTERVAL_S, "iterations_per_push": 10,
            "storm_seconds": storm_seconds, "pattern": pattern,
            "storm_p50_ms": load["storm_p50_ms"], "storm_p99_ms": load["storm_p99_ms"],
            "storm_max_ms": load["storm_max_ms"], "storm_answered": load["storm_answered"],
            "p99_ms": load["p99_ms"], "timeouts_2s": load["timeouts"], "unanswered": load["unanswered"],
            "failures": load["failures"], "missed_slots": load["missed_slots"],
            "server_cpu_pct": round(100 * cpu / max(1e-9, seconds), 1), "answered": load["answered"],
            # Collector CPU per answered batch, warm-up and storm together: what a less loaded machine would need.
            "server_cpu_us_per_batch": round(1e6 * cpu / max(1, load["answered"])),
            "db_mb_per_storm_minute": round((at_end - at_start) * per_minute / 1e6, 2),
            "event_rows_per_storm_minute": round(rows * per_minute),
            "event_mb_per_storm_minute": round(body * per_minute / 1e6, 2),
            "events_by_kind": kinds, "vmhwm_kib": memory.get("VmHWM"),
            "generator_cpu_s": load["generator_cpu_s"], "loadavg_1m": round(os.getloadavg()[0], 2)}


def _side(args: argparse.Namespace, path: str | None) -> dict:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    pattern = "per-skip" if path else "streaks"
    code = ("import sys, json; import ampwatch.server; from bench.storm import measure;"
            "r = measure(*map(int, sys.argv[1:4]), sys.argv[4]); r['server'] = ampwatch.server.__file__;"
            "print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, str(args.ranks), str(args.warmup), str(args.storm_seconds),
                          pattern], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"the {'earlier' if path else 'current'} side failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _line(name: str, r: dict) -> str:
    return (f"{name:>6} ({r['pattern']}): storm ingest p50 {r['storm_p50_ms']} ms, p99 {r['storm_p99_ms']} ms, "
            f"max {r['storm_max_ms']} ms, {r['timeouts_2s']} answers over 2 s, collector CPU "
            f"{r['server_cpu_pct']}%, database +{r['db_mb_per_storm_minute']} MB and "
            f"{r['event_rows_per_storm_minute']} event rows ({r['event_mb_per_storm_minute']} MB) per storm-minute")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=16, help="clean seconds before the storm")
    parser.add_argument("--storm-seconds", type=int, default=60)
    parser.add_argument("--before", default="a95d20e", help="the commit to compare with")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    args = parser.parse_args(argv)
    return print_and_store(before_after(args.before, lambda path: _side(args, path)), KEY, args.out, _line)


if __name__ == "__main__":
    main()
