"""A job without a GradScaler (bf16, float32): ``watch(None, ...)`` checks every optimizer step for inf/NaN
gradients."""

from __future__ import annotations

import pytest
import torch

from ampwatch_support.syncs import SyncCounter  # the counter test_recording_cost.py uses

INF = float("inf")


def repair(model) -> None:
    """Put finite values back into the weights (as a job reloading its last good checkpoint would)."""
    with torch.no_grad():
        for p in model.parameters():
            p.nan_to_num_(0.0, 0.0, 0.0)


def bf16_iteration(model, optimizers, x, *, poison=None) -> dict[int, bool]:
    """One bf16 iteration without a scaler; ``poison(model)`` runs after backward. Return {id(opt): grads finite}."""
    for opt in optimizers:
        opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    if poison is not None:
        poison(model)
    finite = {}
    for opt in optimizers:
        finite[id(opt)] = all(bool(torch.isfinite(p.grad).all()) for g in opt.param_groups for p in g["params"]
                              if p.grad is not None)
        opt.step()
    return finite


def poisoned_events(events_of, w) -> list[dict]:
    return [e for e in events_of(w) if e["kind"] == "poisoned_step"]


def test_a_step_whose_gradients_held_inf_is_a_poisoned_step_named_in_its_iteration(amp, watching, events):
    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model)
    w = watching(None, {"a": opt_a, "b": opt_b}, model=model)

    def inf_in_b(m):
        m.b.bias.grad[1] = INF
        m.b.bias.grad[2] = float("nan")

    truth = [bf16_iteration(model, [opt_a, opt_b], torch.randn(4, 8), poison=inf_in_b if i == 3 else None)
             for i in range(4)]
    assert truth[3] == {id(opt_a): True, id(opt_b): False}  # ground truth: only b's gradients held inf/NaN
    (event,) = poisoned_events(events, w)
    assert (event["optimizer"], event["iteration"], event["reason"], event["streak"]) == ("b", 3, "nonfinite_grad", 1)
    assert event["params"] == [{"name": "b.bias", "inf": 1, "nan": 1}] and event["params_total"] == 1
    assert "exact" not in event  # named from the very gradients the step applied
    state = w.snapshot()["state"]
    assert state["optimizers"]["b"]["poisoned_steps"] == 1 and state["optimizers"]["a"]["poisoned_steps"] == 0
    # Nothing skips without a scaler: every step counts as a step.
    assert state["optimizers"]["a"]["steps"] == state["optimizers"]["b"]["steps"] == 4
    assert state["optimizers"]["b"]["skipped"] == 0 and w.stepped(opt_b) is True


def test_a_run_of_poisoned_steps_is_counted_whole_and_reported_at_its_rungs(amp, watching, events):
    """NaN weights make every later gradient NaN: 20 poisoned steps, events at the 1st, 2nd, 4th, 8th, 16th."""
    model = amp.TwoPart()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = watching(None, opt, model=model)
    x = torch.randn(4, 8)
    x[0, 0] = INF
    bf16_iteration(model, [opt], x)
    truth = [bf16_iteration(model, [opt], torch.randn(4, 8)) for _ in range(19)]
    assert not any(t[id(opt)] for t in truth)  # ground truth: the weights are NaN, so is every gradient
    recorded = poisoned_events(events, w)
    assert [(e["iteration"], e["streak"]) for e in recorded] == [(0, 1), (1, 2), (3, 4), (7, 8), (15, 16)]
    assert all(e["params_total"] == 4 for e in recorded)
    assert w.snapshot()["state"]["optimizers"]["AdamW"]["poisoned_steps"] == 20


def test_a_clean_step_ends_a_run_and_the_next_poisoned_step_starts_one(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, opt, model=model)
    for i in range(6):
        bf16_iteration(model, [opt], torch.randn(4, 8),
                       poison=(lambda m: amp.poison_grad(m.a.weight)) if i in (1, 2, 4) else None)
        repair(model)
    assert [(e["iteration"], e["streak"]) for e in poisoned_events(events, w)] == [(1, 1), (2, 2), (4, 1)]
    assert w.snapshot()["state"]["optimizers"]["SGD"]["poisoned_steps"] == 3


def test_iterations_count_each_optimizers_step_once_whatever_their_order(amp, watching, events):
    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model)
    w = watching(None, {"a": opt_a, "b": opt_b}, model=model)
    assert w.snapshot()["state"]["iteration"] == 0
    for i in range(3):
        bf16_iteration(model, [opt_a, opt_b] if i % 2 else [opt_b, opt_a], torch.randn(4, 8),
                       poison=(lambda m: amp.poison_grad(m.a.weight)) if i == 2 else None)
        assert w.snapshot()["state"]["iteration"] == i + 1
    (event,) = poisoned_events(events, w)
    assert event["iteration"] == 2
    w.close()
    assert [(e["kind"], e["iteration"]) for e in events(w)] == [("close", 3)]
    assert w.snapshot()["state"]["iteration"] == 3


def test_without_a_scaler_there_is_no_loss_scale_and_the_rank_says_so(amp, watching):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, opt, model=model)
    bf16_iteration(model, [opt], torch.randn(4, 8))
    snapshot = w.snapshot()
    assert snapshot["scaler"] == {"enabled": False, "kind": "none", "init_scale": None, "growth_factor": None,
                                  "backoff_factor": None, "growth_interval": None}
    state = snapshot["state"]
    assert state["loss_scale"] is None and state["backoffs"] == state["growths"] == state["manual_sets"] == 0
    assert "no GradScaler" in w.summary() and "loss scale" not in w.summary()
    assert "no GradScaler" in repr(w)
    with pytest.raises(RuntimeError, match="no GradScaler"):
        w.rebind(torch.amp.GradScaler("cpu"))


def test_watching_without_a_scaler_leaves_training_bit_identical(amp, no_collector):
    from ampwatch import agent

    def train(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = amp.TwoPart()
        opt_a = torch.optim.AdamW(model.a.parameters(), lr=1e-3, fused=True)
        opt_b = torch.optim.SGD(model.b.parameters(), lr=0.01, momentum=0.9)
        handle = agent.watch(None, [opt_a, opt_b], model=model, run="t") if watched else None
        try:
            for i in range(8):
                bf16_iteration(model, [opt_a, opt_b], torch.randn(4, 8),
                               poison=(lambda m: amp.poison_grad(m.b.weight)) if i == 5 else None)
        finally:
            if handle is not None:
                handle.close()
        moments = [opt_a.state[p][key] for p in model.a.parameters() for key in ("exp_avg", "exp_avg_sq")]
        return amp.bits([*model.parameters(), *moments])

    assert all(torch.equal(x, y) for x, y in zip(train(False), train(True), strict=True))


def test_checking_each_step_reads_no_device_value_with_item(amp, watching):
    """``.item()`` (``aten._local_scalar_dense``, a sync on a GPU) is never called by the check."""
    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model)

    def syncs(watched: bool) -> int:
        w = watching(None, [opt_a, opt_b], model=model) if watched else None
        bf16_iteration(model, [opt_a, opt_b], torch.randn(4, 8))  # warm-up
        with SyncCounter() as counter:
            for _ in range(4):
                bf16_iteration(model, [opt_a, opt_b], torch.randn(4, 8))
        if w is not None:
            w.close()
        return counter.syncs

    assert syncs(True) == syncs(False)


def test_a_check_still_on_its_way_is_reported_late_by_presence_under_its_own_iteration(amp, watching, events,
                                                                                      late_checks):
    """A GPU's check lands after its step; no GPU here, so the read is held back by hand (the rest is real)."""
    held = late_checks
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, {"net": opt}, model=model)

    def inf_and_nan(m):
        m.a.weight.grad[0, 0] = INF
        m.b.bias.grad[0] = float("nan")

    bf16_iteration(model, [opt], torch.randn(4, 8), poison=inf_and_nan)
    repair(model)
    assert poisoned_events(events, w) == []  # not landed: nothing waits for it
    held[0].landed = True
    bf16_iteration(model, [opt], torch.randn(4, 8))  # the next step finds it landed
    (event,) = poisoned_events(events, w)
    assert (event["iteration"], event["exact"], event["params_total"]) == (0, False, 2)
    assert event["params"] == [{"name": "a.weight", "inf": 1, "nan": 0}, {"name": "b.bias", "inf": 0, "nan": 1}]
    w.close()  # what is still in flight is read at close
    assert w.snapshot()["state"]["optimizers"]["net"]["poisoned_steps"] == 1


@pytest.mark.parametrize("tensors, found", [
    ([torch.full((4,), 3e38), torch.ones(3)], False),  # finite values whose sum overflows: not a poisoned step
    ([torch.full((70000,), 1.0, dtype=torch.float16)], False),  # a float16 sum past 65504
    ([torch.ones(3), torch.tensor([1.0, -INF])], True),
    ([torch.tensor([INF, -INF])], True),  # +inf and -inf: their sum is NaN, still found
    ([torch.tensor([float("nan")], dtype=torch.bfloat16)], True),
    ([torch.ones(0), torch.tensor([2.0 + 0j, complex(INF, 0)])], True),  # complex: the exact scan
    ([torch.sparse_coo_tensor([[0]], [float("nan")], (3,), check_invariants=True)], True),  # sparse: the exact scan
    ([torch.ones(2, dtype=torch.float64), torch.zeros(0)], False),
])
def test_the_cpu_check_finds_every_inf_and_nan_and_nothing_else(tensors, found):
    from ampwatch.agent._poison import _CLEAN, KernelFlag, check_nonfinite

    flag = KernelFlag()
    check = check_nonfinite(tensors, flag)
    assert check.done() and check.any() is found
    assert check_nonfinite([torch.ones(3)], flag) is _CLEAN  # the flag was left clear: the next clean check is fast


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def kernel_calls(monkeypatch):
    """The tensor lists the agent hands GradScaler's kernel (which still runs)."""
    from ampwatch.agent import _poison

    calls: list[list[torch.Tensor]] = []
    real = _poison._kernel

    def counted(tensors, found_inf, inv_scale):
        calls.append(list(tensors))
        return real(tensors, found_inf, inv_scale)

    monkeypatch.setattr(_poison, "_kernel", counted)
    return calls


@pytest.mark.parametrize("dtype, view", [(torch.float32, torch.int32), (torch.float64, torch.int64)])
def test_the_cpu_kernel_check_stores_every_gradient_back_bit_for_bit(dtype, view, kernel_calls):
    """GradScaler's kernel with an inverse scale of 1 writes the gradients in place: the very bits it read,
    with no version counter bumped and nothing recorded for autograd (a ``create_graph=True`` gradient)."""
    from ampwatch.agent._poison import KernelFlag, check_nonfinite

    special = torch.tensor([0.0, -0.0, 1e-45 if dtype == torch.float32 else 5e-324, -3.5, INF, -INF], dtype=dtype)
    nan_payloads = torch.tensor([0x7FC00001, -0x7FFFF] if view == torch.int32 else [0x7FF8000000000001, -0x7FFFF],
                                dtype=view).view(dtype)  # a quiet NaN with a payload, a negative NaN
    w = torch.randn(3, dtype=dtype, requires_grad=True)
    (w * w).sum().backward(create_graph=True)
    graph_grad, node = w.grad, w.grad.grad_fn
    grads = [special, nan_payloads, torch.randn(1000, dtype=dtype)[::3], graph_grad]  # and a strided view
    before, versions = [_bits(g) for g in grads], [g._version for g in grads]
    assert check_nonfinite(grads, KernelFlag()).any() is True
    assert len(kernel_calls) == 1 and all(a is b for a, b in zip(kernel_calls[0], grads, strict=True))
    assert [_bits(g) for g in grads] == before
    assert [g._version for g in grads] == versions and graph_grad.grad_fn is node


def test_the_cpu_check_gives_the_kernel_nothing_it_could_change(kernel_calls):
    """bfloat16/float16 gradients (which the kernel would store back through float32) take the read-only
    sums; overlapping memory, which the kernel refuses, the exact scan; either way the flag stays clear."""
    from ampwatch.agent._poison import _CLEAN, KernelFlag, check_nonfinite

    flag = KernelFlag()
    for tensors in ([torch.ones(4, dtype=torch.bfloat16)], [torch.ones(2), torch.ones(2, dtype=torch.float16)],
                    [torch.tensor([INF], dtype=torch.bfloat16)]):
        before = [_bits(t) for t in tensors]
        assert check_nonfinite(tensors, flag).any() is bool(torch.isinf(tensors[0]).any())
        assert [_bits(t) for t in tensors] == before
    assert kernel_calls == []
    assert check_nonfinite([torch.tensor([INF]).expand(3)], flag).any() is True  # refused by the kernel
    assert len(kernel_calls) == 1
    assert check_nonfinite([torch.ones(3)], flag) is _CLEAN


def test_a_step_given_a_closure_is_checked_on_the_gradients_its_closure_made(amp, watching, events):
    """optimizer.step(closure) runs forward and backward inside the step (Lightning, LBFGS): checked after it."""
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, opt, model=model)
    for i in range(3):
        opt.step(amp.closure(model, opt, poison=model.b.weight if i == 1 else None))
        repair(model)
    (event,) = poisoned_events(events, w)
    assert event["iteration"] == 1 and event["params"] == [{"name": "b.weight", "inf": 1, "nan": 0}]
    assert w.snapshot()["state"]["optimizers"]["SGD"]["steps"] == 3


def test_the_first_step_given_a_closure_is_checked_and_close_removes_its_hook(amp, watching, events):
    """The post-hook that reads a closure's gradients is registered at the first step given one, in time
    for that very step; a job that never passes a closure pays for no post-hook; close() removes both."""
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, opt, model=model)
    bf16_iteration(model, [opt], torch.randn(4, 8))
    assert not opt._optimizer_step_post_hooks

    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 8)).float().pow(2).mean().backward()
        amp.poison_grad(model.a.weight)

    opt.step(closure)
    (event,) = poisoned_events(events, w)
    assert event["iteration"] == 1 and event["params"] == [{"name": "a.weight", "inf": 1, "nan": 0}]
    assert len(opt._optimizer_step_post_hooks) == 1
    w.close()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_a_step_without_a_closure_is_checked_before_it_on_the_gradients_it_is_given(amp, watching, events):
    """A job's own step pre-hook after the watch's (here: one that zeroes non-finite gradients) must not hide
    the inf the step was handed: the check runs in the watch's pre-hook, not after the step."""
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, opt, model=model)

    def zero_nonfinite(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad.nan_to_num_(0.0, 0.0, 0.0)

    opt.register_step_pre_hook(zero_nonfinite)
    for i in range(3):
        bf16_iteration(model, [opt], torch.randn(4, 8), poison=(lambda m: amp.poison_grad(m.b.weight)) if i == 1
                       else None)
    (event,) = poisoned_events(events, w)
    assert event["iteration"] == 1 and event["params"] == [{"name": "b.weight", "inf": 1, "nan": 0}]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_closed_watch_without_a_scaler_is_freed_by_reference_counting_alone(amp, no_collector):
    import gc
    import weakref

    from ampwatch import agent

    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gc.disable()  # nothing of the watch may wait for the cyclic collector
    try:
        w = agent.watch(None, opt, model=model, run="t")
        bf16_iteration(model, [opt], torch.randn(4, 8))
        w.close()
        recorder, check = weakref.ref(w._recorder), weakref.ref(w._recorder.unscaled)
        del w
        assert recorder() is None and check() is None
    finally:
        gc.enable()
