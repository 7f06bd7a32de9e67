"""One request per node: the collector's requests/s and CPU per rank update, per-rank v1 beside per-node v2.

Both sides run in one invocation, on the same machine, minutes apart, each against its own fresh
collector (loopback only): N simulated ranks send one update each per second for S seconds, either
as one protocol v1 request per rank (today's delivery) or as one protocol v2 request per node of
``--per-node`` ranks (what a node relay posts when every rank of the node has a batch waiting). The
same counters and events travel either way; ``answered`` counts rank updates applied. The figure to
compare is the collector's CPU per rank update; latency is from send to answer (a v2 answer waits
for the node's whole batch to commit).

    python -m bench.relay                          # 1,024 ranks, 10 s per side: about 30 s
    python -m bench.relay --ranks 1024 4096 --out bench/relay.json   # both levels: about 70 s
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import _servers
from bench._before_after import store

__all__ = ["run", "main", "KEY"]

KEY = "relay"
SIDES = (("per-rank v1", "ampwatch"), ("per-node v2", "ampwatch-node"))


def _side(target: str, ranks: int, seconds: int, per_node: int) -> dict:
    """One fresh collector under one delivery; its load generator's figures plus the collector's CPU."""
    with _servers.collector() as srv:
        result = _servers.load(srv, ranks, seconds, target=target, per_node=per_node)
    result["requests_per_s"] = round(result["requests"] / max(1e-9, result["elapsed_s"]), 1)
    return result


def run(ranks: int = 1024, seconds: int = 10, per_node: int = 8) -> dict:
    """Run both deliveries in turn, v1 first; return ``{"v1": ..., "v2": ..., ratios}``."""
    v1 = _side("ampwatch", ranks, seconds, per_node)
    v2 = _side("ampwatch-node", ranks, seconds, per_node)
    return {"ranks": ranks, "seconds": seconds, "per_node": per_node, "v1": v1, "v2": v2,
            "cpu_per_update_ratio": round(v2["server_cpu_us_per_update"] / max(1e-9, v1["server_cpu_us_per_update"]),
                                          3),
            "requests_ratio": round(v2["requests"] / max(1, v1["requests"]), 4),
            "note": "loopback; the machine was shared with other work: compare the two sides, not absolute figures"}


def _print(result: dict) -> None:
    print(f"{result['ranks']} ranks, one update per rank per second for {result['seconds']} s; "
          f"v2: {result['per_node']} ranks per request")
    print(f"{'delivery':>12} {'requests/s':>10} {'updates/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'missed':>6} "
          f"{'refused':>7} {'cpu %':>6} {'cpu us/update':>13}")
    for name, key in (("per-rank v1", "v1"), ("per-node v2", "v2")):
        r = result[key]
        print(f"{name:>12} {r['requests_per_s']:>10.1f} {r['updates_per_s']:>10.1f} {r['p50_ms']:>8.1f} "
              f"{r['p99_ms']:>8.1f} {r['missed_slots']:>6} {sum(r['failures'].values()):>7} "
              f"{r['server_cpu_pct']:>6.1f} {r['server_cpu_us_per_update']:>13.1f}")
    print(f"v2/v1: CPU per rank update x{result['cpu_per_update_ratio']}, requests x{result['requests_ratio']}")


def main(argv: list[str] | None = None) -> dict:
    """Run each level both ways, print a table per level (``--json``: the raw results), store with ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024], help="one or more levels, each both ways")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print the raw result as JSON")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    args = parser.parse_args(argv)
    result = {"levels": [run(ranks, args.seconds, args.per_node) for ranks in args.ranks]}
    for level in result["levels"]:
        print(json.dumps(level, indent=1)) if args.json else _print(level)
    if args.out:
        store(args.out, KEY, result, sys.argv)
    return result


if __name__ == "__main__":
    main()
