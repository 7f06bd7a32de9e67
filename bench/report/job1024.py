"""Section 7: what issue 14 asked of one collector at 1,024 ranks, each figure beside the commit before."""

from __future__ import annotations

from bench.report import rule_eval
from bench.report._format import fmt

__all__ = ["section"]


def section(doc: dict) -> list[str]:
    lines = ["What issue 14 asked of one collector at 1,024 ranks x 2 optimizers, each figure beside the commit "
             "before the change, both measured in one run (command and date under each table).", ""]
    memory = doc.get("alert_memory")
    if memory:
        lines += ["Built-in alerts' memory after a full 30-minute alert window (simulated clock: 1,024 ranks report "
                  "every 2 s for 31 minutes, the last one a whole-job skip storm; resident memory of a fresh "
                  "process after minus before, per rank, alert states of the storm included):", "",
                  "| | KiB per rank | MiB at 1,024 ranks | of which history arrays, KiB per rank | CPU s | firing |",
                  "|---|---|---|---|---|---|"]
        for side in ("before", "after"):
            r = memory[side]
            name = f"before ({r['ref']})" if side == "before" else "after"
            lines.append(f"| {name} | {fmt(r['kib_per_rank'])} | {fmt(r['rss_kib'] / 1024)} | "
                         f"{fmt(r.get('history_array_kib_per_rank'))} | {fmt(r['cpu_s'])} | {fmt(r['firing'])} |")
        lines += ["", f"`{memory['command']}`, {memory['date']}.", ""]
    storm = doc.get("notify_storm")
    if storm:
        lines += ["Built-in webhook notifications when 3,072 alerts (1,024 ranks x 3 alerts) fire at once, then "
                  "resolve, default settings, a real HTTP receiver on loopback:", "",
                  "| | phase | POSTs | MB | seconds | alerts dropped (cumulative) |", "|---|---|---|---|---|---|"]
        for side in ("before", "after"):
            for phase in ("firing", "resolved"):
                r = storm[side][phase]
                name = f"before ({storm[side]['ref']})" if side == "before" else "after"
                lines.append(f"| {name} | {phase} | {fmt(r['posts'])} | {fmt(r['bytes'] / 1e6, 2)} | "
                             f"{fmt(r['seconds'])} | {fmt(r['dropped_so_far'])} |")
        lines += ["", f"`{storm['command']}`, {storm['date']}. Grouped by alert and run, the resolved phase goes "
                  "out one `--notify-group-interval` (60 s) after the firing one.", ""]
    skip_storm = doc.get("storm")
    if skip_storm:
        a = skip_storm["after"]
        lines += [f"A whole-job skip storm: {fmt(a['ranks'])} ranks x 2 optimizers push every {fmt(a['interval_s'])} s; "
                  f"after a clean warm-up every rank skips every iteration ({a['iterations_per_push']} per push) for "
                  f"{fmt(a['storm_seconds'])} s. Each side gets the events its agent sends (before: one per skipped "
                  "step per optimizer and one per backoff; after: a streak's rungs and end, backoffs folded), "
                  "`bench/_storm.py`, checked against a real agent by `tests/test_bench_storm.py`:", "",
                  "| | ingest p50 ms | p99 ms | max ms | answers over 2 s | batches answered (slots missed) | "
                  "collector CPU µs per batch | event rows per storm-minute | event MB per storm-minute | "
                  "database MB per storm-minute |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for side in ("before", "after"):
            r = skip_storm[side]
            name = f"before ({r['ref']})" if side == "before" else "after"
            lines.append(f"| {name} | {fmt(r['storm_p50_ms'])} | {fmt(r['storm_p99_ms'])} | "
                         f"{fmt(r['storm_max_ms'])} | {fmt(r['timeouts_2s'])} | "
                         f"{fmt(r.get('answered'))} ({fmt(r['missed_slots'])}) | {fmt(r.get('server_cpu_us_per_batch'))} | "
                         f"{fmt(r['event_rows_per_storm_minute'])} | {fmt(r['event_mb_per_storm_minute'], 2)} | "
                         f"{fmt(r['db_mb_per_storm_minute'], 2)} |")
        lines += ["", f"`{skip_storm['command']}`, {skip_storm['date']}, load average {fmt(a['loadavg_1m'])} at the "
                  "end (a shared machine: latencies are the machine's as much as the collector's).", ""]
    size = doc.get("metrics_size")
    if size:
        lines += ["`/metrics` of a collector filled with 1,024 ranks x 2 optimizers (three batches each), scraped "
                  "plain and as Prometheus asks for it (`Accept-Encoding: gzip`), median of 5:", "",
                  "| | samples | bytes plain | bytes when gzip is asked | scrape ms plain | scrape ms gzip asked |",
                  "|---|---|---|---|---|---|"]
        for side in ("before", "after"):
            r = size[side]
            name = f"before ({r['ref']})" if side == "before" else "after"
            lines.append(f"| {name} | {fmt(r['samples'])} | {fmt(r['bytes'])} | {fmt(r['gzip_bytes'])} | "
                         f"{fmt(r['scrape_median_ms'])} | {fmt(r['gzip_scrape_median_ms'])} |")
        lines += ["", f"`{size['command']}`, {size['date']}. Fewer samples: a streak-ladder rung is exposed once "
                  "a streak reached it.", ""]
    page = doc.get("run_page")
    if page and "before" in page:
        lines += [f"The run page in issue 14's job at {fmt(page['ranks'])} ranks x 2 optimizers (collapse on 40-43, "
                  "1 skip in 8 on 777, a poisoned step on 512, scheduler-after-skip on 900, rank 1000 killed, "
                  "then every rank skipping), live (a batch per rank every 2 s), in headless Chromium. First paint: "
                  "navigation start to the first ranks-in-trouble row; bytes: every API answer during the watch "
                  "over the refreshes it saw; endpoint ms: median of 7 GETs a second apart (first GET in brackets):",
                  "", "| side | phase | first paint ms | bytes per refresh | summary ms | summary bytes | scale ms | "
                  "scale bytes | full run ms | full run bytes | collector CPU % |", "|" + "---|" * 11]
        def ms(x: dict) -> str:
            return "-" if x.get("missing") else f"{fmt(x['median_ms'])} ({fmt(x['first_ms'])})"

        for side in ("before", "after"):
            for phase in ("trouble", "storm"):
                r = page[side][phase]
                e, b = r["endpoints"], r["page"]
                name = f"before ({page[side]['ref']})" if side == "before" else "after"
                per_refresh = fmt(b["refresh_bytes"]) if b["refresh_bytes"] is not None else \
                    f"none completed in {fmt(b['watch_s'])} s ({fmt(sum(b['by_endpoint'].values()))} read)"
                lines.append(f"| {name} | {phase} | {fmt(b['first_paint_ms'])} | {per_refresh} | "
                             f"{ms(e['summary'])} | {fmt(e['summary'].get('bytes'))} | {ms(e['scale'])} | "
                             f"{fmt(e['scale'].get('bytes'))} | {ms(e['run'])} | {fmt(e['run'].get('bytes'))} | "
                             f"{fmt(r['collector_cpu_pct'])} |")
        quiet = [f"`{name}` {side} {fmt(r['min_ms'])} ms fastest, {fmt(r['median_ms'])} median"
                 for name in ("summary", "scale") for side in ("before", "after")
                 if "quiet" in page[side] and not (r := page[side]["quiet"]["endpoints"][name]).get("missing")]
        if quiet:
            lines += ["", "Once the job stopped sending (nothing changing; 20 GETs 0.25 s apart; the median waited "
                      "for the built-in alert pass on the event loop): " + "; ".join(quiet) + "."]
        after = page["after"]["storm"]["page"]["by_endpoint"]
        lines += ["", "Bytes per refresh by endpoint, after, in the storm: " +
                  ", ".join(f"`{k}` {fmt(v)}" for k, v in after.items()) + ".",
                  "", f"`{page['command']}`, {page['date']}; the machine was shared with other jobs (load average "
                  "above its core count): compare the sides, not the absolute figures.", ""]
    lines += rule_eval.section(doc.get("rule_eval"))
    return lines
