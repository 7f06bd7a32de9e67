"""The DDP origin hook in one process (gloo, world size 1): refusals, pass-through after close, pickles clean."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.distributed as dist
from ports import free_port
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ampwatch import agent


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _job():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return net, model, opt, torch.amp.GradScaler("cpu")


def _iterate(model, opt, scaler, x):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_a_model_that_is_not_ddp_and_a_hook_without_ddp_are_refused_leaving_nothing(group):
    net, model, opt, scaler = _job()
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        agent.watch(scaler, opt, collector=(), run="t", ddp=net)
    with pytest.raises(ValueError, match="ddp="):
        agent.watch(scaler, opt, collector=(), run="t", comm_hook=allreduce_hook)
    assert "step" not in vars(scaler) and not model._comm_hooks
    agent.watch(scaler, opt, collector=(), run="t").close()  # the scaler is free to be watched again


def test_after_close_the_hook_passes_through_and_the_model_pickles_without_the_agent(group):
    net, model, opt, scaler = _job()
    x = torch.randn(3, 4)
    x[0, 0] = float("inf")
    watch = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    _iterate(model, opt, scaler, x)
    assert watch.snapshot()["state"]["origin_iterations"] == 1
    assert "skipped iterations that started on this rank (DDP): 1" in watch.summary()
    hook, _ = model._comm_hooks[0]
    watch.close()
    assert not hook.flags.enabled
    _iterate(model, opt, scaler, x)  # still trains (the wrapped all-reduce runs), notes nothing
    assert hook.flags._current == []
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    assert "ampwatch" not in repr(model.state_dict().keys())
    copied = pickle.loads(pickle.dumps(hook))
    assert copied is allreduce_hook  # a pickled model carries the wrapped hook, not the agent


def test_a_model_with_a_builtin_hook_is_refused_with_what_to_do_leaving_nothing(group):
    net, model, opt, scaler = _job()
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)  # not listed in model._comm_hooks
    with pytest.raises(ValueError, match="comm_hook=hook"):
        agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    assert "step" not in vars(scaler) and not opt._optimizer_step_pre_hooks
    _iterate(model, opt, scaler, torch.randn(3, 4))  # the job trains on, with its own hook
