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
             f"in a one-process {d['backend']} DDP group (world size 1: this tree's hook takes its fused path, "
             "the inf/NaN check riding DDP's scaling by 1/world size, as at any world size with DDP's default "
             "settings), both revisions measured in one run. Instructions: callgrind, exact, "
             f"{ins['iterations']} iterations after a warm-up of {ins['warmup']}:", "",
             "| variant | instructions/iter | ratio to plain | the hook's own (minus `python_hook`) |",
             "|---|---|---|---|"]
    for name, count in ins["per_iter"].items():
        own = ins["hook_own_per_iter"].get(name)
        lines.append(f"| {names.get(name, name)} | {fmt(count)} | {ins['ratio_to_plain'][name]:.4f} | "
                     f"{fmt(own) if own is not None else '-'} |")
    lines += ["", "The hook's own CPU time: the thread CPU time of the origin hook's calls (its note and the "
              "all-reduce it runs or wraps) and of its flags' `end_iteration` (which lets go of the iteration's "
              "buckets and, on the fused path, zeroes their flags), minus that of `python_hook`'s calls of "
              "`allreduce_hook`, timers' cost taken off, as a share of `plain`'s process CPU time per iteration; "
              "beside it the whole iterations' process CPU time against `plain` (noisier). Median of "
              f"{len(timing['runs']['after'])} alternating runs of {timing['rounds']} x {timing['block']} "
              "iterations:", "",
              "| revision | hook calls us/iter | end_iteration us/iter | `python_hook` calls us/iter | hook's own "
              "us/iter | plain us/iter | share | iteration: origin / plain | iteration: `python_hook` / plain |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += side_rows(timing["median"], lambda name, m: f"| {name} | {fmt(m['origin_calls_us_per_iter'], 2)} | "
                                                         f"{fmt(m['origin_end_iteration_us_per_iter'], 2)} | "
                                                         f"{fmt(m['python_hook_calls_us_per_iter'], 2)} | "
                                                         f"{fmt(m['hook_own_us_per_iter'], 2)} | "
                                                         f"{fmt(m['plain_cpu_us_per_iter'])} | "
                                                         f"{m['hook_own_share_of_plain_iter'] * 100:.2f}% | "
                                                         f"{m['origin_iter_ratio_to_plain']:.3f} | "
                                                         f"{m['python_hook_iter_ratio_to_plain']:.3f} |",
                       ref=d["before"], sides=timing["median"])  # the bench's order: after, then before if it had one
    return lines + ["", f"{measured_by(d)}.", ""]
