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
    assert hook.flags.notes is None
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


def _backward(model, x):
    model(x).float().pow(2).mean().backward()


def _noted(flags):
    """Where each noted bucket's note lives: its fused flag's storage, or its extremes and their out= views."""
    notes = flags.notes
    return {i: (notes.flags[i].data_ptr(),) if notes.flags[i] is not None
            else (notes.extremes[i].data_ptr(), notes.outs[i][0].data_ptr()) for i in notes.noted()}


def _users_all_reduce(state, bucket):  # a user's own hook: DDP's all-reduce, called from another function
    return allreduce_hook(state, bucket)


@pytest.mark.parametrize("comm_hook", [None, _users_all_reduce], ids=["fused", "aminmax"])
def test_after_the_first_iterations_every_bucket_is_noted_into_the_same_storage(group, comm_hook):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    model = DistributedDataParallel(net, bucket_cap_mb=0.01)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = agent.watch(torch.amp.GradScaler("cpu"), opt, collector=(), run="t", ddp=model, comm_hook=comm_hook,
                        comm_state=dist.group.WORLD if comm_hook else None)
    try:
        flags = model._comm_hooks[0][0].flags
        assert flags.fused is (comm_hook is None)
        x = torch.randn(4, 64)
        for iteration in range(3):  # DDP rebuilds its buckets after the first backward
            _backward(model, x)
            flags.end_iteration(iteration, keep=False)
        _backward(model, x)
        storage = _noted(flags)
        assert len(storage) > 1
        for bucket in flags.notes.noted():  # world size 1: the all-reduce keeps the bucket's own values
            buffer = flags.notes.buckets[bucket].buffer()
            if comm_hook is None:
                assert flags.notes.flags[bucket].tolist() == [0.0] and buffer.isfinite().all()
            else:
                low, high = flags.notes.extremes[bucket].tolist()
                assert (low, high) == (buffer.min().item(), buffer.max().item())
        for iteration in range(4, 10):
            flags.end_iteration(iteration - 1, keep=False)
            _backward(model, x)
            assert _noted(flags) == storage
    finally:
        watch.close()


def test_notes_kept_for_pending_outcomes_name_their_own_iteration_and_are_recycled(group):
    from ampwatch.agent._origin import _KEPT_ITERATIONS

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DistributedDataParallel(net, bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = agent.watch(torch.amp.GradScaler("cpu"), opt, collector=(), run="t", ddp=model)
    try:
        flags = model._comm_hooks[0][0].flags
        clean, poisoned = torch.randn(3, 8), torch.randn(3, 8)
        poisoned[0, 0] = float("inf")
        bad = {2, _KEPT_ITERATIONS + 10}
        seen = set()
        for iteration in range(_KEPT_ITERATIONS + 12):
            model.zero_grad(set_to_none=True)
            _backward(model, poisoned if iteration in bad else clean)
            seen.add(id(flags.notes))
            flags.end_iteration(iteration, keep=True)  # as while a fused outcome is still on the device
        last = _KEPT_ITERATIONS + 11
        assert flags.report(2, current=False) == (None, False)  # older than the kept window: let go
        report, new = flags.report(_KEPT_ITERATIONS + 10, current=False)
        assert new and report.origin and report.buckets and report.params
        assert not flags.report(last, current=False)[0].origin
        assert flags.report(_KEPT_ITERATIONS + 10, current=False) == (report, False)
        assert len(seen) == _KEPT_ITERATIONS + 1  # the kept window and the current one, then recycled
        flags.end_iteration(last + 1, keep=False)  # the outcomes landed: everything back to the spares
        assert not flags._kept and len(flags._spare) == _KEPT_ITERATIONS
    finally:
        watch.close()


class _MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2).double()

    def forward(self, x):
        return self.head(self.body(x).double())


def test_buckets_of_different_dtypes_are_noted_and_only_the_one_holding_the_inf_is_named(group):
    torch.manual_seed(0)
    net = _MixedDtypes()
    model = DistributedDataParallel(net)  # DDP buckets by dtype: a float32 and a float64 bucket
    poison = []
    net.head.bias.register_hook(lambda grad: grad + float("inf") if poison else grad)
    watch = agent.watch(torch.amp.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=0.0), collector=(),
                        run="t", ddp=model)
    try:
        flags = model._comm_hooks[0][0].flags
        for iteration in range(4):
            poison[:] = [True] if iteration == 3 else []
            model.zero_grad(set_to_none=True)
            model(torch.randn(3, 4)).sum().backward()
            if iteration < 3:
                flags.end_iteration(iteration, keep=False)
        assert len(flags.notes.noted()) == 2
        dtypes = {flags.notes.buckets[i].buffer().dtype for i in flags.notes.noted()}
        assert dtypes == {torch.float32, torch.float64}
        report, _ = flags.report(3, current=True)
        assert report.origin and len(report.buckets) == 1
        assert "head.bias" in report.params and not any(name.startswith("body") for name in report.params)
    finally:
        watch.close()


def test_a_failing_fused_note_leaves_the_bucket_to_the_wrapped_all_reduce_and_is_counted(group, caplog):
    """The fused path replaces DDP's allreduce_hook (it divides and all-reduces itself); when its kernel fails,
    the bucket goes, undivided, through the wrapped allreduce_hook instead, and the failure is counted."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DistributedDataParallel(net, bucket_cap_mb=0.0001)  # several buckets
    twin = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    twin.load_state_dict(model.state_dict())
    watch = agent.watch(torch.amp.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=0.1), collector=(),
                        run="t", ddp=model)
    try:
        hook = model._comm_hooks[0][0]
        flags, wrapped_calls = hook.flags, []

        def wrapped(state, bucket):
            wrapped_calls.append(bucket.index())
            return allreduce_hook(state, bucket)
        hook.hook = wrapped
        x = torch.randn(3, 8)
        for _ in range(2):  # past DDP's bucket rebuild
            _backward(model, x)
            flags.end_iteration(0, keep=False)
        assert flags.fused and not wrapped_calls  # the fused path does the all-reduce itself

        def failing(*args):
            raise RuntimeError("kernel unavailable")
        flags._scale_and_flag = failing
        model.zero_grad(set_to_none=True)
        _backward(model, x)
        _backward(twin, x)
        assert len(wrapped_calls) > 1  # every bucket went through the wrapped all-reduce
        assert watch.snapshot()["state"]["delivery"]["agent_errors"] == len(wrapped_calls)
        assert "internal error in DDP comm hook" in caplog.text
        for mine, theirs in zip(net.parameters(), twin.module.parameters()):
            assert torch.equal(mine.grad, theirs.grad)
    finally:
        watch.close()


def test_ddps_builtin_multiplies_only_where_it_copies_every_gradient_into_its_bucket(group):
    """DDP's built-in multiplies by 1/world size a gradient it copies into its bucket, and divides one that
    already is its bucket view (gradient_as_bucket_view=True) or a whole bucket (batched_grad_copy=True)."""
    from ampwatch.agent._device import ddp_builtin_multiplies

    def ddp(**kwargs):
        return DistributedDataParallel(nn.Linear(4, 2), **kwargs)
    assert ddp_builtin_multiplies(ddp()) is True
    assert ddp_builtin_multiplies(ddp(gradient_as_bucket_view=True)) is False
    assert ddp_builtin_multiplies(ddp(batched_grad_copy=True)) is False
    assert ddp_builtin_multiplies(nn.Linear(4, 2)) is False  # settings it cannot read: as if it divided


class _Bucket:
    """What the origin hook asks of DDP's GradBucket."""

    def __init__(self, index: int, buffer: torch.Tensor) -> None:
        self._index, self._buffer = index, buffer

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list:
        return []


def test_the_fused_path_at_three_ranks_scales_each_bucket_as_ddps_builtin_multiplies_it():
    """At a world size that is not a power of two the hook is fused only where the built-in multiplies; then
    float32, bfloat16 and float16 buckets go through the kernel (its float32 1/3 is the built-in's scalar for
    them) and float64 ones (also one that was float32 before DDP rebuilt its buckets) through aminmax and
    ``mul_(1/3)``, the built-in's double scalar; each result is bit for bit ``torch.mul(gradient, 1/3)``, as
    the built-in's ``mul_out``."""
    from ampwatch.agent._origin import OriginFlags
    from ampwatch.agent._params import ParameterNames

    assert OriginFlags(ParameterNames()).fuse(3) is False  # as allreduce_hook's division: not a multiply
    assert OriginFlags(ParameterNames()).fuse(4) is True and OriginFlags(ParameterNames()).fuse(0) is False
    flags = OriginFlags(ParameterNames())
    assert flags.fuse(3, multiplies=True) is True and flags.fused
    grads = torch.randn(4, 10_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1e3
    grads[3, 7] = float("inf")
    for rebuilt in (False, True):
        for index, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float64)):
            if rebuilt:  # every index changes dtype, as when DDP rebuilds its buckets
                dtype = {torch.float32: torch.float64, torch.float64: torch.float32}.get(dtype, dtype)
            grad = grads[index].to(dtype)
            buffer = grad.clone()
            assert flags.note(_Bucket(index, buffer)) is buffer, (rebuilt, dtype)
            assert torch.equal(buffer, torch.mul(grad, 1 / 3)), (rebuilt, dtype)
            kernel = flags.notes.flags[index] is not None
            assert kernel is (dtype is not torch.float64), (rebuilt, dtype)
        report, _ = flags.report(iteration=rebuilt, current=True)
        assert report.origin and report.buckets == [3]  # the one bucket that held the inf, on either path
        flags.end_iteration(iteration=rebuilt, keep=False)
