"""Bounded load generator (its own process): N simulated ranks push one update each per interval.

The same generator drives the ampwatch collector (``POST /v1/ingest``, a protocol v1 batch per rank; or,
as target ``ampwatch-node``, one protocol v2 batch per simulated node of ``--per-node`` ranks, as a node
relay posts) and the Prometheus Pushgateway (``PUT /metrics/job/<run>/rank/<rank>``, the same counters in
the text format). ``answered`` always counts rank updates, whatever carried them.
Each rank keeps one keep-alive connection and sends one request at a time, as an agent does; latency
is from send to the full answer. Bodies are built from a template so the generator stays cheap, and it
reports how late its own sends were (``lag``) and its own CPU, so a slow generator shows up as such.

    python -m bench._loadgen --target ampwatch --port P --ranks 1024 --seconds 10
    python -m bench._loadgen --target pushgateway --port P --ranks 1024 --seconds 10 --saturate 32
    python -m bench._loadgen --target ampwatch-node --per-node 8 --port P --ranks 1024 --seconds 10
    python -m bench._loadgen --target ampwatch --port P --ranks 1024 --seconds 90 --interval 2 \\
        --storm 20,60 --pattern streaks     # a whole-job skip storm from 20 s to 80 s (bench/_storm.py)

This module is the process: the run and its result. The bodies are in ``bench._loadgen_bodies``,
the senders in ``bench._loadgen_senders``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from bench._async_http import run_loop
from bench._loadgen_bodies import PER_NODE, SKIP_EVERY
from bench._loadgen_senders import TARGETS, Load, Tally, paced_sender, saturating_connection
from bench._storm import PATTERNS

__all__ = ["run", "main"]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(load: Load, port: int, seconds: int, saturate: int, grace: float,
               interval: float = 1.0, storm: tuple[float, float] | None = None, pattern: str = "streaks") -> dict:
    tally = Tally()
    window = None
    target, ranks = load.target, load.ranks
    cpu0 = time.process_time()
    if saturate:
        until = time.perf_counter() + seconds
        senders = load.senders
        groups = [list(range(c, senders, saturate)) for c in range(min(saturate, senders))]
        await asyncio.gather(*(saturating_connection(load, port, g, until, grace, tally) for g in groups))
    else:
        start = time.perf_counter() + 0.5
        if storm is not None:
            window = (start + storm[0], start + storm[0] + storm[1])
        await asyncio.gather(*(paced_sender(load, port, r, start, seconds, grace, tally, interval, window, pattern)
                               for r in range(load.senders)))
    elapsed = max(1e-9, tally.last_answer - min(tally.first_send, tally.last_answer))
    if not tally.latency:  # a run too short for steady state: every answer counts
        tally.latency = tally.latency_all
    ms = 1000.0
    out = {"target": target, "ranks": ranks, "seconds": seconds, "mode": "saturate" if saturate else "paced",
           "connections": saturate or load.senders, "requests": tally.requests,
           "answered": tally.answered, "failures": tally.failures,
           "elapsed_s": round(elapsed, 3), "updates_per_s": round(tally.answered / elapsed, 1),
           "p50_ms": round(_pct(tally.latency, .50) * ms, 2), "p99_ms": round(_pct(tally.latency, .99) * ms, 2),
           "max_ms": round(max(tally.latency, default=float("nan")) * ms, 2),
           "p99_all_ms": round(_pct(tally.latency_all, .99) * ms, 2) if tally.latency_all else None,
           "offered_per_s": None if saturate else round(ranks / interval, 1), "missed_slots": tally.missed,
           "unanswered": tally.unanswered, "reconnects": tally.reconnects,
           "lag_p99_ms": round(_pct(tally.lag, .99) * ms, 2) if tally.lag else None,
           "timeouts": tally.timeouts, "interval_s": interval,
           "generator_cpu_s": round(time.process_time() - cpu0, 2)}
    if window is not None:
        # Wall-clock bounds of the storm, for whoever samples the server meanwhile (bench/experiments/storm.py).
        wall = time.time() - time.perf_counter()
        out.update(pattern=pattern, storm_wall=[window[0] + wall, window[1] + wall],
                   storm_answered=len(tally.latency_storm),
                   storm_p50_ms=round(_pct(tally.latency_storm, .50) * ms, 2),
                   storm_p99_ms=round(_pct(tally.latency_storm, .99) * ms, 2),
                   storm_max_ms=round(max(tally.latency_storm, default=float("nan")) * ms, 2))
    return out


def run(target: str, port: int, ranks: int, seconds: int, saturate: int = 0, grace: float = 5.0,
        interval: float = 1.0, storm: tuple[float, float] | None = None, pattern: str = "streaks",
        every: int = SKIP_EVERY, per_node: int = PER_NODE) -> dict:
    """Drive ``target`` on ``port`` (in this process); return throughput, latency and the generator's own cost.

    ``storm``: ``(after_s, seconds)``: every rank skips every iteration in that window (bench/_storm.py).
    ``every``: a skip and a backoff every this many updates of a rank; ``per_node``: ranks per v2 request
    (target ``ampwatch-node``).
    """
    load = Load(target, f"bench-{ranks}", ranks, every, per_node)
    return run_loop(_run(load, port, seconds, saturate, grace, interval, storm, pattern))


def main(argv: list[str] | None = None) -> int:
    """Run one load level and print its result as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench._loadgen", description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=TARGETS, required=True)
    parser.add_argument("--per-node", type=int, default=PER_NODE,
                        help="ranks per node (one v2 request carries them all) for --target ampwatch-node")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--seconds", type=int, required=True)
    parser.add_argument("--skip-every", type=int, default=SKIP_EVERY,
                        help="a skip and a backoff event every this many updates of a rank")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds after the last slot before unanswered requests are given up (bounds the run)")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between two updates of one rank (the agent's push interval or heartbeat)")
    parser.add_argument("--saturate", type=int, default=0, metavar="CONNECTIONS",
                        help="instead of one update per rank per second, send back to back on this many connections")
    parser.add_argument("--storm", metavar="AFTER,SECONDS",
                        help="a whole-job skip storm: every rank skips every iteration from AFTER for SECONDS")
    parser.add_argument("--pattern", choices=PATTERNS, default="streaks",
                        help="the events of a storm: as the agent sends them now (streaks) or before issue 14")
    args = parser.parse_args(argv)
    storm = None
    if args.storm:
        if args.target != "ampwatch":  # the storm model is one rank's; node batches carry healthy ranks only
            parser.error("--storm drives the ampwatch collector only")
        after, seconds = (float(x) for x in args.storm.split(","))
        storm = (after, seconds)
    print(json.dumps(run(args.target, args.port, args.ranks, args.seconds, args.saturate, args.grace,
                         args.interval, storm, args.pattern, args.skip_every, args.per_node)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
