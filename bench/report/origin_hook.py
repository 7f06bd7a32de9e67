"""Section 8: what `watch(..., ddp=model)` costs, this tree beside an earlier commit."""

from __future__ import annotations

from bench.report._format import fmt, measured_by, side_rows

__all__ = ["section"]


def section(doc: dict) -> list[str]:
    """The section's lines for ``doc``, the file ``python -m bench.experiments.origin_hook --store`` writes."""
    d = doc["origin_hook"]
    ins, timing = d["instructions"], d["timing"]
    names = {"plain": "`plain`: DDP's built-in C++ all-reduce", "python_hook": "`python_hook`: DDP's `allreduce_hook` "
             "as a Python comm hook", "origin": "`origin`: `ddp=model`, this tree (a tensor hook per parameter)",
             "origin_before": f"`origin` before ({d['before']}: a comm hook in place of the all-reduce)"}
    lines = [f"What `watch(..., ddp=model)` costs in instructions, this tree beside {d['before']}:", "",
             "| model | variant | instructions/iter | ratio to plain | over plain |", "|---|---|---|---|---|"]
    for model, m in ins["models"].items():
        for name, count in m["per_iter"].items():
            over = m["over_plain"].get(name)
            lines.append(f"| {model} | {names.get(name, name)} | {fmt(count)} | {m['ratio_to_plain'][name]:.4f} | "
                         f"{fmt(over) if over is not None else '-'} |")
    lines += ["", f"`bench.ddp_origin`'s {' and '.join(d['models'])} (one bucket each), in a one-process "
              f"{d['backend']} DDP group (world size 1: DDP still buckets and all-reduces; the agent's work does not "
              "depend on the world size), both revisions measured in one run. This tree leaves DDP's reduction "
              "alone and notes each parameter's own gradient (one `aminmax` per parameter and backward); the "
              "revision before replaced DDP's built-in all-reduce with a Python comm hook whose scaling by 1/world "
              f"size carried the check. Instructions: callgrind, exact, {ins['iterations']} iterations after a "
              f"warm-up of {ins['warmup']}; *over plain* is everything `ddp=model` adds (autograd's and DDP's calls "
              "of the hook included).",
              "", "The agent's own CPU time, as a share of `plain`'s process CPU time per iteration, and the whole "
              "iterations' beside `plain`:", "",
              "| model | revision | hook calls/iter | hook calls us/iter | end_iteration us/iter | `python_hook` "
              "calls us/iter | agent's own us/iter | plain us/iter | share | iteration: origin / plain | "
              "iteration: `python_hook` / plain |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, sides in timing["median"].items():
        lines += side_rows(sides, lambda name, m, model=model: (
            f"| {model} | {name} | {m['calls_per_iter']:g} | {fmt(m['origin_calls_us_per_iter'], 2)} | "
            f"{fmt(m['origin_end_iteration_us_per_iter'], 2)} | {fmt(m['python_hook_calls_us_per_iter'], 2)} | "
            f"{fmt(m['hook_own_us_per_iter'], 2)} | {fmt(m['plain_cpu_us_per_iter'])} | "
            f"{m['hook_own_share_of_plain_iter'] * 100:.2f}% | {m['origin_iter_ratio_to_plain']:.3f} | "
            f"{m['python_hook_iter_ratio_to_plain']:.3f} |"), ref=d["before"], sides=sides)
    return lines + ["", "The agent's own: the thread CPU time of its hook calls and of its `end_iteration`, timers' "
                    "cost taken off (for the comm hook before, whose calls run the all-reduce, minus `python_hook`'s "
                    "calls of `allreduce_hook`); the whole iterations' process CPU time against `plain` is noisier. "
                    f"Median of {len(next(iter(timing['runs'].values()))['after'])} alternating runs of "
                    f"{timing['rounds']} x {timing['block']} iterations per model.", "", f"{measured_by(d)}.", ""]
