"""What one refresh of the run page costs at N ranks: ``GET /v1/runs/{run}`` beside ``GET /v1/runs/{run}/summary``.

A fresh collector is filled with N ranks x 2 optimizers (``bench.scrape.fill``: three batches per
rank); each endpoint is fetched several times; median milliseconds and bytes of each. Then the
status page itself in headless Chromium (tests/helpers/headless_browser.py): time to its first
drawn run view, and the bytes of the API answers of each later refresh (every 3 s).

    python -m bench.run_page [--ranks 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.parse
import urllib.request

from bench import _servers, scrape
from bench._before_after import store

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


def _page(url: str, run: str, refreshes: int = 4) -> dict:
    """Open the run view in Chromium; return ms to the first drawn view and API bytes per later refresh."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "helpers"))
    from headless_browser import open_page

    received: list[tuple[float, int]] = []
    started = time.perf_counter()
    with open_page(f"{url}/#run={urllib.parse.quote(run)}") as (page, _problems):
        page.on("response", lambda r: received.append((time.perf_counter(), len(r.body())))
                if "/v1/" in r.url else None)
        page.wait_for_selector("#trouble-count:not(:empty)", timeout=60_000)
        first_paint = (time.perf_counter() - started) * 1000
        mark = time.perf_counter()
        sizes = []
        for _ in range(refreshes):
            page.wait_for_timeout(3000)  # one refresh period
            now = time.perf_counter()
            sizes.append(sum(size for t, size in received if mark <= t < now))
            mark = now
    return {"first_paint_ms": round(first_paint), "refreshes": sizes, "refresh_bytes": statistics.median_low(sizes)}


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
        result["page"] = _page(srv.url, run)
        print(f"status page: first paint {result['page']['first_paint_ms']} ms, refresh "
              f"{result['page']['refresh_bytes']} bytes (median of {len(result['page']['refreshes'])})")
    if args.out:
        store(args.out, KEY, result, sys.argv)
    return result


if __name__ == "__main__":
    main()
