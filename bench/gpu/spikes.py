"""The spike watch (issue 40) on the device: the loss and the gradient norm watched without a sync, and what it costs.

- ``spikes-syncs-scaled``: the transformer loop with a GradScaler and fused AdamW (a loop that makes no sync by
  itself), watched with the loss watched (it goes through ``scaler.scale(loss)``) and the gradient norm computed by
  the agent (``watch(..., grad_norm=True)``), after a warm-up, under ``torch.cuda.set_sync_debug_mode("error")``:
  0 syncs per clean iteration, as the watched loop without them.
- ``spikes-syncs-bf16``: the same in bf16 without a scaler: ``watch(None, ..., grad_norm=True)`` and
  ``watch.loss(loss)`` every iteration.
- Both also check that the watch did watch them: its ``state`` holds the loss's level and each optimizer's
  gradient-norm level after the iterations (the contract's ``loss`` and ``grad_norm``).
- ``spikes-overhead-*``: the GradScaler loop bare, watched, and watched with the loss and the gradient norm
  (rotating blocks): the overhead ratio vs bare, per optimizer kind (fused, foreach).

On CPU there is no device to wait for: the agent reads CPU values directly (``float()``), which the CPU sync
counter counts, so the CPU rows give the counts as information only. Until the agent has issue 40's
``watch.loss`` / ``watch.grad_norm`` (``hasattr(watch, "grad_norm")``) every check here is a skip saying so.
"""

from __future__ import annotations

from collections.abc import Callable

from bench._loops import compare, rotate
from bench.gpu._amp import Amp
from bench.gpu._checks import check, guarded, verdict
from bench.gpu._syncs import count_syncs, raised_syncing, sync_method
from bench.overhead import Setup

__all__ = ["available", "run"]

_OPTIMIZERS = {"body": 0, "head": 1}


def available() -> bool:
    """Whether this tree's agent has issue 40's spike watch (``watch.loss``, ``watch.grad_norm``)."""
    from ampwatch.agent._watch import Watch

    return hasattr(Watch, "grad_norm") and hasattr(Watch, "loss")


def _spikes(amp: Amp, model: Callable, fused: bool, scaled: bool) -> Setup:
    """The loop bare (scaled: with a GradScaler), then watched with the loss and the gradient norm."""
    from ampwatch import agent

    setup = Setup("bare" if scaled else "bf16", model, fused, collector=(), device=amp.device)
    watch = agent.watch(setup.scaler, {name: setup.opts[i] for name, i in _OPTIMIZERS.items()}, model=setup.model,
                        collector=(), run="bench-gpu-spikes", grad_norm=True)
    setup.watch = watch
    if not scaled:  # nothing goes through scaler.scale(): the job hands its loss over
        forward = setup.loss

        def loss():
            value = forward()
            watch.loss(value)
            return value
        setup.loss = loss
    return setup


def _watched(amp: Amp, model: Callable, fused: bool, scaled: bool) -> Setup:
    return Setup("ampwatch_unasked" if scaled else "bf16_ampwatch", model, fused, collector=(), device=amp.device)


def _levels(setup: Setup) -> list[str]:
    """What the watch's state lacks of the levels it should hold by now."""
    state = setup.watch.snapshot()["state"]  # type: ignore[attr-defined] # a watched setup
    missing = [] if "loss" in state else ["state.loss"]
    missing += [f"state.optimizers.{name}.grad_norm" for name, counters in state["optimizers"].items()
                if "grad_norm" not in counters]
    errors = state["delivery"]["agent_errors"]
    return missing + ([f"{errors} agent errors"] if errors else [])


def _syncs(amp: Amp, quick: bool, scaled: bool) -> dict:
    from bench.gpu.overhead import transformer_builder

    name = f"spikes-syncs-{'scaled' if scaled else 'bf16'}"
    model = transformer_builder(amp, quick)
    setups = {"watched": _watched(amp, model, True, scaled), "spikes": _spikes(amp, model, True, scaled)}
    iterations = 3 if quick else 10
    try:
        for s in setups.values():
            s.iterate(3)  # warm-up: the first reads of values an iteration later, the windows' first values
        amp.sync()
        problems = []
        if amp.cuda:
            raised = raised_syncing(setups, iterations, amp.sync)
            if "watched" in raised:
                return check("spikes", name, "skip", f"the watched loop syncs without the spike watch: "
                                                     f"{raised['watched']}")
            if raised:
                problems.append(f"the loop with the loss and gradient norm watched synced: {raised['spikes']}")
            how = "under set_sync_debug_mode('error'): 0 syncs"
        else:
            counts = {v: count_syncs(False, lambda s=s: s.iterate(iterations)) for v, s in setups.items()}
            how = (f"{counts} ({sync_method(False)}; on CPU the agent reads values directly, no device to wait "
                   "for: not judged)")
        problems += _levels(setups["spikes"])
        detail = (f"{iterations} clean iterations of {model.__name__}, AdamW(fused)"
                  f"{' with a GradScaler' if scaled else ' in bf16, watch.loss()'}, grad_norm=True, {how}")
        if not amp.cuda and not problems:
            return check("spikes", name, "info", detail, syncs=counts)
        return verdict("spikes", name, problems, detail)
    finally:
        for s in setups.values():
            s.close()


def _overhead(amp: Amp, quick: bool) -> list[dict]:
    from bench.gpu.overhead import transformer_builder

    model = transformer_builder(amp, quick)
    rounds, block = (4, 3) if quick else (10, 6)
    primary, key = ("wall", "wall_ratio") if amp.cuda else ("cpu", "ratio")
    checks = []
    for fused in (True, False):
        setups = {"bare": Setup("bare", model, fused, collector=(), device=amp.device),
                  "watched": _watched(amp, model, fused, True), "spikes": _spikes(amp, model, fused, True)}
        try:
            for s in setups.values():
                s.iterate(3)
            amp.sync()
            cpu, wall = rotate(setups, rounds, block, settle=amp.sync)  # type: ignore[arg-type] # Setups are Loops
            v = compare(cpu, wall, "bare")
        finally:
            for s in setups.values():
                s.close()
        w, e = v["watched"], v["spikes"]
        label = f"{model.__name__}, AdamW({'fused' if fused else 'foreach'}), GradScaler"
        checks.append(check("spikes", f"spikes-overhead-{'fused' if fused else 'foreach'}", "info",
                            f"{label}: bare {v['bare']['wall_us_per_iter'] / 1000:.3f} ms/iter, watched "
                            f"{w[key]:.3f}, loss and gradient norm watched {e[key]:.3f} "
                            f"[{e[key + '_p25']:.3f}-{e[key + '_p75']:.3f}] ({primary} time vs bare)",
                            primary=primary, variants=v, rounds=rounds, block=block))
    return checks


def run(amp: Amp, quick: bool) -> list[dict]:
    """Run the spike-watch checks for this device (skips while the agent lacks the spike watch)."""
    if not available():
        return [check("spikes", "spikes", "skip", "this tree's agent has no watch.loss / watch.grad_norm (issue 40's "
                                                  "spike watch): nothing to measure until it lands")]
    checks = guarded("spikes", "spikes-syncs-scaled", lambda: [_syncs(amp, quick, scaled=True)])
    checks += guarded("spikes", "spikes-syncs-bf16", lambda: [_syncs(amp, quick, scaled=False)])
    checks += guarded("spikes", "spikes-overhead", lambda: _overhead(amp, quick))
    return checks
