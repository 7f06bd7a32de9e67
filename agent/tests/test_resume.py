"""Resuming and scale edge values: a restore is its own transition, and every float32 scale is a state.

Ground truth: the scaler's own float32 scale before and after, and parameter bit patterns.
"""

from __future__ import annotations

import gc
import logging
import math
import weakref

import pytest
import torch


def job(amp, **scaler_kwargs):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, torch.amp.GradScaler("cpu", **scaler_kwargs)


def x():
    return torch.randn(4, 8)


def transitions(events, cause=None):
    return [e for e in events if e["kind"] == "scale_change" and (cause is None or e["cause"] == cause)]


def counts(w):
    state = w.snapshot()["state"]
    return state["backoffs"], state["growths"], state["manual_sets"]


@pytest.mark.parametrize("checkpoint_scale, by_keyword", [(1024.0, False), (2.0 ** 20, True)])
def test_load_state_dict_is_a_restore_never_a_backoff_or_growth(amp, watching, events, checkpoint_scale,
                                                                by_keyword):
    model, opt, scaler = job(amp)
    w = watching(scaler, opt, model=model)
    amp.iteration(model, scaler, [opt], x())
    saved = torch.amp.GradScaler("cpu", init_scale=checkpoint_scale, growth_interval=7).state_dict()
    if by_keyword:
        scaler.load_state_dict(state_dict=saved)
    else:
        scaler.load_state_dict(saved)
    for _ in range(3):
        amp.iteration(model, scaler, [opt], x())
    assert counts(w) == (0, 0, 0), "the checkpoint's scale was booked as a backoff or growth"
    restored = transitions(events(w), "restored")
    assert [(e["before"], e["after"], e["iteration"]) for e in restored] == [(65536.0, checkpoint_scale, 1)]
    snap = w.snapshot()
    assert snap["state"]["loss_scale"] == scaler.get_scale() == checkpoint_scale
    assert snap["scaler"]["init_scale"] == checkpoint_scale and snap["scaler"]["growth_interval"] == 7


def test_a_restore_to_the_same_scale_is_no_transition_but_settings_follow(amp, watching, events):
    model, opt, scaler = job(amp)
    w = watching(scaler, opt, model=model)
    scaler.load_state_dict(torch.amp.GradScaler("cpu", growth_factor=4.0).state_dict())
    assert transitions(events(w)) == []
    assert w.snapshot()["scaler"]["growth_factor"] == 4.0


def test_growth_after_a_restore_counts_from_the_restored_growth_tracker(amp, watching, events):
    model, opt, scaler = job(amp, growth_interval=3)
    w = watching(scaler, opt, model=model)
    donor = torch.amp.GradScaler("cpu", growth_interval=3)
    donor.load_state_dict({**donor.state_dict(), "scale": 256.0, "_growth_tracker": 2})
    scaler.load_state_dict(donor.state_dict())
    amp.iteration(model, scaler, [opt], x())  # the third clean iteration: the scaler grows now
    assert scaler.get_scale() == 512.0
    assert counts(w) == (0, 1, 0)
    assert [(e["cause"], e["after"]) for e in transitions(events(w))] == [("restored", 256.0), ("growth", 512.0)]


def test_a_new_scaler_without_rebind_is_warned_about_once_naming_rebind(amp, watching, events, caplog):
    model, opt, old = job(amp)
    w = watching(old, {"main": opt}, model=model)
    amp.iteration(model, old, [opt], x())
    new = torch.amp.GradScaler("cpu")
    new.load_state_dict(old.state_dict())
    with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
        for _ in range(3):
            amp.iteration(model, new, [opt], x())
    warned = [r for r in caplog.records if "rebind" in r.getMessage()]
    assert len(warned) == 1 and "'main'" in warned[0].getMessage()
    codes = [e["code"] for e in events(w) if e["kind"] == "warning"]
    assert codes == ["stepped_outside_scaler"]


@pytest.mark.parametrize("old_scaler_kept", [False, True], ids=["old-scaler-dropped", "old-scaler-kept"])
def test_a_notebook_cell_run_again_with_a_new_scaler_and_watch_warns_of_nothing(amp, no_collector, caplog,
                                                                                old_scaler_kept):
    # The cell: a new scaler and a new watch of the same optimizer (and scheduler), the old handle overwritten.
    # Every step goes through a watched scaler, so the old watch has nothing to warn about, whether its scaler
    # was freed with the handle or is kept (e.g. in IPython's output history), and counts nothing after.
    from ampwatch import agent

    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    history = []

    def train(scaler, poisoned):
        for i in range(3):
            amp.iteration(model, scaler, [opt], x(),
                          after_backward=(lambda: amp.poison_grad(model.a.weight)) if i in poisoned else None)
            scheduler.step()

    with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
        scaler = torch.amp.GradScaler("cpu")
        w = agent.watch(scaler, {"main": opt}, model=model, schedulers={"main": scheduler}, collector=(), run="nb")
        train(scaler, poisoned=(2,))  # the first run ends on a skip
        old_events, (old_record,) = w._recorder.events, w._recorder.records
        if old_scaler_kept:
            history.append(scaler)
        old_counts = old_record.counters()

        scaler = torch.amp.GradScaler("cpu")  # the same cell, run again
        w = agent.watch(scaler, {"main": opt}, model=model, schedulers={"main": scheduler}, collector=(), run="nb")
        try:
            train(scaler, poisoned=(1,))
            new_counts = w.snapshot()["state"]["optimizers"]["main"]
        finally:
            w.close()
    said = [r.getMessage() for r in caplog.records if "stepped" in r.getMessage()]
    assert said == [], said
    assert [e for e in old_events.drain() if e["kind"] == "warning"] == []
    assert old_record.counters() == old_counts, "the overwritten watch counted the new watch's steps"
    assert (new_counts["steps"], new_counts["skipped"], new_counts["scheduler_steps_after_skip"]) == (2, 1, 1)


def test_rebind_carries_the_watch_over_to_a_new_scaler(amp, watching, events):
    model, opt, old = job(amp)
    w = watching(old, {"main": opt}, model=model)
    amp.iteration(model, old, [opt], x(), after_backward=lambda: amp.poison_grad(model.a.weight))
    new = torch.amp.GradScaler("cpu", init_scale=4096.0)
    w.rebind(new)
    assert "step" not in vars(old) and "step" in vars(new)
    truth = amp.iteration(model, new, [opt], x(), after_backward=lambda: amp.poison_grad(model.b.bias))
    assert truth == {id(opt): False}
    amp.iteration(model, new, [opt], x())
    state = w.snapshot()["state"]
    assert state["optimizers"]["main"]["skipped"] == 2 and state["optimizers"]["main"]["steps"] == 1
    assert state["loss_scale"] == new.get_scale() == 2048.0
    assert [(e["cause"], e["before"], e["after"]) for e in transitions(events(w))] == [
        ("backoff", 65536.0, 32768.0), ("restored", 32768.0, 4096.0), ("backoff", 4096.0, 2048.0)]
    assert counts(w) == (2, 0, 0)


def test_after_rebind_collecting_the_old_scaler_leaves_the_watch_on_the_new_one(amp, watching):
    model, opt, old = job(amp)
    w = watching(old, {"main": opt}, model=model)
    w.rebind(new := torch.amp.GradScaler("cpu"))
    old_ref = weakref.ref(old)
    del old
    gc.collect()
    assert old_ref() is None
    assert not w.closed, "collecting the scaler the watch left ended the watch"
    amp.iteration(model, new, [opt], x(), after_backward=lambda: amp.poison_grad(model.a.weight))
    assert w.snapshot()["state"]["optimizers"]["main"]["skipped"] == 1 and w.stepped(opt) is False


def test_after_rebind_the_old_scaler_can_be_watched_again(amp, watching):
    model, opt, old = job(amp)
    w = watching(old, {"main": opt})
    w.rebind(new := torch.amp.GradScaler("cpu"))
    _, other_opt, _ = job(amp)
    again = watching(old, {"other": other_opt})
    amp.iteration(model, new, [opt], x())
    assert w.stepped(opt) is True and again.stepped(other_opt) is None


def test_after_rebind_the_watch_holds_the_new_scaler_weakly_and_its_id_leaves_the_watched_set(amp, no_collector):
    # The handle is dropped (it alone holds its scaler strongly); dropping the new scaler then ends the watch by
    # reference counting, and its id is free for a later scaler that happens to get the same address.
    from ampwatch import agent
    from ampwatch.agent import _session

    model, opt, old = job(amp)
    w = agent.watch(old, {"main": opt}, model=model, collector=(), run="r")
    w.rebind(new := torch.amp.GradScaler("cpu"))
    session, new_ref, new_id = w._session, weakref.ref(new), id(new)
    del w, old
    gc.collect()
    gc.disable()
    try:
        del new
        assert new_ref() is None, "the watch kept the scaler it was carried over to alive"
    finally:
        gc.enable()
    assert session.closed and new_id not in _session.watched
    plain = torch.amp.GradScaler("cpu")
    w = agent.watch(plain, {"main": opt}, collector=(), run="r")
    plain_id, session = id(plain), w._session
    del w, plain
    assert session.closed and plain_id not in _session.watched


def test_rebind_refuses_a_scaler_another_watch_has(amp, watching):
    model, opt, old = job(amp)
    _, other_opt, other = job(amp)
    w = watching(old, opt)
    watching(other, other_opt)
    with pytest.raises(ValueError, match="already watched"):
        w.rebind(other)
    with pytest.raises(TypeError, match="GradScaler"):
        w.rebind(object())
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.rebind(torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("init_scale", [1e-3, 0.1, 3000.7])
def test_an_init_scale_float32_cannot_hold_is_no_transition(amp, watching, events, init_scale):
    model, opt, scaler = job(amp, init_scale=init_scale)
    w = watching(scaler, opt, model=model)
    for _ in range(3):
        amp.iteration(model, scaler, [opt], x())
    assert counts(w) == (0, 0, 0) and transitions(events(w)) == []
    assert w.snapshot()["state"]["loss_scale"] == scaler.get_scale()
    assert w.snapshot()["scaler"]["init_scale"] == scaler.get_scale()


def test_a_nan_scale_is_reported_as_nan_and_never_as_growth(amp, watching, events):
    model, opt, scaler = job(amp, growth_interval=1)
    w = watching(scaler, opt, model=model)
    amp.iteration(model, scaler, [opt], x(), new_scale=float("nan"))
    for _ in range(10):
        amp.iteration(model, scaler, [opt], x())
    assert math.isnan(scaler.get_scale())
    assert counts(w) == (0, 0, 1)
    assert math.isnan(w.snapshot()["state"]["loss_scale"])
    assert len(transitions(events(w))) == 1


def test_a_scale_that_underflows_to_zero_is_reported_as_zero(amp, watching, events):
    model, opt, scaler = job(amp, init_scale=2.0 ** -140)  # subnormal in float32: a few backoffs reach 0.0
    w = watching(scaler, opt, model=model)
    skips = 0
    while scaler.get_scale() > 0.0 and skips < 20:
        amp.iteration(model, scaler, [opt], x(), after_backward=lambda: amp.poison_grad(model.a.weight))
        skips += 1
    assert scaler.get_scale() == 0.0
    state = w.snapshot()["state"]
    assert state["loss_scale"] == 0.0 and state["backoffs"] == skips
    assert state["optimizers"]["SGD"]["skipped"] == skips
    amp.iteration(model, scaler, [opt], x(), after_backward=lambda: amp.poison_grad(model.a.weight))
    assert w.snapshot()["state"]["backoffs"] == skips, "0.0 * backoff_factor is still 0.0: no transition"
