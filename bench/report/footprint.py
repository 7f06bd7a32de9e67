"""Section 4: how the collector's database grows, and what keeps it bounded."""

from __future__ import annotations

__all__ = ["section", "summary_rows"]


def section(fp: dict) -> list[str]:
    s, l_ = fp["short"], fp["long"]
    return ["| run | batches | events | incarnation rows | database bytes |", "|---|---|---|---|---|",
            f"| short | {s['answered']:,} | {s['events']:,} | {s['incarnations']} | {s['file_bytes']:,} |",
            f"| long | {l_['answered']:,} | {l_['events']:,} | {l_['incarnations']} | {l_['file_bytes']:,} |", "",
            f"Two fresh collectors, {s['ranks']} ranks at one batch per second for {s['seconds']} s and "
            f"{l_['seconds']} s, a skip and a backoff event every {fp['skip_every']} batches (on purpose many, to "
            "measure them); database size after a WAL checkpoint.", "",
            f"- **{fp['bytes_per_event_on_disk']:.0f} bytes per stored event** (skip with one offending parameter, "
            f"or scale change); an event-free batch adds nothing: it rewrites its rank's row "
            f"(~{fp['bytes_per_incarnation_row']:.0f} bytes, one per rank and process).",
            f"- At this event rate ({fp['events_per_rank_hour']:,.0f} events per rank-hour): "
            f"{fp['bytes_per_rank_hour'] / 1e6:.2f} MB per rank-hour. A healthy run (a skip and a backoff every "
            f"few thousand iterations) grows by a few KB per rank-hour; a skip storm adds one skip event per "
            f"skipped step per optimizer (e.g. 10 skipped steps/s: "
            f"{10 * 3600 * fp['bytes_per_event_on_disk'] / 1e6:.0f} MB per rank-hour).",
            "- What keeps it bounded: `--db-retention` (default 30 days) deletes the history of runs last seen "
            "earlier (checked hourly); memory holds only ranks in `/metrics` (`--expire-after`, "
            "`--run-retention`), and the agent caps the events it keeps between batches."]


def summary_rows(fp: dict) -> list[str]:
    """The summary's row: the database's growth per event, which `--db-retention` bounds."""
    return [f"| database growth | {fp['bytes_per_event_on_disk']:.0f} B per event; 0 B per event-free "
            f"batch | Pushgateway keeps no history | bounded by `--db-retention` |"]
