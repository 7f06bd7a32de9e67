"""Truth: what the agent reports against bit-level ground truth, with a real GradScaler on the device.

Three optimizers (AdamW foreach, AdamW fused, SGD fused) own one layer each of a small model under float16
autocast. The scale starts at 2**32, so the first iterations overflow for real and back off; growth every
3 clean iterations pushes it back into overflow now and then; infs and NaNs are written into chosen
gradients at known iterations, one input is pushed past 65504, and one ``update(new_scale)`` sets the scale
by hand. The same plan runs three times: asking ``watch.stepped()`` after every step, never asking (fused
answers then arrive asynchronously), and with a ``torch.compile``d model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil

import torch

from bench.gpu._amp import Amp, ThreePart, make_optimizers, params_of
from bench.gpu._checks import check, guarded, verdict
from bench.gpu._truth import Plan, Run, compare, drain_events, expected, run_plan

__all__ = ["MAIN", "NAMES", "run"]

INF, NAN = float("inf"), float("nan")

MAIN = Plan(iterations=40, init_scale=2.0 ** 32, growth_interval=3,
            grad_faults={14: [("a.weight", INF, 1)],                      # adamw_foreach alone
                         17: [("c.bias", NAN, 1)],                        # sgd_fused alone
                         20: [("b.weight", INF, 1), ("c.weight", NAN, 1)],  # two in one iteration: one backoff
                         23: [("b.bias", INF, 1)], 24: [("b.bias", INF, 1)], 25: [("b.bias", INF, 1)]},
            overflow_at=(28,), manual={31: 1234.5})
"""The truth plan; the first iterations' overflows come from the scale itself."""

NAMES = Plan(iterations=8, init_scale=2.0 ** 8,
             grad_faults={2: [("a.weight", INF, 2)], 4: [("b.weight", INF, 1), ("b.bias", NAN, 1)],
                          6: [("c.weight", NAN, 3)]})
"""One skip per optimizer, each the first of its streak (always inspected), at a scale that never overflows."""


@dataclasses.dataclass
class Watched:
    """One watched run of a plan: ground truth, the agent's counters before and after close(), its events."""

    run: Run
    open_state: dict
    state: dict
    events: list[dict]
    notes: list[str]
    owned: dict[str, list[str]]
    """optimizer name -> names of its parameters, in its order."""


def _watched(amp: Amp, plan: Plan, *, ask: bool, forward_with=None) -> Watched:
    """Run ``plan`` on a fresh model and the ``mixed`` optimizers with the agent attached."""
    from ampwatch import agent

    torch.manual_seed(0)
    model = ThreePart().to(amp.device)
    optimizers, notes = make_optimizers(model, "mixed", amp.device)
    scaler = amp.scaler(init_scale=plan.init_scale, growth_interval=plan.growth_interval)
    forward = forward_with(model) if forward_with is not None else model
    watch = agent.watch(scaler, optimizers, model=model, collector=(), run="bench-gpu-truth")
    try:
        run = run_plan(amp, model, forward, optimizers, scaler, plan, watch=watch, ask=ask)
        open_state = watch.snapshot()["state"]
    finally:
        watch.close()  # resolves the answers still on their way
    names = {id(p): n for n, p in model.named_parameters()}
    owned = {n: [names[id(p)] for p in params_of(opt)] for n, opt in optimizers.items()}
    return Watched(run, open_state, watch.snapshot()["state"], drain_events(watch), notes, owned)


def _counts(run: Run, plan: Plan) -> str:
    exp = expected(run, plan)
    per = ", ".join(f"{n} {c['steps']}/{c['skipped']}" for n, c in exp["optimizers"].items())
    return (f"{plan.iterations} iterations, steps/skips {per}; {exp['backoffs']} backoffs, {exp['growths']} "
            f"growths, {exp['manual_sets']} manual set, final scale {exp['final_scale']:g}: all exact")


def _plan_check(amp: Amp, name: str, *, ask: bool, forward_with=None) -> dict:
    w = _watched(amp, MAIN, ask=ask, forward_with=forward_with)
    run, state = w.run, w.state
    problems = compare(run, MAIN, state, w.events)
    if ask:  # every answer arrived when asked, so the open streaks must be right before close()
        for n, want in expected(run, MAIN)["optimizers"].items():
            got = w.open_state["optimizers"][n]["consecutive_skipped"]
            if got != want["consecutive_skipped"]:
                problems.append(f"{n}.consecutive_skipped before close: agent {got} != truth "
                                f"{want['consecutive_skipped']}")
    return verdict("truth", name, problems, _counts(run, MAIN) + "".join(f" ({n})" for n in w.notes),
                   optimizers=list(run.truth[0]), expected={k: v for k, v in expected(run, MAIN).items()
                                                            if k != "skips"}, agent=state)


def _compile_backend(amp: Amp, quick: bool) -> tuple[str | None, str]:
    """Return (backend, why) for the compiled run; backend None means it cannot run here."""
    if amp.cuda:
        if importlib.util.find_spec("triton") is None:
            return None, "triton is not installed (inductor's CUDA code generator needs it)"
        return "inductor", "inductor"
    if quick:
        return "aot_eager", "aot_eager (--quick on CPU leaves out inductor's C++ build, 20+ s)"
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++")):
        return None, "no C++ compiler on PATH (inductor on CPU needs one: install g++, or use --quick)"
    return "inductor", "inductor (C++ on CPU)"


def _compiled_check(amp: Amp, quick: bool) -> dict:
    backend, why = _compile_backend(amp, quick)
    if backend is None:
        return check("truth", "compiled", "skip", f"torch.compile cannot run here: {why}")
    try:  # compile once before the agent is attached: a failure here is the toolchain's, not ampwatch's
        probe = ThreePart().to(amp.device)
        compiled = torch.compile(probe, backend=backend)
        with amp.autocast():
            compiled(torch.randn(64, 16, device=amp.device)).float().sum().backward()
    except Exception as error:  # noqa: BLE001
        return check("truth", "compiled", "skip", f"torch.compile({backend}) failed before the agent was "
                     f"attached: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
    result = _plan_check(amp, "compiled", ask=False, forward_with=lambda m: torch.compile(m, backend=backend))
    result["detail"] = f"backend {why}; " + result["detail"]
    result["backend"] = backend
    return result


def _names_check(amp: Amp, ask: bool) -> dict:
    w = _watched(amp, NAMES, ask=ask)
    problems = compare(w.run, NAMES, w.state, w.events)
    skips = [e for e in w.events if e["kind"] == "skip"]
    inspected = [e for e in skips if e.get("inspected")]
    for e in skips:
        if not e.get("inspected"):
            if ask:
                problems.append(f"skip of {e['optimizer']} at iteration {e['iteration']} was not inspected")
            continue
        counts = w.run.nonfinite.get(e["iteration"], {})
        want = [{"name": p, "inf": counts[p][0], "nan": counts[p][1]} for p in w.owned[e["optimizer"]]
                if counts.get(p, (0, 0)) != (0, 0)]
        if e["params"] != want or e["params_total"] != len(want):
            problems.append(f"skip of {e['optimizer']} at {e['iteration']}: agent named {e['params']} "
                            f"(total {e['params_total']}), truth {want}")
    name = "parameter-names" if ask else "parameter-names-unasked"
    detail = (f"{len(inspected)} of {len(skips)} skip events inspected, each naming exactly the parameters "
              f"whose gradients held inf/NaN, with counts")
    if not ask and not problems:  # deferred fused answers may land after their iteration: not judged
        return check("truth", name, "info", detail + " (never asking: fused outcomes that land after their "
                     "iteration are not inspected, by design)", inspected=len(inspected), skips=len(skips))
    return verdict("truth", name, problems, detail, inspected=len(inspected), skips=len(skips))


POISON_AT = 1


def _clip_whole_model(i: int, model, scaler, optimizers) -> None:
    """The unsafe recipe (docs/gradscaler.md 13): NaN in one optimizer's gradients, unscale both, clip all at once."""
    if i == POISON_AT:
        model.b.bias.grad.view(-1)[0] = NAN
    for opt in optimizers.values():
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def _poisoned_check(amp: Amp, kind: str, ask: bool) -> dict:
    """Two optimizers, ``unscale_`` both, one ``clip_grad_norm_`` over the whole model: the NaN of the
    skipping optimizer reaches the other's gradients after its check, and it steps into NaN weights."""
    from ampwatch import agent

    torch.manual_seed(0)
    model = ThreePart().to(amp.device)
    flavour = {"fused": True} if kind == "fused" else {"foreach": True}
    optimizers = {"first": torch.optim.AdamW(model.a.parameters(), lr=1e-3, **flavour),
                  "rest": torch.optim.SGD(list(model.b.parameters()) + list(model.c.parameters()), lr=1e-2,
                                          **flavour)}
    scaler = amp.scaler(init_scale=2.0 ** 8)
    plan = Plan(iterations=4, init_scale=2.0 ** 8)
    nan_counts: dict[str, torch.Tensor] = {}

    def poison(i, *_):
        _clip_whole_model(i, model, scaler, optimizers)
        if i == POISON_AT:
            nan_counts.update({n: torch.stack([p.grad.isinf().sum(), p.grad.isnan().sum()])
                               for n, p in model.a.named_parameters(prefix="a")})

    with agent.watch(scaler, optimizers, model=model, collector=(), run="bench-gpu-poisoned") as watch:
        run = run_plan(amp, model, model, optimizers, scaler, plan, watch=watch, ask=ask, after_backward=poison)
    state, events = watch.snapshot()["state"], drain_events(watch)
    first_finite = all(bool(torch.isfinite(p).all()) for p in model.a.parameters())
    problems = []
    if not (run.truth[POISON_AT]["first"] and not run.truth[POISON_AT]["rest"] and not first_finite):
        problems.append(f"ground truth: expected 'first' to step into NaN and 'rest' to skip at iteration "
                        f"{POISON_AT}, saw {run.truth[POISON_AT]}, first finite: {first_finite}")
    want = [{"name": n, "inf": int(c[0]), "nan": int(c[1])} for n, c in nan_counts.items() if c.sum()]
    poisoned = [e for e in events if e["kind"] == "poisoned_step"]
    got = [(e["optimizer"], e["iteration"], e["reason"], e["params"]) for e in poisoned]
    if got != [("first", POISON_AT, "nonfinite_grad", want)]:
        problems.append(f"poisoned_step events: agent {got}, truth {[('first', POISON_AT, 'nonfinite_grad', want)]}")
    counters = {n: c["poisoned_steps"] for n, c in state["optimizers"].items()}
    if counters != {"first": 1, "rest": 0}:
        problems.append(f"poisoned_steps counters: agent {counters}, truth {{'first': 1, 'rest': 0}}")
    name = f"poisoned-step-{kind}" + ("" if ask else "-unasked")
    detail = (f"{kind} AdamW + SGD, unscale_ both, whole-model clip_grad_norm_: the poisoned step of 'first' "
              f"at iteration {POISON_AT} reported once, with its parameters' NaN counts")
    if not ask and kind == "fused" and amp.cuda and problems and not problems[0].startswith("ground truth"):
        # Deferred answers are inspected only when they land within their iteration: not judged.
        return check("truth", name, "info", "not caught when never asking (fused outcomes landed after their "
                     "iteration): " + "; ".join(problems), problems=problems)
    return verdict("truth", name, problems, detail)


def _fused_sgd_momentum(amp: Amp) -> dict:
    """A torch fact, not an ampwatch one: fused SGD with momentum after the scaler skipped its first step.

    Its first call creates the momentum buffers with ``empty_like`` and the skipping kernel leaves them
    uninitialised; foreach SGD, whose step the scaler does not call, creates none. Compared on weights after
    two real steps (uninitialised memory that happens to hold zeros would hide it, hence both facts).
    """
    weights, buffers = {}, {}
    for flavour in ("fused", "foreach"):
        torch.manual_seed(0)
        layer = torch.nn.Linear(16, 4).to(amp.device)
        opt = torch.optim.SGD(layer.parameters(), lr=1e-2, momentum=0.9, **{flavour: True})
        scaler = amp.scaler(init_scale=2.0 ** 8)
        x = torch.randn(8, 16).to(amp.device)
        for i in range(3):
            opt.zero_grad()
            with amp.autocast():
                loss = layer(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            if i == 0:
                layer.weight.grad.view(-1)[0] = INF
            scaler.step(opt)
            scaler.update()
            if i == 0:
                buffers[flavour] = sum("momentum_buffer" in opt.state[p] for p in layer.parameters())
        weights[flavour] = [p.detach().clone() for p in layer.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(weights["fused"], weights["foreach"], strict=True))
    diff = max(float((a - b).abs().max()) for a, b in zip(weights["fused"], weights["foreach"], strict=True))
    return check("truth", "torch-fused-sgd-momentum", "info",
                 f"torch itself, not ampwatch: after a skipped first step, SGD(momentum=0.9, fused=True) holds "
                 f"{buffers['fused']} momentum buffers (foreach: {buffers['foreach']}); after two real steps its "
                 f"weights {'equal' if same else 'differ from'} foreach SGD's (max |diff| {diff:.3g})",
                 fused_buffers=buffers["fused"], weights_equal=same, max_abs_diff=diff)


CHECKS = (
    ("ask-every-step", lambda amp, quick: _plan_check(amp, "ask-every-step", ask=True)),
    ("never-ask", lambda amp, quick: _plan_check(amp, "never-ask", ask=False)),
    ("compiled", _compiled_check),
    ("parameter-names", lambda amp, quick: _names_check(amp, ask=True)),
    ("parameter-names-unasked", lambda amp, quick: _names_check(amp, ask=False)),
    ("poisoned-step-foreach", lambda amp, quick: _poisoned_check(amp, "foreach", ask=True)),
    ("poisoned-step-fused", lambda amp, quick: _poisoned_check(amp, "fused", ask=True)),
    ("poisoned-step-fused-unasked", lambda amp, quick: _poisoned_check(amp, "fused", ask=False)),
    ("torch-fused-sgd-momentum", lambda amp, quick: _fused_sgd_momentum(amp)),
)


def run(amp: Amp, quick: bool) -> list[dict]:
    """Run every truth check (one that crashes becomes an error check; the others still run)."""
    return [c for name, fn in CHECKS for c in guarded("truth", name, lambda fn=fn: [fn(amp, quick)])]
