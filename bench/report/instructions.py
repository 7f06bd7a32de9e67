"""Section 1b: the agent's overhead counted in instructions (callgrind), which load does not move."""

from __future__ import annotations

__all__ = ["section", "summary_rows"]


def section(ins: dict) -> list[str]:
    out = ["Instructions executed by the training process over the measured iterations, counted by valgrind's "
           "callgrind (`bench/instructions.py`: counters zeroed after set-up and a warm-up of "
           f"{ins['warmup']} iterations, dumped right after the loop; one compute thread). Unlike time, the count "
           "does not move with the machine's load, so it can answer a 1% question on a shared machine. The bf16 "
           "rows train without a GradScaler, bare and watched with `watch(None, ...)`, which checks the gradients of "
           "every optimizer step: on CPU one `sum` per gradient, added on the host (an operator call per gradient "
           "and step, which this 6-tensor model's short iteration weighs heavily; on a GPU one batched "
           "`_foreach_norm` per step instead, `python -m bench.gpu`).", "",
           "| model | optimizer | precision | iterations | bare instructions/iter | watched instructions/iter | agent "
           "| ratio |",
           "|---|---|---|---|---|---|---|---|"]
    for r in ins["rows"]:
        out.append(f"| {r['model']} | {r['optimizer']} | {_precision(r)} | {r['iterations']} | "
                   f"{r['bare_per_iter']:,} | {r['watched_per_iter']:,} | +{r['agent_per_iter']:,} | "
                   f"{r['ratio']:.4f} |")
    return out


def summary_rows(ins: dict) -> list[str]:
    """The summary's rows: the instructions ratio per model, which the machine's load does not move."""
    out = []
    for r in ins["rows"]:
        out.append(f"| CPU instructions per iteration, {r['model']} {r['optimizer']} {_precision(r)} "
                   "(callgrind, exact) | "
                   f"{r['ratio']:.4f} of bare (+{r['agent_per_iter']:,} per iteration) | - | "
                   f"{(r['ratio'] - 1) * 100:.2f}% |")
    return out


def _precision(row: dict) -> str:
    """How the row's loop trains (runs before the bf16 rows were added measured only the GradScaler loop)."""
    return row.get("precision", "GradScaler")
