"""Section 9: a 16,384-rank job on one collector (``bench.experiments.fleet``), today's delivery beside the one
before it.

The table is ``rows``' figures for each stored side; ``bench.experiments.fleet --render`` prints the same table for
every result in a file. Issue 18's targets are checked against the *after* side of the 16,384-rank run,
and the result's ``note`` (written by whoever measured it) says why a target is not met and what would
close the gap.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.report._format import fmt, measured_by

__all__ = ["ROWS", "table", "section"]

VISIBLE_WITHIN_S = 2.0
HEALTHY_P99_MS = 100.0


def _first_skips(r: dict) -> str:
    seen = r["storm"]["first_skip_to_metrics"]
    return f"{fmt(seen['within_2s'])} of {fmt(seen['n'] + r['storm']['first_skips_not_visible_by_end'])}"


def _spread(figures: dict | None, unit: str) -> str:
    if not figures or figures.get("p50" + unit) is None:
        return "-"
    return " / ".join(fmt(figures[q + unit]) for q in ("p50", "p99", "max"))


ROWS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("ranks (transport)", lambda r: f"{fmt(r['ranks'])} ({r.get('transport', 'per-rank')})"),
    ("rank batches / HTTP requests per s, healthy",
     lambda r: f"{fmt(r['healthy']['requests_per_s'])} / {fmt(r['healthy'].get('http_requests_per_s'))}"),
    ("ingest p50 / p99 / max ms, healthy", lambda r: _spread(r["healthy"]["latency"], "_ms")),
    ("ingest p99 ms outside scrapes, healthy", lambda r: fmt(r["healthy"]["latency_outside_scrapes"]["p99_ms"])),
    ("ingest p50 / p99 / max ms, storm", lambda r: _spread(r["storm"]["latency"], "_ms")),
    ("ingest p99 ms outside scrapes, storm", lambda r: fmt(r["storm"]["latency_outside_scrapes"]["p99_ms"])),
    ("missed / refused / timed-out updates",
     lambda r: f"{fmt(r['missed_updates'])} / {fmt(sum(r['refused'].values()))} / {fmt(r['timeouts'])}"),
    ("collector CPU, cores (healthy)", lambda r: fmt(r["healthy"]["collector_cpu_cores"], 3)),
    ("collector CPU µs per rank-second", lambda r: fmt(r["healthy"]["collector_cpu_us_per_rank_s"])),
    ("collector memory KiB per rank", lambda r: fmt(r["healthy"]["collector_kib_per_rank"])),
    ("wire KiB per rank-hour, healthy / storm",
     lambda r: f"{fmt(r['healthy']['wire_kib_per_rank_hour'])} / {fmt(r['storm']['wire_kib_per_rank_hour'])}"),
    ("first skip -> /metrics p50 / p99 / max s", lambda r: _spread(r["storm"]["first_skip_to_metrics"], "_s")),
    ("first skips in /metrics within 2 s", _first_skips),
    ("16th skip -> built-in alert p50 / p99 / max s", lambda r: _spread(r["storm"]["rung16_to_builtin_alert"], "_s")),
    ("scrapes disagreeing with answers", lambda r: fmt(r["storm"]["scrape_disagreements"])),
    ("killed rank: last batch -> AmpRankSilent s (bound)",
     lambda r: f"{fmt(r['silence']['last_batch_to_alert_s'])} ({fmt(r['silence']['documented_within_s'])})"),
    ("other ranks called silent", lambda r: fmt(r["silence"]["other_ranks_silent"])),
)
"""Each row's label and how it reads one side's figures."""


SIDES = ("before", "previous", "after")
"""``before``: the delivery before issue 18 (state every second); ``previous``, where stored: the *after* side
as an earlier commit ran it (its ``label`` says which); ``after``: this tree."""


def _name(result: dict, side: str) -> str:
    if side == "before":
        return "before (state every 1 s)"
    if "label" in result[side]:
        return result[side]["label"]
    return f"after (news at once, heartbeat {fmt(result['settings']['heartbeat_s'])} s)"


def table(result: dict) -> list[str]:
    """The Markdown table of a stored ``bench.experiments.fleet`` result: a column per side it ran."""
    sides = [s for s in SIDES if s in result]
    names = [_name(result, s) for s in sides]
    return ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(sides),
            *(f"| {label} | " + " | ".join(cell(result[s]) for s in sides) + " |" for label, cell in ROWS)]


def _targets(r: dict) -> list[tuple[str, str, bool]]:
    healthy, storm, silence = r["healthy"]["latency"], r["storm"], r["silence"]
    seen = storm["first_skip_to_metrics"]
    all_seen = seen["n"] + storm["first_skips_not_visible_by_end"]
    lost = r["missed_updates"] + sum(r["refused"].values()) + r["timeouts"]
    alert = storm["rung16_to_builtin_alert"]
    return [
        ("healthy ingest p99 < 100 ms", f"{fmt(healthy['p99_ms'])} ms", (healthy["p99_ms"] or 1e9) < HEALTHY_P99_MS),
        ("no missed, refused or timed-out update", f"{fmt(lost)}", lost == 0),
        ("a streak's first skip in `/metrics` within 2 s", f"{fmt(seen['within_2s'])} of {fmt(all_seen)}",
         seen["within_2s"] == all_seen),
        ("built-in streak alert within 2 s of its 16th skip", f"p99 {fmt(alert.get('p99_s'))} s, max "
         f"{fmt(alert.get('max_s'))} s", (alert.get("max_s") or 1e9) <= VISIBLE_WITHIN_S),
        ("counts exact (scrapes agree with answers)", f"{fmt(storm['scrape_disagreements'])} disagreements",
         storm["scrape_disagreements"] == 0),
        ("AmpRankSilent within its bound, no other rank called silent",
         f"{fmt(silence['last_batch_to_alert_s'])} s (bound {fmt(silence['documented_within_s'])}), "
         f"{fmt(silence['other_ranks_silent'])} others",
         silence["last_batch_to_alert_s"] is not None
         and silence["last_batch_to_alert_s"] <= silence["documented_within_s"] and silence["other_ranks_silent"] == 0),
    ]


def section(delivery: dict | None) -> list[str]:
    """The section's lines from ``bench/experiments/results/fleet_delivery.json``, or none before a 16,384-rank run
    was stored."""
    if not delivery or "fleet_16384" not in delivery:
        return []
    main = delivery["fleet_16384"]
    settings = main["settings"]
    lines = ["Issue 18's targets against the *after* side:", "", "| target | measured | |", "|---|---|---|",
             *(f"| {target} | {figure} | {'met' if ok else '**not met**'} |" for target, figure, ok in
               _targets(main["after"])), "", *table(main), "",
             f"A simulated job of {fmt(main['after']['ranks'])} ranks (2,048 nodes x 8) against one collector with "
             "default settings, real HTTP on loopback, the agent's own delivery schedule: every rank starts, "
             f"trains healthily (a batch on news, a heartbeat every {fmt(settings['heartbeat_s'])} s), then "
             f"{fmt(settings['storm_share'] * 100)}% of the ranks run skip streaks, `/metrics` scraped every "
             f"{fmt(settings['scrape_every_s'])} s as Prometheus does, one rank killed without `close()`. The "
             "*before* side is the delivery that came before (full state every second). `bench/experiments/fleet.py` "
             "says how each figure is taken.", "", f"{measured_by(main)}."]
    for paragraph in (main.get("note") or "").split("\n\n"):
        if paragraph:
            lines += ["", paragraph]
    for key, other in delivery.items():
        if key != "fleet_16384" and key.startswith("fleet_"):
            lines += ["", f"`{key}`:", "", *table(other), "", f"{measured_by(other)}."
                      + (f" {other['note']}" if other.get("note") else "")]
    return lines + [""]
