"""The public ``watch()`` API: arguments, names, errors a user can hit, close/restore, AMPWATCH_DISABLED."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def optimizers():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    return model, torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.Adam(model[1].parameters())


def names(w):
    return list(w.snapshot()["state"]["optimizers"])


def test_a_single_optimizer_is_named_by_its_class(watching):
    _, sgd, _ = optimizers()
    assert names(watching(torch.amp.GradScaler("cpu"), sgd)) == ["SGD"]


def test_a_list_of_distinct_classes_is_named_by_class(watching):
    _, sgd, adam = optimizers()
    assert names(watching(torch.amp.GradScaler("cpu"), [sgd, adam])) == ["SGD", "Adam"]


def test_a_list_with_repeated_classes_is_named_by_position(watching):
    model = nn.Linear(4, 4)
    first, second = torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)
    assert names(watching(torch.amp.GradScaler("cpu"), [first, second])) == ["optimizer0", "optimizer1"]


def test_dict_keys_name_the_optimizers(watching):
    _, sgd, adam = optimizers()
    assert names(watching(torch.amp.GradScaler("cpu"), {"gen": sgd, "disc": adam})) == ["gen", "disc"]


@pytest.mark.parametrize("bad, error, message", [
    ("adam", TypeError, "optimizers must be"),
    ([], ValueError, "optimizers is empty"),
    ({"": None}, ValueError, "names must be printable"),
    ({"gen": "adam"}, TypeError, "optimizers\\['gen'\\] must be a torch.optim.Optimizer"),
])
def test_bad_optimizers_argument_says_what_is_wrong(watching, bad, error, message):
    with pytest.raises(error, match=message):
        watching(torch.amp.GradScaler("cpu"), bad)


def test_the_same_optimizer_twice_is_refused(watching):
    _, sgd, _ = optimizers()
    with pytest.raises(ValueError, match="listed twice"):
        watching(torch.amp.GradScaler("cpu"), {"a": sgd, "b": sgd})


def test_a_non_scaler_is_refused(watching):
    _, sgd, _ = optimizers()
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        watching(object(), sgd)


def test_model_and_named_parameters_together_are_refused(watching):
    model, sgd, _ = optimizers()
    with pytest.raises(ValueError, match="either model= or named_parameters="):
        watching(torch.amp.GradScaler("cpu"), sgd, model=model, named_parameters=model.named_parameters())


def test_schedulers_keyed_by_an_unknown_optimizer_name_are_refused(watching):
    _, sgd, adam = optimizers()
    sched = torch.optim.lr_scheduler.StepLR(sgd, 1)
    with pytest.raises(ValueError, match="'gen' is not the name of a watched optimizer"):
        watching(torch.amp.GradScaler("cpu"), {"a": sgd, "b": adam}, schedulers={"gen": sched})


def test_a_scheduler_of_another_optimizer_is_refused(watching):
    _, sgd, adam = optimizers()
    sched = torch.optim.lr_scheduler.StepLR(adam, 1)
    with pytest.raises(ValueError, match="schedules a different optimizer"):
        watching(torch.amp.GradScaler("cpu"), {"a": sgd, "b": adam}, schedulers={"a": sched})


def test_stepped_of_an_unwatched_optimizer_says_which_are_watched(watching):
    _, sgd, adam = optimizers()
    w = watching(torch.amp.GradScaler("cpu"), {"gen": sgd})
    with pytest.raises(ValueError, match="watched optimizers: gen"):
        w.stepped(adam)


def test_watching_the_same_scaler_twice_is_refused_until_closed(watching):
    _, sgd, _ = optimizers()
    scaler = torch.amp.GradScaler("cpu")
    first = watching(scaler, sgd)
    with pytest.raises(ValueError, match="already watched"):
        watching(scaler, sgd)
    first.close()
    watching(scaler, sgd).close()


def test_stepping_an_unwatched_optimizer_warns_once(amp, watching, events):
    model, sgd, adam = optimizers()
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"gen": sgd})
    for _ in range(2):
        amp.iteration(model, scaler, [sgd, adam], torch.randn(2, 4))
    warnings = [e for e in events(w) if e["kind"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["code"] == "stepped_unknown_optimizer"
    assert "Adam" in warnings[0]["message"] and "Pass every optimizer to watch()" in warnings[0]["message"]


def test_a_new_optimizer_at_a_dropped_watched_optimizers_address_is_not_taken_for_it(amp, watching, events):
    # The watch holds its optimizers weakly, so a dropped one is freed and a new object may get its id.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    scaler = torch.amp.GradScaler("cpu")
    dropped = torch.optim.SGD(model.parameters(), lr=0.1)
    w = watching(scaler, {"dropped": dropped})
    address = id(dropped)
    del dropped
    made = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(1)]
    while id(made[-1]) != address and len(made) < 1000:
        made.append(torch.optim.SGD(model.parameters(), lr=0.1))
    if id(made[-1]) != address:
        pytest.skip("the interpreter did not reuse the dropped optimizer's address")
    new = made[-1]
    amp.iteration(model, scaler, [new], torch.randn(2, 4), after_backward=lambda: amp.poison_grad(model[0].weight))
    assert w.snapshot()["state"]["optimizers"]["dropped"]["skipped"] == 0
    assert [e["code"] for e in events(w) if e["kind"] == "warning"] == ["stepped_unknown_optimizer"]
    with pytest.raises(ValueError, match="does not know"):
        w.stepped(new)


def test_close_ends_open_streaks_and_emits_close(amp, watching, events):
    model, sgd, _ = optimizers()
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"gen": sgd})
    amp.iteration(model, scaler, [sgd], torch.randn(2, 4), after_backward=lambda: amp.poison_grad(model[0].bias))
    events(w)
    w.close()
    w.close()  # idempotent
    recorded = events(w)
    assert [e["kind"] for e in recorded] == ["streak_end", "close"]
    assert (recorded[0]["start_iteration"], recorded[0]["length"]) == (0, 1)
    assert w.closed


def test_ampwatch_max_events_bounds_the_event_buffer_of_watch(amp, watching, events, monkeypatch):
    monkeypatch.setenv("AMPWATCH_MAX_EVENTS", "3")
    model, sgd, _ = optimizers()
    scaler = torch.amp.GradScaler("cpu", growth_interval=1000)
    w = watching(scaler, {"gen": sgd})
    for _ in range(4):  # a streak of 4: a skip and a backoff event at its 1st, 2nd and 4th skip
        amp.iteration(model, scaler, [sgd], torch.randn(2, 4),
                      after_backward=lambda: amp.poison_grad(model[0].bias))
    kept = events(w)
    assert len(kept) == 3
    assert w._recorder.events.dropped == 3
    assert kept[-1]["iteration"] == 3  # the oldest were dropped first


def test_after_close_the_loop_runs_untouched(amp, watching):
    model, sgd, _ = optimizers()
    scaler = torch.amp.GradScaler("cpu")
    with watching(scaler, sgd) as w:
        amp.iteration(model, scaler, [sgd], torch.randn(2, 4))
    amp.iteration(model, scaler, [sgd], torch.randn(2, 4))
    assert w.snapshot()["state"]["optimizers"]["SGD"]["steps"] == 1 and w.snapshot()["state"]["iteration"] == 1


def test_ampwatch_disabled_returns_a_do_nothing_watch(amp, monkeypatch, no_collector):
    from ampwatch import agent

    monkeypatch.setenv("AMPWATCH_DISABLED", "1")
    model, sgd, _ = optimizers()
    scaler = torch.amp.GradScaler("cpu")
    with agent.watch(scaler, sgd) as w:
        assert isinstance(w, agent.DisabledWatch)
        assert "step" not in vars(scaler) and not sgd._optimizer_step_pre_hooks
        amp.iteration(model, scaler, [sgd], torch.randn(2, 4))
        assert w.stepped(sgd) is None
        w.grad_norm(1.0, sgd)  # the job's calls to the watch do nothing, and never fail
        w.loss(1.0)


def test_summary_reads_as_a_local_report(amp, watching):
    model, sgd, _ = optimizers()
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"gen": sgd})
    amp.iteration(model, scaler, [sgd], torch.randn(2, 4), after_backward=lambda: amp.poison_grad(model[0].bias))
    assert "gen: 0 stepped, 1 skipped" in w.summary() and "backoffs 1" in w.summary()


def test_snapshot_has_the_protocol_shape(amp, watching):
    model, sgd, _ = optimizers()
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"gen": sgd})
    amp.iteration(model, scaler, [sgd], torch.randn(2, 4))
    snap = w.snapshot()
    assert snap["scaler"] == {"enabled": True, "kind": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
                              "backoff_factor": 0.5, "growth_interval": 2000}
    assert set(snap["state"]) == {"iteration", "loss_scale", "backoffs", "growths", "manual_sets",
                                  "optimizers", "delivery"}
    assert set(snap["state"]["optimizers"]["gen"]) == {
        "steps", "skipped", "consecutive_skipped", "longest_streak", "streaks", "streaks_reached",
        "scheduler_steps_after_skip", "poisoned_steps"}


def test_a_watched_scaler_pickles_and_copies_as_a_plain_unwatched_one(amp, watching):
    import copy
    import pickle

    model, sgd, _ = optimizers()
    scaler = torch.amp.GradScaler("cpu")
    sched = torch.optim.lr_scheduler.StepLR(sgd, 1)
    w = watching(scaler, sgd, schedulers=sched)
    amp.iteration(model, scaler, [sgd], torch.randn(2, 4), after_backward=lambda: amp.poison_grad(model[0].bias))
    for clone in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert not {"step", "update", "__getstate__"} & set(vars(clone))
        assert clone.get_scale() == scaler.get_scale() == 32768.0
    assert not {"step", "__getstate__"} & set(vars(copy.deepcopy(sched)))
    amp.iteration(model, scaler, [sgd], torch.randn(2, 4))  # the original is still watched
    assert w.snapshot()["state"]["iteration"] == 2
