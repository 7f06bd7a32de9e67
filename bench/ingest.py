"""Collector ingest benchmark: N simulated ranks each POST one batch per second over loopback.

A real collector runs in one process, the load generator in another (both on this machine);
the generator keeps one keep-alive connection per rank, as an agent does, and measures each
request from send to durable answer. Then /metrics is scraped at the final state.

    python -m bench.ingest                 # 64 and 1,024 ranks, 20 s each
    python -m bench.ingest --quick         # 5 s each
    python -m bench.ingest --ranks 256 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

__all__ = ["main", "generate"]


def _batch(run: str, rank: int, ranks: int, incarnation: str, seq: int) -> bytes:
    # A realistic batch: two optimizers, a skip and a backoff every 50th batch.
    skips = seq // 50
    events = []
    if seq % 50 == 0:
        now = time.time()
        events = [{"id": 2 * skips - 1, "kind": "skip", "time": now, "iteration": seq, "optimizer": "gen",
                   "streak": 1, "params": [{"name": "decoder.layers.11.mlp.fc2.weight", "inf": 3, "nan": 0}],
                   "params_total": 1, "inspected": True},
                  {"id": 2 * skips, "kind": "scale_change", "time": now, "iteration": seq, "cause": "backoff",
                   "before": 65536.0, "after": 32768.0}]
    opt = {"steps": seq - skips, "skipped": skips, "consecutive_skipped": 0, "longest_streak": min(skips, 1),
           "streaks": skips, "streaks_reached": {"1": skips} if skips else {}, "scheduler_steps_after_skip": 0,
           "poisoned_steps": 0}
    return json.dumps({
        "protocol": 1, "agent": {"version": "0.1.0", "torch": "2.13.0"}, "run": run, "rank": rank,
        "world_size": ranks, "local_rank": rank % 8, "host": f"node-{rank // 8}", "pid": 1000 + rank,
        "incarnation": incarnation, "seq": seq, "sent_at": time.time(),
        "scaler": {"enabled": True, "kind": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
                   "backoff_factor": 0.5, "growth_interval": 2000},
        "state": {"iteration": seq * 10, "loss_scale": 32768.0, "backoffs": skips, "growths": 0, "manual_sets": 0,
                  "optimizers": {"gen": opt, "disc": dict(opt, skipped=0, streaks=0, streaks_reached={})},
                  "delivery": {"dropped_events": 0, "send_failures": 0, "rejected_batches": 0, "agent_errors": 0}},
        "events": events, "closed": False,
    }).encode()


async def _rank(port: int, run: str, rank: int, ranks: int, start: float, seconds: int,
                latencies: list[float], failures: list[str]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    incarnation = uuid.uuid4().hex
    try:
        for seq in range(1, seconds + 1):
            delay = start + rank / ranks + (seq - 1) - time.perf_counter()  # spread ranks over each second
            if delay > 0:
                await asyncio.sleep(delay)
            body = _batch(run, rank, ranks, incarnation, seq)
            sent = time.perf_counter()
            writer.write(b"POST /v1/ingest HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            status = (await reader.readline()).split(b" ")[1]
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            latencies.append((seq, time.perf_counter() - sent))
            if status != b"200":
                failures.append(status.decode())
    finally:
        writer.close()


async def _generate(port: int, ranks: int, seconds: int) -> dict:
    latencies: list[float] = []
    failures: list[str] = []
    run = f"bench-{ranks}"
    start = time.perf_counter() + 0.5
    await asyncio.gather(*(_rank(port, run, r, ranks, start, seconds, latencies, failures) for r in range(ranks)))
    elapsed = time.perf_counter() - start
    return {"batches": len(latencies), "elapsed_s": elapsed, "failures": len(failures), "latencies": latencies}


def generate(port: int, ranks: int, seconds: int) -> dict:
    """Simulate ``ranks`` agents for ``seconds`` seconds against a collector on ``port``."""
    return asyncio.run(_generate(port, ranks, seconds))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _scrape_ms(url: str, times: int = 10) -> list[float]:
    out = []
    for _ in range(times):
        t = time.perf_counter()
        with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
            answer.read()
        out.append((time.perf_counter() - t) * 1000)
    return out


def bench(ranks: int, seconds: int) -> dict:
    """Run one load level against a fresh collector; return its figures."""
    from ampwatch.server._harness import CollectorProcess
    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(os.path.join(tmp, "bench.db")) as collector:
        # The generator is its own process, so the collector keeps one core to itself on a 2-core machine.
        out = subprocess.run([sys.executable, "-m", "bench.ingest", "--generate", str(collector.port),
                              "--ranks", str(ranks), "--seconds", str(seconds)],
                             capture_output=True, text=True, check=True, timeout=seconds + 120)
        result = json.loads(out.stdout)
        scrape = _scrape_ms(collector.url)
        lat = [latency for _, latency in result["latencies"]]
        # Steady state: without the first 2 s, when every rank connects and registers at once.
        steady = [latency for seq, latency in result.pop("latencies") if seq > 2] or lat
        return {"ranks": ranks, "seconds": seconds, "batches": result["batches"], "failures": result["failures"],
                "batches_per_s": result["batches"] / result["elapsed_s"],
                "p50_ms": _pct(steady, .50) * 1000, "p99_ms": _pct(steady, .99) * 1000,
                "max_ms": max(steady) * 1000, "p99_all_ms": _pct(lat, .99) * 1000,
                "scrape_median_ms": statistics.median(scrape), "scrape_max_ms": max(scrape)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one line per load level."""
    parser = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, action="append", help="simulated ranks (repeatable; default 64 1024)")
    parser.add_argument("--seconds", type=int, default=None, help="seconds of load per level (default 20)")
    parser.add_argument("--quick", action="store_true", help="5 seconds per level")
    parser.add_argument("--generate", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    seconds = args.seconds or (5 if args.quick else 20)
    if args.generate:
        print(json.dumps(generate(args.generate, args.ranks[0], seconds)))
        return 0
    print(f"ingest: each rank POSTs one batch per second for {seconds} s; latency = send to durable answer")
    print("latency percentiles leave out each rank's first 2 batches (connect + register); p99 all includes them")
    print(f"{'ranks':>6} {'batches/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 all':>8} {'fail':>5} "
          f"{'scrape ms (median/max)':>24}")
    for ranks in args.ranks or [64, 1024]:
        r = bench(ranks, seconds)
        print(f"{r['ranks']:>6} {r['batches_per_s']:>10.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
              f"{r['max_ms']:>8.1f} {r['p99_all_ms']:>8.1f} {r['failures']:>5} {r['scrape_median_ms']:>11.1f} / {r['scrape_max_ms']:.1f}"
              f"   ({r['ranks']} ranks x 2 optimizers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
