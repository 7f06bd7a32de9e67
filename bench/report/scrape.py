"""Section 3: what a scrape of `/metrics` costs, the collector beside the Pushgateway."""

from __future__ import annotations

from bench.report._format import fmt

__all__ = ["section"]


def section(sc: dict) -> list[str]:
    out = [f"Median of {sc['scrapes']} uncompressed scrapes after one warm-up. The Pushgateway holds exactly the "
           f"series the collector exposed, pushed in groups of {sc['pushgateway_group_size']} ranks (it adds its "
           "`job`/`group` labels and `push_time_seconds` per group).", "",
           "| server | ranks | scrape ms (median) | min | max | bytes | samples | RSS after fill MiB | "
           "RSS per rank KiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sc["levels"]:
        out.append(f"| {r['target']} | {r['ranks']:,} | {r['scrape_median_ms']} | {r['scrape_min_ms']} | "
                   f"{r['scrape_max_ms']} | {r['bytes']:,} | {r['samples']:,} | {r['rss_kib_after'] / 1024:.0f} | "
                   f"{fmt(r['rss_kib_per_rank'])} |")
    return out
