"""Section 2: ingest throughput and latency, the collector beside the Pushgateway."""

from __future__ import annotations

from bench.report._format import beside_pushgateway, find, fmt, ratio

__all__ = ["section", "summary_rows"]


def section(ing: dict) -> list[str]:
    return ["| server | mode | ranks | updates/s | p50 ms | p99 ms | p99 incl. first contact | max ms | unanswered | "
            "missed | server CPU % | server CPU us/update | server RSS MiB | generator CPU s | generator lag p99 ms "
            "| load avg |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *(f"| {r['target']} | {r['mode']} | {r['ranks']:,} | {fmt(r['updates_per_s'])} | {fmt(r['p50_ms'])} "
              f"| {fmt(r['p99_ms'])} | {fmt(r.get('p99_all_ms'))} | {fmt(r['max_ms'])} | {r['unanswered']} | "
              f"{r['missed_slots']} | {r['server_cpu_pct']} | {fmt(r['server_cpu_us_per_update'])} | "
              f"{r.get('vmrss', 0) / 1024:.0f} | {r['generator_cpu_s']} | {fmt(r.get('lag_p99_ms'))} | "
              f"{r['loadavg_1m']} |" for r in ing["paced"] + ing["saturated"]),
            "", f"Paced: every rank sends one update per second for {ing['seconds']} s (offered rate = ranks/s); "
            "latency from send to full answer (ampwatch: committed to SQLite with synchronous=FULL; Pushgateway: "
            "held in memory). p50/p99 leave out each rank's first 2 updates; *unanswered* requests were still "
            "open 5 s after the last slot (their latency counts as at least that); *missed* slots were skipped "
            "by ranks whose previous answer came too late. Saturated: "
            f"{ing['saturate_connections']} connections sending back to back for {ing['saturate_seconds']} s."]


def summary_rows(ing: dict) -> list[str]:
    """The summary's rows: paced and back-to-back ingest, each beside the Pushgateway's at the same level."""
    out = [f"| ingest, {ranks:,} ranks x 1 update/s: sustained updates/s (p99 ms) | "
           f"{fmt(a['updates_per_s'])} ({fmt(a['p99_ms'])}) | Pushgateway {fmt(p['updates_per_s'])} "
           f"({fmt(p['p99_ms'])}) | {ratio(a['updates_per_s'], p['updates_per_s'])} |"
           for ranks, a, p in beside_pushgateway(ing["paced"])]
    for s in ing.get("saturated", []):
        if s["target"] == "ampwatch":
            p = find(ing["saturated"], target="pushgateway", ranks=s["ranks"])
            if p:
                out.append(f"| ingest capacity, {s['ranks']:,} ranks, back to back: updates/s | "
                           f"{fmt(s['updates_per_s'])} | Pushgateway {fmt(p['updates_per_s'])} | "
                           f"{ratio(s['updates_per_s'], p['updates_per_s'])} |")
    return out
