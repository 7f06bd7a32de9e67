"""One request per node: the collector's requests/s and CPU per rank update, per-rank v1 beside per-node v2.

Both sides run in one invocation, on the same machine, minutes apart, each against its own fresh
collector (loopback only): N simulated ranks send one update each per second for S seconds, either
as one protocol v1 request per rank (today's delivery) or as one protocol v2 request per node of
``--per-node`` ranks (what a node relay posts when every rank of the node has a batch waiting). The
same counters and events travel either way; ``answered`` counts rank updates applied. The figure to
compare is the collector's CPU per rank update; latency is from send to answer (a v2 answer waits
for the node's whole batch to commit).

Then the real thing, for how many batches a relay really gathers: ``--per-node`` processes with the
real sender (stand-in recorders, no training) and ``AMPWATCH_RELAY=1`` at the default push interval,
started together as a launcher starts them, against one more collector, twice: counters only (a
healthy job), and a skip on every rank at the same moment every 5 s (as DDP ranks skip together).
The collector's own counters give batches applied per request.

    python -m bench.experiments.relay                          # 1,024 ranks, 10 s per side, then the real relay: ~3 min
    python -m bench.experiments.relay --ranks 1024 4096 --out bench/experiments/results/relay.json
                                                               # both levels: about 4 minutes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request

from bench import _servers
from bench._before_after import print_and_store

__all__ = ["run", "main", "KEY"]

KEY = "relay"
SIDES = (("per-rank v1", "ampwatch"), ("per-node v2", "ampwatch-node"))


def _side(target: str, ranks: int, seconds: int, per_node: int) -> dict:
    """One fresh collector under one delivery; its load generator's figures plus the collector's CPU."""
    with _servers.collector() as srv:
        result = _servers.load(srv, ranks, seconds, target=target, per_node=per_node)
    result["requests_per_s"] = round(result["requests"] / max(1e-9, result["elapsed_s"]), 1)
    return result


_AGENT = """
import sys, time
from ampwatch_support.delivery_harness import make_sender
url, rank, world, seconds, relay_dir, skips = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
    sys.argv[5], sys.argv[6] == "skips"
sender, recorder = make_sender(url, run="bench-relay", rank=rank, world_size=world, push_interval=1.0,
                               max_backoff=30.0, timeout=5.0, relay=True, relay_dir=relay_dir)
end = time.monotonic() + seconds
while time.monotonic() < end:
    if not skips:  # healthy training: counters only
        time.sleep(0.5)
        continue
    time.sleep(max(0.0, min(end - time.monotonic(), 5.0 - time.time() % 5.0)))
    recorder.skip()  # every rank at the same moment, as DDP ranks skip together; news goes out soon
    sender.wake()
sender.close(10)
"""
SCENARIOS = ("counters only", "skips")


def real_relay(agents: int = 8, seconds: int = 30, scenario: str = "counters only") -> dict:
    """Run ``agents`` real senders relaying on this host for ``seconds``; return batches per request."""
    with _servers.collector() as srv, tempfile.TemporaryDirectory() as relay_dir:
        procs = [subprocess.Popen([sys.executable, "-c", _AGENT, srv.url, str(r), str(agents), str(seconds),
                                   relay_dir, scenario.split()[0]]) for r in range(agents)]
        for proc in procs:
            proc.wait(seconds + 300)  # importing torch takes a while on a loaded machine
        with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as answer:
            text = answer.read().decode()
    from ampwatch_support.exposition import value
    requests = value(text, "ampwatch_collector_ingest_requests_total", code="200") or 0
    batches = value(text, "ampwatch_collector_batches_applied_total") or 0
    return {"scenario": scenario, "agents": agents, "seconds": seconds, "push_interval_s": 1.0,
            "requests": requests, "batches": batches, "batches_per_request": round(batches / max(1, requests), 2),
            "exit_codes": sorted({p.returncode for p in procs})}


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


def _real_relay_line(scenario: str, real: dict) -> str:
    return (f"real relay, {scenario}: {real['agents']} sender processes, push every "
            f"{real['push_interval_s']} s for {real['seconds']} s: {real['batches']:.0f} batches in "
            f"{real['requests']:.0f} requests ({real['batches_per_request']} per request)")


def main(argv: list[str] | None = None) -> dict:
    """Run each level both ways, print a table per level (``--json``: the raw results), store with ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.relay", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024], help="one or more levels, each both ways")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--real-seconds", type=int, default=30, help="how long the real relay runs, per scenario")
    parser.add_argument("--json", action="store_true", help="print the raw result as JSON")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    args = parser.parse_args(argv)
    result = {"levels": [run(ranks, args.seconds, args.per_node) for ranks in args.ranks],
              "real_relay": [real_relay(args.per_node, args.real_seconds, scenario) for scenario in SCENARIOS]}
    for level in result["levels"]:
        print(json.dumps(level, indent=1)) if args.json else _print(level)
    return print_and_store(result, KEY, args.out, _real_relay_line,
                           rows=((real["scenario"], real) for real in result["real_relay"]))


if __name__ == "__main__":
    main()
