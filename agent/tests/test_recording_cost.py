"""The agent adds no host-device synchronisation on clean iterations.

A sync shows up as ``aten._local_scalar_dense`` (what ``.item()``, ``float()``
and ``bool()`` of a tensor dispatch to); ``ampwatch_support.syncs.SyncCounter``, a
TorchDispatchMode, counts them on CPU exactly as it would on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampwatch_support.syncs import SyncCounter  # the counter the benchmarks and the GPU check use


def count_syncs(amp, *, fused: bool, watched: bool, iterations: int = 10,
                poison_at: tuple[int, ...] = (), unscale: bool = False) -> tuple[int, object]:
    from ampwatch import agent

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt_a = torch.optim.AdamW(model[0].parameters(), lr=1e-3, fused=fused or None)
    opt_b = torch.optim.AdamW(model[2].parameters(), lr=1e-3, fused=fused or None)
    scaler = torch.amp.GradScaler("cpu", growth_interval=4)
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1)
    handle = agent.watch(scaler, {"a": opt_a, "b": opt_b}, model=model, schedulers={"a": sched},
                         run="cost") if watched else None
    xs = [torch.randn(4, 8) for _ in range(iterations)]
    try:
        with SyncCounter() as counter:
            for i, x in enumerate(xs):
                for opt in (opt_a, opt_b):
                    opt.zero_grad()
                scaler.scale(amp.forward(model, x)).backward()
                if i in poison_at:
                    amp.poison_grad(model[2].bias)
                if unscale:
                    scaler.unscale_(opt_a)
                    scaler.unscale_(opt_b)
                scaler.step(opt_a)
                scaler.step(opt_b)
                scaler.update()
                sched.step()
    finally:
        if handle is not None:
            handle.close()
    return counter.syncs, handle


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("unscale", [False, True], ids=["step-unscales", "explicit-unscale"])
def test_clean_iterations_cost_no_extra_sync(amp, no_collector, fused, unscale):
    bare, _ = count_syncs(amp, fused=fused, watched=False, unscale=unscale)
    watched, handle = count_syncs(amp, fused=fused, watched=True, unscale=unscale)
    # Ten clean iterations, two growths (growth_interval=4): the agent saw them all.
    state = handle.snapshot()["state"]
    assert state["optimizers"]["a"]["steps"] == 10 and state["growths"] == 2
    assert watched == bare
    if not fused:  # the counter works: the scaler itself reads found_inf once per optimizer step
        assert bare >= 20


def test_only_iterations_with_a_skip_pay_for_inspection(amp, no_collector):
    bare, _ = count_syncs(amp, fused=False, watched=False, poison_at=(3,))
    watched, handle = count_syncs(amp, fused=False, watched=True, poison_at=(3,))
    assert handle.snapshot()["state"]["optimizers"]["b"]["skipped"] == 1
    # Inspection copies its counts to the host with .cpu() (no scalar reads), so even a skip adds none.
    assert watched == bare


def test_a_named_skip_copies_to_the_host_twice_and_a_rate_limited_one_once(amp, no_collector, monkeypatch):
    """On a GPU each host copy of the scan is a sync: flags (gradients and weights at a streak start, one
    copy), then the counts of the named few; an unnamed streak start only has its weights checked (one)."""
    from ampwatch import agent

    copies = []
    real_cpu = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        copies.append(tuple(self.shape))
        return real_cpu(self, *args, **kwargs)

    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with agent.watch(scaler, opt, model=model, run="cost") as w:
        w._recorder.inspect_interval = 3600.0
        for i in range(4):  # skip (named), step, skip (not named: within the interval), step
            if i in (1, 3):
                amp.iteration(model, scaler, [opt], torch.randn(4, 8))
                continue
            with monkeypatch.context() as patch:
                patch.setattr(torch.Tensor, "cpu", cpu)
                amp.iteration(model, scaler, [opt], torch.randn(4, 8),
                              after_backward=lambda: amp.poison_grad(model.b.bias))
            if i == 0:  # first skip ever: named, no step before it whose weights to check
                assert copies == [(4,), (1, 2)]
            else:  # a streak start after a step, names rate-limited: one copy flags its weights and, for began,
                assert copies == [(8,)]  # its gradients (4 + 4 flags), unnamed

            copies.clear()
        w._recorder.inspect_interval = 0.0
        amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=lambda: amp.poison_grad(model.b.bias))
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "cpu", cpu)
            amp.iteration(model, scaler, [opt], torch.randn(4, 8))  # step: nothing is scanned
            assert copies == []
            amp.iteration(model, scaler, [opt], torch.randn(4, 8),
                          after_backward=lambda: amp.poison_grad(model.b.bias))
        # Named streak start after a step: gradients and weights flagged in one copy (8 = 4 + 4), then counts.
        assert copies == [(8,), (1, 2)]
