"""The storm load generator (bench/_storm.py) sends what a real agent sends, and its batches pass the collector."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ampwatch_support.batches import APPLIED
from bench._loadgen_bodies import storm_template
from bench._storm import OPTIMIZERS, StormRank

CLEAN = 3
# (init_scale, skipped iterations, clean ones after, whether a checkpoint is restored first): a storm that ends, one
# whose backoffs reach 0.0 (a scale of 0.0 makes every later gradient NaN, so that storm never ends: the run stops
# in it), and one ended by restoring the checkpoint taken before it (the scaler's state comes back).
SCENARIOS = {"ends": (65536.0, 40, 2, False), "reaches_zero": (2.0 ** -120, 40, 0, False),
             "restored": (65536.0, 40, 2, True)}
_SHAPE = ("kind", "optimizer", "iteration", "streak", "cause", "before", "after", "count", "start_iteration", "length")


def _shape(events: list[dict]) -> list[tuple]:
    return [tuple(e.get(k, 1 if k == "count" and e["kind"] == "scale_change" else None) for k in _SHAPE)
            for e in events]


def _real_agent_storm(init_scale: float, storm: int, after: int, restore: bool) -> tuple[list[dict], dict]:
    from ampwatch import agent
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizers = {name: torch.optim.SGD(part.parameters(), lr=0.01)
                  for name, part in zip(OPTIMIZERS, model, strict=True)}
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2000)
    watch = agent.watch(scaler, optimizers, model=model, collector=(), run="storm-truth")
    checkpoint = None
    try:
        for i in range(CLEAN + storm + after):
            if i == CLEAN:
                checkpoint = scaler.state_dict()
            if restore and i == CLEAN + storm:
                scaler.load_state_dict(checkpoint)
            for opt in optimizers.values():
                opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(2, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if CLEAN <= i < CLEAN + storm:  # an inf reaches every optimizer, as DDP's all-reduce spreads one
                for part in model:
                    part.weight.grad.view(-1)[0] = float("inf")
            for opt in optimizers.values():
                scaler.step(opt)
            scaler.update()
        events = watch._recorder.events.drain()  # no public API returns them; no sender runs (collector=())
        return events, watch.snapshot()["state"]
    finally:
        watch.close(timeout=1.0)


@pytest.mark.parametrize("pattern", ["streaks", "per-skip"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_storm_generator_sends_the_counters_and_events_of_a_real_agent(scenario, pattern, monkeypatch):
    for var in ("AMPWATCH_URL", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)
    init_scale, storm, after, restore = SCENARIOS[scenario]
    events, state = _real_agent_storm(init_scale, storm, after, restore)
    model = StormRank(pattern, iterations=1, scale=init_scale)
    modelled = [e for skipping in [False] * CLEAN + [True] * storm for e in model.push(skipping)]
    if restore:
        modelled += model.restore(init_scale)
    modelled += [e for _ in range(after) for e in model.push(False)]
    got = model.state()
    assert (got["iteration"], got["loss_scale"], got["backoffs"]) == \
        (state["iteration"], state["loss_scale"], state["backoffs"])
    assert got["backoffs"] == (30 if scenario == "reaches_zero" else 40)  # 2**-120 -> 2**-149 -> 0.0, then no change
    for name in OPTIMIZERS:
        assert got["optimizers"][name] == state["optimizers"][name], name
    if pattern == "streaks":  # this tree's agent, event for event
        assert _shape(modelled) == _shape(events)
    else:  # the agent before issue 14: every skip and every backoff, the same totals
        assert [e["streak"] for e in modelled if e["kind"] == "skip" and e["optimizer"] == "gen"] == \
            list(range(1, storm + 1))
        assert sum(e.get("cause") == "backoff" for e in modelled) == state["backoffs"]
    assert sum(e.get("count", 1) for e in events if e.get("cause") == "backoff") == state["backoffs"]
    assert [(e["before"], e["after"]) for e in events if e.get("cause") == "restored"] == \
        ([(65536.0 * 0.5 ** storm, 65536.0)] if restore else [])


def test_storm_batches_are_accepted_and_applied_by_the_collector(tmp_path):
    from fastapi.testclient import TestClient

    from ampwatch.server import ServerConfig, create_app

    build = storm_template("storm-accept", 0, 1, "streaks")
    config = ServerConfig(db=str(tmp_path / "ampwatch.db"), allowed_hosts=("testserver",))  # TestClient's Host
    with TestClient(create_app(config)) as client:
        for seq, storm in enumerate([False, True, True, False], start=1):  # 10 iterations a push
            answer = client.post("/v1/ingest", content=build(seq, storm), headers={"Content-Type": "application/json"})
            assert answer.json() == APPLIED, answer.text
        events = client.get("/v1/runs/storm-accept/events", params={"limit": 1000}).json()["events"]
        run = client.get("/v1/runs/storm-accept").json()
    backoffs = [e for e in events if e["kind"] == "scale_change"]
    assert sum(e["count"] for e in backoffs) == run["ranks"][0]["backoffs"] == 20
    assert {(e["optimizer"], e["length"]) for e in events if e["kind"] == "streak_end"} == \
        {(name, 20) for name in OPTIMIZERS}
    assert json.loads(build(5, False))["state"]["optimizers"]["gen"]["skipped"] == 20
