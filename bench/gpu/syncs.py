"""Zero syncs: clean iterations cost the same host-device synchronisation with the agent as without.

With fused optimizers the bare CUDA loop makes no sync at all, so the watched loop runs under
``torch.cuda.set_sync_debug_mode("error")`` and must not raise; the agent swallows its own errors (it must
never break training), so its ``agent_errors`` counter must stay 0 as well. With foreach optimizers the
scaler itself syncs once per optimizer step: the ``"warn"`` warnings are counted bare and watched. On CPU
the same loops count ``aten._local_scalar_dense`` calls. :func:`trace` (CUDA, run last) counts every
stream, event and device synchronisation through torch's GPU trace hooks, which also see event waits.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu._amp import Amp, CleanLoop
from bench.gpu._checks import check, guarded, verdict
from bench.gpu._syncs import SyncTrace, count_syncs, sync_debug, sync_method

__all__ = ["run", "trace"]

WARMUP = 3


def _watched_ok(state: dict[str, Any], kind_iterations: int) -> list[str]:
    """The agent saw every step and failed nowhere."""
    problems = []
    if state["delivery"]["agent_errors"]:
        problems.append(f"the agent counted {state['delivery']['agent_errors']} internal errors (a sync it made "
                        "under debug mode 'error' raises inside it and is swallowed there)")
    for name, c in state["optimizers"].items():
        if (c["steps"], c["skipped"]) != (kind_iterations, 0):
            problems.append(f"{name}: agent saw {c['steps']} steps / {c['skipped']} skips of {kind_iterations} "
                            "clean iterations")
    return problems


def _error_mode(amp: Amp, iterations: int) -> dict:
    """CUDA, fused optimizers: the bare loop makes no sync; the watched one must not either."""
    raised = {}
    states = {}
    for watched in (False, True):
        loop = CleanLoop(amp, "fused", watched)
        loop.run(WARMUP)
        amp.sync()
        try:
            with sync_debug("error"):
                loop.run(iterations)
        except RuntimeError as error:
            raised[watched] = str(error).splitlines()[0]
        amp.sync()
        states[watched] = loop.close()
    if False in raised:  # the premise is gone: this torch's fused loop syncs by itself; compare counts instead
        return _counted(amp, "fused", iterations,
                        note=f"the bare fused loop itself raised under debug mode 'error' ({raised[False]}), "
                             "so counts are compared instead")
    problems = [f"the watched loop raised under debug mode 'error': {raised[True]}"] if True in raised else []
    problems += _watched_ok(states[True], WARMUP + iterations)
    try:  # else a debug mode that catches nothing would pass
        with sync_debug("error"):
            torch.zeros((), device=amp.device).item()
        problems.append("debug mode 'error' did not raise on a deliberate .item(): this check proves nothing here")
    except RuntimeError:
        pass
    return verdict("syncs", "fused-error-mode", problems,
                   f"{iterations} clean iterations, 3 fused optimizers, watched, under "
                   "torch.cuda.set_sync_debug_mode('error'): no sync, no agent error")


def _counted(amp: Amp, kind: str, iterations: int, note: str = "") -> dict:
    """Count syncs over the same clean iterations bare and watched: they must be equal."""
    counts, state = {}, None
    for watched in (False, True):
        loop = CleanLoop(amp, kind, watched)
        loop.run(WARMUP)
        amp.sync()
        counts[watched] = count_syncs(amp.cuda, lambda loop=loop: loop.run(iterations))
        amp.sync()
        state = loop.close() or state
    problems = []
    if kind == "foreach" and not counts[False]:  # else a counter that sees nothing would pass
        problems.append("the counter saw no sync in the bare foreach loop, where the scaler reads found_inf once per "
                        "step: counting does not work here")
    if counts[True] != counts[False]:
        problems.append(f"{counts[True]} syncs watched vs {counts[False]} bare over {iterations} clean iterations")
    problems += _watched_ok(state, WARMUP + iterations)
    detail = (f"{iterations} clean iterations, 3 {kind} optimizers: {counts[False]} syncs bare, {counts[True]} "
              f"watched ({sync_method(amp.cuda)})" + (f"; {note}" if note else ""))
    return verdict("syncs", f"{kind}-counted", problems, detail, bare=counts[False], watched=counts[True],
                   method=sync_method(amp.cuda))


def run(amp: Amp, quick: bool) -> list[dict]:
    """Run the zero-sync checks for this device."""
    iterations = 10 if quick else 50
    checks = guarded("syncs", "fused-error-mode", lambda: [_error_mode(amp, iterations)]) if amp.cuda else []
    for kind in ("fused", "foreach"):
        checks += guarded("syncs", f"{kind}-counted", lambda kind=kind: [_counted(amp, kind, iterations)])
    return checks


def trace(amp: Amp, quick: bool) -> list[dict]:
    """CUDA only, last: count every stream/event/device synchronisation bare vs watched (GPU trace hooks)."""
    if not amp.cuda:
        return [check("sync-trace", "all-synchronisations", "skip", "CUDA only (torch's GPU trace hooks)")]
    missing = SyncTrace.available()
    if missing:
        return [check("sync-trace", "all-synchronisations", "skip", missing)]
    tracer = SyncTrace.get()
    iterations = 10 if quick else 50
    checks = []
    for kind in ("fused", "foreach"):
        seen = {}
        for watched in (False, True):
            loop = CleanLoop(amp, kind, watched)
            loop.run(WARMUP)
            amp.sync()
            with tracer.counting() as counts:
                loop.run(iterations)
            seen[watched] = dict(counts)
            amp.sync()
            loop.close()
        problems = [] if seen[True] == seen[False] else [f"watched {seen[True]} != bare {seen[False]}"]
        if kind == "foreach" and not seen[False].get("stream"):  # the scaler's .item() per step is one
            problems.append("the trace saw no stream synchronisation in the bare foreach loop: the hooks do not work")
        checks.append(verdict("sync-trace", f"{kind}-all-synchronisations", problems,
                              f"{iterations} clean iterations, 3 {kind} optimizers, stream/event/device "
                              f"synchronisations: bare {seen[False] or 'none'}, watched {seen[True] or 'none'}",
                              bare=seen[False], watched=seen[True]))
    loop = CleanLoop(amp, "fused", True, ask=True)
    loop.run(WARMUP)
    amp.sync()
    with tracer.counting() as counts:
        loop.run(iterations)
    asked = dict(counts)
    loop.close()
    checks.append(check("sync-trace", "fused-asking-stepped", "info",
                        f"asking watch.stepped() after each of 3 fused steps, {iterations} iterations: "
                        f"{asked or 'no'} synchronisations (the documented cost of asking: a wait for the answer "
                        "when it has not landed)", counts=asked))
    return checks
