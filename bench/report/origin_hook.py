"""Section 8: what the hook of `watch(..., ddp=model)` costs, this tree beside an earlier commit."""

from __future__ import annotations

from bench.report._format import fmt, measured_by, side_rows

__all__ = ["section"]


def section(doc: dict) -> list[str]:
    """The section's lines for ``doc``, the file ``python -m bench.origin_hook --store`` writes."""
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
        lines.append(f"| {names.get(name, name)} | {fmt(count)} | {ins['ratio_to_plain'][name]:.4f} | "
                     f"{fmt(own) if own is not None else '-'} |")
    lines += ["", "The hook's own CPU time (its call's thread CPU time minus the all-reduce it wraps, timers' cost "
              "taken off), as a share of `plain`'s process CPU time per iteration, median of "
              f"{len(timing['runs']['after'])} alternating runs of {timing['rounds']} x {timing['block']} "
              "iterations:", "", "| revision | hook's own us/iter | plain us/iter | share |", "|---|---|---|---|"]
    lines += side_rows(timing["median"], lambda name, m: f"| {name} | {fmt(m['hook_own_us_per_iter'], 2)} | "
                                                         f"{fmt(m['plain_cpu_us_per_iter'])} | "
                                                         f"{m['hook_own_share_of_plain_iter'] * 100:.2f}% |",
                       ref=d["before"], sides=timing["median"])  # the bench's order: after, then before if it had one
    return lines + ["", f"{measured_by(d)}.", ""]
