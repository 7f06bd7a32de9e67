"""Section 7's status-page part: the run page at 1,024 ranks in a real browser, the earlier commit beside this."""

from __future__ import annotations

from bench.report._format import SIDES, fmt, measured_by, phase_rows

__all__ = ["section"]


_PARTS = {"html_answered": "HTML answered", "script_answered": "script answered", "scripts_run": "scripts run",
          "summary_asked": "summary asked", "summary_answered": "summary answered"}


def _ms(x: dict) -> str:
    """An endpoint's median ms with its first GET's in brackets, or ``-`` where a side has no such endpoint."""
    return "-" if x.get("missing") else f"{fmt(x['median_ms'])} ({fmt(x['first_ms'])})"


def _row(name: str, phase: str, r: dict) -> str:
    e, b = r["endpoints"], r["page"]
    per_refresh = fmt(b["refresh_bytes"]) if b["refresh_bytes"] is not None else \
        f"none completed in {fmt(b['watch_s'])} s ({fmt(sum(b['by_endpoint'].values()))} read)"
    return (f"| {name} | {phase} | {fmt(b['first_paint_ms'])} | {per_refresh} | "
            f"{_ms(e['summary'])} | {fmt(e['summary'].get('bytes'))} | {_ms(e['scale'])} | "
            f"{fmt(e['scale'].get('bytes'))} | {_ms(e['run'])} | {fmt(e['run'].get('bytes'))} | "
            f"{fmt(r['collector_cpu_pct'])} |")


def section(page: dict | None) -> list[str]:
    """The part's lines, or none when ``bench.experiments.run_page`` has not stored a before/after result."""
    if not page or "before" not in page:
        return []
    lines = [f"The run page at {fmt(page['ranks'])} ranks x 2 optimizers, in a real browser:",
             "", "| side | phase | first paint ms | bytes per refresh | summary ms | summary bytes | scale ms | "
             "scale bytes | full run ms | full run bytes | collector CPU % |", "|" + "---|" * 11,
             *phase_rows(page, ("trouble", "storm"), _row),
             "", "Issue 14's job (collapse on 40-43, 1 skip in 8 on 777, a poisoned step on 512, scheduler-after-skip "
             "on 900, rank 1000 killed, then every rank skipping), live (a batch per rank every 2 s), in headless "
             "Chromium. First paint: navigation start to the first ranks-in-trouble row; bytes: every API answer "
             "during the watch over the refreshes it saw; endpoint ms: median of 7 GETs a second apart (first GET in "
             "brackets)."]
    quiet = [f"`{name}` {side} {fmt(r['min_ms'])} ms fastest, {fmt(r['median_ms'])} median"
             for name in ("summary", "scale") for side in SIDES
             if "quiet" in page[side] and not (r := page[side]["quiet"]["endpoints"][name]).get("missing")]
    if quiet:
        lines += ["", "Once the job stopped sending (nothing changing; 20 GETs 0.25 s apart; the median waited "
                  "for the built-in alert pass on the event loop): " + "; ".join(quiet) + "."]
    parts = [f"{side} {phase} " + ", ".join(f"{_PARTS[k]} {fmt(v)}" for k, v in found.items()
                                            if k in _PARTS and v is not None)
             for side in SIDES for phase in ("trouble", "storm")
             if (found := page[side][phase]["page"].get("first_paint_parts"))]
    if parts:
        lines += ["", "Where the first paint's time went (ms from navigation start): " + "; ".join(parts) + "."]
    after = page["after"]["storm"]["page"]["by_endpoint"]
    return lines + ["", "Bytes per refresh by endpoint, after, in the storm: " +
                    ", ".join(f"`{k}` {fmt(v)}" for k, v in after.items()) + ".",
                    "", f"{measured_by(page)}.", ""]
