"""watch(..., ddp=model) in one process (gloo, world size 1): what it refuses, what it leaves behind, how it notes.

The real DDP reducer runs (world size 1 still buckets and all-reduces); the multi-rank matrix is
test_ddp_bit_identity.py.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ampwatch import agent
from ampwatch_support.ports import free_port
from ampwatch_support.syncs import SyncCounter  # the counter test_recording_cost.py uses


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _job(**ddp_options):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DistributedDataParallel(net, **ddp_options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return net, model, opt, torch.amp.GradScaler("cpu")


def _iterate(model, opt, scaler, x):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def _poisoned(rows: int = 3, columns: int = 4) -> torch.Tensor:
    x = torch.randn(rows, columns)
    x[0, 0] = float("inf")
    return x


def _skips(watch) -> list[dict]:
    return [e for e in watch._recorder.events.drain() if e["kind"] == "skip"]


def _hooks_on(module: nn.Module) -> int:
    return sum(len(p._backward_hooks or {}) for p in module.parameters())


def test_a_model_that_is_not_ddp_and_the_old_comm_hook_arguments_are_refused_leaving_nothing(group, monkeypatch):
    net, model, opt, scaler = _job()
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        agent.watch(scaler, opt, collector=(), run="t", ddp=net)
    for arguments in ({"comm_hook": allreduce_hook}, {"comm_state": dist.group.WORLD}):
        with pytest.raises(TypeError, match=r"model\.register_comm_hook\(state, hook\)"):
            agent.watch(scaler, opt, collector=(), run="t", ddp=model, **arguments)
    monkeypatch.setenv("AMPWATCH_DISABLED", "1")  # disabled, the job would silently train without its hook
    with pytest.raises(TypeError, match="comm_hook"):
        agent.watch(scaler, opt, collector=(), run="t", ddp=model, comm_hook=allreduce_hook)
    monkeypatch.delenv("AMPWATCH_DISABLED")
    assert "step" not in vars(scaler) and not model._comm_hooks and _hooks_on(net) == 0
    agent.watch(scaler, opt, collector=(), run="t").close()  # the scaler is free to be watched again


def test_close_takes_every_hook_off_and_nothing_of_the_agent_is_pickled_or_copied_with_the_model(group):
    net, model, opt, scaler = _job()
    watch = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    assert _hooks_on(net) == 4 and not model._comm_hooks  # one hook per parameter; DDP's reduction its own
    _iterate(model, opt, scaler, _poisoned())
    assert watch.snapshot()["state"]["origin_iterations"] == 1
    assert "skipped iterations that started on this rank (DDP): 1" in watch.summary()
    for thing in (net, model.state_dict()):  # while watching: a checkpoint or a pickled module carries nothing of ours
        buffer = io.BytesIO()
        torch.save(thing, buffer)
        assert b"ampwatch" not in buffer.getvalue()
    assert _hooks_on(copy.deepcopy(net)) == 0 and b"ampwatch" not in pickle.dumps(net)
    watch.close()
    assert _hooks_on(net) == 0 and not model._comm_hooks
    _iterate(model, opt, scaler, torch.randn(3, 4))  # trains on, as if never watched


def test_a_ddp_model_can_be_watched_again_open_or_closed_and_each_watch_names_its_origin(group):
    """A second watch of the same model (a notebook cell run again with a new scaler, a second phase)."""
    net, model, opt, scaler = _job()
    first = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    _iterate(model, opt, scaler, torch.randn(3, 4))
    scaler = torch.amp.GradScaler("cpu")  # the old watch is left open, its handle overwritten
    second = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    _iterate(model, opt, scaler, _poisoned())
    assert [e["origin"] for e in _skips(second)] == [True]
    second.close()
    first.close()
    assert _hooks_on(net) == 0
    third = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    _iterate(model, opt, scaler, _poisoned())
    assert [e["origin"] for e in _skips(third)] == [True]
    third.close()


class _Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4, sparse=True)
        self.dense = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (self.table(ids) * scale).sum() + self.dense(x).sum()


def test_a_sparse_embedding_gradient_is_noted_and_named_without_an_error(group):
    """nn.Embedding(sparse=True): its gradient is a sparse tensor; an inf in it (and only in it) makes this rank
    the origin, naming the embedding, and nothing fails on the iterations before or after."""
    torch.manual_seed(0)
    net = _Embedder()
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    watch = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    try:
        for iteration in range(4):
            scale = torch.full((3, 1), float("inf") if iteration == 2 else 1.0)
            opt.zero_grad()
            scaler.scale(model(torch.tensor([1, 2, 3]), scale, torch.randn(3, 4))).backward()
            assert net.table.weight.grad.is_sparse
            scaler.step(opt)
            scaler.update()
        skips = _skips(watch)
        assert [(e["iteration"], e["origin"], e["origin_params"]) for e in skips] == [(2, True, ["table.weight"])]
        assert watch.snapshot()["state"]["delivery"]["agent_errors"] == 0
    finally:
        watch.close()


def test_an_inf_in_any_backward_of_an_iteration_is_kept_and_the_next_iteration_starts_afresh(group):
    """Several backwards before one step (micro-batches, here without no_sync()): an inf in the first is not
    overwritten by the finite ones after it; the iteration after the skip names no origin. After the first
    iterations the notes are written into the same storage."""
    net, model, opt, scaler = _job()
    watch = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    local = watch._recorder.origin
    try:
        storage = []
        for iteration in range(6):
            opt.zero_grad()
            for micro in range(3):
                x = _poisoned() if (iteration, micro) == (2, 0) else torch.randn(3, 4)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
            storage.append([g.extremes.data_ptr() for g in local._groups])
            scaler.step(opt)
            scaler.update()
        assert [(e["iteration"], e["origin"]) for e in _skips(watch)] == [(2, True)]
        assert storage[1:] == storage[-1:] * 5
        assert local._groups[0].extremes.shape[0] == 4  # rows grew by doubling to hold three backwards
    finally:
        watch.close()


def test_notes_an_earlier_iteration_wrote_are_not_read_as_this_ones(group):
    """Rows and parameters an iteration did not write still hold an earlier iteration's notes: a skip whose inf
    came after DDP's all-reduce (written into ``.grad`` after backward here) must not be taken for this rank's
    own because of them: after an iteration of two backwards whose second held an inf, an iteration of one;
    after an iteration whose every gradient held one, an iteration where the head takes no gradient."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DistributedDataParallel(net, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    watch = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    try:
        plan = [([torch.randn(3, 4), _poisoned()], False), ([torch.randn(3, 4)], True), ([_poisoned()], False),
                ([torch.randn(3, 8)], True)]
        for inputs, after in plan:
            opt.zero_grad()
            for x in inputs:
                body_only = x.shape[1] == 8  # only the head runs: the first layer writes no note
                out = model.module[2:](x) if body_only else model(x)
                scaler.scale(out.float().pow(2).mean()).backward()
            if after:  # an inf that no rank's own gradient held
                next(p for p in net.parameters() if p.grad is not None).grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        assert [(e["iteration"], e["origin"]) for e in _skips(watch)] == [(0, True), (1, False), (2, True),
                                                                          (3, False)]
    finally:
        watch.close()


def test_flags_kept_for_pending_outcomes_name_their_own_iteration_and_are_let_go(group):
    from ampwatch.agent._origin import _KEPT_ITERATIONS

    net, model, opt, scaler = _job()
    watch = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    local = watch._recorder.origin
    try:
        clean, poisoned = torch.randn(3, 4), _poisoned()
        bad = {2, _KEPT_ITERATIONS + 10}
        for iteration in range(_KEPT_ITERATIONS + 12):
            model.zero_grad(set_to_none=True)
            model(poisoned if iteration in bad else clean).sum().backward()
            local.end_iteration(iteration, keep=True)  # as while a fused outcome is still on the device
        last = _KEPT_ITERATIONS + 11
        assert local.report(2, current=False) == (None, False)  # older than the kept window: let go
        report, new = local.report(_KEPT_ITERATIONS + 10, current=False)
        assert new and report.params == ["0.weight", "2.weight"]  # the ones whose own gradients held it
        assert not local.report(last, current=False)[0].origin
        assert local.report(_KEPT_ITERATIONS + 10, current=False) == (report, False)
        local.end_iteration(last + 1, keep=False)  # the outcomes landed
        assert not local._kept and not local._reports
    finally:
        watch.close()


class _MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.middle = nn.Linear(8, 8).to(torch.bfloat16)
        self.head = nn.Linear(8, 2).double()

    def forward(self, x):
        return self.head(self.middle(self.body(x).bfloat16()).double())


def test_parameters_of_different_dtypes_are_noted_and_only_those_holding_the_inf_are_named(group):
    torch.manual_seed(0)
    net = _MixedDtypes()
    model = DistributedDataParallel(net)
    poison = []
    net.head.bias.register_hook(lambda grad: grad + float("inf") if poison else grad)
    watch = agent.watch(torch.amp.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=0.0), collector=(),
                        run="t", ddp=model)
    local = watch._recorder.origin
    try:
        assert {g.extremes.dtype for g in local._groups} == {torch.float32, torch.bfloat16, torch.float64}
        for iteration in range(3):
            poison[:] = [True] if iteration == 2 else []
            model.zero_grad(set_to_none=True)
            model(torch.randn(3, 4)).sum().backward()
            report, _ = local.report(iteration, current=True)
            local.end_iteration(iteration, keep=False)
            assert report.origin is (iteration == 2)
        assert report.params == ["head.bias"] and report.params_total == 1
    finally:
        watch.close()


def test_a_gradient_inside_the_autograd_graph_and_a_failing_note_never_fail_the_backward(monkeypatch, caplog):
    """On a plain module (DDP itself refuses ``backward(create_graph=True)`` here): gradients that require grad
    are noted detached; a note that fails is counted and the gradients are those of the same module unwatched."""
    from ampwatch.agent._errors import AgentErrors
    from ampwatch.agent._origin import LocalGradients

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    twin = copy.deepcopy(net)
    errors = AgentErrors()
    local = LocalGradients(net.named_parameters(), errors)
    local.attach()
    try:
        net(_poisoned()).sum().backward(create_graph=True)
        report, _ = local.report(0, current=True)
        assert report.params == ["0.weight", "2.weight"] and errors.count == 0
        local.end_iteration(0, keep=False)
        net.zero_grad(set_to_none=True)

        def failing(*args, **kwargs):
            raise RuntimeError("kernel unavailable")
        monkeypatch.setattr("ampwatch.agent._origin._aminmax", failing)
        x = torch.randn(3, 4)
        net(x).sum().backward()
        twin(x).sum().backward()
        assert errors.count == 4  # counted, once per parameter
        assert "internal error in DDP gradient note" in caplog.text
        for mine, theirs in zip(net.parameters(), twin.parameters(), strict=True):
            assert torch.equal(mine.grad, theirs.grad)
    finally:
        local.close()
    assert _hooks_on(net) == 0


def test_nonfinite_gives_other_readers_one_on_device_flag_per_iteration_without_a_sync(group):
    """The seam for other agent code (e.g. bfloat16 jobs without a scaler): whether this rank's own gradients held
    inf/NaN in the current iteration, as a 0-d bool tensor, made without reading anything back."""
    net, model, opt, scaler = _job()
    watch = agent.watch(scaler, opt, collector=(), run="t", ddp=model)
    local = watch._recorder.origin
    try:
        assert local.nonfinite() is None
        for iteration, x in enumerate((torch.randn(3, 4), _poisoned(), torch.randn(3, 4))):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            with SyncCounter() as counter:
                flag = local.nonfinite()
            assert counter.syncs == 0 and flag.dtype == torch.bool and flag.dim() == 0
            assert flag.item() is (iteration == 1)
            local.end_iteration(iteration, keep=False)
            assert local.nonfinite() is None
    finally:
        watch.close()


def test_clean_iterations_cost_no_device_sync_and_report_nothing(group):
    syncs = {}
    for ddp in (False, True):
        net, model, opt, scaler = _job()
        watch = agent.watch(scaler, opt, collector=(), run="t", **({"ddp": model} if ddp else {"model": net}))
        try:
            _iterate(model, opt, scaler, torch.randn(3, 4))
            with SyncCounter() as counter:
                for _ in range(5):
                    _iterate(model, opt, scaler, torch.randn(3, 4))
            syncs[ddp] = counter.syncs
            assert _skips(watch) == [] and watch.snapshot()["state"].get("origin_iterations", 0) == 0
        finally:
            watch.close()
    assert syncs[True] == syncs[False] > 0  # the counter works: the scaler reads found_inf once per step


def test_parameters_ddp_ignores_are_not_watched(group):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["2.weight", "2.bias"])
    model = DistributedDataParallel(net)
    watch = agent.watch(torch.amp.GradScaler("cpu"), torch.optim.SGD(net.parameters(), lr=0.1), collector=(),
                        run="t", ddp=model)
    try:
        assert watch._recorder.origin.names == ["0.weight", "0.bias"]
    finally:
        watch.close()


def test_without_a_scaler_a_poisoned_step_says_whether_this_rank_s_own_gradients_held_the_inf(group):
    """watch(None, ..., ddp=model), two optimizers, two micro-batches per step. The job zeroes non-finite
    gradients before its steps (a step pre-hook of its own), so the weights stay finite and later iterations
    are clean. Iteration 1: an inf in the first micro-batch's input (own: origin). Iteration 3: an inf put into
    the reduced gradient after backward (not own: no origin, although iteration 1's notes held one).
    Iteration 4: an inf in 2.weight's own gradient only, so only the second optimizer's step is poisoned."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DistributedDataParallel(net)
    first, second = torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.SGD(net[2].parameters(), lr=0.1)
    iteration = 0
    net[2].weight.register_hook(lambda g: g.clone().fill_(float("inf")) if iteration == 4 else None)
    watch = agent.watch(None, {"first": first, "second": second}, collector=(), run="t", ddp=model)

    def zero_nonfinite(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad.nan_to_num_(0.0, 0.0, 0.0)

    for opt in (first, second):
        opt.register_step_pre_hook(zero_nonfinite)
    try:
        for iteration in range(6):
            for opt in (first, second):
                opt.zero_grad()
            for micro in range(2):
                x = _poisoned() if (iteration, micro) == (1, 0) else torch.randn(3, 4)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(x).float().pow(2).mean().backward()
            if iteration == 3:
                net[2].bias.grad[0] = float("inf")
            first.step()
            second.step()
        drained = watch._recorder.events.drain()
        poisoned = [(e["iteration"], e["optimizer"], e["origin"], e["origin_params"])
                    for e in drained if e["kind"] == "poisoned_step"]
        assert poisoned == [(1, "first", True, ["0.weight", "0.bias", "2.weight", "2.bias"]),
                            (1, "second", True, ["0.weight", "0.bias", "2.weight", "2.bias"]),
                            (3, "second", False, []), (4, "second", True, ["2.weight"])]
        assert watch.snapshot()["state"]["origin_iterations"] == 2
        assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
    finally:
        watch.close()
    assert _hooks_on(net) == 1  # the job's own hook: ampwatch's came off


def test_without_a_scaler_a_check_landing_late_gets_the_origin_of_its_own_iteration(group, late_checks):
    """A GPU's check lands after its step (held back by hand here, the rest real): the DDP notes of its iteration
    are kept on the device until then, apart from the next iteration's. Iteration 0: an own inf. Iteration 1: an
    inf put into the reduced gradient only. Both land at iteration 2's step."""
    held = late_checks
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = agent.watch(None, opt, collector=(), run="t", ddp=model)
    try:
        for iteration in range(3):
            if iteration == 2:
                for read in held:
                    read.landed = True
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(_poisoned() if iteration == 0 else torch.randn(3, 4)).float().pow(2).mean().backward()
            if iteration == 1:
                net[2].bias.grad[0] = float("inf")
            opt.step()
            with torch.no_grad():
                for p in net.parameters():
                    p.nan_to_num_(0.0, 0.0, 0.0)  # the weights put right, as a job reloading them would
        poisoned = [(e["iteration"], e["exact"], e["origin"], e["origin_params_total"])
                    for e in watch._recorder.events.drain() if e["kind"] == "poisoned_step"]
        assert poisoned == [(0, False, True, 4), (1, False, False, 0)]
    finally:
        watch.close()
