"""bf16 without a GradScaler (``watch(None, ...)``): zero syncs, poisoned steps found and dated, overhead.

- ``bf16-error-mode`` (CUDA): the bare bf16 loop with fused optimizers makes no sync; the watched one runs
  under ``torch.cuda.set_sync_debug_mode("error")`` and must not raise, nor count an agent error. On CPU the
  syncs (``aten._local_scalar_dense``) are counted bare and watched instead.
- ``bf16-poisoned``: an inf fed in at one iteration; every later gradient is NaN (the weights are). The
  poisoned steps the agent counts must equal the truth (read after the loop, no sync inside it), the first
  event must carry the iteration of the inf, and how many iterations after it the event was seen is reported.
- ``bf16-overhead`` (CUDA): the bf16 loop bare vs watched (``bench.overhead.Setup``'s ``bf16`` variants); on
  CPU its cost is counted in instructions instead (``python -m bench --only instructions``).
"""

from __future__ import annotations

import torch

from bench.gpu._amp import Amp
from bench.gpu._checks import check, guarded, verdict
from bench.gpu._syncs import count_syncs, raised_syncing, sync_method
from bench.overhead import BF16_VARIANTS, Setup

__all__ = ["run"]

INJECT_AT = 5


def _sync_check(amp: Amp, iterations: int) -> dict:
    setups = {v: Setup(v, "mlp", True, collector=(), device=amp.device) for v in BF16_VARIANTS}
    try:
        for s in setups.values():
            s.iterate(3)
        amp.sync()
        if amp.cuda:
            raised = raised_syncing(setups, iterations, amp.sync)
            if "bf16" in raised:
                return check("bf16", "bf16-error-mode", "skip", f"the bare bf16 loop syncs by itself: {raised['bf16']}")
            problems = [f"the watched loop raised: {raised['bf16_ampwatch']}"] if raised else []
            counts = None
        else:
            counts = {v: count_syncs(False, lambda s=s: s.iterate(iterations)) for v, s in setups.items()}
            problems = [] if counts["bf16"] == counts["bf16_ampwatch"] else [f"syncs {counts}"]
        state = setups["bf16_ampwatch"].watch.snapshot()["state"]
        if state["delivery"]["agent_errors"]:
            problems.append(f"{state['delivery']['agent_errors']} agent errors")
        how = "under set_sync_debug_mode('error')" if amp.cuda else f"{counts} ({sync_method(False)})"
        return verdict("bf16", "bf16-error-mode" if amp.cuda else "bf16-counted", problems,
                       f"{iterations} clean bf16 iterations, 2 fused AdamW, watched without a scaler {how}: no sync")
    finally:
        for s in setups.values():
            s.close()


def _poisoned_check(amp: Amp, iterations: int) -> dict:
    setup = Setup("bf16_ampwatch", "mlp", False, collector=(), device=amp.device)
    recorder = setup.watch._recorder
    truth, seen_at = [], None
    try:
        for i in range(iterations):
            setup.storm = i == INJECT_AT  # an inf into the first optimizer's gradients, this iteration only
            setup.iterate(1)
            truth.append(torch.stack([torch.stack([~torch.isfinite(p.grad).all() for group in opt.param_groups
                                                    for p in group["params"]]).any() for opt in setup.opts]))
            if seen_at is None and recorder.records[0].poisoned:
                seen_at = i
        setup.storm = False
        setup.watch.close()
        state = setup.watch.snapshot()["state"]
        events = [e for e in recorder.events.drain() if e["kind"] == "poisoned_step"]
    finally:
        setup.close()
    per_iteration = torch.stack(truth).tolist()  # the truth, read once the loop is over: [iteration][optimizer]
    poisoned = [i for i, bad in enumerate(per_iteration) if any(bad)]
    reported = sum(c["poisoned_steps"] for c in state["optimizers"].values())
    expected = sum(sum(bad) for bad in per_iteration)
    problems = []
    if not poisoned or poisoned[0] != INJECT_AT:
        problems.append(f"the truth is off: poisoned iterations {poisoned}")
    if reported != expected:
        problems.append(f"{reported} poisoned steps reported, {expected} true")
    if not events or events[0]["iteration"] != INJECT_AT:
        problems.append(f"the first event's iteration is {events[0]['iteration'] if events else None}, not {INJECT_AT}")
    late = None if seen_at is None else seen_at - INJECT_AT
    return verdict("bf16", "bf16-poisoned", problems,
                   f"inf at iteration {INJECT_AT}: {reported} poisoned steps reported of {expected}, the first "
                   f"under iteration {INJECT_AT}, seen by the host {late} iteration(s) after the step "
                   f"({'still in flight at close' if late is None else 'without waiting for the device'})",
                   iterations_late=late)


def _overhead(amp: Amp, quick: bool) -> list[dict]:
    from bench.gpu.overhead import _measure, transformer_builder

    plans = [("mlp", (8, 20) if quick else (30, 40)), (transformer_builder(amp, quick), (4, 3) if quick else (10, 6))]
    primary = "wall" if amp.cuda else "cpu"
    key = "wall_ratio" if amp.cuda else "ratio"
    checks = []
    for model, (rounds, block) in plans:
        name = model if isinstance(model, str) else model.__name__
        for fused in (True, False):
            measured = _measure(amp, model, fused, rounds, block, BF16_VARIANTS, base="bf16")
            v = measured["variants"]
            e = v["bf16_ampwatch"]
            checks.append(check("bf16", f"bf16-overhead-{name}-{'fused' if fused else 'foreach'}", "info",
                                f"{name}, AdamW({'fused' if fused else 'foreach'}), bf16 without a scaler: bare "
                                f"{v['bf16']['wall_us_per_iter'] / 1000:.3f} ms/iter, watched {e[key]:.3f} "
                                f"[{e[key + '_p25']:.3f}-{e[key + '_p75']:.3f}] ({primary} time vs bare)",
                                primary=primary, **measured))
    return checks


def run(amp: Amp, quick: bool) -> list[dict]:
    """Run the bf16 checks for this device."""
    iterations = 10 if quick else 50
    checks = guarded("bf16", "bf16-syncs", lambda: [_sync_check(amp, iterations)])
    checks += guarded("bf16", "bf16-poisoned", lambda: [_poisoned_check(amp, 12 if quick else 30)])
    if amp.cuda:
        checks += guarded("bf16", "bf16-overhead", lambda: _overhead(amp, quick))
    else:  # CPU time of the bf16 loop is measured in instructions: python -m bench --only instructions
        checks.append(check("bf16", "bf16-overhead", "skip", "GPU only; on CPU see docs/benchmarks.md, section 1b"))
    return checks
