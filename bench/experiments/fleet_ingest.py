"""Ingest latency of a 16,384-rank job on a heartbeat while Prometheus scrapes: this tree beside an earlier one.

Each side runs a fresh collector process (the earlier side with ``git archive <ref>``'s ``server/src``
first on its ``PYTHONPATH``), then the load generator (``bench/_loadgen.py``, its own process): N
ranks x 2 optimizers, one keep-alive connection each, one update per rank every ``--interval``
seconds (a heartbeat), spread evenly over the interval. Meanwhile this process fetches ``/metrics``
gzipped every ``--scrape-every`` seconds, as Prometheus does, and the collector's own alert pass
ticks every second. Latency is from send to the committed answer; percentiles leave out each
rank's first 2 updates (first contact). Both sides run on the same machine minutes apart; on a
shared machine, compare the two sides rather than the absolute figures.

    python -m bench.experiments.fleet_ingest [--ranks 16384] [--interval 15] [--seconds 90] [--before REF] [--out FILE]

Takes about twice (``--seconds`` + 40 s) at the defaults.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import urllib.request

from bench import _servers
from bench._before_after import before_after, print_and_store

__all__ = ["KEY", "measure", "main"]

KEY = "fleet_ingest"


class _Scraper(threading.Thread):
    """Fetch ``/metrics`` gzipped every ``every`` seconds until stopped; keep each fetch's duration."""

    def __init__(self, url: str, every: float) -> None:
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.ms: list[float] = []
        self.failures = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            started = time.perf_counter()
            try:
                request = urllib.request.Request(self.url + "/metrics", headers={"Accept-Encoding": "gzip"})
                with urllib.request.urlopen(request, timeout=120) as answer:
                    answer.read()
                self.ms.append((time.perf_counter() - started) * 1000)
            except OSError:
                self.failures += 1


def measure(ranks: int, interval: float, seconds: int, scrape_every: float, pythonpath: str | None) -> dict:
    """Run one side: a fresh collector (``pythonpath`` first on its path when given) under paced load and scrapes."""
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    with _servers.collector(args=("--max-ranks-per-run", str(ranks)), env=env) as srv:
        scraper = _Scraper(srv.url, scrape_every)
        scraper.start()
        try:
            result = _servers.load(srv, ranks, seconds, interval=interval)
        finally:
            scraper.stop.set()
            scraper.join(150)
        result["scrapes"] = len(scraper.ms)
        result["scrape_failures"] = scraper.failures
        result["scrape_median_ms"] = round(statistics.median(scraper.ms), 1) if scraper.ms else None
        result["scrape_max_ms"] = round(max(scraper.ms), 1) if scraper.ms else None
        result["server_path"] = pythonpath or "this tree"
        return result


def _line(side: str, r: dict) -> str:
    return (f"{side:>6} {r['ranks']:>6} {r['updates_per_s']:>7.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
            f"{r['max_ms']:>8.1f} {r['missed_slots']:>6} {r['unanswered']:>6} {r['scrapes']:>7} "
            f"{r['scrape_median_ms'] or float('nan'):>9.1f} {r['server_cpu_us_per_update']:>10.1f} "
            f"{r['loadavg_1m']:>5.2f}")


def main(argv: list[str] | None = None) -> dict:
    """Run both sides and print them side by side; ``--out`` also stores them under ``fleet_ingest``."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.fleet_ingest",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between two updates of a rank")
    parser.add_argument("--seconds", type=int, default=90, help="seconds of paced load per side")
    parser.add_argument("--scrape-every", type=float, default=15.0, help="seconds between two scrapes")
    parser.add_argument("--before", default="main", help="the commit to compare with (default: main)")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    args = parser.parse_args(argv)
    result = before_after(args.before, lambda path: measure(args.ranks, args.interval, args.seconds,
                                                            args.scrape_every, path))
    print(f"{'side':>6} {'ranks':>6} {'upd/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'missed':>6} "
          f"{'unansw':>6} {'scrapes':>7} {'scrape ms':>9} {'cpu us/upd':>10} {'load':>5}")
    return print_and_store(result, KEY, args.out, _line)


if __name__ == "__main__":
    main()
