"""The page's first table: what one collector did at each job size, a row per measurement, each linked to its section.

Nothing is measured here: each cell is a figure of the section the row links to (sections 2 and 3 from the run's
document, 7 and 9 from the results the hand-run experiments stored), so a reader asking "how fast at 1,024 ranks?"
finds the rows first and the why in the section.
"""

from __future__ import annotations

from collections.abc import Mapping

from bench.report._format import find, fmt

__all__ = ["section"]

_HEAD = ["| ranks | what each rank sends | rank batches/s | ingest p99 ms, healthy | ingest p99 ms, skip storm | "
         "`/metrics` ms (median) | collector memory KiB per rank | measured in |", "|---|---|---|---|---|---|---|---|"]


def _paced(res: dict, links: Mapping[str, str]) -> list[str]:
    """A row per paced level of section 2, with section 3's scrape and memory at the same number of ranks."""
    rows = []
    levels = (res.get("scrape") or {}).get("levels", [])
    for r in (res.get("ingest") or {}).get("paced", []):
        if r["target"] != "ampwatch":
            continue
        scrape = find(levels, target="ampwatch", ranks=r["ranks"])
        where = links["ingest"] + (f", {links['scrape']}" if scrape else "")
        asked = round(r.get("offered_per_s") or r["ranks"])
        rate = fmt(r["updates_per_s"]) + (f" of {fmt(asked)} asked" if r["updates_per_s"] < 0.99 * asked else "")
        rows.append(f"| {fmt(r['ranks'])} | a batch every second (a load test, not the agent's schedule) | "
                    f"{rate} | {fmt(r['p99_ms'])} | - | "
                    f"{fmt(scrape['scrape_median_ms']) if scrape else '-'} | "
                    f"{fmt(scrape.get('rss_kib_per_rank')) if scrape else '-'} | {where} |")
    return rows


def _lockstep_job(job: dict | None, link: str) -> list[str]:
    """Section 7's DDP job: its healthy phase, its whole-job storm, and memory after 15 minutes with the storm."""
    a = ((job or {}).get("lockstep_storm") or {}).get("after")
    if not a:
        return []
    plain = (a["metrics_ms"].get("healthy") or {}).get("plain") or {}
    return [f"| {fmt(a['ranks'])} | the agent's schedule; a DDP job in lockstep, every rank skipping for "
            f"{fmt(a['phases_s']['storm'])} s | {fmt(a['requests_per_s'].get('healthy'))} (storm "
            f"{fmt(a['requests_per_s'].get('storm'))}) | {fmt(a['latency']['healthy']['p99_ms'])} | "
            f"{fmt(a['latency']['storm']['p99_ms'])} | {fmt(plain.get('p50_ms'))} | {fmt(a['kib_per_rank'])} "
            f"(after {fmt(a['minutes'])} min) | {link} |"]


def _fleet(fleet: dict | None, link: str) -> list[str]:
    """Section 9's jobs on one collector: a share of the ranks in skip streaks, and the whole job in lockstep."""
    rows = []
    for key in ("fleet_16384", "fleet_16384_lockstep"):
        doc = (fleet or {}).get(key)
        if not doc or not doc.get("after"):
            continue
        a, settings = doc["after"], doc["settings"]
        storm = ("every rank skipping at once" if settings.get("lockstep")
                 else f"{fmt(settings['storm_share'] * 100)}% of the ranks in skip streaks")
        rows.append(f"| {fmt(a['ranks'])} | the agent's schedule (a heartbeat every {fmt(settings['heartbeat_s'])} "
                    f"s); {storm} | {fmt(a['healthy']['requests_per_s'])} | {fmt(a['healthy']['latency']['p99_ms'])} | "
                    f"{fmt(a['storm']['latency']['p99_ms'])} | - | {fmt(a['healthy']['collector_kib_per_rank'])} | "
                    f"{link} |")
    return rows


def section(res: dict, job: dict | None, fleet: dict | None, links: Mapping[str, str]) -> list[str]:
    """The table's lines (none where nothing was measured); ``links``: the Markdown link of each section a row cites,
    under ``ingest``, ``scrape``, ``job1024`` and ``fleet``."""
    rows = sorted([*_paced(res, links), *_lockstep_job(job, links["job1024"]), *_fleet(fleet, links["fleet"])],
                  key=lambda row: int(row.split("|")[1].replace(",", "")))  # by ranks, each source's order kept
    if not rows:
        return []
    return [*_HEAD, *rows, "",
            "One collector with default settings on this project's shared 2-core machine, real HTTP on loopback. "
            "The rows differ in what the ranks send: a batch every second from every rank is a load test, and "
            "where it asks for more than the collector applies the rate says so; the agent's own schedule sends "
            "news at once and the cumulative state once per heartbeat. Why each figure is what it is: the "
            "section the row links to.", ""]
