"""``began`` on the device: the backward order and the forward probes name where an inf began, and what they cost.

- ``began-backward``: ``ampwatch_support.began_job``'s Tower (bf16 autocast, a GradScaler of the device type) with
  its gradient made inf at ``p3`` in backward: the skip must name ``p3.weight`` (module ``p3``, ``Linear``), the
  first gradient backward made non-finite; weights bit-identical to the unwatched twin.
- ``began-forward``: its ``spike`` module returns inf at two iterations: the first skip arms the probes, the second
  names ``spike`` (``Exp``); no forward hook before or after; bit-identical to the twin.
- ``began-armed-syncs``: the transformer loop (bf16, fused AdamW, ``watch(None)``: no sync of its own) watched
  with the probes armed for every iteration runs under
  ``torch.cuda.set_sync_debug_mode("error")`` (CUDA) or counts as many syncs as the watched loop (CPU): the probes
  never wait for the device.
- ``began-probes-overhead-*``: that loop watched vs watched with the probes armed, rotating blocks: what one
  iteration of a window after a forward start costs (a healthy run never arms them).
"""

from __future__ import annotations

from bench._loops import compare, rotate
from bench.gpu._amp import Amp
from bench.gpu._checks import check, guarded, verdict
from bench.gpu._syncs import count_syncs, raised_syncing, sync_method
from bench.overhead import Setup

__all__ = ["run"]

BACKWARD = {"loss_finite": True, "stage": "backward", "param": "p3.weight", "module": "p3", "module_type": "Linear"}
ARMED = {"loss_finite": False, "stage": "forward", "probe": "armed"}
FOUND = {"loss_finite": False, "stage": "forward", "probe": "found", "module": "spike", "module_type": "Exp"}


def _watch(scaler, opt, model):
    from ampwatch import agent

    return agent.watch(scaler, opt, model=model, collector=(), run="bench-gpu-began")


def _truth(amp: Amp, name: str, expected: list, **job) -> dict:
    from ampwatch_support.began_job import run as train

    watched = train(_watch, scaled=True, device=str(amp.device), **job)
    twin = train(None, scaled=True, device=str(amp.device), **job)
    problems = []
    if watched["events"] != expected:
        problems.append(f"events {watched['events']}, expected {expected}")
    if watched["digests"] != twin["digests"]:
        problems.append("the weights differ from the unwatched twin's")
    if watched["errors"]:
        problems.append(f"{watched['errors']} agent errors")
    if watched["hooks"][0] != [0, 0] or watched["hooks"][-1] != [0, 0]:
        problems.append(f"forward hooks before/after: {watched['hooks'][0]} / {watched['hooks'][-1]}")
    return verdict("began", name, problems, f"{[e[2] for e in watched['events']]}; bit-identical to the twin",
                   events=watched["events"])


def _armed(setup: Setup) -> Setup:
    probes = setup.watch._recorder.began.probes  # type: ignore[attr-defined] # a watched variant
    probes.iterations = 1 << 30
    probes.arm(0)
    return setup


def _syncs(amp: Amp, quick: bool) -> dict:
    from bench.gpu.overhead import transformer_builder

    # bf16 with fused AdamW and no scaler: a loop that makes no sync by itself (a GradScaler's non-fused step does).
    model = transformer_builder(amp, quick)
    setups = {"watched": Setup("bf16_ampwatch", model, True, collector=(), device=amp.device)}
    setups["armed"] = _armed(Setup("bf16_ampwatch", model, True, collector=(), device=amp.device))
    iterations = 3 if quick else 10
    try:
        for s in setups.values():
            s.iterate(2)
        amp.sync()
        problems = []
        if amp.cuda:
            raised = raised_syncing(setups, iterations, amp.sync)
            if "watched" in raised:
                return check("began", "began-armed-syncs", "skip",
                             f"the watched bf16 loop syncs without the probes: {raised['watched']}")
            problems += [f"the armed loop synced: {raised['armed']}"] if raised else []
            how = "under set_sync_debug_mode('error')"
        else:
            counts = {v: count_syncs(False, lambda s=s: s.iterate(iterations)) for v, s in setups.items()}
            if counts["watched"] != counts["armed"]:
                problems.append(f"syncs {counts}")
            how = f"{counts} ({sync_method(False)})"
        errors = setups["armed"].watch.snapshot()["state"]["delivery"]["agent_errors"]  # type: ignore[attr-defined]
        if errors:
            problems.append(f"{errors} agent errors")
        return verdict("began", "began-armed-syncs", problems,
                       f"{iterations} iterations of {model.__name__} with the forward probes armed {how}: no sync")
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
        setups = {"watched": Setup("ampwatch_unasked", model, fused, collector=(), device=amp.device),
                  "armed": _armed(Setup("ampwatch_unasked", model, fused, collector=(), device=amp.device))}
        try:
            for s in setups.values():
                s.iterate(3)
            amp.sync()
            cpu, wall = rotate(setups, rounds, block, settle=amp.sync)  # type: ignore[arg-type] # Setups are Loops
            v = compare(cpu, wall, "watched")
        finally:
            for s in setups.values():
                s.close()
        e = v["armed"]
        label = f"{model.__name__}, AdamW({'fused' if fused else 'foreach'})"
        checks.append(check("began", f"began-probes-overhead-{'fused' if fused else 'foreach'}", "info",
                            f"{label}: watched {v['watched']['wall_us_per_iter'] / 1000:.3f} ms/iter, probes armed "
                            f"{e[key]:.3f} [{e[key + '_p25']:.3f}-{e[key + '_p75']:.3f}] ({primary} time vs watched)",
                            primary=primary, variants=v, rounds=rounds, block=block))
    return checks


def run(amp: Amp, quick: bool) -> list[dict]:
    """Run the began checks for this device."""
    checks = guarded("began", "began-backward", lambda: [_truth(
        amp, "began-backward", [[1, "skip", BACKWARD]], iterations=3, backward_at=frozenset({1}))])
    checks += guarded("began", "began-forward", lambda: [_truth(
        amp, "began-forward", [[2, "skip", ARMED], [4, "skip", FOUND]], iterations=6, forward_at=frozenset({2, 4}))])
    checks += guarded("began", "began-armed-syncs", lambda: [_syncs(amp, quick)])
    checks += guarded("began", "began-probes-overhead", lambda: _overhead(amp, quick))
    return checks
