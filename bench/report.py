"""Render the benchmark results (one JSON document) as ``docs/benchmarks.md``."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from bench.gpu import report as gpu_report

__all__ = ["render", "BEFORE_AFTER"]

BEFORE_AFTER = os.path.join(os.path.dirname(__file__), "tail_before_after.json")  # written by hand-run bench.tail
JOB_1024 = os.path.join(os.path.dirname(__file__), "job1024_before_after.json")
"""Written by hand-run ``bench.alert_memory``, ``notify_storm``, ``storm``, ``metrics_size`` and ``run_page`` with
``--out``."""
ORIGIN_HOOK = os.path.join(os.path.dirname(__file__), "origin_hook_before_after.json")  # python -m bench.origin_hook
GPU_RESULTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "benchmarks-gpu.json")
"""The latest ``python -m bench.gpu`` result run on a GPU, committed by hand (docs/benchmarks.md, GPU)."""


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _find(rows: list[dict], **match: Any) -> Optional[dict]:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _ratio(a: Optional[float], b: Optional[float], digits: int = 1) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:,.{digits}f}x"


def _summary(res: dict) -> list[str]:
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
    out += _inspection_summary(res.get("inspection"))
    ing = res.get("ingest")
    if ing and "paced" in ing:
        for ranks in (1024, 4096):
            a = _find(ing["paced"], target="ampwatch", ranks=ranks)
            p = _find(ing["paced"], target="pushgateway", ranks=ranks)
            if a and p:
                out.append(f"| ingest, {ranks:,} ranks x 1 update/s: sustained updates/s (p99 ms) | "
                           f"{_fmt(a['updates_per_s'])} ({_fmt(a['p99_ms'])}) | Pushgateway {_fmt(p['updates_per_s'])} "
                           f"({_fmt(p['p99_ms'])}) | {_ratio(a['updates_per_s'], p['updates_per_s'])} |")
        for s in ing.get("saturated", []):
            if s["target"] == "ampwatch":
                p = _find(ing["saturated"], target="pushgateway", ranks=s["ranks"])
                if p:
                    out.append(f"| ingest capacity, {s['ranks']:,} ranks, back to back: updates/s | "
                               f"{_fmt(s['updates_per_s'])} | Pushgateway {_fmt(p['updates_per_s'])} | "
                               f"{_ratio(s['updates_per_s'], p['updates_per_s'])} |")
    sc = res.get("scrape")
    if sc and "levels" in sc:
        for ranks in (1024, 4096):
            a = _find(sc["levels"], target="ampwatch", ranks=ranks)
            p = _find(sc["levels"], target="pushgateway", ranks=ranks)
            if a and p:
                out.append(f"| /metrics at {ranks:,} ranks x 2 optimizers: ms (MB) | {_fmt(a['scrape_median_ms'])} "
                           f"({a['bytes'] / 1e6:.1f}) | Pushgateway {_fmt(p['scrape_median_ms'])} "
                           f"({p['bytes'] / 1e6:.1f}) | "
                           f"{_ratio(p['scrape_median_ms'], a['scrape_median_ms'])} faster |")
        a = _find(sc["levels"], target="ampwatch", ranks=4096) or _find(sc["levels"], target="ampwatch", ranks=1024)
        if a and a.get("rss_kib_per_rank") is not None:
            p = _find(sc["levels"], target="pushgateway", ranks=a["ranks"])
            out.append(f"| resident memory per rank ({a['ranks']:,} ranks) | {a['rss_kib_per_rank']} KiB | "
                       f"Pushgateway {p['rss_kib_per_rank'] if p else '-'} KiB | |")
    fp = res.get("footprint")
    if fp and "bytes_per_event_on_disk" in fp:
        out.append(f"| database growth | {fp['bytes_per_event_on_disk']:.0f} B per event; 0 B per event-free "
                   f"batch | Pushgateway keeps no history | bounded by `--db-retention` |")
    return out


def _overhead(ov: dict) -> list[str]:
    out = [f"Per-iteration process CPU time (the agent's sender thread included), median of {ov['rounds']} "
           f"rotating rounds of {ov['block']} iterations per variant; ratio = median of per-round ratios to the "
           f"bare block of the same round [p25-p75]. Collector: {ov['collector']}.", ""]
    out += ["| model | optimizer | variant | CPU us/iter | ratio [p25-p75] | wall ratio | syncs/clean iter | "
            "syncs/storm iter | update() per iter | storm: skipped iterations seen | storm: per-optimizer right | "
            "clean: false alarms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in ov["measurements"] + ([ov["storm_fused"]] if "storm_fused" in ov else []):
        for name, v in m["variants"].items():
            n = v.get("checked_iterations")
            out.append(f"| {m['model']} | {m['optimizer']} | {name} | {v['cpu_us_per_iter']} | {v['ratio']:.3f} "
                       f"[{v['ratio_p25']:.3f}-{v['ratio_p75']:.3f}] | {v['wall_ratio']:.3f} | "
                       f"{v['syncs_per_clean_iter']:g} | {v['syncs_per_storm_iter']:g} | {v['updates_per_iter']:g} | "
                       + (f"{v['storm_flagged']}/{n} | {v['storm_per_optimizer_right']}/{n} | "
                          f"{v['clean_false_alarms']}/{n} |" if n else "- | - | - |"))
    h = ov.get("host_cost")
    if h:
        out += ["", f"Agent host CPU per iteration (watched minus bare on a 4-wide, 2-optimizer model whose bare "
                    f"iteration costs {h['tiny_bare_cpu_us_per_iter']} us; sender thread and `stepped()` calls "
                    f"included): **{h['agent_host_us_per_iter']} us** (p25 {h['agent_host_us_p25']}, p75 "
                    f"{h['agent_host_us_p75']}). The recorder's own calls per iteration alone "
                    f"(`agent_hot_path_us` in `bench/overhead.py`, best of 5): **{h.get('hot_path_us_per_iter', '-')} us**."]
    out += _ddp_origin(ov.get("ddp_origin"))
    return out


def _ddp_origin(d: Optional[dict]) -> list[str]:
    if not d or "measurements" not in d:
        return []
    out = ["", f"Naming the origin rank (`watch(..., ddp=model)`, `bench/ddp_origin.py`): a {d['world_size']}-process "
               f"{d['backend']} DDP loop (AdamW, one GradScaler), rank 0's process CPU per iteration, median of "
               f"{d['rounds']} rotating rounds of {d['block']} iterations; ratio to `plain` (the agent watching "
               "without `ddp=`, DDP's built-in all-reduce). `python_hook` registers DDP's own `allreduce_hook` "
               "and nothing else (what any Python comm hook costs); `origin` is ampwatch's hook wrapping it.", "",
           "| model | variant | CPU us/iter | ratio [p25-p75] | extra us/iter | wall ratio | syncs/clean iter |",
           "|---|---|---|---|---|---|---|"]
    for m in d["measurements"]:
        for name, v in m["variants"].items():
            out.append(f"| {m['model']} | {name} | {v['cpu_us_per_iter']} | {v['ratio']:.3f} "
                       f"[{v['ratio_p25']:.3f}-{v['ratio_p75']:.3f}] | {v['extra_us_per_iter']} | "
                       f"{v['wall_ratio']:.3f} | {v['syncs_per_clean_iter']:g} |")
    out += ["", "The origin hook's own work, its thread CPU time timed around it (each bucket's extremes written "
                "in place by one `aminmax`): "
                + "; ".join(f"{m['model']} **{m['note_us_per_iter']} us** per iteration ({m['buckets_per_iter']:g} "
                            f"bucket), **{m['note_share_of_plain_iter'] * 100:.2f}%** of the plain iteration"
                            for m in d["measurements"]) + "."]
    return out


def _instructions(ins: dict) -> list[str]:
    out = ["Instructions executed by the training process over the measured iterations, counted by valgrind's "
           "callgrind (`bench/instructions.py`: counters zeroed after set-up and a warm-up of "
           f"{ins['warmup']} iterations, dumped right after the loop; one compute thread). Unlike time, the count "
           "does not move with the machine's load, so it can answer a 1% question on a shared machine.", "",
           "| model | optimizer | iterations | bare instructions/iter | watched instructions/iter | agent | ratio |",
           "|---|---|---|---|---|---|---|"]
    for r in ins["rows"]:
        out.append(f"| {r['model']} | {r['optimizer']} | {r['iterations']} | {r['bare_per_iter']:,} | "
                   f"{r['watched_per_iter']:,} | +{r['agent_per_iter']:,} | {r['ratio']:.4f} |")
    return out


def _shape(cost: dict) -> str:
    return f"{cost['tensors']:,} x {cost['elements']:,}"


def _inspection_summary(insp: Optional[dict]) -> list[str]:
    if not insp or "skip_cost" not in insp:
        return []
    out = []
    for cost in insp["skip_cost"]:
        one, every = (cost["scenarios"][k]["variants"] for k in ("one", "all"))
        before = (f"; before this change {_fmt(one['before_names']['ms'])} / {_fmt(every['before_names']['ms'])} ms"
                  if "before_names" in one else "")
        out.append(f"| inspected skip over {_shape(cost)} gradients: ms, one / every tensor non-finite | "
                   f"{_fmt(one['names']['ms'])} / {_fmt(every['names']['ms'])} | GradScaler's own check "
                   f"{_fmt(one['gradscaler']['ms'])} / {_fmt(every['gradscaler']['ms'])}{before} | "
                   f"{one['names']['ratio']:.1f}x / {every['names']['ratio']:.1f}x GradScaler's check |")
    before = insp.get("issue_before", {}).get("storm_ratio")
    for st in insp.get("storms", []):
        out.append(f"| skip storm (skips alternate with steps), {st['tensors']:,}-tensor {st['model']}, "
                   f"{st['optimizers']} optimizer(s): CPU time vs unwatched | {st['ratio']:.3f} "
                   f"[{st['ratio_p25']:.3f}-{st['ratio_p75']:.3f}] | "
                   f"{'issue 11 measured ' + format(before, '.2f') + 'x before this change (its model)' if before else '-'} | "
                   f"{st['named_skips']} of {st['skips']} skips named (rate limit); checks for poisoned steps on all |")
    return out


def _inspection(insp: dict) -> list[str]:
    out = ["One inspected skip (`bench/inspection.py`): float32 gradients of the shapes issue 11 measured, "
           "one compute thread, CPU time, median of "
           f"{insp['skip_cost'][0]['rounds']} rotating rounds; ratio = median of per-round ratios to "
           "GradScaler's own check of the same gradients [p25-p75]. *GradScaler's check*: "
           "`GradScaler._unscale_grads_` with an inverse scale of 1, what `unscale_()` (or `step()`) runs to find "
           "inf/NaN (group the gradients by device and dtype, then one `_amp_foreach_non_finite_check_and_unscale_` "
           "per group); *kernel alone*: that one call. *Names*: the agent's scan naming the skipping optimizer's "
           "gradients, the cost of an inspected skip. *Weight check*: the check of the skipping optimizer's weights "
           "at a streak start (never rate-limited; a streak start whose naming is not rate-limited does both). "
           "*Before*: the agent's scan before issue 11 (kept in the bench module as the baseline), naming "
           "gradients alone and, at a streak start, gradients and weights.", "",
           "| gradients | non-finite tensors | GradScaler's check ms | kernel alone ms | names ms (ratio) | "
           "weight check ms (ratio) | before: names ms (ratio) | before: streak start ms (ratio) |",
           "|---|---|---|---|---|---|---|---|"]

    def cell(v: dict, key: str) -> str:
        r = v.get(key)
        return "-" if r is None else f"{_fmt(r['ms'])} ({r['ratio']:.2f}x [{r['ratio_p25']:.2f}-{r['ratio_p75']:.2f}])"
    for cost in insp["skip_cost"]:
        for scenario in ("one", "all"):
            sc = cost["scenarios"][scenario]
            v = sc["variants"]
            out.append(f"| {_shape(cost)} | {sc['offending']:,} | {_fmt(v['gradscaler']['ms'])} | "
                       f"{_fmt(v['gradscaler_kernel']['ms'])} | {cell(v, 'names')} | {cell(v, 'weights')} | "
                       f"{cell(v, 'before_names')} | {cell(v, 'before_streak_start')} |")
    storms = insp.get("storms", [])
    if storms:
        out += ["", "Skip storms: every other iteration the first optimizer's gradients hold an inf, so each of its "
                "skips starts a streak (weights checked every time, names at most once per second per optimizer); "
                "in `mlp-2opt` a second optimizer steps every iteration and is checked on each skip. A real "
                "collector on loopback; float32 compute; per-iteration CPU time of the whole process (sender thread "
                f"included), median of {storms[0]['rounds']} alternating rounds of {storms[0]['block']} iterations; "
                "ratio = median of per-round ratios to the unwatched model [p25-p75].", "",
                "| model | tensors | optimizers | unwatched ms/iter | watched ms/iter | ratio [p25-p75] | wall ratio | "
                "watched iterations | skips | named | poisoned steps | agent errors |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for st in storms:
            out.append(f"| {st['model']} | {st['tensors']:,} | {st['optimizers']} | {_fmt(st['bare_ms_per_iter'])} | "
                       f"{_fmt(st['watched_ms_per_iter'])} | {st['ratio']:.3f} [{st['ratio_p25']:.3f}-"
                       f"{st['ratio_p75']:.3f}] | {st['wall_ratio']:.3f} | {st.get('iterations', '-')} | "
                       f"{st.get('skips', '-')} | "
                       f"{st.get('named_skips', '-')} | {st.get('poisoned_steps', '-')} | {st.get('agent_errors', '-')} |")
    before = insp.get("issue_before")
    if before:
        out += ["", f"Before this change a 10,000-tensor skip storm ran at {before['storm_ratio']:.2f}x the unwatched "
                f"iteration time ({before['note']})."]
    return out


def _ingest(ing: dict) -> list[str]:
    out = [f"Paced: every rank sends one update per second for {ing['seconds']} s (offered rate = ranks/s); "
           "latency from send to full answer (ampwatch: committed to SQLite with synchronous=FULL; Pushgateway: "
           "held in memory). p50/p99 leave out each rank's first 2 updates; *unanswered* requests were still "
           "open 5 s after the last slot (their latency counts as at least that); *missed* slots were skipped "
           "by ranks whose previous answer came too late. Saturated: "
           f"{ing['saturate_connections']} connections sending back to back for {ing['saturate_seconds']} s.", "",
           "| server | mode | ranks | updates/s | p50 ms | p99 ms | p99 incl. first contact | max ms | unanswered | "
           "missed | server CPU % | server CPU us/update | server RSS MiB | generator CPU s | generator lag p99 ms "
           "| load avg |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ing["paced"] + ing["saturated"]:
        out.append(f"| {r['target']} | {r['mode']} | {r['ranks']:,} | {_fmt(r['updates_per_s'])} | {_fmt(r['p50_ms'])} "
                   f"| {_fmt(r['p99_ms'])} | {_fmt(r.get('p99_all_ms'))} | {_fmt(r['max_ms'])} | {r['unanswered']} | "
                   f"{r['missed_slots']} | {r['server_cpu_pct']} | {_fmt(r['server_cpu_us_per_update'])} | "
                   f"{r.get('vmrss', 0) / 1024:.0f} | {r['generator_cpu_s']} | {_fmt(r.get('lag_p99_ms'))} | "
                   f"{r['loadavg_1m']} |")
    return out


def _scrape(sc: dict) -> list[str]:
    out = [f"Median of {sc['scrapes']} uncompressed scrapes after one warm-up. The Pushgateway holds exactly the "
           f"series the collector exposed, pushed in groups of {sc['pushgateway_group_size']} ranks (it adds its "
           "`job`/`group` labels and `push_time_seconds` per group).", "",
           "| server | ranks | scrape ms (median) | min | max | bytes | samples | RSS after fill MiB | "
           "RSS per rank KiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sc["levels"]:
        out.append(f"| {r['target']} | {r['ranks']:,} | {r['scrape_median_ms']} | {r['scrape_min_ms']} | "
                   f"{r['scrape_max_ms']} | {r['bytes']:,} | {r['samples']:,} | {r['rss_kib_after'] / 1024:.0f} | "
                   f"{_fmt(r['rss_kib_per_rank'])} |")
    return out


def _footprint(fp: dict) -> list[str]:
    s, l_ = fp["short"], fp["long"]
    return [f"Two fresh collectors, {s['ranks']} ranks at one batch per second for {s['seconds']} s and "
            f"{l_['seconds']} s, a skip and a backoff event every {fp['skip_every']} batches (on purpose many, to "
            "measure them); database size after a WAL checkpoint.", "",
            "| run | batches | events | incarnation rows | database bytes |", "|---|---|---|---|---|",
            f"| short | {s['answered']:,} | {s['events']:,} | {s['incarnations']} | {s['file_bytes']:,} |",
            f"| long | {l_['answered']:,} | {l_['events']:,} | {l_['incarnations']} | {l_['file_bytes']:,} |", "",
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


def _tail(tail: list[dict], before_after: Optional[dict]) -> list[str]:
    out = ["`python -m bench.tail --profile`: the collector in-process under 1,024 paced ranks, with the "
           "default garbage-collector settings and with the collector's own (`ampwatch.server._gc`: freeze the "
           "start-up heap, young collections every 5,000 allocations).", "",
           "| GC | updates/s | p50 ms | p99 ms | GC CPU ms (gen0/1/2) | longest GC pause ms | loop lag max ms | "
           "lags > 50 ms | commit max ms | mean group | alert tick ms | load avg |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in tail:
        g, load = t["gc_pauses_cpu"], t["load"]
        gc_ms = "/".join(_fmt(g[k].get("total_ms", 0.0)) for k in ("gen0", "gen1", "gen2"))
        longest = max(g[k].get("max_ms", 0.0) for k in g)
        out.append(f"| {'tuned' if t['gc_tuned'] else 'default'} | {_fmt(load.get('updates_per_s'))} | "
                   f"{_fmt(load.get('p50_ms'))} | {_fmt(load.get('p99_ms'))} | {gc_ms} | {longest} | "
                   f"{t['loop_lag'].get('max_ms')} | {t['loop_lag'].get('over_50ms')} | {t['commits'].get('max_ms')} | "
                   f"{t['commits'].get('mean_group')} | {t['alert_tick_cpu'].get('p50_ms')} | {t['loadavg_1m']} |")
    if before_after:
        out += ["", before_after.get("note", ""), "", "| version | mode | updates/s | p50 ms | p99 ms | max ms | "
                "server CPU us/update | load avg |", "|---|---|---|---|---|---|---|---|"]
        for r in before_after["runs"]:
            out.append(f"| {r['version']} | {r['mode']} | {_fmt(r['updates_per_s'])} | {_fmt(r['p50_ms'])} | "
                       f"{_fmt(r['p99_ms'])} | {_fmt(r['max_ms'])} | {_fmt(r['server_cpu_us_per_update'])} | "
                       f"{r['loadavg_1m']} |")
    return out


def _remeasured(res: dict, key: str) -> list[str]:
    stamp = res.get("remeasured", {}).get(key)
    if not stamp:
        return []
    return [f"Re-measured by `{stamp['command']}` on {stamp['date']} in {stamp['duration_s']:.0f} s (load average "
            f"{stamp['loadavg_start']} at start, {stamp['loadavg_end']} at the end); the rest of the page is from the "
            "run above.", ""]


def _job1024(doc: dict) -> list[str]:
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
            lines.append(f"| {name} | {_fmt(r['kib_per_rank'])} | {_fmt(r['rss_kib'] / 1024)} | "
                         f"{_fmt(r.get('history_array_kib_per_rank'))} | {_fmt(r['cpu_s'])} | {_fmt(r['firing'])} |")
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
                lines.append(f"| {name} | {phase} | {_fmt(r['posts'])} | {_fmt(r['bytes'] / 1e6, 2)} | "
                             f"{_fmt(r['seconds'])} | {_fmt(r['dropped_so_far'])} |")
        lines += ["", f"`{storm['command']}`, {storm['date']}. Grouped by alert and run, the resolved phase goes "
                  "out one `--notify-group-interval` (60 s) after the firing one.", ""]
    skip_storm = doc.get("storm")
    if skip_storm:
        a = skip_storm["after"]
        lines += [f"A whole-job skip storm: {_fmt(a['ranks'])} ranks x 2 optimizers push every {_fmt(a['interval_s'])} s; "
                  f"after a clean warm-up every rank skips every iteration ({a['iterations_per_push']} per push) for "
                  f"{_fmt(a['storm_seconds'])} s. Each side gets the events its agent sends (before: one per skipped "
                  "step per optimizer and one per backoff; after: a streak's rungs and end, backoffs folded), "
                  "`bench/_storm.py`, checked against a real agent by `tests/test_bench_storm.py`:", "",
                  "| | ingest p50 ms | p99 ms | max ms | answers over 2 s | batches answered (slots missed) | "
                  "collector CPU µs per batch | event rows per storm-minute | event MB per storm-minute | "
                  "database MB per storm-minute |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for side in ("before", "after"):
            r = skip_storm[side]
            name = f"before ({r['ref']})" if side == "before" else "after"
            lines.append(f"| {name} | {_fmt(r['storm_p50_ms'])} | {_fmt(r['storm_p99_ms'])} | "
                         f"{_fmt(r['storm_max_ms'])} | {_fmt(r['timeouts_2s'])} | "
                         f"{_fmt(r.get('answered'))} ({_fmt(r['missed_slots'])}) | {_fmt(r.get('server_cpu_us_per_batch'))} | "
                         f"{_fmt(r['event_rows_per_storm_minute'])} | {_fmt(r['event_mb_per_storm_minute'], 2)} | "
                         f"{_fmt(r['db_mb_per_storm_minute'], 2)} |")
        lines += ["", f"`{skip_storm['command']}`, {skip_storm['date']}, load average {_fmt(a['loadavg_1m'])} at the "
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
            lines.append(f"| {name} | {_fmt(r['samples'])} | {_fmt(r['bytes'])} | {_fmt(r['gzip_bytes'])} | "
                         f"{_fmt(r['scrape_median_ms'])} | {_fmt(r['gzip_scrape_median_ms'])} |")
        lines += ["", f"`{size['command']}`, {size['date']}. Fewer samples: a streak-ladder rung is exposed once "
                  "a streak reached it.", ""]
    page = doc.get("run_page")
    if page and "before" in page:
        lines += [f"The run page in issue 14's job at {_fmt(page['ranks'])} ranks x 2 optimizers (collapse on 40-43, "
                  "1 skip in 8 on 777, a poisoned step on 512, scheduler-after-skip on 900, rank 1000 killed, "
                  "then every rank skipping), live (a batch per rank every 2 s), in headless Chromium. First paint: "
                  "navigation start to the first ranks-in-trouble row; bytes: every API answer during the watch "
                  "over the refreshes it saw; endpoint ms: median of 7 GETs a second apart (first GET in brackets):",
                  "", "| side | phase | first paint ms | bytes per refresh | summary ms | summary bytes | scale ms | "
                  "scale bytes | full run ms | full run bytes | collector CPU % |", "|" + "---|" * 11]
        def ms(x: dict) -> str:
            return "-" if x.get("missing") else f"{_fmt(x['median_ms'])} ({_fmt(x['first_ms'])})"

        for side in ("before", "after"):
            for phase in ("trouble", "storm"):
                r = page[side][phase]
                e, b = r["endpoints"], r["page"]
                name = f"before ({page[side]['ref']})" if side == "before" else "after"
                per_refresh = _fmt(b["refresh_bytes"]) if b["refresh_bytes"] is not None else \
                    f"none completed in {_fmt(b['watch_s'])} s ({_fmt(sum(b['by_endpoint'].values()))} read)"
                lines.append(f"| {name} | {phase} | {_fmt(b['first_paint_ms'])} | {per_refresh} | "
                             f"{ms(e['summary'])} | {_fmt(e['summary'].get('bytes'))} | {ms(e['scale'])} | "
                             f"{_fmt(e['scale'].get('bytes'))} | {ms(e['run'])} | {_fmt(e['run'].get('bytes'))} | "
                             f"{_fmt(r['collector_cpu_pct'])} |")
        quiet = [f"`{name}` {side} {_fmt(r['min_ms'])} ms fastest, {_fmt(r['median_ms'])} median"
                 for name in ("summary", "scale") for side in ("before", "after")
                 if "quiet" in page[side] and not (r := page[side]["quiet"]["endpoints"][name]).get("missing")]
        if quiet:
            lines += ["", "Once the job stopped sending (nothing changing; 20 GETs 0.25 s apart; the median waited "
                      "for the built-in alert pass on the event loop): " + "; ".join(quiet) + "."]
        after = page["after"]["storm"]["page"]["by_endpoint"]
        lines += ["", "Bytes per refresh by endpoint, after, in the storm: " +
                  ", ".join(f"`{k}` {_fmt(v)}" for k, v in after.items()) + ".",
                  "", f"`{page['command']}`, {page['date']}; the machine was shared with other jobs (load average "
                  "above its core count): compare the sides, not the absolute figures.", ""]
    lines += _rule_eval(doc.get("rule_eval"))
    return lines


def _rule_eval(r: dict | None) -> list[str]:
    if not r:
        return []
    lines = [f"Prometheus rule evaluation at {_fmt(r['ranks'])} ranks x {r['optimizers']} optimizers "
             f"({_fmt(r['series'])} series) every {r['interval_s']} s over full 30-minute windows ("
             f"{_fmt(r['samples_per_series_in_30m'])} samples per series in 30m), the real Prometheus, the earlier "
             "commit's rules and these side by side on the same data, a whole-job storm's streak alerts firing "
             f"({_fmt(r['after']['firing'].get('AmpConsecutiveSkippedSteps (warning)', 0))} instances). Wall-clock "
             f"times over {r['after']['evaluations']} evaluations each, as `/api/v1/rules` reports them (they stretch "
             "while other jobs hold this shared machine's 2 cores), and the CPU each Prometheus used per interval "
             "(evaluation, scrape, the bench's reads):", "",
             "| | rules | group median ms | % of interval | group max ms | % of interval | CPU s per interval |",
             "|---|---|---|---|---|---|---|"]
    for side in ("before", "after"):
        x = r[side]
        name = f"before ({x['ref']})" if side == "before" else "after"
        lines.append(f"| {name} | {x['rules']} | {_fmt(x['group_median_s'] * 1000)} | "
                     f"{_fmt(x['median_percent_of_interval'])}% | {_fmt(x['group_max_s'] * 1000)} | "
                     f"{_fmt(x['max_percent_of_interval'])}% | {_fmt(x['cpu_s_per_interval'], 2)} |")
    keys = list(r["before"]["per_rule_ms"])[:6]
    lines += ["", "The heaviest rules before, median ms (after: the same rule; the recording rules it now reads are "
              "in the JSON):", "", "| rule | before | after |", "|---|---|---|"]
    for key in keys:
        after = r["after"]["per_rule_ms"].get(key)
        lines.append(f"| {key} | {_fmt(r['before']['per_rule_ms'][key]['median'])} | "
                     f"{_fmt(after['median']) if after else '-'} |")
    heaviest = r["after"].get("heaviest_alert")
    if heaviest:
        lines += ["", f"Of the {_fmt(heaviest['median_ms'])} ms of {heaviest['rule']} ({_fmt(heaviest['instances'])} "
                  f"instances), its expression alone takes {_fmt(heaviest['expression_alone_ms'])} ms: the rest is "
                  "Prometheus building the alerts, templating each instance's label and annotations at every "
                  "evaluation, which no rewrite of the expression removes."]
    dash = [r[side].get("dashboard") for side in ("before", "after")]
    if all(dash):
        lines += ["", "The dashboard's queries over its last 30 minutes at 15 s steps, as Grafana sends them (tables: "
                  "instant):", "", "| | panels | most series in one panel | panels over 100 series | MB in all |",
                  "|---|---|---|---|---|"]
        for side, d in zip(("before", "after"), dash):
            lines.append(f"| {side} | {d['panels']} | {_fmt(d['max_series'])} | {d['panels_over_100_series']} | "
                         f"{_fmt(d['bytes'] / 1e6, 1)} |")
        big = [title for title, cost in dash[1]["per_panel"].items() if cost["series"] > 100]
        if big:
            lines += ["", f"Over 100 series after: {', '.join(big)} (one row per firing alert instance, the storm's "
                      "included)."]
    lines += ["", f"`{r['command']}`, {r['date']}.", ""]
    return lines


def _origin_hook(doc: dict) -> list[str]:
    d = doc["origin_hook"]
    ins, timing = d["instructions"], d["timing"]
    names = {"plain": "`plain`: DDP's built-in C++ all-reduce", "python_hook": "`python_hook`: DDP's `allreduce_hook` "
             "as a Python comm hook", "origin": "`origin`: `ddp=model`, this tree",
             "origin_before": f"`origin` before ({d['before']})"}
    lines = [f"What the hook of `watch(..., ddp=model)` costs on `bench.ddp_origin`'s {d['model']} (one bucket), "
             f"in a one-process {d['backend']} DDP group (the hook's work does not depend on the world size), both "
             "revisions measured in one run. Instructions: callgrind, exact, "
             f"{ins['iterations']} iterations after a warm-up of {ins['warmup']}:", "",
             "| variant | instructions/iter | ratio to plain | the hook's own (minus `python_hook`) |",
             "|---|---|---|---|"]
    for name, count in ins["per_iter"].items():
        own = ins["hook_own_per_iter"].get(name)
        lines.append(f"| {names.get(name, name)} | {_fmt(count)} | {ins['ratio_to_plain'][name]:.4f} | "
                     f"{_fmt(own) if own is not None else '-'} |")
    lines += ["", "The hook's own CPU time (its call's thread CPU time minus the all-reduce it wraps, timers' cost "
              "taken off), as a share of `plain`'s process CPU time per iteration, median of "
              f"{len(timing['runs']['after'])} alternating runs of {timing['rounds']} x {timing['block']} "
              "iterations:", "", "| revision | hook's own us/iter | plain us/iter | share |", "|---|---|---|---|"]
    for side, m in timing["median"].items():
        name = f"before ({d['before']})" if side == "before" else "after"
        lines.append(f"| {name} | {_fmt(m['hook_own_us_per_iter'], 2)} | {_fmt(m['plain_cpu_us_per_iter'])} | "
                     f"{m['hook_own_share_of_plain_iter'] * 100:.2f}% |")
    return lines + ["", f"`{d['command']}`, {d['date']}.", ""]


def render(res: dict, json_name: str = "benchmarks.json") -> str:
    """Return the Markdown page for ``res`` (the document ``python -m bench`` writes as ``json_name``)."""
    env = res["environment"]
    lines = ["# Benchmarks", "",
             f"Generated by `{res['command']}` on {env['date']} in {res['duration_s']:.0f} s"
             f"{' (quick mode: short runs, wide spread)' if res['quick'] else ''}; raw figures in "
             f"[`{json_name}`]({json_name}). Do not edit by hand: run `make bench`.", "",
             "## Summary", ""]
    lines += _summary(res)
    lines += ["", f"Machine: {env['cpu']}, {env['cores']} cores, {env['memory_gib']} GiB, Linux {env['kernel']}; "
              f"load average {env['loadavg_start']} at start, {env['loadavg_end']} at the end (other jobs shared "
              "the machine: absolute times drift, so every comparison is a ratio from the same run, with "
              "alternating order).", "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".", ""]
    sections = [("overhead", "1. Agent overhead per training iteration", _overhead),
                ("instructions", "1b. Agent overhead in CPU instructions (exact)", _instructions),
                ("inspection", "1c. Inspecting skips on models with many tensors", _inspection),
                ("ingest", "2. Ingest throughput and latency vs the Pushgateway", _ingest),
                ("scrape", "3. Scrape cost", _scrape),
                ("footprint", "4. Collector footprint", _footprint)]
    for key, title, fn in sections:
        if key in res:
            lines += [f"## {title}", ""]
            lines += _remeasured(res, key)
            lines += fn(res[key]) if "error" not in res[key] else [f"Failed: `{res[key]['error']}`"]
            lines += [""]
    if "tail" in res:
        lines += ["## 5. The ingest tail at 1,024 ranks", ""]
        before_after = None
        if os.path.exists(BEFORE_AFTER):
            with open(BEFORE_AFTER) as f:
                before_after = json.load(f)
        lines += (_tail(res["tail"], before_after) if isinstance(res["tail"], list)
                  else [f"Failed: `{res['tail']['error']}`"])
        lines += [""]
    gpu = None
    if os.path.exists(GPU_RESULTS):
        with open(GPU_RESULTS) as f:
            gpu = json.load(f)
    lines += gpu_report.section(gpu, "## 6. GPU")
    if os.path.exists(JOB_1024):
        with open(JOB_1024) as f:
            lines += ["## 7. A 1,024-rank job", "", *_job1024(json.load(f))]
    if os.path.exists(ORIGIN_HOOK):
        with open(ORIGIN_HOOK) as f:
            lines += ["## 8. The DDP origin hook, before and after", "", *_origin_hook(json.load(f))]
    lines += ["## How it is measured", "", *res["notes"], ""]
    return "\n".join(lines)
