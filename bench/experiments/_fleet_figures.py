"""The figures of one side of ``bench.experiments.fleet``: latency spreads, first skips, streak alerts, and each
replica's share where the job ran on several collectors.

:func:`summary` turns what the simulated job (``bench.experiments._fleet_ranks``), the scrapes and the built-in
alerts recorded into the side's figures; :func:`replica` the same targets for one replica's ranks alone.
"""

from __future__ import annotations

from ampwatch.server._rank_ranges import rank_ranges
from bench._servers import Usage

__all__ = ["VISIBLE_WITHIN_S", "first_skip_delays", "ms_summary", "replica", "seconds_summary", "streak_alert_delays",
           "summary"]

VISIBLE_WITHIN_S = 2.0  # the target: a streak's first skip in /metrics and the built-in alerts


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


def streak_alert_delays(storm: dict, firing: list[dict] | None, end: float,
                        replica_of: list[int] | None = None) -> tuple[list[float], int]:
    """Seconds from each storm rank's 16th skip (before ``end`` - 2 s) to its streak alert in the built-in alerts
    ``firing``, and how many ranks had none. A rank's streak alert is its own ``AmpConsecutiveSkippedSteps``, or,
    in a whole-job storm, the run's ``AmpRunSkipStorm``, which speaks for the ranks in it (their own are held
    back: ``contract.alerts``), whichever started first. With several replicas, ``firing`` holds each one's alerts
    marked with its ``replica`` index and ``replica_of`` gives each rank's: a replica's run-wide alert speaks for
    its own ranks only."""
    streak_alerts: dict[str, float] = {}
    run_storm: dict[int | None, float] = {}
    for alert in firing or ():
        if alert["name"] == "AmpRunSkipStorm":
            where = alert.get("replica")
            run_storm[where] = min(run_storm.get(where, float("inf")), alert["starts_at"])
    for alert in firing or ():
        if alert["name"] == "AmpConsecutiveSkippedSteps" and alert["labels"].get("optimizer") == "gen":
            rank = alert["labels"]["rank"]
            streak_alerts[rank] = min(streak_alerts.get(rank, float("inf")), alert["starts_at"])
    delays, missing = [], 0
    for rank, s in storm.items():
        if s["rung16"] is None or s["rung16"] > end - 2:
            continue
        spoken = run_storm.get(None if replica_of is None else replica_of[int(rank)], float("inf"))
        alerted = min(streak_alerts.get(rank, float("inf")), spoken)
        if alerted < float("inf"):
            delays.append(alerted - s["rung16"])
        else:
            missing += 1
    return delays, missing


def replica(job: dict, timeline: dict, index: int, scrapes: list[dict], firing: list[dict] | None, usage: Usage,
            rss_healthy_kib: int, cores: list[int] | None) -> dict:
    """Replica ``index``'s own figures of a job run over several collectors: its ranks (by the placement the job
    used), its healthy ingest latency, its storm ranks' first skips and streak alerts (from its own built-in
    alerts ``firing``), the ranks its own ``/metrics`` showed that the placement put elsewhere (``foreign``),
    its CPU in each phase and the cores it was pinned to."""
    from bench.experiments._fleet_ranks import placement  # the job's own rule, the same module it ran

    url = job["collectors"][index]
    port = int(url.rsplit(":", 1)[1])
    ports = [int(u.rsplit(":", 1)[1]) for u in job["collectors"]]
    mine = {str(rank) for rank, p in enumerate(placement(job["run"], job["ranks"], ports, job["block_ranks"]))
            if p == port}
    storm = {rank: s for rank, s in job["storm"].items() if rank in mine}
    visible, not_visible = first_skip_delays(storm)
    delays, missing = streak_alert_delays(storm, firing, timeline["end"])
    shown: set[str] = set()
    for scraped in scrapes:
        shown |= set((scraped["each"][index] if "each" in scraped else scraped)["counts"])
    latency = job["latency_by_collector"][index]
    return {"index": index, "url": url, "ranks": len(mine), "first_rank": min(map(int, mine)),
            "last_rank": max(map(int, mine)), "rank_ranges": rank_ranges(sorted(map(int, mine))),
            "pinned_to": cores,
            "healthy_latency": ms_summary(latency["healthy"]), "storm_latency": ms_summary(latency["storm"]),
            "storm_ranks": len(storm), "first_skip_to_metrics": seconds_summary(visible),
            "first_skips_not_visible_by_end": not_visible, "rung16_to_builtin_alert": seconds_summary(delays),
            "streak_alerts_missing": missing, "alerts_answered": firing is not None,
            "ranks_in_metrics": len(shown & mine), "foreign_ranks_in_metrics": len(shown - mine),
            "cpu_cores": {phase: usage.between(a, b)["collectors"][index]
                          for phase, a, b in (("healthy", "healthy", "storm"), ("storm", "storm", "end"))},
            "rss_mib": round(rss_healthy_kib / 1024, 1)}


def summary(delivery: str, ranks: int, timeline: dict, job: dict, scrapes: list[dict], firing: list[dict] | None,
            silent_at: float | None, cpu: dict, rss0: int, rss_healthy: int, peak: dict, *,
            raised_limit: bool, quiet: dict[str, int], replica_of: list[int] | None = None) -> dict:
    """One side's figures: ``ranks`` simulated ranks (the collectors' CPU and memory summed where there are several,
    ``firing`` every collector's built-in alerts together, each marked with its ``replica`` where ``replica_of``
    gives each rank's)."""
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
    alert_delays, alert_missing = streak_alert_delays(storm, firing, timeline["end"], replica_of)
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
