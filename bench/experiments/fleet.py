"""A 16,384-rank job (2,048 nodes x 8 ranks) on one collector: state every second vs news now, state every heartbeat.

Both sides in one run, each on a fresh collector (this tree's, default settings but for
``--max-ranks-per-run`` when its default refuses the job) with a simulated job in another process
(``bench/experiments/_fleet_ranks.py``: the agent's own schedule, real HTTP on loopback). Timeline per side:
every rank starts within a second and sends its first batch (*warm*), trains healthily (*healthy*: ingest latency,
collector CPU and memory, bytes on the wire), then 10% of the ranks run skip streaks (*storm*: from
each streak's first skip to its answer, which is when ``/metrics`` shows it, checked against real
scrapes every 15 s as Prometheus makes them; from a streak's 16th skip to ``AmpConsecutiveSkippedSteps``
firing in the built-in alerts). One rank is killed (no close) early in the healthy phase:
``AmpRankSilent`` must fire within ``silent_after_s`` + ``silent_for_s`` of its last
batch (+ 2 ticks of 1 s), with the silence scaled to 3 heartbeats + 1 so that the bench stays short
(:func:`silence`; the default is 8 heartbeats + 60 s).

    python -m bench.experiments.fleet                          # 16,384 ranks, before and after: about 6 minutes
    python -m bench.experiments.fleet --quick                  # 1,024 ranks, shorter phases: about 4 minutes
    python -m bench.experiments.fleet --only after --ranks 4096
    python -m bench.experiments.fleet --out bench/experiments/results/fleet_delivery.json
                                                               # also store it (key "fleet_16384")
    python -m bench.experiments.fleet --lockstep --before f833925  # a whole-job storm, f833925's collector beside
                                                                   # this tree's (key "fleet_16384_lockstep")
    python -m bench.experiments.fleet --render bench/experiments/results/fleet_delivery.json
                                                               # print the Markdown tables stored there

``--transport node-relay`` runs the *after* side through the node relay (one protocol v2 request
per node, ``bench/experiments/_fleet_ranks.py`` ``TRANSPORTS``). A rank's ingest latency is from handing its
batch over to its answer (with the relay, the hold for the node's other ranks included); the HTTP
request row times the requests themselves, whoever sent them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from ampwatch.agent._schedule import RANKS_PER_SECOND, default_heartbeat
from ampwatch.contract.protocol import COLLECTOR_DEFAULTS, HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S
from bench import _servers
from bench._before_after import ROOT, source_of, store
from bench.report._format import measured_by
from bench.report.fleet import table

__all__ = ["SILENCE", "first_skip_delays", "ms_summary", "scrape", "seconds_summary", "silence", "sleep_until", "run",
           "main", "warm_seconds"]

KEY = "fleet"
SCRAPE_EVERY_S = 15.0  # as Prometheus does by default
VISIBLE_WITHIN_S = 2.0  # the target: a streak's first skip in /metrics and the built-in alerts
def silence(heartbeat: float) -> dict[str, int]:
    """Bench-only silence thresholds: short enough to see AmpRankSilent fire within the run, still 3
    heartbeats (the longest wait between a healthy rank's batches is 1.5), so that a healthy rank
    whose heartbeats come late shows up as a false alert. The default is 8 heartbeats + 60 s."""
    return {"silent_after_s": int(3 * heartbeat), "silent_for_s": int(heartbeat)}


SILENCE = silence(HEARTBEAT_INTERVAL_S)

PHASES = {"full": {"before": (20, 30), "after": (45, 45)}, "quick": {"before": (20, 30), "after": (30, 30)}}
"""Seconds of (healthy, storm) per side; before them, *warm* lets every rank make its first contact. The
healthy phase of the *after* side is 3 (quick: 2) heartbeats, so every rank sends the same number."""


def warm_seconds(ranks: int, side: str = "after") -> float:
    """Seconds until every rank has sent its first batch: the agent spreads a big job's first batches."""
    if side == "before":
        return 2.0  # the ranks start within a second and send at once
    return min((ranks - 1) / RANKS_PER_SECOND, 4 * default_heartbeat(ranks)) + 3.0


_SKIPPED = re.compile(r'^ampwatch_optimizer_skipped_steps_total\{([^}]*)\} (\S+)', re.M)
_RANK = re.compile(r'rank="(\d+)"')


def _get(url: str, timeout: float = 120.0) -> bytes:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        data = answer.read()
        return gzip.decompress(data) if answer.headers.get("Content-Encoding") == "gzip" else data


def scrape(url: str) -> dict:
    """Scrape /metrics as Prometheus does; return its times and every rank's ``gen`` skipped count."""
    started = time.time()
    try:
        text = _get(url + "/metrics", timeout=SCRAPE_EVERY_S).decode()
    except OSError as error:  # an overwhelmed collector: Prometheus would mark the target down
        return {"start": started, "end": time.time(), "counts": {}, "bytes": 0, "error": str(error)}
    ended = time.time()
    counts = {}
    for labels, value in _SKIPPED.findall(text):
        if 'optimizer="gen"' in labels and (m := _RANK.search(labels)):
            counts[m.group(1)] = float(value)
    return {"start": started, "end": ended, "counts": counts, "bytes": len(text)}


def _alerts(url: str) -> list[dict] | None:
    """Return the built-in alerts firing now, or None when the collector does not answer within 30 s."""
    try:
        return json.loads(_get(url + "/v1/alerts", timeout=30.0))["firing"]
    except OSError:
        return None


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms_summary(values: list[float]) -> dict:
    """``n``, p50, p99 and max of ``values`` (seconds) in ms."""
    out = {"n": len(values)}
    for name, q in (("p50_ms", .5), ("p99_ms", .99)):
        v = _pct(values, q)
        out[name] = None if v is None else round(v * 1000, 1)
    out["max_ms"] = round(max(values) * 1000, 1) if values else None
    return out


def seconds_summary(values: list[float]) -> dict:
    """``n``, p50, p99 and max of ``values`` in seconds, and how many are within 2 s."""
    return {"n": len(values), "p50_s": _round(_pct(values, .5)), "p99_s": _round(_pct(values, .99)),
            "max_s": _round(max(values) if values else None),
            "within_2s": sum(v <= VISIBLE_WITHIN_S for v in values)}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _side(delivery: str, ranks: int, phases: tuple[float, float], transport: str,
          heartbeat: float | None = None, lockstep: bool = False, server: str | None = None) -> dict:
    """Run one side on a fresh collector (``server``: the ``server/src`` it runs, default this tree's); return
    its figures."""
    (healthy, storm), warm = phases, warm_seconds(ranks, delivery)
    limit = COLLECTOR_DEFAULTS["max_ranks_per_run"]
    args = ["--max-ranks-per-run", str(ranks)] if ranks > limit else []
    with tempfile.TemporaryDirectory() as tmp:
        thresholds = os.path.join(tmp, "thresholds.json")
        quiet = silence(heartbeat or HEARTBEAT_INTERVAL_S)
        with open(thresholds, "w") as f:
            json.dump(quiet, f)
        args += ["--alert-thresholds", thresholds]
        with _servers.collector(tuple(args), env={"PYTHONPATH": server} if server else None) as srv:
            stats = srv.stats
            rss0 = stats.memory_kib()["VmRSS"]
            out = os.path.join(tmp, "ranks.json")
            kill_rank = ranks // 2 + 3  # a rank in no storm (the simulation keeps it out)
            sim = subprocess.Popen([sys.executable, "-m", "bench.experiments._fleet_ranks", "--port", str(srv.port),
                                    "--ranks", str(ranks), "--delivery", delivery, "--transport", transport,
                                    "--warm", str(warm), "--healthy", str(healthy), "--storm", str(storm),
                                    "--kill-rank", str(kill_rank), "--kill-after", "5", "--out", out,
                                    *(["--heartbeat", str(heartbeat)] if heartbeat else []),
                                    *(["--lockstep"] if lockstep else [])],
                                   cwd=ROOT, stdout=subprocess.PIPE, text=True)
            timeline = json.loads(sim.stdout.readline())
            sleep_until(timeline["warm_end"])
            cpu = {"healthy": stats.cpu_s()}
            scrapes: list[dict] = []
            moments = [(timeline["warm_end"] + k * SCRAPE_EVERY_S, "scrape")
                       for k in range(int((timeline["end"] - timeline["warm_end"]) / SCRAPE_EVERY_S) + 1)]
            for at, what in sorted(moments + [(timeline["storm_at"], "sample")]):
                if at >= timeline["end"]:
                    break
                sleep_until(at)
                if what == "sample":
                    cpu["healthy_end"], rss_healthy = stats.cpu_s(), stats.memory_kib()["VmRSS"]
                else:
                    scrapes.append(scrape(srv.url))
            sleep_until(timeline["end"])
            cpu["end"] = stats.cpu_s()
            sim.wait(timeout=120)
            if sim.returncode != 0:
                raise RuntimeError(f"the simulated job failed (exit {sim.returncode})")
            with open(out) as f:
                job = json.load(f)
            firing = _alerts(srv.url)
            killed = job["killed"]
            silent_at = _silent_fired_at(srv.url, str(killed["rank"]), job["killed_last_ack"], firing, quiet)
            firing = _alerts(srv.url) or firing
            peak = stats.memory_kib()
    return _summary(delivery, ranks, timeline, job, scrapes, firing, silent_at, cpu, rss0, rss_healthy, peak,
                    raised_limit=ranks > limit, quiet=quiet)


def _silent_fired_at(url: str, rank: str, last_ack: float | None, firing: list[dict] | None,
                     quiet: dict[str, int]) -> float | None:
    """Wait (bounded) for AmpRankSilent on the killed ``rank``; return when it started firing."""
    deadline = (last_ack or time.time()) + quiet["silent_after_s"] + quiet["silent_for_s"] + 10
    while True:
        for alert in firing or ():
            if alert["name"] == "AmpRankSilent" and alert["labels"].get("rank") == rank:
                return alert["starts_at"]
        if time.time() > deadline:
            return None
        time.sleep(1.0)
        firing = _alerts(url)


def first_skip_delays(storm: dict) -> tuple[list[float], int]:
    """Seconds from each streak's first skip to the answer of the batch that carried it, and how many were never
    answered, of a simulated job's storm ranks. The skip is in /metrics (and the built-in alerts) from then on:
    the collector applies a batch before it answers."""
    visible, not_visible = [], 0
    for s in storm.values():
        for t_skip, skipped in s["starts"]:
            acked = next((done for done, count in s["answers"] if count >= skipped), None)
            if acked is None:
                not_visible += 1
            else:
                visible.append(acked - t_skip)
    return visible, not_visible


def _summary(delivery: str, ranks: int, timeline: dict, job: dict, scrapes: list[dict], firing: list[dict],
             silent_at: float | None, cpu: dict, rss0: int, rss_healthy: int, peak: dict, *,
             raised_limit: bool, quiet: dict[str, int]) -> dict:
    healthy_s = timeline["storm_at"] - timeline["warm_end"]
    storm_s = timeline["end"] - timeline["storm_at"]
    storm = job["storm"]
    latency = {phase: [seconds for _, seconds in pairs] for phase, pairs in job["latency"].items()}
    # Requests in flight during a scrape wait for its render on the collector's event loop (until the
    # collector renders elsewhere): the same figures without them say what the delivery alone costs.
    busy = [(s["start"], s["end"]) for s in scrapes]
    unscraped = {phase: [seconds for sent, seconds in pairs
                         if not any(a - seconds <= sent <= b for a, b in busy)]
                 for phase, pairs in job["latency"].items()}
    # Every scrape must agree with the answers: it shows at least what was answered before it began.
    visible, not_visible = first_skip_delays(storm)
    disagreements = 0
    for rank, s in storm.items():
        answers = s["answers"]
        for scrape in scrapes:
            if "error" in scrape:
                continue
            shown = scrape["counts"].get(rank)
            before = max((count for done, count in answers if done <= scrape["start"]), default=0)
            if shown is None and before == 0:
                continue
            if shown is None or shown < before:
                disagreements += 1
    streak_alerts = {}
    for alert in firing or ():
        if alert["name"] == "AmpConsecutiveSkippedSteps" and alert["labels"].get("optimizer") == "gen":
            rank = alert["labels"]["rank"]
            streak_alerts[rank] = min(streak_alerts.get(rank, float("inf")), alert["starts_at"])
    alert_delays, alert_missing = [], 0
    for rank, s in storm.items():
        if s["rung16"] is None or s["rung16"] > timeline["end"] - 2:
            continue
        if rank in streak_alerts:
            alert_delays.append(streak_alerts[rank] - s["rung16"])
        else:
            alert_missing += 1
    killed = job["killed"]
    silent_others = sorted({a["labels"]["rank"] for a in firing or () if a["name"] == "AmpRankSilent"}
                           - {str(killed["rank"])})
    limit_s = quiet["silent_after_s"] + quiet["silent_for_s"] + 2  # + a tick to notice, a tick to fire
    last_ack = job.get("killed_last_ack")
    per_rank_hour = 3600.0 / ranks
    return {
        "delivery": delivery, "transport": job["transport"], "ranks": ranks,
        "raised_max_ranks_per_run": raised_limit,
        "phases_s": {"warm": round(timeline["warm_end"] - timeline["t0"], 1), "healthy": round(healthy_s, 1),
                     "storm": round(storm_s, 1)},
        "healthy": {"requests_per_s": round(job["requests"]["healthy"] / healthy_s, 1),
                    "http_requests_per_s": round(len(job["http_latency"]["healthy"]) / healthy_s, 1),
                    "http_latency": ms_summary(job["http_latency"]["healthy"]),
                    "latency": ms_summary(latency["healthy"]),
                    "latency_outside_scrapes": ms_summary(unscraped["healthy"]),
                    "late_p99_ms": ms_summary(job["late"]["healthy"])["p99_ms"],
                    "collector_cpu_cores": round((cpu["healthy_end"] - cpu["healthy"]) / healthy_s, 3),
                    "collector_cpu_us_per_rank_s": round(1e6 * (cpu["healthy_end"] - cpu["healthy"])
                                                         / (ranks * healthy_s), 2),
                    "collector_rss_mib": round(rss_healthy / 1024, 1),
                    "collector_kib_per_rank": round((rss_healthy - rss0) / ranks, 2),
                    "wire_kib_per_rank_hour": round(job["bytes"]["healthy"] / healthy_s * per_rank_hour / 1024, 1)},
        "storm": {"requests_per_s": round(job["requests"]["storm"] / storm_s, 1),
                  "http_requests_per_s": round(len(job["http_latency"]["storm"]) / storm_s, 1),
                  "http_latency": ms_summary(job["http_latency"]["storm"]),
                  "latency": ms_summary(latency["storm"]), "latency_outside_scrapes": ms_summary(unscraped["storm"]),
                  "collector_cpu_cores": round((cpu["end"] - cpu["healthy_end"]) / storm_s, 3),
                  "wire_kib_per_rank_hour": round(job["bytes"]["storm"] / storm_s * per_rank_hour / 1024, 1),
                  "storm_ranks": len(storm),
                  "first_skip_to_metrics": seconds_summary(visible), "first_skips_not_visible_by_end": not_visible,
                  "scrapes": len(scrapes), "scrapes_failed": sum("error" in s for s in scrapes),
                  "scrape_disagreements": disagreements, "alerts_answered": firing is not None,
                  "scrape_p50_ms": ms_summary([s["end"] - s["start"] for s in scrapes])["p50_ms"],
                  "rung16_to_builtin_alert": seconds_summary(alert_delays), "streak_alerts_missing": alert_missing},
        "missed_updates": job["missed"], "refused": job["refused"], "timeouts": job["timeouts"],
        "silence": {"killed_rank": killed["rank"], "last_batch_to_alert_s": _round(
                        None if silent_at is None or last_ack is None else silent_at - last_ack),
                    "documented_within_s": limit_s, "thresholds": quiet, "other_ranks_silent": len(silent_others)},
        "collector_peak_rss_mib": round(peak["VmHWM"] / 1024, 1),
        "generator_cpu_s": job["generator_cpu_s"],
    }


def run(ranks: int, sides: tuple[str, ...], quick: bool, transport: str = "per-rank",
        heartbeat: float | None = None, lockstep: bool = False, before: str | None = None) -> dict:
    """Run each side in turn; return ``{side: figures}`` with the run's settings.

    ``before``: a commit whose collector runs the *after* delivery first, as side ``previous`` (its
    ``server/src`` from ``git archive``); ``lockstep``: a DDP job whose whole storm is every rank's.
    """
    plan = dict(PHASES["quick" if quick else "full"])
    heartbeat = heartbeat or default_heartbeat(ranks)  # the agent's default for a job of this size
    # The after side's healthy phase stays a whole number of heartbeats (3; quick: 2).
    plan["after"] = plan["previous"] = (plan["after"][0] // HEARTBEAT_INTERVAL_S * heartbeat, plan["after"][1])
    result: dict = {}
    for side in sides:
        with tempfile.TemporaryDirectory() as tmp:
            server = source_of(before, tmp) if side == "previous" else None
            delivery = "before" if side == "before" else "after"
            result[side] = _side(delivery, ranks, plan[side], transport if side != "before" else "per-rank",
                                 heartbeat if side != "before" else None, lockstep, server)
        if side == "previous":
            result[side]["label"] = f"at {before} (the same job)"
    result["settings"] = {"heartbeat_s": heartbeat, "scrape_every_s": SCRAPE_EVERY_S,
                          "iteration_s": 1.0, "storm_share": 1.0 if lockstep else 0.1, "lockstep": lockstep,
                          "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2)}
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the fleet comparison, print a table, and store the result with ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=None, help="simulated ranks (default 16,384; --quick 1,024)")
    parser.add_argument("--quick", action="store_true", help="1,024 ranks and shorter phases")
    parser.add_argument("--only", choices=("before", "after"), help="run one side only")
    parser.add_argument("--transport", default="per-rank", help="how the after side's batches travel "
                                                                "(bench/experiments/_fleet_ranks.py TRANSPORTS)")
    parser.add_argument("--heartbeat", type=float, help=f"the after side's push interval (default: the agent's "
                                                        f"for the job's size, {HEARTBEAT_INTERVAL_S} s up to "
                                                        f"{MAX_HEARTBEAT_INTERVAL_S} s; 16,384 ranks: "
                                                        f"{default_heartbeat(16384):.1f} s)")
    parser.add_argument("--lockstep", action="store_true", help="a DDP job: every rank iterates and skips together "
                                                                    "(a whole-job storm, each rank's news in the "
                                                                    "same second)")
    parser.add_argument("--before", metavar="REF", help="instead of the delivery before issue 18, compare with "
                                                        "the collector of commit REF under the same job")
    parser.add_argument("--out", help=f"also store the result under '{KEY}_RANKS' in this JSON file")
    parser.add_argument("--render", metavar="JSON", help="print the Markdown table of a stored result and exit")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            for key, result in json.load(f).items():
                if key.startswith(KEY):
                    print(f"{key} ({measured_by(result)}):\n")
                    print("\n".join(table(result)) + "\n")
        return 0
    ranks = args.ranks or (1024 if args.quick else 16384)
    first = "previous" if args.before else "before"
    sides = ((first if args.only == "before" else "after"),) if args.only else (first, "after")
    result = run(ranks, sides, args.quick, args.transport, args.heartbeat, args.lockstep, args.before)
    print("\n".join(table(result)))
    print(json.dumps(result, indent=1))
    if args.out:
        key = (f"{KEY}_{ranks}" + ("_lockstep" if args.lockstep else "")
               + (f"_heartbeat_{args.heartbeat:g}" if args.heartbeat else "")
               + ("" if args.transport == "per-rank" else "_" + args.transport.replace("-", "_")))
        store(args.out, key, result, sys.argv, module="fleet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
