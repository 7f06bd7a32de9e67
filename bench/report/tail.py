"""Section 5: the ingest tail at 1,024 ranks, with and without the collector's GC settings."""

from __future__ import annotations

from bench.report._format import fmt

__all__ = ["section"]


def section(tail: list[dict], before_after: dict | None) -> list[str]:
    out = ["| GC | updates/s | p50 ms | p99 ms | GC CPU ms (gen0/1/2) | longest GC pause ms | loop lag max ms | "
           "lags > 50 ms | commit max ms | mean group | alert tick ms | load avg |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in tail:
        g, load = t["gc_pauses_cpu"], t["load"]
        gc_ms = "/".join(fmt(g[k].get("total_ms", 0.0)) for k in ("gen0", "gen1", "gen2"))
        longest = max(g[k].get("max_ms", 0.0) for k in g)
        out.append(f"| {'tuned' if t['gc_tuned'] else 'default'} | {fmt(load.get('updates_per_s'))} | "
                   f"{fmt(load.get('p50_ms'))} | {fmt(load.get('p99_ms'))} | {gc_ms} | {longest} | "
                   f"{t['loop_lag'].get('max_ms')} | {t['loop_lag'].get('over_50ms')} | {t['commits'].get('max_ms')} | "
                   f"{t['commits'].get('mean_group')} | {t['alert_tick_cpu'].get('p50_ms')} | {t['loadavg_1m']} |")
    out += ["", "`python -m bench.tail --profile`: the collector in-process under 1,024 paced ranks, with the "
                "default garbage-collector settings and with the collector's own (`ampwatch.server._gc`: the heap "
                "frozen at start-up and every 0.5 s, young collections every 1,000 allocations, older ones never "
                "between two freezes; until issue 26, every 2 s and 5,000)."]
    if before_after:
        out += ["", "| version | mode | updates/s | p50 ms | p99 ms | max ms | server CPU us/update | load avg |",
                "|---|---|---|---|---|---|---|---|"]
        for r in before_after["runs"]:
            out.append(f"| {r['version']} | {r['mode']} | {fmt(r['updates_per_s'])} | {fmt(r['p50_ms'])} | "
                       f"{fmt(r['p99_ms'])} | {fmt(r['max_ms'])} | {fmt(r['server_cpu_us_per_update'])} | "
                       f"{r['loadavg_1m']} |")
        out += ["", before_after.get("note", "")]
    return out
