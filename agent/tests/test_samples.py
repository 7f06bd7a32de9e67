"""Which batch (issue 39): ``watch.batch(ids)`` puts each iteration's sample ids on its skip and poisoned-step events.

A real ``GradScaler("cpu")`` under bfloat16 autocast; a skip is made by an inf in the input of the iteration
whose ids the test knows, so the event must name exactly those ids (and the iterations before it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ampwatch import agent
from ampwatch.contract.batch import samples_digest
from ampwatch.contract.protocol import MAX_SAMPLE_IDS, MAX_SAMPLES_BEFORE, TEXT_LIMITS
from ampwatch.server._batch_parse import parse_batch
from ampwatch_support.recording_collector import RecordingCollector


def _step(amp, model, scaler, opt, *, poisoned: bool) -> None:
    x = torch.randn(4, 8)
    if poisoned:
        x[0, 0] = float("inf")
    opt.zero_grad()
    scaler.scale(amp.forward(model, x)).backward()
    scaler.step(opt)
    scaler.update()


def _ids_of(iteration: int) -> list[int]:
    return [10 * iteration + k for k in range(3)]


def _skips(events) -> list[dict]:
    return [e for e in events if e["kind"] == "skip"]


def test_a_streaks_first_skip_carries_its_ids_and_those_of_the_four_iterations_before_it(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model)
    for iteration in range(8):
        w.batch(_ids_of(iteration))
        _step(amp, model, scaler, opt, poisoned=iteration in (6, 7))
    first, second = _skips(events(w))
    assert (first["iteration"], first["streak"]) == (6, 1)
    assert first["samples"] == {"ids": _ids_of(6), "count": 3, "digest": samples_digest(_ids_of(6))}
    before = first["samples_before"]
    assert len(before) == MAX_SAMPLES_BEFORE
    assert [(e["iteration"], e["samples"]["ids"]) for e in before] == [(i, _ids_of(i)) for i in (2, 3, 4, 5)]
    assert (second["iteration"], second["streak"]) == (7, 2)
    assert second["samples"]["ids"] == _ids_of(7) and "samples_before" not in second  # not a streak's first


def test_with_gradient_accumulation_every_micro_batch_of_the_iteration_is_in_its_samples(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model)
    micro = [torch.arange(0, 4), [4, "five", 6], range(7, 9), np.array([9, 10])]  # every form batch() takes
    for iteration in range(2):
        opt.zero_grad()
        for k, ids in enumerate(micro):
            w.batch(ids if iteration else [100 + k])
            x = torch.randn(4, 8)
            if iteration == 1 and k == 2:
                x[0, 0] = float("inf")
            scaler.scale(amp.forward(model, x) / len(micro)).backward()
        scaler.step(opt)
        scaler.update()
    (skip,) = _skips(events(w))
    every = [0, 1, 2, 3, 4, "five", 6, 7, 8, 9, 10]
    assert skip["iteration"] == 1
    assert skip["samples"] == {"ids": every, "count": 11, "digest": samples_digest(every)}
    assert skip["samples_before"] == [{"iteration": 0, "samples": {"ids": [100, 101, 102, 103], "count": 4,
                                                                  "digest": samples_digest([100, 101, 102, 103])}}]


def test_the_same_samples_in_another_order_have_the_same_digest_and_other_samples_another(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model)
    orders = [[1, 2, "3"], [7], ["3", 1, 2], [8], [1, 2, 3]]  # skips at 0, 2 and 4; "3" and 3 are not the same id
    for iteration, ids in enumerate(orders):
        w.batch(ids)
        _step(amp, model, scaler, opt, poisoned=iteration % 2 == 0)
    a, b, c = (s["samples"] for s in _skips(events(w)))
    assert a["ids"] == [1, 2, "3"] and b["ids"] == ["3", 1, 2]
    assert a["digest"] == b["digest"] != c["digest"]


def test_an_iteration_of_more_than_64_ids_sends_64_and_counts_and_digests_them_all(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model)
    ids = list(range(1000, 1100))
    w.batch(torch.tensor(ids[:50]))
    w.batch(ids[50:])
    _step(amp, model, scaler, opt, poisoned=True)
    (skip,) = _skips(events(w))
    assert skip["samples"] == {"ids": ids[:MAX_SAMPLE_IDS], "count": 100, "digest": samples_digest(ids)}


def test_iterations_without_ids_carry_no_samples_and_a_skip_before_any_has_none(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model)
    _step(amp, model, scaler, opt, poisoned=True)  # no ids recorded at all yet
    w.batch([5])
    _step(amp, model, scaler, opt, poisoned=False)
    _step(amp, model, scaler, opt, poisoned=True)  # no ids for this one: the earlier ones are only "before"
    first, second = _skips(events(w))
    assert "samples" not in first and "samples_before" not in first
    assert "samples" not in second
    assert [e["iteration"] for e in second["samples_before"]] == [1]


def test_a_poisoned_step_without_a_scaler_carries_its_samples_and_those_before(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, opt, model=model)
    for iteration in range(4):
        w.batch([f"doc-{iteration}-a", f"doc-{iteration}-b"])
        opt.zero_grad()
        amp.forward(model, torch.randn(4, 8)).backward()
        if iteration == 3:
            amp.poison_grad(model.a.weight)
        opt.step()
    (poisoned,) = [e for e in events(w) if e["kind"] == "poisoned_step"]
    assert poisoned["iteration"] == 3 and poisoned["streak"] == 1
    assert poisoned["samples"]["ids"] == ["doc-3-a", "doc-3-b"]
    assert [(e["iteration"], e["samples"]["ids"]) for e in poisoned["samples_before"]] == [
        (i, [f"doc-{i}-a", f"doc-{i}-b"]) for i in range(3)]


@pytest.mark.parametrize(("ids", "error", "says"), [
    (torch.tensor([1.0, 2.0]), TypeError, "torch.float32"),
    (torch.zeros(2, dtype=torch.int64, device="meta"), ValueError, "on meta"),  # any device but the host
    ([1, 2.5], TypeError, "item 1 is a float"),
    ({"a": 1}, TypeError, "got a dict"),
    (True, TypeError, "bool"),
    (np.array([0.5]), TypeError, "float64"),
])
def test_ids_that_are_not_ints_or_strings_on_the_host_are_refused_at_the_call(amp, watching, ids, error, says):
    model = amp.TwoPart()
    w = watching(torch.amp.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=0.01), model=model)
    with pytest.raises(error, match=says):
        w.batch(ids)


def test_a_disabled_agent_takes_ids_and_does_nothing(monkeypatch):
    monkeypatch.setenv("AMPWATCH_DISABLED", "1")
    w = agent.watch(torch.amp.GradScaler("cpu"), torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
    assert isinstance(w, agent.DisabledWatch)
    assert w.batch([1, 2]) is None


def test_sample_ids_reach_the_collector_within_its_limits_long_string_ids_cut(amp, no_collector):
    long_ids = [f"{'x' * 200}-{k}" for k in range(3)]  # past the protocol's 128 characters
    with RecordingCollector() as server:
        model = amp.TwoPart()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        w = agent.watch(scaler, opt, model=model, collector=server.url, run="samples", push_interval=0.05)
        for iteration in range(3):
            w.batch(long_ids if iteration == 2 else [iteration])
            _step(amp, model, scaler, opt, poisoned=iteration == 2)
        w.close()
    events = [e for body in server.bodies for e in json.loads(body)["events"]]
    for body in server.bodies:
        parse_batch(body)  # the collector's own schema: raises on a field past its limits
    (skip,) = _skips(events)
    limit = TEXT_LIMITS["sample_id"]
    assert [len(i) for i in skip["samples"]["ids"]] == [limit] * 3
    assert all(i.endswith("…") and i[:limit - 1] == full[:limit - 1] for i, full in zip(skip["samples"]["ids"],
                                                                                       long_ids, strict=True))
    assert skip["samples"]["digest"] == samples_digest(long_ids)  # of the whole ids, not the cut ones
    assert [e["samples"]["ids"] for e in skip["samples_before"]] == [[0], [1]]


def test_ids_recorded_in_a_loop_that_never_steps_are_bounded_and_the_latest_kept(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model)
    for k in range(10_000):  # an evaluation loop that records ids and never steps
        w.batch([k])
    assert len(w._recorder.samples._pending) <= 4096
    _step(amp, model, scaler, opt, poisoned=True)
    (skip,) = _skips(events(w))
    assert 2048 <= skip["samples"]["count"] <= 4096 and skip["samples"]["ids"][0] > 10_000 - 4096  # the latest
