"""The two-stage non-finite scan: which tensors hold inf/NaN (stage 1), and exactly how many (stage 2).

Stage 1 has three ways to flag tensors: stacks of small same-shaped tensors (CPU), one
``torch.aminmax`` per tensor (larger CPU tensors, and any device without the next one) and one
``torch._foreach_norm`` call per device and dtype (GPUs; a private op). Every case is checked on
each against the truth computed element by element; the GPU's batched call runs here on CPU tensors.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from ampwatch.agent import _device
from ampwatch.agent._params import MAX_NAMED_PARAMS, ParameterNames, scan_optimizers

INF, NAN = math.inf, math.nan
SIZES = (1, 7, 16, 256, 257, 5000)


def truth(tensors) -> list[int]:
    """Positions of the tensors holding inf/NaN, element by element (the slow, obviously right way)."""
    out = []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if t.is_sparse:
            t = t.coalesce().values()
        if t.is_floating_point() or t.is_complex():
            if not torch.isfinite(t.to(torch.complex128 if t.is_complex() else torch.float64)).all():
                out.append(i)
    return out


@pytest.fixture(params=["default", "stacked-only", "per-tensor-only"])
def routing(request, monkeypatch):
    """Route stage 1 on CPU through the default split by size, only stacks, or only one aminmax per tensor."""
    if request.param == "stacked-only":
        monkeypatch.setattr(_device, "CPU_STACK_MAX_NUMEL", 10 ** 12)
        monkeypatch.setattr(_device, "_STACK_MAX_ELEMENTS", 3000)  # several chunks per stack here
    elif request.param == "per-tensor-only":
        monkeypatch.setattr(_device, "CPU_STACK_MAX_NUMEL", 0)
    return request.param


def planted(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]]:
    """Tensors of every size with inf, -inf or NaN at the first, middle or last element, and clean ones."""
    finfo = torch.finfo(dtype)
    tensors = []
    for size in SIZES:
        for value in (INF, -INF, NAN):
            for where in {0, size // 2, size - 1}:
                t = torch.randn(size).to(dtype)
                t[where] = value
                tensors.append(t)
        # Clean, including the extremes a scale-up can reach: never flagged.
        tensors.append(torch.full((size,), finfo.max, dtype=dtype))
        tensors.append(torch.full((size,), -finfo.max, dtype=dtype))
        tensors.append(torch.full((size,), finfo.tiny / 2, dtype=dtype))
        tensors.append(torch.randn(size).to(dtype))
    return tensors, truth(tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_stage_one_flags_exactly_the_tensors_holding_inf_or_nan(routing, dtype):
    tensors, expected = planted(dtype)
    assert len(expected) == sum(3 * len({0, s // 2, s - 1}) for s in SIZES)
    assert _device.nonfinite_indices(tensors) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_batched_gpu_path_flags_exactly_the_same_tensors(dtype):
    """``_foreach_norm(ord=inf)``, as a GPU runs it per device and dtype (here its CPU implementation)."""
    tensors, expected = planted(dtype)
    with torch.no_grad():
        flags = _device._flags_batched(tensors).tolist()
    assert [i for i, bad in enumerate(flags) if bad] == expected


def test_a_device_without_the_batched_kernel_falls_back_to_the_public_path(monkeypatch):
    tensors, expected = planted(torch.float32)

    def missing_kernel(*args, **kwargs):
        raise NotImplementedError("no _foreach_norm for this device")

    with torch.no_grad():
        monkeypatch.setattr(_device, "_foreach_norm", missing_kernel)
        flags = _device._flags(torch.device("meta"), False, tensors).tolist()  # as on a non-CPU device
        assert [i for i, bad in enumerate(flags) if bad] == expected
        monkeypatch.setattr(_device, "_foreach_norm", None)  # a torch without the private op
        assert _device._flags(torch.device("meta"), False, tensors).tolist() == flags


def test_mixed_sizes_dtypes_and_holes_come_back_in_order(routing):
    tensors: list[torch.Tensor | None] = []
    for i in range(60):
        t = torch.randn(3 if i % 2 else 600).to((torch.float32, torch.bfloat16, torch.float16)[i % 3])
        if i % 7 == 0:
            t[-1] = NAN
        tensors.append(t)
        if i % 5 == 0:
            tensors.append(None)
            tensors.append(torch.empty(0))
            tensors.append(torch.arange(4))  # integers hold no inf/NaN
    assert _device.nonfinite_indices(tensors) == truth(tensors)
    assert len(truth(tensors)) == 9


def test_complex_tensors_are_checked_part_by_part_without_overflow(routing):
    huge = torch.full((4,), 3e38 + 3e38j, dtype=torch.complex64)  # |z| overflows float32; z is finite
    imag_inf = torch.zeros(4, dtype=torch.complex64)
    imag_inf[2] = complex(0, INF)
    real_nan = torch.zeros(300, dtype=torch.complex128)
    real_nan[-1] = complex(NAN, 0)
    conjugated = imag_inf.conj()  # a lazily conjugated view
    tensors = [huge, imag_inf, real_nan, conjugated]
    assert _device.nonfinite_indices(tensors) == [1, 2, 3] == truth(tensors)
    assert _device.nonfinite_counts(tensors) == [(0, 0), (1, 0), (0, 1), (1, 0)]


def test_sparse_gradients_are_checked_by_their_coalesced_values(routing):
    def coo(values):  # index 0 twice: uncoalesced
        return torch.sparse_coo_tensor(torch.tensor([[0, 0, 3, 5]]), torch.tensor(values), (8,), check_invariants=True)

    with_inf, with_nan, clean = coo([1.0, INF, 2.0, 3.0]), coo([1.0, 2.0, NAN, NAN]), coo([1.0, 2.0, 3.0, 4.0])
    assert not with_inf.is_coalesced()
    tensors = [clean, with_inf, with_nan]
    assert _device.nonfinite_indices(tensors) == [1, 2] == truth(tensors)
    assert _device.nonfinite_counts(tensors) == [(0, 0), (1, 0), (0, 2)]


def test_eight_bit_floats_are_widened_not_skipped(routing):
    e5m2 = torch.tensor([1.0, INF, NAN, -INF]).to(torch.float8_e5m2)
    e4m3 = torch.tensor([1.0, NAN, 2.0]).to(torch.float8_e4m3fn)  # no inf in this format
    clean = torch.tensor([1.0, 448.0]).to(torch.float8_e4m3fn)
    assert _device.nonfinite_indices([clean, e5m2, e4m3]) == [1, 2]
    assert _device.nonfinite_counts([clean, e5m2, e4m3]) == [(0, 0), (2, 1), (0, 1)]


def test_stage_two_counts_inf_and_nan_exactly():
    t = torch.zeros(1000)
    t[:7] = INF
    t[7:10] = -INF
    t[500:505] = NAN
    half = t.to(torch.bfloat16)
    assert _device.nonfinite_counts([t, None, half, torch.empty(0), torch.ones(3)]) == [
        (10, 5), (0, 0), (10, 5), (0, 0), (0, 0)]


def model_with_offenders(n_params: int, offending: set[int], *, sizes=(4, 300)) -> tuple[torch.nn.ParameterList,
                                                                                        torch.optim.Optimizer]:
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(sizes[i % len(sizes)])) for i in range(n_params))
    for i, p in enumerate(params):
        p.grad = torch.randn_like(p)
        if i in offending:
            p.grad[i % p.numel()] = INF if i % 2 else NAN
    half = n_params // 2
    opt = torch.optim.SGD([{"params": list(params)[:half]}, {"params": list(params)[half:], "lr": 0.5}], lr=0.1)
    return params, opt


def test_scan_names_the_first_offenders_in_optimizer_order_and_counts_all_of_them(routing):
    offending = {1, 4, 5, 9, 11, 12, 13, 17, 20, 22, 23, 24, 28, 30, 31, 33, 36, 37, 39, 40}
    params, opt = model_with_offenders(42, offending)
    names = ParameterNames((f"p{i}", p) for i, p in enumerate(params) if i != 4)  # p4 has no model name
    (grads, weights) = scan_optimizers([(opt, "grads"), (opt, "weights")], names)
    assert grads.total == len(offending) == 20 and len(grads.params) == MAX_NAMED_PARAMS
    first = sorted(offending)[:MAX_NAMED_PARAMS]
    assert [p["name"] for p in grads.params] == [
        "param_groups[0][4] [4]" if i == 4 else f"p{i}" for i in first]
    assert [(p["inf"], p["nan"]) for p in grads.params] == [(1, 0) if i % 2 else (0, 1) for i in first]
    assert weights.params == [] and weights.total == 0


def test_scan_numbers_parameters_within_their_group(routing):
    params, opt = model_with_offenders(10, {2, 7})
    (grads,) = scan_optimizers([(opt, "grads")], ParameterNames())
    # Two groups of five: parameter 7 is the third of the second group.
    assert [p["name"] for p in grads.params] == ["param_groups[0][2] [4]", "param_groups[1][2] [300]"]


def test_gradients_that_are_none_are_skipped(routing):
    params, opt = model_with_offenders(6, {3})
    params[0].grad = None
    params[5].grad = None
    (grads,) = scan_optimizers([(opt, "grads")], ParameterNames())
    assert grads.total == 1 and grads.params == [{"name": "param_groups[1][0] [300]", "inf": 1, "nan": 0}]


@contextlib.contextmanager
def counting_host_copies(monkeypatch):
    copies = []
    real_cpu = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        copies.append(self.shape)
        return real_cpu(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "cpu", cpu)
        yield copies


def test_a_scan_copies_to_the_host_once_per_stage_and_never_reads_a_scalar(monkeypatch):
    """On a GPU each copy is the scan's only sync: one for the flags, one for the counts of the named few."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                ScalarReads.reads += 1
            return func(*args, **(kwargs or {}))

    params, opt = model_with_offenders(2000, set(range(0, 2000, 3)), sizes=(16, 4096))
    clean_params, clean_opt = model_with_offenders(2000, set(), sizes=(16, 4096))
    with counting_host_copies(monkeypatch) as copies, ScalarReads():
        (flagged,) = scan_optimizers([(opt, "grads"), (clean_opt, "grads")], ParameterNames())[:1]
        assert [tuple(s) for s in copies] == [(4000,), (MAX_NAMED_PARAMS, 2)]
        copies.clear()
        (clean,) = scan_optimizers([(clean_opt, "weights")], ParameterNames())
        assert [tuple(s) for s in copies] == [(2000,)]  # nothing flagged: no second copy
    assert ScalarReads.reads == 0
    assert flagged.total == 667 and clean.total == 0


def test_a_sharded_gradient_is_scanned_in_this_rank_s_shard_without_an_internal_error():
    """FSDP2 (fully_shard) in a one-rank gloo group: parameters and gradients are DTensors. The scan looks at
    the local shard (never a DTensor reduction, a collective, nor .tolist(), which DTensor refuses) and names
    the parameter; here the one rank holds the whole of it, so no slice is added (test_fsdp.py: 2 and 4 ranks)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ampwatch.agent._shards import is_sharded
    from ampwatch_support.ports import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        fully_shard(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net(torch.randn(3, 4)).sum().backward()
        assert is_sharded(net[1].weight.grad)
        net[1].weight.grad.to_local()[0, 0] = INF
        (report,) = scan_optimizers([(opt, "grads")], ParameterNames(net.named_parameters()))
        assert report.params == [{"name": "1.weight", "inf": 1, "nan": 0}] and report.total == 1
    finally:
        dist.destroy_process_group()
