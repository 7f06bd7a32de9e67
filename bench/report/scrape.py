"""Section 3: what a scrape of `/metrics` costs, the collector beside the Pushgateway."""

from __future__ import annotations

from bench.report._format import beside_pushgateway, find, fmt, speed_beside

__all__ = ["section", "summary_rows"]


def section(sc: dict) -> list[str]:
    return ["| server | ranks | scrape ms (median) | min | max | bytes | samples | RSS after fill MiB | "
            "RSS per rank KiB |", "|---|---|---|---|---|---|---|---|---|",
            *(f"| {r['target']} | {r['ranks']:,} | {r['scrape_median_ms']} | {r['scrape_min_ms']} | "
              f"{r['scrape_max_ms']} | {r['bytes']:,} | {r['samples']:,} | {r['rss_kib_after'] / 1024:.0f} | "
              f"{fmt(r['rss_kib_per_rank'])} |" for r in sc["levels"]),
            "", f"Median of {sc['scrapes']} uncompressed scrapes after one warm-up. The Pushgateway holds exactly the "
            f"series the collector exposed, pushed in groups of {sc['pushgateway_group_size']} ranks (it adds its "
            "`job`/`group` labels and `push_time_seconds` per group)."]


def summary_rows(sc: dict) -> list[str]:
    """The summary's rows: scrape time and size, and memory per rank, each beside the Pushgateway's."""
    out = [f"| /metrics at {ranks:,} ranks x 2 optimizers: ms (MB) | {fmt(a['scrape_median_ms'])} "
           f"({a['bytes'] / 1e6:.1f}) | Pushgateway {fmt(p['scrape_median_ms'])} "
           f"({p['bytes'] / 1e6:.1f}) | {speed_beside(a['scrape_median_ms'], p['scrape_median_ms'])} |"
           for ranks, a, p in beside_pushgateway(sc["levels"])]
    a = find(sc["levels"], target="ampwatch", ranks=4096) or find(sc["levels"], target="ampwatch", ranks=1024)
    if a and a.get("rss_kib_per_rank") is not None:
        p = find(sc["levels"], target="pushgateway", ranks=a["ranks"])
        out.append(f"| resident memory per rank ({a['ranks']:,} ranks) | {a['rss_kib_per_rank']} KiB | "
                   f"Pushgateway {p['rss_kib_per_rank'] if p else '-'} KiB | |")
    return out
