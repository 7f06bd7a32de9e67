"""Drive a planned AMP run, record bit-level ground truth, derive what the agent must report, compare.

Ground truth never synchronises inside the loop: parameter bits are compared on the device and the
answers are read once at the end, so the agent's asynchronous path (fused optimizers on CUDA) is tested
as it runs in real training. The expected scale follows GradScaler's documented rule (docs:
backoff after any optimizer found inf/NaN, growth after ``growth_interval`` clean iterations, a manual
``update(new_scale)`` leaves the growth tracker alone) and is itself checked against ``get_scale()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampwatch.contract.protocol import is_rung
from bench.gpu._amp import Amp, inject, overflowing_input, step_all

__all__ = ["Plan", "Run", "compare", "drain_events", "expected", "run_plan"]


@dataclasses.dataclass
class Plan:
    """What happens at which iteration of a run."""

    iterations: int
    grad_faults: dict[int, list[tuple[str, float, int]]] = dataclasses.field(default_factory=dict)
    """iteration -> [(parameter name, value, how many leading elements)] written into gradients after backward."""
    overflow_at: tuple[int, ...] = ()
    """Iterations whose input is scaled past float16's 65504 (inf in the autocast forward)."""
    manual: dict[int, float] = dataclasses.field(default_factory=dict)
    """iteration -> ``scaler.update(new_scale)`` value."""
    init_scale: float = 2.0 ** 16
    growth_interval: int = 2000


@dataclasses.dataclass
class Run:
    """What one run observed: ground truth per iteration and what the agent answered."""

    truth: list[dict[str, bool]]
    """Per iteration: optimizer name -> its parameters' bits changed (it stepped)."""
    answers: list[dict[str, Any]]
    """Per iteration: optimizer name -> ``watch.stepped()`` right after its step (empty when not asked)."""
    nonfinite: dict[int, dict[str, tuple[int, int]]]
    """Per fault iteration: parameter name -> (inf, nan) counts of its gradient after the faults."""
    final_scale: float


def run_plan(amp: Amp, model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
             optimizers: dict[str, torch.optim.Optimizer], scaler: torch.amp.GradScaler, plan: Plan,
             watch: Any = None, ask: bool = False, seed: int = 0,
             after_backward: Callable[[int], None] = lambda i: None) -> Run:
    """Run ``plan``: zero_grad, autocast forward, scale, backward, faults, step each, update."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(64, 16, generator=gen).to(amp.device) for _ in range(plan.iterations)]
    names = dict(model.named_parameters())
    flags, answers, counts = [], [], {}
    for i, x in enumerate(xs):
        for opt in optimizers.values():
            opt.zero_grad()
        with amp.autocast():
            loss = forward(overflowing_input(x) if i in plan.overflow_at else x).float().pow(2).mean()
        scaler.scale(loss).backward()
        for target, value, count in plan.grad_faults.get(i, ()):
            inject(model, target, value, count)
        after_backward(i)
        if i in plan.grad_faults:
            counts[i] = {t: torch.stack([p.grad.isinf().sum(), p.grad.isnan().sum()])
                         for t, p in names.items() if p.grad is not None}
        asked: dict[str, Any] = {}
        if ask:
            flags.append(step_all(scaler, optimizers,
                                  after_each=lambda n, asked=asked: asked.__setitem__(n, watch.stepped(optimizers[n]))))
        else:
            flags.append(step_all(scaler, optimizers))
        scaler.update(plan.manual[i]) if i in plan.manual else scaler.update()
        answers.append(asked)
    order = list(optimizers)
    rows = torch.stack([torch.stack([f[n] for n in order]) for f in flags]).tolist()  # the one sync
    truth = [dict(zip(order, row, strict=True)) for row in rows]
    nonfinite = {i: {t: tuple(v.tolist()) for t, v in c.items()} for i, c in counts.items()}
    return Run(truth=truth, answers=answers, nonfinite=nonfinite, final_scale=float(scaler.get_scale()))


def _runs(flags: list[bool]) -> list[int]:
    """Lengths of the runs of False (consecutive skips) in ``flags``."""
    runs, current = [], 0
    for stepped in flags:
        if stepped:
            if current:
                runs.append(current)
            current = 0
        else:
            current += 1
    return runs + ([current] if current else [])


def expected(run: Run, plan: Plan, growth_factor: float = 2.0, backoff_factor: float = 0.5) -> dict[str, Any]:
    """Return the counters, skip list and scale transitions the agent must report for ``run``."""
    names = list(run.truth[0])
    optimizers = {}
    for n in names:
        flags = [row[n] for row in run.truth]
        runs = _runs(flags)
        optimizers[n] = {"steps": sum(flags), "skipped": len(flags) - sum(flags),
                         "longest_streak": max(runs, default=0), "streaks": len(runs),
                         "consecutive_skipped": 0 if flags[-1] else runs[-1]}
    scale, tracker, transitions = plan.init_scale, 0, []
    for i, row in enumerate(run.truth):
        before = scale
        if i in plan.manual:
            scale, cause = float(plan.manual[i]), "manual"
        elif not all(row.values()):
            scale, tracker, cause = scale * backoff_factor, 0, "backoff"
        else:
            tracker += 1
            cause = "growth"
            if tracker == plan.growth_interval:
                scale, tracker = scale * growth_factor, 0
        if scale != before:
            transitions.append((i, cause, before, scale))
    skips = []
    for n in names:  # a streak is sent as its rungs (1st, 2nd, 4th, ... skip) and its end
        position = 0
        for i, row in enumerate(run.truth):
            position = 0 if row[n] else position + 1
            if position and is_rung(position):
                skips.append((n, i))
    return {"optimizers": optimizers, "transitions": fold_backoffs(transitions), "final_scale": scale,
            "skips": sorted(skips),
            "backoffs": sum(t[1] == "backoff" for t in transitions),
            "growths": sum(t[1] == "growth" for t in transitions),
            "manual_sets": sum(t[1] == "manual" for t in transitions)}


def fold_backoffs(transitions: list[tuple]) -> list[tuple]:
    """Return ``(iteration, cause, before, after, count)`` as the agent sends them: backoffs in consecutive
    iterations folded at the run's 1st, 2nd, 4th, ... backoff, and the rest when the run ends."""
    out: list[tuple] = []
    pending: list[tuple] = []  # backoffs of the current run not yet in an event
    length, last = 0, None

    def fold() -> None:
        if pending:
            out.append((pending[-1][0], "backoff", pending[0][2], pending[-1][3], len(pending)))
            pending.clear()
    for t in transitions:
        if t[1] != "backoff" or last is None or t[0] != last + 1:
            fold()  # a run of backoffs ends at any other transition or iteration
            length = 0
        if t[1] != "backoff":
            out.append((*t, 1))
            last = None
            continue
        length, last = length + 1, t[0]
        pending.append(t)
        if is_rung(length):
            fold()
    fold()
    return out


def drain_events(watch: Any) -> list[dict[str, Any]]:
    """Take the events the agent recorded.

    No public API returns them (a user gets them through the collector); with ``collector=()`` no
    sender thread runs, so the event buffer holds every event and this private read is the only way.
    """
    return watch._recorder.events.drain()


def compare(run: Run, plan: Plan, state: dict[str, Any], events: list[dict[str, Any]]) -> list[str]:
    """List every way the agent's ``state`` and ``events`` differ from the ground truth of ``run``.

    Open streaks (``consecutive_skipped``) are left out: ``close()`` ends them, and before it fused
    answers may still be on their way.
    """
    exp = expected(run, plan)
    problems = []
    if run.final_scale != exp["final_scale"]:
        problems.append(f"ground truth: the scaler's get_scale() {run.final_scale} != GradScaler's rule "
                        f"applied to the observed skips {exp['final_scale']}")
    keys = ("steps", "skipped", "longest_streak", "streaks")
    for name, want in exp["optimizers"].items():
        got = state["optimizers"].get(name)
        if got is None:
            problems.append(f"{name}: missing from the agent's counters")
            continue
        problems += [f"{name}.{k}: agent {got[k]} != truth {want[k]}" for k in keys if got[k] != want[k]]
        if got["poisoned_steps"]:
            problems.append(f"{name}.poisoned_steps: agent {got['poisoned_steps']} != truth 0")
    for key in ("backoffs", "growths", "manual_sets"):
        if state[key] != exp[key]:
            problems.append(f"{key}: agent {state[key]} != truth {exp[key]}")
    if state["loss_scale"] != exp["final_scale"]:
        problems.append(f"loss_scale: agent {state['loss_scale']} != truth {exp['final_scale']}")
    if state["iteration"] != plan.iterations:
        problems.append(f"iteration: agent {state['iteration']} != truth {plan.iterations}")
    skips = sorted((e["optimizer"], e["iteration"]) for e in events if e["kind"] == "skip")
    if skips != exp["skips"]:
        problems.append(f"skip events (optimizer, iteration): agent {_diff(skips, exp['skips'])}")
    changes = [(e["iteration"], e["cause"], e["before"], e["after"], e.get("count", 1)) for e in events
               if e["kind"] == "scale_change"]
    if changes != exp["transitions"]:
        problems.append("scale_change events (iteration, cause, before, after, count): "
                        f"agent {_diff(changes, exp['transitions'])}")
    wrong = [(i, n, a, run.truth[i][n]) for i, row in enumerate(run.answers) for n, a in row.items()
             if a is not run.truth[i][n]]
    if wrong:
        problems.append(f"stepped() wrong {len(wrong)} times, first (iteration, optimizer, answer, truth): {wrong[:3]}")
    return problems


def _diff(got: list, want: list) -> str:
    extra = [x for x in got if x not in want]
    missing = [x for x in want if x not in got]
    return f"has {len(got)}, truth {len(want)}; extra {extra[:4]}, missing {missing[:4]}"
