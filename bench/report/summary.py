"""The page's summary table: one row per headline figure, each beside its peer where there is one."""

from __future__ import annotations

from bench.report import inspection
from bench.report._format import find, fmt, ratio

__all__ = ["table"]


def table(res: dict) -> list[str]:
    out = ["| what | ampwatch | peer | ratio / verdict |", "|---|---|---|---|"]
    ov = res.get("overhead")
    if ov and "measurements" in ov:
        for m in ov["measurements"]:
            v = m["variants"]
            aw, acc, forum = v["ampwatch"], v["accelerate"], v["forum"]
            out.append(f"| training iteration, {m['model']} (CPU time vs bare loop) | "
                       f"{aw['ratio']:.3f} [{aw['ratio_p25']:.3f}-{aw['ratio_p75']:.3f}] | "
                       f"Accelerate {acc['ratio']:.3f}, "
                       f"get_scale recipe {forum['ratio']:.3f} | extra syncs per clean iteration: ampwatch "
                       f"{aw['syncs_per_clean_iter'] - v['bare']['syncs_per_clean_iter']:+.0f}, Accelerate "
                       f"{acc['syncs_per_clean_iter'] - v['bare']['syncs_per_clean_iter']:+.0f}, recipe "
                       f"{forum['syncs_per_clean_iter'] - v['bare']['syncs_per_clean_iter']:+.0f} |")
        if "host_cost" in ov:
            h = ov["host_cost"]
            out.append(f"| agent host CPU per iteration (2 optimizers) | "
                       f"hot path {h.get('hot_path_us_per_iter', '-')} us; "
                       f"whole agent {h['agent_host_us_per_iter']} us [{h['agent_host_us_p25']}-"
                       f"{h['agent_host_us_p75']}] | - | on a {h['tiny_bare_cpu_us_per_iter']} us iteration |")
        fused = ov.get("storm_fused", {}).get("variants")
        if fused:
            out.append(f"| skip storm, fused AdamW: iterations whose skip was reported | "
                       f"{fused['ampwatch']['storm_flagged']}/{fused['ampwatch']['checked_iterations']} | Accelerate "
                       f"{fused['accelerate']['storm_flagged']}/{fused['accelerate']['checked_iterations']} | "
                       f"Accelerate's step hook fires although the fused kernel skipped |")
    ins = res.get("instructions")
    if ins and "rows" in ins:
        for r in ins["rows"]:
            out.append(f"| CPU instructions per iteration, {r['model']} {r['optimizer']} (callgrind, exact) | "
                       f"{r['ratio']:.4f} of bare (+{r['agent_per_iter']:,} per iteration) | - | "
                       f"{(r['ratio'] - 1) * 100:.2f}% |")
    out += inspection.summary_rows(res.get("inspection"))
    ing = res.get("ingest")
    if ing and "paced" in ing:
        for ranks in (1024, 4096):
            a = find(ing["paced"], target="ampwatch", ranks=ranks)
            p = find(ing["paced"], target="pushgateway", ranks=ranks)
            if a and p:
                out.append(f"| ingest, {ranks:,} ranks x 1 update/s: sustained updates/s (p99 ms) | "
                           f"{fmt(a['updates_per_s'])} ({fmt(a['p99_ms'])}) | Pushgateway {fmt(p['updates_per_s'])} "
                           f"({fmt(p['p99_ms'])}) | {ratio(a['updates_per_s'], p['updates_per_s'])} |")
        for s in ing.get("saturated", []):
            if s["target"] == "ampwatch":
                p = find(ing["saturated"], target="pushgateway", ranks=s["ranks"])
                if p:
                    out.append(f"| ingest capacity, {s['ranks']:,} ranks, back to back: updates/s | "
                               f"{fmt(s['updates_per_s'])} | Pushgateway {fmt(p['updates_per_s'])} | "
                               f"{ratio(s['updates_per_s'], p['updates_per_s'])} |")
    sc = res.get("scrape")
    if sc and "levels" in sc:
        for ranks in (1024, 4096):
            a = find(sc["levels"], target="ampwatch", ranks=ranks)
            p = find(sc["levels"], target="pushgateway", ranks=ranks)
            if a and p:
                out.append(f"| /metrics at {ranks:,} ranks x 2 optimizers: ms (MB) | {fmt(a['scrape_median_ms'])} "
                           f"({a['bytes'] / 1e6:.1f}) | Pushgateway {fmt(p['scrape_median_ms'])} "
                           f"({p['bytes'] / 1e6:.1f}) | "
                           f"{ratio(p['scrape_median_ms'], a['scrape_median_ms'])} faster |")
        a = find(sc["levels"], target="ampwatch", ranks=4096) or find(sc["levels"], target="ampwatch", ranks=1024)
        if a and a.get("rss_kib_per_rank") is not None:
            p = find(sc["levels"], target="pushgateway", ranks=a["ranks"])
            out.append(f"| resident memory per rank ({a['ranks']:,} ranks) | {a['rss_kib_per_rank']} KiB | "
                       f"Pushgateway {p['rss_kib_per_rank'] if p else '-'} KiB | |")
    fp = res.get("footprint")
    if fp and "bytes_per_event_on_disk" in fp:
        out.append(f"| database growth | {fp['bytes_per_event_on_disk']:.0f} B per event; 0 B per event-free "
                   f"batch | Pushgateway keeps no history | bounded by `--db-retention` |")
    return out
