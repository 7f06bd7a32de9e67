"""``/metrics`` at 1,024 ranks x 2 optimizers, this tree beside an earlier commit, in one run.

Each side fills a fresh collector (``bench.scrape.level``: three batches per rank) and scrapes it
plain and as Prometheus asks (``Accept-Encoding: gzip``); the earlier side's collector runs
``ampwatch.server`` from ``git archive <ref>`` (first on PYTHONPATH).

    python -m bench.experiments.metrics_size [--ranks 1024] [--before d90d65f] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench._before_after import ROOT as _ROOT
from bench._before_after import before_after, print_and_store

__all__ = ["main"]

KEY = "metrics_size"


def _side(ranks: int, path: str | None) -> dict:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    code = ("import sys, json; from bench import scrape; r = scrape.level('ampwatch', int(sys.argv[1]), 5)[0];"
            "print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, str(ranks)], cwd=_ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--before", default="d90d65f", help="the commit to compare with")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    args = parser.parse_args(argv)
    return print_and_store(before_after(args.before, lambda path: _side(args.ranks, path)), KEY, args.out,
                           lambda name, r: f"{name:>6}: {r['samples']} samples, {r['bytes']} bytes plain, "
                                           f"{r['gzip_bytes']} bytes when gzip is asked, scrape "
                                           f"{r['scrape_median_ms']} / {r['gzip_scrape_median_ms']} ms")


if __name__ == "__main__":
    main()
