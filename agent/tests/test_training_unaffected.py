"""The agent leaves training as it is: bit-identical weights and scale, and its own failures never reach the loop."""

from __future__ import annotations

import logging
import random
import threading

import torch

from ampwatch_support.patience import wait_until
from ampwatch_support.recording_collector import free_port


def test_attaching_the_agent_leaves_training_bit_identical(amp, no_collector, monkeypatch):
    from ampwatch import agent

    monkeypatch.setenv("AMPWATCH_GRAD_NORM", "1")  # the spike watch computes each step's gradient norm too
    states = []

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
                states.append(handle.snapshot()["state"])
        return amp.bits(model.parameters()) + [torch.tensor(scaler.get_scale()).view(torch.int32)]

    assert all(torch.equal(x, y) for x, y in zip(train(False), train(True), strict=True))
    (state,) = states
    assert state["delivery"]["agent_errors"] == 0 and "loss" in state
    assert all("grad_norm" in counters for counters in state["optimizers"].values())  # the fused one's too


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


def _global_streams(draws: int) -> list:
    """Draw from every global random stream a job may seed: Python's, torch's and (if installed) NumPy's."""
    values = [random.random() for _ in range(draws)] + torch.rand(draws).tolist()
    try:
        import numpy
    except ImportError:
        return values
    return values + numpy.random.random(draws).tolist()


def test_a_jobs_seeded_random_streams_are_the_same_watched_with_failing_deliveries_as_unwatched(
        amp, no_collector, monkeypatch, tmp_path):
    # Data order and augmentation come from the global generators the job seeded: the agent's retry jitter
    # (drawn on its sender thread at every failed delivery), its node relay's thread, its skip scans and its
    # scale accounting draw none.
    from ampwatch import agent

    monkeypatch.setenv("AMPWATCH_RELAY", "1")  # batches go through this process's own relay thread
    monkeypatch.setenv("AMPWATCH_RELAY_DIR", str(tmp_path / "relay"))

    def job(watched: bool) -> list:
        random.seed(7)
        torch.manual_seed(7)
        try:
            import numpy
            numpy.random.seed(7)
        except ImportError:
            pass
        model = amp.TwoPart()
        opt_a, opt_b = amp.two_optimizers(model, fused=True)
        scheduler = torch.optim.lr_scheduler.StepLR(opt_b, 1)
        scaler = torch.amp.GradScaler("cpu", growth_interval=2)
        nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens: every delivery fails and is retried
        w = agent.watch(scaler, {"a": opt_a, "b": opt_b}, model=model, schedulers={"b": scheduler},
                        collector=nowhere, run="rng", push_interval=0.05) if watched else None
        values = []
        try:
            for i in range(6):
                values += _global_streams(2)  # the job's own draws, interleaved with training
                amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                              after_backward=(lambda: amp.poison_grad(model.b.weight)) if i in (1, 2, 4) else None)
                scheduler.step()
            if w is not None:
                w.rebind(scaler2 := torch.amp.GradScaler("cpu"))
                scaler2.load_state_dict(scaler.state_dict())
                wait_until(lambda: w.snapshot()["state"]["delivery"]["send_failures"] >= 4, every=0.02,
                           what="four failed attempts")
                assert any(t.name == "ampwatch-relay" for t in threading.enumerate())
                assert w.snapshot()["state"]["optimizers"]["b"]["skipped"] == 3
            values += _global_streams(3)
        finally:
            if w is not None:
                w.close(timeout=0.2)  # a final attempt or two, retried with jitter
        return values + _global_streams(3)

    unwatched = job(False)
    assert job(True) == unwatched
