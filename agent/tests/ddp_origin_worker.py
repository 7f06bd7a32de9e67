"""Real DDP over gloo with N ranks: which rank's own gradients held the inf that made every rank skip (issue 17).

Run as a script (``python ddp_origin_worker.py OUT_DIR PORT WORLD_SIZE``); each rank writes
``OUT_DIR/rank{r}.json`` with, per scenario, the ground truth, what the agent reported, the reduced
gradients of every iteration (a digest of their bits, and whether they were finite), which path the hook
took (fused or aminmax) and the final weights' bits. Used by test_origin_ddp.py, which owns the time
limit and the cleanup.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ddp_harness import scaled_backward

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench.overhead
from bench.overhead import SyncCounter  # noqa: E402 - the counter test_recording_cost.py uses

ITERATIONS = 8
CLEAN_ITERATIONS = 6


def injections(world_size: int) -> dict[int, list[int]]:
    """Iteration -> the ranks that feed an inf into their input: one rank twice, then two ranks at once."""
    one = world_size - 1 if world_size > 2 else 1
    two = [0, 1] if world_size == 2 else [1, world_size - 1]
    return {2: [one], 5: [one], 6: two}


def _as_ints(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def bits(params) -> list[list[int]]:
    return [_as_ints(p).reshape(-1).tolist() for p in params]


def reduced_gradients(params) -> tuple[str, bool]:
    """The gradients after DDP's all-reduce: a digest of their bits, and whether they are all finite."""
    grads = [p.grad for p in params]
    digest = hashlib.sha256(b"".join(_as_ints(g).contiguous().numpy().tobytes() for g in grads)).hexdigest()
    return digest, all(bool(torch.isfinite(g).all()) for g in grads)


class HookAminmaxCount:
    """Count ``torch.aminmax(..., out=...)`` calls (the origin hook's aminmax path) while entered."""

    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self) -> "HookAminmaxCount":
        self._original = original = torch.aminmax

        def counting(*args, **kwargs):
            if "out" in kwargs:
                self.calls += 1
            return original(*args, **kwargs)
        torch.aminmax = counting
        return self

    def __exit__(self, *exc) -> None:
        torch.aminmax = self._original


class CountingHook:
    """A user's own comm hook (DDP's all-reduce) that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, state, bucket):
        self.calls += 1
        return allreduce_hook(state, bucket)


def _net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    # Two Linear blocks in separate small buckets, so that a bucket index says something.
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    return net.to(dtype)


def train(rank: int, world_size: int, *, origin: bool, comm_hook=None, iterations: int = ITERATIONS,
          inject: bool = True, count_syncs: bool = False, python_hook: bool = False,
          dtype: torch.dtype = torch.float32, **ddp_options) -> dict:
    """Train with the agent (``origin``: with ``ddp=model``; ``python_hook``: without it, DDP's own
    ``allreduce_hook`` registered as a Python comm hook), ``dtype`` the weights' and so the buckets' dtype,
    ``ddp_options`` DistributedDataParallel's own (``gradient_as_bucket_view``, ``batched_grad_copy``)."""
    from ampwatch import agent

    net = _net(dtype)
    model = DistributedDataParallel(net, bucket_cap_mb=0.01, **ddp_options)
    if python_hook:
        model.register_comm_hook(dist.group.WORLD, allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    plan = injections(world_size) if inject else {}
    kwargs = {"ddp": model, "comm_hook": comm_hook, "comm_state": dist.group.WORLD if comm_hook else None} \
        if origin else {"model": net}
    truth, reported, skips, grads = [], [], [], []
    w = agent.watch(scaler, {"net": opt}, collector=(), run="origin-test", **kwargs)
    counter = SyncCounter()
    try:
        with counter, HookAminmaxCount() as aminmax:
            for i in range(iterations):
                scaled_backward(model, opt, scaler, rank=rank, iteration=i, inject=rank in plan.get(i, ()),
                                dtype=torch.float64 if dtype is torch.float64 else torch.float32)
                grads.append(reduced_gradients(net.parameters()))
                before = bits(net.parameters())
                scaler.step(opt)
                truth.append(before != bits(net.parameters()))
                reported.append(w.stepped(opt))
                scaler.update()
        state = w.snapshot()["state"]
        skips = [e for e in w._recorder.events.drain() if e["kind"] == "skip"]
        fused = model._comm_hooks[0][0].flags.fused if origin else None
    finally:
        w.close()
    return {"truth": truth, "reported": reported, "skips": skips, "state": state, "bits": bits(net.parameters()),
            "syncs": counter.syncs if count_syncs else None, "grads": grads, "fused": fused,
            "hook_aminmax_calls": aminmax.calls}


def train_fp16(rank: int, world_size: int, *, origin: bool, python_hook: bool = False) -> dict:
    """float16 weights and buckets: GradScaler refuses to unscale float16 gradients, so no scaler steps here;
    a plain backward (an inf fed in as in :func:`train`) and SGD on the iterations whose reduced gradients
    are finite. The agent watches (with ``ddp=model`` when ``origin``); its scaler is never stepped."""
    from ampwatch import agent

    net = _net(torch.float16)
    model = DistributedDataParallel(net, bucket_cap_mb=0.01)
    if python_hook:
        model.register_comm_hook(dist.group.WORLD, allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = injections(world_size)
    w = agent.watch(torch.amp.GradScaler("cpu"), {"net": opt}, collector=(), run="origin-test",
                    **({"ddp": model} if origin else {"model": net}))
    grads = []
    try:
        with HookAminmaxCount() as aminmax:
            for i in range(ITERATIONS):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + i)).half()
                if rank in plan.get(i, ()):
                    x[0, 0] = float("inf")
                opt.zero_grad()
                model(x).float().pow(2).mean().backward()
                grads.append(reduced_gradients(net.parameters()))
                if grads[-1][1]:
                    opt.step()
        fused = model._comm_hooks[0][0].flags.fused if origin else None
    finally:
        w.close()
    return {"bits": bits(net.parameters()), "grads": grads, "fused": fused, "hook_aminmax_calls": aminmax.calls}


def already_hooked(world_size: int) -> dict:
    from ampwatch import agent

    model = DistributedDataParallel(nn.Linear(4, 4))
    model.register_comm_hook(dist.group.WORLD, allreduce_hook)
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        agent.watch(scaler, opt, collector=(), run="origin-test", ddp=model)
    except ValueError as error:
        return {"error": str(error), "scaler_patched": "step" in vars(scaler)}
    return {"error": None, "scaler_patched": "step" in vars(scaler)}


def main(rank: int, out_dir: str, port: int, world_size: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("AMPWATCH_URL", None)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        hook = CountingHook()
        results = {
            "origin": train(rank, world_size, origin=True),
            "plain": train(rank, world_size, origin=False),
            "user_hook": train(rank, world_size, origin=True, comm_hook=hook),
            "already": already_hooked(world_size),
            "clean_origin": train(rank, world_size, origin=True, inject=False, iterations=CLEAN_ITERATIONS,
                                  count_syncs=True),
            "clean_plain": train(rank, world_size, origin=False, inject=False, iterations=CLEAN_ITERATIONS,
                                 count_syncs=True),
            "python_hook": train(rank, world_size, origin=False, python_hook=True),
            "bf16_origin": train(rank, world_size, origin=True, dtype=torch.bfloat16),
            "bf16_plain": train(rank, world_size, origin=False, dtype=torch.bfloat16),
            "bf16_python_hook": train(rank, world_size, origin=False, python_hook=True, dtype=torch.bfloat16),
            "fp16_origin": train_fp16(rank, world_size, origin=True),
            "fp16_plain": train_fp16(rank, world_size, origin=False),
            "fp16_python_hook": train_fp16(rank, world_size, origin=False, python_hook=True),
        }
        if world_size == 3:  # a world size that is not a power of two: how DDP scales decides the path
            results.update({
                "fp64_origin": train(rank, world_size, origin=True, dtype=torch.float64),
                "fp64_plain": train(rank, world_size, origin=False, dtype=torch.float64),
                "view_origin": train(rank, world_size, origin=True, gradient_as_bucket_view=True),
                "view_python_hook": train(rank, world_size, origin=False, python_hook=True,
                                          gradient_as_bucket_view=True),
            })
            if "batched_grad_copy" in inspect.signature(DistributedDataParallel).parameters:  # torch >= 2.13
                results.update({
                    "batched_origin": train(rank, world_size, origin=True, batched_grad_copy=True),
                    "batched_plain": train(rank, world_size, origin=False, batched_grad_copy=True),
                })
        results["user_hook"]["hook_calls"] = hook.calls
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    size = int(sys.argv[3])
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2]), size), nprocs=size, join=True)
