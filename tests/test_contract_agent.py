"""Contract: batches the real agent sends (real GradScaler, a real skip) validate against the collector's schema."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ampwatch import agent
from ampwatch.contract.batch import (
    EVENTS,
    STAMPED,
    DeliveryCounters,
    OptimizerCounters,
    ParamCount,
    RankState,
    fields,
    required,
)
from ampwatch.contract.protocol import STREAK_LADDER
from ampwatch.server._batch_parse import parse_batch
from ampwatch.server._schema import Batch
from ampwatch_support.batches import SENT_WHEN_PRESENT
from ampwatch_support.ports import free_port
from ampwatch_support.recording_collector import RecordingCollector


def _nan_in_second_then_clip_all(model, scaler, opt_a, opt_b) -> None:
    """Whole-model clipping after unscaling both: the second optimizer's NaN reaches the first after its inf
    check, so the first steps with NaN gradients (a poisoned step) and then skips ever after."""
    model[1].bias.grad[0] = float("nan")
    scaler.unscale_(opt_a)
    scaler.unscale_(opt_b)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


@pytest.fixture(scope="module")
def agent_bodies():
    """What the real agent sent (real GradScaler, real skips, DDP's origin watched), every event kind among it, as
    raw JSON bodies."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        return _agent_bodies()
    finally:
        dist.destroy_process_group()


def _agent_bodies() -> list[bytes]:
    with RecordingCollector() as server:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        ddp = DistributedDataParallel(model)
        opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
        opt_b = torch.optim.AdamW(model[1].parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.StepLR(opt_a, step_size=100)
        scaler = torch.amp.GradScaler("cpu", growth_interval=3)
        # grad_norm=True: each step's norm is watched; the first optimizer's NaN step at 12 is a grad_norm_spike,
        # the inf inputs at 4 and 5 loss_spikes.
        watch = agent.watch(scaler, {"first": opt_a, "second": opt_b}, model=model, schedulers={"first": schedule},
                            ddp=ddp, collector=server.url, run="contract", push_interval=0.05, grad_norm=True)
        for iteration in range(14):
            watch.batch([iteration, f"sample-{iteration}"])  # samples and samples_before on skips and poisoned steps
            x = torch.randn(8, 4)
            if iteration in (4, 5):
                x[0, 0] = float("inf")  # non-finite gradients: both optimizers skip, the scale backs off
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ddp(x).float().pow(2).mean()
            opt_a.zero_grad()
            opt_b.zero_grad()
            scaler.scale(loss).backward()
            if iteration == 12:
                _nan_in_second_then_clip_all(model, scaler, opt_a, opt_b)
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            if iteration == 6:
                opt_b.step()  # a warning: stepped outside the watched scaler's step()
            schedule.step()  # after a skip: a scheduler_after_skip
        watch.close()
        off = agent.watch(torch.amp.GradScaler("cpu", enabled=False), {"off": torch.optim.SGD(
            torch.nn.Linear(1, 1).parameters(), lr=0.1)}, collector=server.url, run="contract-off",
            push_interval=0.05)
        off.close()
    assert server.bodies, "the agent sent nothing"
    return list(server.bodies)


def test_batches_from_the_real_agent_validate_against_the_collector_schema(agent_bodies):
    batches: list[Batch] = [parse_batch(body) for body in agent_bodies]  # raises with the field on a mismatch
    kinds = {event.kind for b in batches for event in b.events}
    assert kinds == set(EVENTS), "the run must show every event kind the contract declares"
    assert any(event.origin for b in batches for event in b.events if event.kind == "skip")
    assert any(event.samples_before for b in batches for event in b.events if event.kind == "skip")
    assert any(event.samples for b in batches for event in b.events if event.kind == "poisoned_step")
    assert any(b.device is not None for b in batches)
    last = [b for b in batches if b.run == "contract"][-1]
    assert last.closed
    first, second = last.state.optimizers["first"], last.state.optimizers["second"]
    # Both skip at 4 and 5; at 12 the second skips and the first steps with NaN (poisoned); at 13 both skip.
    assert (first.skipped, first.poisoned_steps, first.streaks_reached) == (3, 1, {"1": 2, "2": 1})
    assert (second.skipped, second.poisoned_steps, second.streaks_reached) == (4, 0, {"1": 2, "2": 2})
    seqs = [b.seq for b in batches if b.run == "contract"]
    assert seqs == list(range(1, len(seqs) + 1))


def undeclared(body: dict) -> list[str]:
    """Every field of a batch's ``state`` and ``events`` that ``ampwatch.contract.batch`` does not declare, and
    every event that lacks one the contract says it must have, as ``path: field``."""
    state, problems = body["state"], []

    def check(path: str, value: dict, part: type) -> None:
        problems.extend(f"{path}: {key}" for key in value if key not in fields(part))

    check("state", state, RankState)
    check("state.delivery", state.get("delivery", {}), DeliveryCounters)
    for name, counters in state["optimizers"].items():
        check(f"state.optimizers.{name}", counters, OptimizerCounters)
        problems.extend(f"state.optimizers.{name}.streaks_reached: {key}" for key in counters["streaks_reached"]
                        if key not in map(str, STREAK_LADDER))
    for i, event in enumerate(body["events"]):
        part = EVENTS[event["kind"]]
        check(f"events[{i}] ({event['kind']})", event, part)
        problems.extend(f"events[{i}] ({event['kind']}) lacks {key}" for key in required(part) | set(STAMPED)
                        if key not in event)
        for param in event.get("params", []):
            check(f"events[{i}].params", param, ParamCount)
    return problems


def test_every_field_the_real_agent_sends_is_one_the_contract_declares(agent_bodies):
    # The collector ignores fields it does not know: a misspelt one would pass the schema and be lost.
    sent = [json.loads(body) for body in agent_bodies]
    assert [problem for body in sent for problem in undeclared(body)] == []
    # Every counter the contract declares is sent (an agent-side rename would leave its old name out): always, but
    # those sent only when nonzero or present (spike counters, levels), which some batch of the run must hold.
    always = set(fields(OptimizerCounters)) - set(SENT_WHEN_PRESENT)
    for body in sent:
        assert all(always <= set(c) <= set(fields(OptimizerCounters)) for c in body["state"]["optimizers"].values())
        assert set(body["state"]["delivery"]) == set(fields(DeliveryCounters))
    seen = {key for body in sent for c in body["state"]["optimizers"].values() for key in c}
    # local_grad_norm: with ddp=, this rank's own norm (the branch that adds it extends this run to send it).
    assert seen >= always | {"grad_norm_spikes", "grad_norm"}
    assert {"loss", "loss_spikes"} <= {key for body in sent for key in body["state"]}


def test_the_batch_builder_of_tests_and_benchmarks_sends_the_contracts_counters():
    from ampwatch_support.batches import OptimizerRun, make_batch, optimizer

    run = OptimizerRun()
    for iteration, skipped in enumerate((False, True, True, False, True)):
        run.skip(iteration) if skipped else run.step()
    assert run.counters() == optimizer(steps=2, skipped=3, consecutive=1, longest=2, streaks=2,
                                      reached={"1": 2, "2": 1})
    assert undeclared(make_batch(optimizers={"gen": run.counters()})) == []
    with pytest.raises(TypeError, match="poisoned"):
        optimizer(poisoned=1)


def test_the_contract_check_reports_what_a_typo_would_send():
    from ampwatch_support.batches import make_batch, skip_event

    body = make_batch(events=[dict(skip_event(1), scale_typo=2.0)])
    body["state"]["optimizers"]["gen"]["skiped"] = 1
    assert undeclared(body) == ["state.optimizers.gen: skiped", "events[0] (skip): scale_typo"]


@pytest.mark.timeout(60)
def test_poisoned_steps_of_a_bf16_ddp_job_without_a_scaler_validate_with_their_origin():
    # watch(None, ..., ddp=model) in a one-rank gloo group: poisoned_step events carry streak, exact and origin.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ampwatch_support.ports import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with RecordingCollector() as server:
            torch.manual_seed(0)
            model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            watch = agent.watch(None, {"net": opt}, ddp=model, collector=server.url, run="contract-bf16",
                                push_interval=0.05)
            for iteration in range(4):
                x = torch.randn(8, 4)
                if iteration == 1:
                    x[0, 0] = float("inf")  # poisons this step, and through the weights every later one
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(x).float().pow(2).mean().backward()
                opt.step()
            watch.close()
    finally:
        dist.destroy_process_group()
    batches: list[Batch] = [parse_batch(body) for body in server.bodies]
    poisoned = [e for b in batches for e in b.events if e.kind == "poisoned_step"]
    assert [(e.iteration, e.streak, e.origin, e.exact) for e in poisoned] == [(1, 1, True, True), (2, 2, True, True)]
    assert poisoned[0].origin_params == ["0.weight", "0.bias", "1.weight", "1.bias"]
    last = batches[-1]
    assert last.state.optimizers["net"].poisoned_steps == 3 and last.state.origin_iterations == 3
    assert last.scaler.kind == "none" and last.state.loss_scale is None


def _max_length(model: type, field: str) -> int:
    """The ``max_length`` the collector's schema puts on ``model.field`` (an optional one's, on what it holds)."""
    import typing

    import msgspec

    kind = next(f.type for f in msgspec.structs.fields(model) if f.name == field)
    while typing.get_origin(kind) is typing.Union:
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    return next(m.max_length for m in typing.get_args(kind)[1:] if getattr(m, "max_length", None) is not None)


def test_the_agent_and_the_collectors_schema_and_defaults_keep_to_the_one_contract():
    # The agent cannot import the server (no web stack in a training image): both read ampwatch.contract.
    import typing

    from ampwatch.agent import _batch, _limits
    from ampwatch.contract import protocol
    from ampwatch.server import ServerConfig
    from ampwatch.server._schema import (
        AgentInfo,
        Batch,
        Began,
        DeviceInfo,
        Event,
        ParamDetail,
        PoisonedStepEvent,
        SampleId,
        Samples,
        ScalerInfo,
        SchedulerAfterSkipEvent,
        SkipEvent,
        WarningEvent,
    )

    sample_text = next(arg for arg in typing.get_args(SampleId) if typing.get_args(arg)[0] is str)

    enforced = {
        "label": _max_length(Batch, "run"),
        "param_name": _max_length(ParamDetail, "name"),
        "scheduler": _max_length(SchedulerAfterSkipEvent, "scheduler"),
        "warning_code": _max_length(WarningEvent, "code"),
        "warning_message": _max_length(WarningEvent, "message"),
        "host": _max_length(Batch, "host"),
        "version": _max_length(AgentInfo, "version"),
        "scaler_kind": _max_length(ScalerInfo, "kind"),
        "sample_id": typing.get_args(sample_text)[1].max_length,
        "module": _max_length(Began, "module"),
        "module_type": _max_length(Began, "module_type"),
        "device_text": _max_length(DeviceInfo, "type"),
    }
    assert {_max_length(DeviceInfo, name) for name in ("uuid", "pci_bus_id")} == {protocol.TEXT_LIMITS["device_text"]}
    assert protocol.MAX_SAMPLE_IDS == _max_length(Samples, "ids")
    assert protocol.MAX_SAMPLES_BEFORE == _max_length(SkipEvent, "samples_before")
    assert enforced == protocol.TEXT_LIMITS and _max_length(AgentInfo, "torch") == protocol.TEXT_LIMITS["version"]
    assert protocol.MAX_PARAMS == _max_length(SkipEvent, "params") == _max_length(PoisonedStepEvent, "params")
    assert protocol.MAX_BATCH_EVENTS == _max_length(Batch, "events")
    kinds = [model.__struct_config__.tag for model in typing.get_args(Event)]
    assert tuple(kinds) == protocol.EVENT_KINDS
    defaults = ServerConfig()
    assert {name: getattr(defaults, name) for name in protocol.COLLECTOR_DEFAULTS} == protocol.COLLECTOR_DEFAULTS
    assert defaults.max_label_length == protocol.TEXT_LIMITS["label"]
    assert (_limits.TEXT_LIMITS, _limits.COLLECTOR_DEFAULTS, _batch.PROTOCOL_VERSION) == \
        (protocol.TEXT_LIMITS, protocol.COLLECTOR_DEFAULTS, protocol.PROTOCOL_VERSION)


def test_non_finite_scales_from_the_agents_encoder_validate_as_what_they_are():
    import math

    from ampwatch.agent._batch import encode_batch
    from ampwatch_support.batches import make_batch

    batch = make_batch(loss_scale=math.nan, events=[{"id": 1, "kind": "scale_change", "time": 1.0, "iteration": 0,
                                                     "cause": "restored", "before": math.inf, "after": 0.0}])
    batch["scaler"]["growth_factor"] = math.inf
    parsed = parse_batch(encode_batch(batch))
    assert math.isnan(parsed.state.loss_scale) and parsed.scaler.growth_factor == math.inf
    assert (parsed.events[0].cause, parsed.events[0].before, parsed.events[0].after) == ("restored", math.inf, 0.0)
