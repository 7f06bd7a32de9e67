"""What one refresh of the run page costs at N ranks: ``GET /v1/runs/{run}`` beside ``GET /v1/runs/{run}/summary``.

A fresh collector is filled with N ranks x 2 optimizers (``bench.scrape.fill``: three batches per
rank); each endpoint is fetched several times; median milliseconds and bytes of each.

    python -m bench.run_page [--ranks 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request

from bench import _servers, scrape
from bench.alert_memory import store

__all__ = ["main"]

KEY = "run_page"


def _get(url: str, times: int = 7) -> tuple[float, int]:
    spent, size = [], 0
    for _ in range(times):
        t = time.perf_counter()
        with urllib.request.urlopen(url, timeout=120) as answer:
            size = len(answer.read())
        spent.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(spent), 1), size


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    args = parser.parse_args(argv)
    result = {"ranks": args.ranks}
    with _servers.server("ampwatch") as srv:
        scrape.fill(srv, args.ranks)
        run = f"scrape-{args.ranks}"
        for name, path in (("run", f"/v1/runs/{run}"), ("summary", f"/v1/runs/{run}/summary?limit=50")):
            ms, size = _get(srv.url + path)
            result[name] = {"path": path, "median_ms": ms, "bytes": size}
            print(f"{path}: {ms} ms, {size} bytes")
    if args.out:
        store(args.out, KEY, result, sys.argv)
    return result


if __name__ == "__main__":
    main()
