"""Section 7: what issue 14 asked of one collector at 1,024 ranks, each figure beside the commit before.

Each part is one hand-run benchmark's result in ``bench/experiments/results/job1024_before_after.json`` (under the
benchmark's name), rendered when it is there: a table with a row per side, then the command and date that measured it.
"""

from __future__ import annotations

from bench.report import rule_eval, run_page
from bench.report import storm as lockstep
from bench.report._format import fmt, measured_by, phase_rows, side_rows

__all__ = ["section"]


def _alert_memory(memory: dict) -> list[str]:
    return ["Built-in alerts' memory after a full 30-minute alert window:", "",
            "| | KiB per rank | MiB at 1,024 ranks | of which history arrays, KiB per rank | CPU s | firing |",
            "|---|---|---|---|---|---|",
            *side_rows(memory, lambda name, r: f"| {name} | {fmt(r['kib_per_rank'])} | {fmt(r['rss_kib'] / 1024)} | "
                                               f"{fmt(r.get('history_array_kib_per_rank'))} | {fmt(r['cpu_s'])} | "
                                               f"{fmt(r['firing'])} |"),
            "", "A simulated clock: 1,024 ranks report every 2 s for 31 minutes, the last one a whole-job skip storm; "
            "resident memory of a fresh process after minus before, per rank, alert states of the storm included.",
            "", f"{measured_by(memory)}.", ""]


def _notify_storm(storm: dict) -> list[str]:
    return ["Built-in webhook notifications when 3,072 alerts (1,024 ranks x 3 alerts) fire at once, then "
            "resolve:", "",
            "| | phase | POSTs | MB | seconds | alerts dropped (cumulative) |", "|---|---|---|---|---|---|",
            *phase_rows(storm, ("firing", "resolved"),
                        lambda name, phase, r: f"| {name} | {phase} | {fmt(r['posts'])} | {fmt(r['bytes'] / 1e6, 2)} | "
                                               f"{fmt(r['seconds'])} | {fmt(r['dropped_so_far'])} |"),
            "", "Default settings, a real HTTP receiver on loopback. Grouped by alert and run, the resolved phase "
            "goes out one `--notify-group-interval` (60 s) after the firing one.", "", f"{measured_by(storm)}.", ""]


def _metrics_size(size: dict) -> list[str]:
    return ["`/metrics` of a collector filled with 1,024 ranks x 2 optimizers, plain and gzipped:", "",
            "| | samples | bytes plain | bytes when gzip is asked | scrape ms plain | scrape ms gzip asked |",
            "|---|---|---|---|---|---|",
            *side_rows(size, lambda name, r: f"| {name} | {fmt(r['samples'])} | {fmt(r['bytes'])} | "
                                             f"{fmt(r['gzip_bytes'])} | {fmt(r['scrape_median_ms'])} | "
                                             f"{fmt(r['gzip_scrape_median_ms'])} |"),
            "", "Three batches each, scraped plain and as Prometheus asks for it (`Accept-Encoding: gzip`), median of "
            "5. Fewer samples: a streak-ladder rung is exposed once a streak reached it.", "", f"{measured_by(size)}.",
            ""]


_PARTS = (("alert_memory", _alert_memory), ("notify_storm", _notify_storm), ("metrics_size", _metrics_size))
"""The parts before the run page, in the page's order, each under the key its benchmark stores it."""


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _memory(alerts: dict, collector: dict | None) -> list[tuple[str, str, bool]]:
    """The memory target's row: the built-in alerts' share, and the whole collector's where it was measured."""
    figure = f"built-in alerts {fmt(alerts['kib_per_rank'])} KiB"
    worst = alerts["kib_per_rank"]
    if collector:
        whole = collector["after"]["kib_per_rank"]
        figure += (f"; the whole collector {fmt(whole)} KiB (`python -m bench.experiments.collector_memory`, "
                   f"{collector['date']})")
        worst = max(worst, whole)
    return [("memory < 50 KiB per rank after a full 30-minute window", figure, worst < 50)]


def _targets(doc: dict) -> list[str]:
    """Issue 14's four targets beside the figures below that answer them, where all four parts were measured."""
    needed = ("lockstep_storm", "notify_storm", "run_page", "alert_memory", "rule_eval", "metrics_size")
    if not all(doc.get(key, {}).get("after") for key in needed):
        return []
    storm, notify, memory = doc["lockstep_storm"]["after"], doc["notify_storm"]["after"], doc["alert_memory"]["after"]
    in_storm = storm["latency"]["storm"]
    page, rules, size = (doc["run_page"]["after"]["storm"]["page"], doc["rule_eval"]["after"],
                         doc["metrics_size"]["after"])
    rows = [("whole-job storm: ingest p99 < 250 ms, no answer past the agent's 2 s",
             f"p99 {fmt(in_storm['p99_ms'])} ms, {fmt(in_storm['over_2s'])} past 2 s (lockstep, below)",
             in_storm["p99_ms"] < 250 and in_storm["over_2s"] == 0),
            ("notifications grouped by alert and run", f"{fmt(notify['firing']['posts'])} POSTs for 3,072 alerts, "
             f"{fmt(notify['firing']['dropped_so_far'])} dropped", notify["firing"]["dropped_so_far"] == 0),
            ("storage grows by streaks: a few MB per storm-minute",
             f"{fmt(storm['event_mb_per_storm_minute'], 2)} MB of events, {fmt(storm['db_mb_per_storm_minute'], 2)} MB "
             "of database", storm["db_mb_per_storm_minute"] < 10),
            ("status page: first paint < 2 s, a refresh < 200 KB (storm phase)",
             f"{fmt(page['first_paint_ms'])} ms, {fmt(page['refresh_bytes'])} bytes",
             page["first_paint_ms"] < 2000 and page["refresh_bytes"] < 200_000),
            *_memory(memory, doc.get("collector_memory")),
            ("rule evaluation < 20% of a 15 s interval over full 30-minute windows",
             f"median {fmt(rules['median_percent_of_interval'])}%, max {fmt(rules['max_percent_of_interval'])}%",
             rules["max_percent_of_interval"] < 20),
            ("`/metrics` gzipped when asked", f"{fmt(size['bytes'])} -> {fmt(size['gzip_bytes'])} bytes",
             size["gzip_bytes"] < size["bytes"] / 2),
            ("dashboard panels show spread and top-k, not 1,024 lines",
             f"{rules['dashboard']['panels_over_100_series']} panel over 100 series (the firing-alerts table)",
             rules["dashboard"]["panels_over_100_series"] <= 1)]
    return ["Issue 14's targets, each with the figure below that answers it (the after side):", "",
            "| target | measured | |", "|---|---|---|",
            *(f"| {target} | {figure} | {_verdict(ok)} |" for target, figure, ok in rows), ""]


def section(doc: dict) -> list[str]:
    """The section's lines for ``doc`` (the whole JSON file), each part that was measured in its order."""
    lines = [*_targets(doc),
             "What issues 14 and 26 asked of one collector at 1,024 ranks x 2 optimizers, each figure beside the "
             "commit before the change, both measured in one run (command and date under each table).", "",
             *lockstep.section(doc.get("lockstep_storm"))]
    for key, part in _PARTS:
        if doc.get(key):
            lines += part(doc[key])
    lines += run_page.section(doc.get("run_page"))
    lines += rule_eval.section(doc.get("rule_eval"))
    return lines
