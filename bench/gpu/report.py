"""Render a ``python -m bench.gpu`` result as the "GPU" section of docs/benchmarks.md (no torch needed)."""

from __future__ import annotations

from typing import Any

__all__ = ["COMMAND", "section"]

COMMAND = "PYTHONPATH=agent/src:contract/src:support/src python -m bench.gpu --out-dir $OUT"
"""The one command a session with a GPU runs from the repository root (``$OUT``: a folder that comes back)."""

_NOT_RUN = [
    "**Not yet run on a GPU.** Every figure above is from CPU, and the agent's CUDA path (fused optimizers' "
    "`found_inf` and the scale copied without blocking into pinned memory with an event, inspection on the "
    "device) has not been exercised.",
    "",
    "| what `python -m bench.gpu` checks | how |",
    "|---|---|",
    "| truth against bit-level ground truth | three optimizers, real float16 overflow, injected inf/NaN, a manual "
    "scale; asking `stepped()` every step, never asking, and a `torch.compile`d model; the poisoned-step scenario "
    "and parameter names |",
    "| zero extra syncs | fused loop under `torch.cuda.set_sync_debug_mode(\"error\")`, foreach warnings counted, "
    "every stream/event/device synchronisation traced |",
    "| overhead | a host-bound and a device-bound model |",
    "| inspection | an inspected skip over 10,000 tensors |",
    "| DDP | a 2-rank NCCL job when two GPUs are present |",
    "| sharded training, on the available ranks | FSDP2 `fully_shard` with a `GradScaler` and in bf16 without one, "
    "FSDP1 with `ShardedGradScaler`, each rank against its own shards; Lightning's `FSDPStrategy` and Accelerate's "
    "FSDP plugin, FSDP1 and 2, with the integrations, when installed (these need a GPU) |",
    "| where it began (`began`) | an inf made in backward at a known layer named by the learned backward order, one "
    "made in a module's forward named by the probes at its next occurrence, bit-identical to the unwatched twin; "
    "the armed probes make no sync, and what they cost per iteration of the transformer |",
    "| the spike watch (issue 40) | the loss and the gradient norm watched (`scaler.scale(loss)` or `watch.loss`, "
    "`grad_norm=True`): no sync per clean iteration with a GradScaler and in bf16, the levels in the state, and "
    "the overhead vs bare on the transformer (skipped until the agent has `watch.grad_norm`) |",
    "",
    "It needs only torch and the source of the agent and its contract (no venv, no collector), takes under 5 "
    "minutes on one GPU and exits non-zero on any truth or sync mismatch. From the repository root of a machine "
    "with a GPU:",
    "",
    f"    {COMMAND}",
    "",
    "It writes `$OUT/gpu.json`. This section is rendered from `docs/benchmarks-gpu.json`, a file that appears "
    "only after such a run: copy `$OUT/gpu.json` there and run `python -m bench --render docs/benchmarks.json`, "
    "which rewrites this page with the GPU section filled in.",
    "",
    "`make bench-gpu` runs the same; `make bench-gpu ARGS=\"--device cpu --quick\"` is its CPU smoke run (part of "
    "`make test`), which proves nothing about CUDA.",
]


def _environment(env: dict[str, Any]) -> str:
    if env.get("device") == "cuda":
        gpus = env.get("gpus", [])
        names = ", ".join(f"{g['name']} ({g['memory_gib']} GiB, sm {g['capability']})" for g in gpus[:1])
        count = f"{len(gpus)} x " if len(gpus) > 1 else ""
        return (f"{count}{names}; driver {env.get('driver')}; torch {env['torch']}, CUDA {env['cuda']}, "
                f"cuDNN {env.get('cudnn')}, NCCL {env.get('nccl')}; {env['cpu']}, {env['cores']} cores")
    return f"CPU only: {env['cpu']}, {env['cores']} cores; torch {env['torch']}"


def section(results: dict[str, Any] | None, heading: str = "## GPU") -> list[str]:
    """Return the section's lines for ``results`` (the JSON ``python -m bench.gpu`` writes), or for None."""
    if results is None:
        return [heading, "", *_NOT_RUN, ""]
    env = results["environment"]
    counts: dict[str, int] = {}
    for c in results["checks"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    lines = [heading, "",
             f"`{results['command']}` on {env['date']}, {results['duration_s']:.0f} s"
             f"{' (--quick)' if results['quick'] else ''}: {_environment(env)}. Checks: "
             + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".", ""]
    if env.get("device") != "cuda":
        lines += ["**This run was on CPU: it exercises the script and the agent's CPU path and proves nothing "
                  "about CUDA.**", ""]
    lines += ["| section | check | result | detail |", "|---|---|---|---|"]
    for c in results["checks"]:
        detail = str(c["detail"]).replace("|", "\\|")
        lines.append(f"| {c['section']} | {c['name']} | {c['status']} | {detail} |")
    return lines + [""]
