"""Section 1c: what an inspected skip costs beside GradScaler's own check, and skip storms on many tensors."""

from __future__ import annotations

from bench.report._format import fmt

__all__ = ["section", "summary_rows"]


def _shape(cost: dict) -> str:
    return f"{cost['tensors']:,} x {cost['elements']:,}"


def summary_rows(insp: dict) -> list[str]:
    """The summary's rows: an inspected skip's cost beside GradScaler's own check, and each skip storm's."""
    out = []
    for cost in insp["skip_cost"]:
        one, every = (cost["scenarios"][k]["variants"] for k in ("one", "all"))
        before = (f"; before this change {fmt(one['before_names']['ms'])} / {fmt(every['before_names']['ms'])} ms"
                  if "before_names" in one else "")
        out.append(f"| inspected skip over {_shape(cost)} gradients: ms, one / every tensor non-finite | "
                   f"{fmt(one['names']['ms'])} / {fmt(every['names']['ms'])} | GradScaler's own check "
                   f"{fmt(one['gradscaler']['ms'])} / {fmt(every['gradscaler']['ms'])}{before} | "
                   f"{one['names']['ratio']:.1f}x / {every['names']['ratio']:.1f}x GradScaler's check |")
    before = insp.get("issue_before", {}).get("storm_ratio")
    for st in insp.get("storms", []):
        out.append(f"| skip storm (skips alternate with steps), {st['tensors']:,}-tensor {st['model']}, "
                   f"{st['optimizers']} optimizer(s): CPU time vs unwatched | {st['ratio']:.3f} "
                   f"[{st['ratio_p25']:.3f}-{st['ratio_p75']:.3f}] | "
                   f"{f'issue 11 measured {before:.2f}x before this change (its model)' if before else '-'} | "
                   f"{st['named_skips']} of {st['skips']} skips named (rate limit); checks for poisoned steps on all |")
    return out


def section(insp: dict) -> list[str]:
    out = ["| gradients | non-finite tensors | GradScaler's check ms | kernel alone ms | names ms (ratio) | "
           "weight check ms (ratio) | before: names ms (ratio) | before: streak start ms (ratio) |",
           "|---|---|---|---|---|---|---|---|"]

    def cell(v: dict, key: str) -> str:
        r = v.get(key)
        return "-" if r is None else f"{fmt(r['ms'])} ({r['ratio']:.2f}x [{r['ratio_p25']:.2f}-{r['ratio_p75']:.2f}])"
    for cost in insp["skip_cost"]:
        for scenario in ("one", "all"):
            sc = cost["scenarios"][scenario]
            v = sc["variants"]
            out.append(f"| {_shape(cost)} | {sc['offending']:,} | {fmt(v['gradscaler']['ms'])} | "
                       f"{fmt(v['gradscaler_kernel']['ms'])} | {cell(v, 'names')} | {cell(v, 'weights')} | "
                       f"{cell(v, 'before_names')} | {cell(v, 'before_streak_start')} |")
    out += ["", "One inspected skip (`bench/inspection.py`): float32 gradients of the shapes issue 11 measured, one "
                "compute thread, CPU time, median of "
                f"{insp['skip_cost'][0]['rounds']} rotating rounds; ratio = median of per-round ratios to "
                "GradScaler's own check of the same gradients [p25-p75].",
            "", "*GradScaler's check*: `GradScaler._unscale_grads_` with an inverse scale of 1, what `unscale_()` (or "
                "`step()`) runs to find inf/NaN (group the gradients by device and dtype, then one "
                "`_amp_foreach_non_finite_check_and_unscale_` per group); *kernel alone*: that one call. *Names*: the "
                "agent's scan naming the skipping optimizer's gradients, the cost of an inspected skip. *Weight "
                "check*: the check of the skipping optimizer's weights at a streak start (never rate-limited; a "
                "streak start whose naming is not rate-limited does both). *Before*: the agent's scan before issue 11 "
                "(kept in the bench module as the baseline), naming gradients alone and, at a streak start, "
                "gradients and weights."]
    storms = insp.get("storms", [])
    if storms:
        out += ["", "| model | tensors | optimizers | unwatched ms/iter | watched ms/iter | ratio [p25-p75] | "
                "wall ratio | watched iterations | skips | named | poisoned steps | agent errors |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for st in storms:
            out.append(f"| {st['model']} | {st['tensors']:,} | {st['optimizers']} | {fmt(st['bare_ms_per_iter'])} | "
                       f"{fmt(st['watched_ms_per_iter'])} | {st['ratio']:.3f} [{st['ratio_p25']:.3f}-"
                       f"{st['ratio_p75']:.3f}] | {st['wall_ratio']:.3f} | {st.get('iterations', '-')} | "
                       f"{st.get('skips', '-')} | "
                       f"{st.get('named_skips', '-')} | {st.get('poisoned_steps', '-')} | "
                       f"{st.get('agent_errors', '-')} |")
        out += ["", "Skip storms: every other iteration the first optimizer's gradients hold an inf, so each of its "
                    "skips starts a streak (weights checked every time, names at most once per second per optimizer); "
                    "in `mlp-2opt` a second optimizer steps every iteration and is checked on each skip. A real "
                    "collector on loopback; float32 compute; per-iteration CPU time of the whole process (sender "
                    f"thread included), median of {storms[0]['rounds']} alternating rounds of {storms[0]['block']} "
                    "iterations; ratio = median of per-round ratios to the unwatched model [p25-p75]."]
    before = insp.get("issue_before")
    if before:
        out += ["", f"Before this change a 10,000-tensor skip storm ran at {before['storm_ratio']:.2f}x the unwatched "
                f"iteration time ({before['note']})."]
    return out
