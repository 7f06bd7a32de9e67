"""``calibration`` on a skip: the scaler settling, never evidence of a fault (docs/agent.md#calibration).

A real GradScaler("cpu") under bfloat16 autocast: a huge ``init_scale`` overflows the scaled gradients until
the scale has backed off far enough; a small ``growth_interval`` grows it within a few clean steps.
"""

from __future__ import annotations

import torch

from ampwatch.contract.protocol import is_rung


def _loop(watching, scaler: torch.amp.GradScaler, faults: set[int], iterations: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    w = watching(scaler, opt, model=model)
    outcomes = []
    for iteration in range(iterations):
        x = torch.randn(4, 8) * 100
        if iteration in faults:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        outcomes.append(w.stepped(opt))
    skips = {e["iteration"]: e.get("calibration", False) for e in w._recorder.events.drain() if e["kind"] == "skip"}
    return outcomes, skips


def test_a_fresh_scalers_skips_until_its_first_step_are_calibration_and_a_later_fault_is_not(watching):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, backoff_factor=2.0 ** -8)
    outcomes, skips = _loop(watching, scaler, faults={8}, iterations=10)
    settled = outcomes.index(True)
    assert settled >= 2 and all(outcomes[settled:8])  # ground truth: it overflowed, then settled
    assert skips == {**{i: True for i in range(settled) if is_rung(i + 1)}, 8: False}


def test_the_first_skip_after_a_growth_is_calibration_and_one_with_no_growth_since_the_last_skip_is_not(watching):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    # Clean at 0-2: the scale grows at 2. Faults at 3 (the first skip after it), 4 (right after a skip: no
    # growth since), 6 (one clean step since: none), 10 (clean 7, 8, 9: it grew at 9).
    outcomes, skips = _loop(watching, scaler, faults={3, 4, 6, 10}, iterations=11)
    assert [i for i, stepped in enumerate(outcomes) if not stepped] == [3, 4, 6, 10]  # ground truth
    assert skips == {3: True, 4: False, 6: False, 10: True}
