"""A whole-job skip storm at 1,024 ranks as a DDP job makes it: this tree's collector beside an earlier commit's.

Each side starts a fresh collector (default settings; the earlier side's from ``git archive <ref>``, first
on PYTHONPATH) and drives it over real HTTP on loopback with a simulated DDP job in another process
(``bench.experiments._fleet_ranks --lockstep``): N ranks x 2 optimizers that iterate together every
``--iteration-s``, each sending when the agent's own schedule (``ampwatch.agent._schedule``) says:
a heartbeat, and news at the iteration it happens, within the agent's own spread. Timeline: the ranks
start together (*warm*), train healthily (*healthy*), then every rank skips every iteration for
``--storm-seconds`` (*storm*: news at the streak's first skip and at each rung, in the same second on
every rank), then the checkpoint taken before the storm is restored on every rank at the same iteration
(*recovery*), and the job trains on (*hold*) until ``--minutes`` after the start.

Measured per phase: ingest latency (from handing a batch over to its answer, as the agent times it),
answers over 1 s and 2 s, ``/metrics`` scraped every 7.5 s both plain and gzipped (as Prometheus asks for
it), one right after the other, which first by turns, so that the two are compared at the same moments of
the job (scraped by turns, each every 15 s, the gzipped scrapes met the storm's bursts at its 32nd and
256th skips and the plain ones met none), collector CPU; at the end the collector's resident memory over
the empty collector's, per rank, and the database's growth per storm-minute. The sides run one after the
other, each about ``--minutes`` plus start-up.

    python -m bench.experiments.storm                      # 1,024 ranks, 15 minutes a side: about 32 minutes
    python -m bench.experiments.storm --minutes 4          # the same phases, a shorter hold: about 10 minutes
    python -m bench.experiments.storm --only after --minutes 4
    python -m bench.experiments.storm --only after --minutes 4 --news-spread 0.95   # the agent's spread before 1.5 s
    python -m bench.experiments.storm --out bench/experiments/results/job1024_before_after.json
                                                           # also store it (key "lockstep_storm")
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request

from ampwatch.agent._schedule import NEWS_SPREAD
from ampwatch.server._trace import TRACE_ENV
from bench._before_after import ROOT, print_and_store, source_of
from bench.experiments.fleet import first_skip_delays, ms_summary, seconds_summary, warm_seconds

__all__ = ["KEY", "PHASES", "measure", "main"]

KEY = "lockstep_storm"
SCRAPE_EVERY_S = 7.5  # a plain and a gzipped scrape, one right after the other
HEALTHY_S, RECOVERY_S = 45.0, 45.0
PHASES = ("warm", "healthy", "storm", "recovery", "hold")


def _logical_bytes(db: sqlite3.Connection) -> int:
    """Bytes of the database's pages in use as a reader sees it now (WAL included, free pages not)."""
    pages, free, size = (db.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count",
                                                                         "page_size"))
    return (pages - free) * size


def _scrape(url: str, gzipped: bool) -> dict:
    """Time one ``GET /metrics`` to its last byte, plain or as Prometheus asks for it (``Accept-Encoding: gzip``)."""
    request = urllib.request.Request(url + "/metrics", headers={"Accept-Encoding": "gzip"} if gzipped else {})
    started = time.time()
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            size = len(answer.read())
    except OSError as error:
        return {"t": started, "gzip": gzipped, "error": str(error)}
    return {"t": started, "gzip": gzipped, "ms": round(1000 * (time.time() - started), 1), "bytes": size}


def _phase_of(t: float, bounds: dict[str, tuple[float, float]]) -> str | None:
    return next((name for name, (a, b) in bounds.items() if a <= t < b), None)


def measure(ranks: int, minutes: float, storm_s: float, iteration_s: float, server: str = "",
            news_spread: float = NEWS_SPREAD) -> dict:
    """Run the job against a fresh collector (``server``, a PYTHONPATH to put first: an earlier commit's; else
    this tree's), its ranks spreading their news over at most ``news_spread`` s; return the figures."""
    from bench import _servers

    warm = warm_seconds(ranks)
    hold = max(0.0, minutes * 60 - warm - HEALTHY_S - storm_s - RECOVERY_S)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (server, os.environ.get("PYTHONPATH")) if p)} if server else None
    with tempfile.TemporaryDirectory() as tmp, _servers.collector(env=env) as srv:
        stats = srv.stats
        _scrape(srv.url, False)  # the exposition's own start-up (a thread, label caches) is not the job's
        rss_empty = stats.memory_kib()["VmRSS"]
        out = os.path.join(tmp, "job.json")
        sim = subprocess.Popen([sys.executable, "-m", "bench.experiments._fleet_ranks", "--port", str(srv.port),
                                "--ranks", str(ranks), "--delivery", "after", "--lockstep",
                                "--iteration-s", str(iteration_s), "--news-spread", str(news_spread),
                                "--warm", str(warm), "--healthy", str(HEALTHY_S), "--storm", str(storm_s),
                                "--recovery", str(RECOVERY_S), "--hold", str(hold), "--run", "storm", "--out", out],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
        t = json.loads(sim.stdout.readline())
        bounds = {"warm": (t["t0"], t["warm_end"]), "healthy": (t["warm_end"], t["storm_at"]),
                  "storm": (t["storm_at"], t["storm_end"]),
                  "recovery": (t["storm_end"], t["storm_end"] + RECOVERY_S), "hold": (t["storm_end"] + RECOVERY_S,
                                                                                     t["end"])}
        db = sqlite3.connect(f"file:{srv.db}?mode=ro", uri=True, isolation_level=None)
        samples: dict[str, tuple[float, int, int]] = {}  # phase boundary -> (CPU s, RSS KiB, database bytes)
        scrapes: list[dict] = []
        moments = [(a, "sample:" + name) for name, (a, _) in bounds.items() if name != "warm"]
        k = 0
        while (at := t["warm_end"] + k * SCRAPE_EVERY_S) < t["end"]:
            moments.append((at, "scrape"))
            k += 1
        for at, what in sorted(moments):
            time.sleep(max(0.0, at - time.time()))
            if what == "scrape":
                first_gzipped = len(scrapes) % 4 == 2  # plain first, then gzipped first, by turns
                scrapes.append(_scrape(srv.url, gzipped=first_gzipped))
                scrapes.append(_scrape(srv.url, gzipped=not first_gzipped))
            else:
                samples[what[7:]] = (stats.cpu_s(), stats.memory_kib()["VmRSS"], _logical_bytes(db))
        time.sleep(max(0.0, t["end"] - time.time()))
        samples["end"] = (stats.cpu_s(), stats.memory_kib()["VmRSS"], _logical_bytes(db))
        sim.wait(timeout=300)
        if sim.returncode != 0:
            raise RuntimeError(f"the simulated job failed (exit {sim.returncode})")
        with open(out) as f:
            job = json.load(f)
        if trace := os.environ.get(TRACE_ENV):  # the collector's own timings: the job's beside them
            with open(trace + ".job.json", "w") as f:
                json.dump({"bounds": bounds, "latency": job["latency"]}, f)
        peak = stats.memory_kib()["VmHWM"]
        storm_end = t["storm_end"] + 2 * iteration_s  # the batches carrying the storm's last skips
        rows, body = db.execute("SELECT count(*), coalesce(sum(length(body)), 0) FROM events "
                                "WHERE time >= ? AND time < ?", (t["storm_at"], storm_end)).fetchone()
        kinds = dict(db.execute("SELECT kind, count(*) FROM events GROUP BY kind").fetchall())
        db.close()
    return dict(_summary(ranks, iteration_s, bounds, job, scrapes, samples, rss_empty, peak, rows, body, kinds),
                news_spread_s=news_spread)


def _summary(ranks: int, iteration_s: float, bounds: dict, job: dict, scrapes: list[dict], samples: dict,
             rss_empty: int, peak: int, rows: int, body: int, kinds: dict) -> dict:
    latency = {p: [seconds for _, seconds in pairs] for p, pairs in job["latency"].items()}
    latency["storm+recovery"] = latency.get("storm", []) + latency.get("recovery", [])  # issue 41's target
    ends = {"warm": "healthy", "healthy": "storm", "storm": "recovery", "recovery": "hold", "hold": "end"}
    metrics: dict[str, dict] = {}
    for phase in PHASES:
        for kind in ("plain", "gzip"):
            times = [s["ms"] / 1000 for s in scrapes if "ms" in s and s["gzip"] == (kind == "gzip")
                     and _phase_of(s["t"], bounds) == phase]
            if times:
                metrics.setdefault(phase, {})[kind] = ms_summary(times)
    storm_minutes = (bounds["storm"][1] - bounds["storm"][0]) / 60
    visible, not_visible = first_skip_delays(job["storm"])
    cpu = {}
    for phase, nxt in ends.items():
        if phase in samples and nxt in samples:
            cpu[phase] = round((samples[nxt][0] - samples[phase][0]) / max(1e-9, bounds[phase][1] - bounds[phase][0]),
                               3)
    return {
        "ranks": ranks, "optimizers": 2, "iteration_s": iteration_s,
        "phases_s": {p: round(b - a, 1) for p, (a, b) in bounds.items()},
        "latency": {p: dict(ms_summary(v), over_1s=sum(x > 1 for x in v), over_2s=sum(x > 2 for x in v))
                    for p, v in latency.items()},
        "requests_per_s": {p: round(job["requests"][p] / max(1e-9, bounds[p][1] - bounds[p][0]), 1)
                           for p in job["requests"]},
        "missed_updates": job["missed"], "refused": job["refused"], "timeouts": job["timeouts"],
        "metrics_ms": metrics,
        "scrapes_failed": sum("error" in s for s in scrapes),
        "metrics_bytes": {kind: max((s["bytes"] for s in scrapes if "bytes" in s and s["gzip"] == (kind == "gzip")),
                                    default=None) for kind in ("plain", "gzip")},
        "collector_cpu_cores": cpu,
        "rss_mib": {"empty": round(rss_empty / 1024, 1), "end": round(samples["end"][1] / 1024, 1),
                    "after_storm": round(samples["recovery"][1] / 1024, 1), "peak": round(peak / 1024, 1)},
        "kib_per_rank": round((samples["end"][1] - rss_empty) / ranks, 1),
        "minutes": round((bounds["hold"][1] - bounds["warm"][0]) / 60, 1),
        "first_skip_to_answer": seconds_summary(visible), "first_skips_not_answered": not_visible,
        "event_rows_per_storm_minute": round(rows / storm_minutes),
        "event_mb_per_storm_minute": round(body / storm_minutes / 1e6, 2),
        "db_mb_per_storm_minute": round((samples["recovery"][2] - samples["storm"][2]) / storm_minutes / 1e6, 2),
        "events_by_kind": kinds, "generator_cpu_s": job["generator_cpu_s"],
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def _side(args: argparse.Namespace, path: str | None) -> dict:
    if args.trace:
        os.environ[TRACE_ENV] = os.path.abspath(f"{args.trace}.{'before' if path else 'after'}")
    # Only the collector runs the earlier commit's code (with its contract); the job and the measuring are this tree's.
    code = ("import sys, json; from bench.experiments.storm import measure;"
            "r = measure(int(sys.argv[1]), *map(float, sys.argv[2:5]), sys.argv[5], float(sys.argv[6]));"
            "print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, str(args.ranks), str(args.minutes), str(args.storm_seconds),
                          str(args.iteration_s), path or "", str(args.news_spread)],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=args.minutes * 60 + 900)
    if out.returncode != 0:
        raise RuntimeError(f"the {'earlier' if path else 'current'} side failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _line(name: str, r: dict) -> str:
    lat, m = r["latency"], r["metrics_ms"]

    def spread(phase: str) -> str:
        x = lat.get(phase) or {}
        return f"{x.get('p50_ms')} / {x.get('p99_ms')} / {x.get('max_ms')} ms ({x.get('over_1s')} over 1 s)"

    def scrape(phase: str, kind: str) -> str:
        return str((m.get(phase) or {}).get(kind, {}).get("p50_ms"))

    return "\n".join([
        f"{name:>6}: ingest p50/p99/max healthy {spread('healthy')}, storm {spread('storm')}, "
        f"recovery {spread('recovery')}, storm+recovery {spread('storm+recovery')}",
        f"{'':>8}/metrics median ms plain/gzip: healthy {scrape('healthy', 'plain')}/{scrape('healthy', 'gzip')}, "
        f"storm {scrape('storm', 'plain')}/{scrape('storm', 'gzip')}; RSS {r['rss_mib']['empty']} -> "
        f"{r['rss_mib']['end']} MiB after {r['minutes']} min ({r['kib_per_rank']} KiB/rank, peak "
        f"{r['rss_mib']['peak']}); CPU cores {r['collector_cpu_cores']}; load {r['loadavg']}"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.storm", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--minutes", type=float, default=15.0, help="from the job's start to the memory reading")
    parser.add_argument("--storm-seconds", type=float, default=60.0)
    parser.add_argument("--iteration-s", type=float, default=0.2, help="seconds per training iteration")
    parser.add_argument("--before", default="f833925", help="the commit whose collector to compare with")
    parser.add_argument("--only", choices=("before", "after"), help="run one side only")
    parser.add_argument("--news-spread", type=float, default=NEWS_SPREAD,
                        help="the widest spread of the job's news, seconds, on both sides (default: the agent's "
                             f"NEWS_SPREAD, {NEWS_SPREAD}; 0.95 was the agent's up to issue 26)")
    parser.add_argument("--out", help=f"also store the result under {KEY!r} in this JSON file")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="with --only after: run it N times one after the other (each on a fresh collector), "
                             f"stored under {KEY + '_runs'!r}")
    parser.add_argument("--trace", metavar="FILE",
                        help="each side's collector writes its own timings to FILE.before / FILE.after "
                             "(AMPWATCH_SERVER_TRACE, docs/collector.md; a side whose code has none writes nothing), "
                             "the job's answers beside them (FILE.after.job.json): read them with "
                             "python -m bench.experiments.storm_trace FILE.after")
    args = parser.parse_args(argv)
    if args.repeat > 1:
        if args.only != "after":
            parser.error("--repeat needs --only after")
        if args.trace:
            parser.error("--repeat takes no --trace (each run would overwrite it)")
        runs = {f"after {i + 1}": _side(args, None) for i in range(args.repeat)}
        p99 = ", ".join(str(r["latency"]["storm+recovery"]["p99_ms"]) for r in runs.values())
        result = print_and_store({"runs": list(runs.values())}, KEY + "_runs", args.out, _line, rows=runs.items())
        print(f"storm+recovery p99 of each run: {p99} ms")
        return result
    result: dict = {}
    if args.only != "after":
        with tempfile.TemporaryDirectory() as tmp:
            result["before"] = dict(_side(args, source_of(args.before, tmp)), ref=args.before)
    if args.only != "before":
        result["after"] = _side(args, None)
    return print_and_store(result, KEY, args.out, _line, rows=list(result.items()))


if __name__ == "__main__":
    main()
