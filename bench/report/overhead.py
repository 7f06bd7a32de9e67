"""Section 1: the agent's CPU time per training iteration, and what naming a DDP origin rank adds."""

from __future__ import annotations

__all__ = ["section", "summary_rows"]


def section(ov: dict) -> list[str]:
    out = ["| model | optimizer | variant | CPU us/iter | ratio [p25-p75] | wall ratio | syncs/clean iter | "
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
    out += ["", f"Per-iteration process CPU time (the agent's sender thread included), median of {ov['rounds']} "
                f"rotating rounds of {ov['block']} iterations per variant; ratio = median of per-round ratios to the "
                f"bare block of the same round [p25-p75]. Collector: {ov['collector']}."]
    h = ov.get("host_cost")
    if h:
        out += ["", f"Agent host CPU per iteration (watched minus bare on a 4-wide, 2-optimizer model whose bare "
                    f"iteration costs {h['tiny_bare_cpu_us_per_iter']} us; sender thread and `stepped()` calls "
                    f"included): **{h['agent_host_us_per_iter']} us** (p25 {h['agent_host_us_p25']}, p75 "
                    f"{h['agent_host_us_p75']}). The recorder's own calls per iteration alone "
                    f"(`agent_hot_path_us` in `bench/overhead.py`, best of 5): "
                    f"**{h.get('hot_path_us_per_iter', '-')} us**."]
        out += _samples(h.get("samples"))
    out += _ddp_origin(ov.get("ddp_origin"))
    return out


def _samples(s: dict | None) -> list[str]:
    if not s:
        return []
    out = ["", "Recording sample ids (`watch.batch()`, `watch(loader=)`; `bench/_samples_cost.py`):", "",
           "| what | per | CPU us | extra us [p25-p75] |", "|---|---|---|---|"]
    for part, per in (("batch", "iteration (recorder calls, 2 optimizers)"), ("loader", "batch (32 ints, 0 workers)")):
        for name, v in s[part].items():
            out.append(f"| {name} | {per} | {v['us']} | {v['extra_us']} [{v['extra_us_p25']}-{v['extra_us_p75']}] |")
    out += ["", f"Process CPU per unit, median of {s['rounds']} rotating rounds ({s['iterations']} iterations, "
                f"{s['loader_batches']} batches each); extra = median of the per-round differences to the first row of "
                "its part, timed in the same process. `another loader followed`: a loader no watch follows while "
                "another one is (torch's iterator class wrapped, passing through)."]
    return out


def _ddp_origin(d: dict | None) -> list[str]:
    if not d or "measurements" not in d:
        return []
    out = ["", "Naming the origin rank (`watch(..., ddp=model)`, `bench/ddp_origin.py`):", "",
           "| model | variant | CPU us/iter | ratio [p25-p75] | extra us/iter | wall ratio | syncs/clean iter |",
           "|---|---|---|---|---|---|---|"]
    for m in d["measurements"]:
        for name, v in m["variants"].items():
            out.append(f"| {m['model']} | {name} | {v['cpu_us_per_iter']} | {v['ratio']:.3f} "
                       f"[{v['ratio_p25']:.3f}-{v['ratio_p75']:.3f}] | {v['extra_us_per_iter']} | "
                       f"{v['wall_ratio']:.3f} | {v['syncs_per_clean_iter']:g} |")
    out += ["", f"A {d['world_size']}-process {d['backend']} DDP loop (AdamW, one GradScaler), rank 0's process CPU "
                f"per iteration, median of {d['rounds']} rotating rounds of {d['block']} iterations; ratio to `plain` "
                "(the agent watching without `ddp=`, DDP's built-in all-reduce). `python_hook` registers DDP's own "
                "`allreduce_hook` and nothing else (what any Python comm hook costs); `origin` is `ddp=model`."]
    calls = "calls_per_iter" if all("calls_per_iter" in m for m in d["measurements"]) else "buckets_per_iter"
    replaced = any(m.get("hook_calls", {}).get("origin", {}).get("replaces_reduction", calls != "calls_per_iter")
                   for m in d["measurements"])
    measure = ("its calls and its flags' end of iteration, minus `python_hook`'s calls of `allreduce_hook`, "
               "thread CPU time" if replaced else
               "the thread CPU time of its tensor hooks' calls, one per parameter, and of its end of iteration")
    out += ["", f"The agent's own work for `ddp=` ({measure}): "
                + "; ".join(f"{m['model']} **{m['note_us_per_iter']} us** per iteration ({m[calls]:g} hook "
                            f"calls), **{m['note_share_of_plain_iter'] * 100:.2f}%** of the plain iteration"
                            for m in d["measurements"]) + "."]
    return out


def summary_rows(ov: dict) -> list[str]:
    """The summary's rows: the ratio to the bare loop beside Accelerate's and the recipe's, the host cost."""
    out = []
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
        s = h.get("samples")
        if s:
            out.append(f"| recording sample ids (host CPU) | `watch.batch(32 ids)` "
                       f"{s['batch']['batch(list of 32)']['extra_us']} us per iteration; followed loader "
                       f"{s['loader']['followed']['extra_us']} us per batch | - | "
                       f"another loader meanwhile {s['loader']['another loader followed']['extra_us']} us per batch |")
    fused = ov.get("storm_fused", {}).get("variants")
    if fused:
        out.append(f"| skip storm, fused AdamW: iterations whose skip was reported | "
                   f"{fused['ampwatch']['storm_flagged']}/{fused['ampwatch']['checked_iterations']} | Accelerate "
                   f"{fused['accelerate']['storm_flagged']}/{fused['accelerate']['checked_iterations']} | "
                   f"Accelerate's step hook fires although the fused kernel skipped |")
    return out
