"""The agent leaves training as it is: bit-identical weights and scale, and its own failures never reach the loop."""

from __future__ import annotations

import logging

import torch


def test_attaching_the_agent_leaves_training_bit_identical(amp, no_collector):
    from ampwatch import agent

    def train(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = amp.TwoPart()
        opt_a, opt_b = amp.two_optimizers(model)
        fused = torch.optim.AdamW(model.b.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu", growth_interval=3)
        handle = agent.watch(scaler, [opt_a, fused], model=model, run="t") if watched else None
        try:
            for i in range(12):
                amp.iteration(model, scaler, [opt_a, fused], torch.randn(4, 8),
                              after_backward=(lambda: amp.poison_grad(model.b.bias)) if i in (2, 3, 7) else None)
        finally:
            if handle is not None:
                handle.close()
        return amp.bits(model.parameters()) + [torch.tensor(scaler.get_scale()).view(torch.int32)]

    assert all(torch.equal(x, y) for x, y in zip(train(False), train(True)))


def test_a_failure_inside_the_agent_never_reaches_the_training_loop(amp, watching, monkeypatch, caplog):
    from ampwatch.agent import _device, _inspection

    def broken(*args, **kwargs):
        raise RuntimeError("injected agent fault")

    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, model=model)
    monkeypatch.setattr(_inspection, "scan_optimizers", broken)  # breaks skip inspection
    monkeypatch.setattr(_device, "fused_found_inf", broken)  # breaks the step pre-hook
    monkeypatch.setattr(_device, "scale_tensor", broken)  # breaks the update wrapper
    caplog.set_level(logging.ERROR, logger="ampwatch.agent")
    for _ in range(3):
        truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                              after_backward=lambda: amp.poison_grad(model.b.bias))
        # The scaler's own behaviour is intact: b skipped, a stepped, the scale backed off.
        assert truth == {id(opt_a): True, id(opt_b): False}
    assert scaler.get_scale() == 2.0 ** 16 / 8
    errors = w.snapshot()["state"]["delivery"]["agent_errors"]
    assert errors >= 6
    logged = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert 1 <= len(logged) <= 3  # once per failing site, not once per failure
