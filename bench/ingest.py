"""Ingest throughput and latency: the ampwatch collector vs the Prometheus Pushgateway, same load.

Each server runs alone in its own process on a free loopback port; the load generator
(``bench/_loadgen.py``) is another process: N simulated ranks, one keep-alive connection each, one
update per rank per second carrying the same counters (a protocol v1 batch for ampwatch, the same
counters in the text format for the Pushgateway). Latency is from send to full answer (for ampwatch:
committed to SQLite); percentiles leave out each rank's first 2 updates (first contact). Then a
saturation run: 32 connections sending back to back over N ranks, for the most updates per second.

    python -m bench.ingest                       # 64, 256, 1,024, 4,096 ranks, 10 s each, both servers
    python -m bench.ingest --quick               # 64 and 1,024 ranks, 3 s each
    python -m bench.ingest --ranks 1024 --seconds 20 --no-peer
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request

from bench import _servers

__all__ = ["run", "main", "LEVELS"]

LEVELS = (64, 256, 1024, 4096)
SATURATE_CONNECTIONS = 32


def _scrape_ms(url: str, times: int) -> list[float]:
    out = []
    for _ in range(times):
        t = time.perf_counter()
        with urllib.request.urlopen(url + "/metrics", timeout=60) as answer:
            answer.read()
        out.append((time.perf_counter() - t) * 1000)
    return out


def _level(kind: str, ranks: int, seconds: int, saturate: int = 0) -> dict:
    with _servers.server(kind) as srv:
        result = _servers.load(srv, ranks, seconds, saturate)
        if kind == "ampwatch" and not saturate:
            result["scrape_median_ms"] = round(statistics.median(_scrape_ms(srv.url, 3)), 1)
        return result


def run(levels: tuple[int, ...] = LEVELS, seconds: int = 10, peer: bool = True,
        saturate_levels: tuple[int, ...] = (64, 1024), saturate_seconds: int = 6) -> dict:
    """Run every level against each server in turn; return the results."""
    kinds = ("ampwatch", "pushgateway") if peer else ("ampwatch",)
    paced, saturated = [], []
    for i, ranks in enumerate(levels):
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):  # alternate who goes first: drift hits both
            paced.append(_level(kind, ranks, seconds))
    for i, ranks in enumerate(saturate_levels):
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):
            saturated.append(_level(kind, ranks, saturate_seconds, SATURATE_CONNECTIONS))
    return {"seconds": seconds, "paced": paced, "saturated": saturated,
            "saturate_connections": SATURATE_CONNECTIONS, "saturate_seconds": saturate_seconds}


def _print(results: dict) -> None:
    print(f"paced: each rank sends one update per second for {results['seconds']} s; latency = send to answer")
    print(f"{'server':>12} {'ranks':>6} {'updates/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'unanswered':>10} "
          f"{'cpu %':>6} {'cpu us/upd':>10} {'rss MiB':>8} {'load':>5}")
    for r in results["paced"] + results["saturated"]:
        label = r["target"] + ("*" if r["mode"] == "saturate" else "")
        print(f"{label:>12} {r['ranks']:>6} {r['updates_per_s']:>10.1f} {r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f} "
              f"{r['unanswered']:>10} {r['server_cpu_pct']:>6.1f} {r['server_cpu_us_per_update']:>10.1f} "
              f"{r.get('vmrss', 0) / 1024:>8.1f} {r['loadavg_1m']:>5.2f}")
    print(f"* saturation: {results['saturate_connections']} connections back to back for "
          f"{results['saturate_seconds']} s")


def main(argv: list[str] | None = None) -> int:
    """Run the ingest comparison and print a table (``--json`` for the raw results)."""
    parser = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, action="append", help="simulated ranks (repeatable)")
    parser.add_argument("--seconds", type=int, default=None, help="seconds of paced load per level (default 10)")
    parser.add_argument("--quick", action="store_true", help="64 and 1,024 ranks, 3 s each")
    parser.add_argument("--no-peer", action="store_true", help="the collector only, without the Pushgateway")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = parser.parse_args(argv)
    levels = tuple(args.ranks or ((64, 1024) if args.quick else LEVELS))
    seconds = args.seconds or (3 if args.quick else 10)
    saturate_levels = tuple(args.ranks) if args.ranks else (1024,) if args.quick else (64, 1024)
    results = run(levels, seconds, peer=not args.no_peer, saturate_levels=saturate_levels,
                  saturate_seconds=3 if args.quick else 6)
    print(json.dumps(results, indent=1)) if args.json else _print(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
