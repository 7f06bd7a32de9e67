"""Real FSDP2 (``fully_shard``) over gloo with N ranks: the agent with a GradScaler and without one.

Run as ``python -m ampwatch_support.fsdp_worker OUT_DIR PORT WORLD_SIZE``; each rank writes ``OUT_DIR/rank{r}.json``
with, per scenario, the ground truth, what the agent reported and the bits of this rank's shards at the end.
All scenarios share one process group. Used by agent/tests/test_fsdp.py, which owns the time limit and the cleanup.

- ``scaled``/``scaled_plain``: a GradScaler, two micro-batches per step (the first without gradient
  sync), an inf fed into the last rank's first micro-batch at one step and planted into rank 1's shard of
  ``2.weight``'s gradient at another; a ``torch.distributed.checkpoint`` save in the middle, while watched.
- ``restored``: a new model, optimizer and scaler loaded from that checkpoint, watched by a new watch,
  trained over the same steps as the rest of ``scaled``.
- ``unscaled``/``unscaled_plain``: no scaler (bf16), the same two micro-batches per step; an inf planted into
  rank 1's shard of a gradient after the second; a ``torch.distributed.checkpoint`` save before the plant.
- ``unscaled_restored``: a new model and optimizer loaded from that checkpoint, watched by a new ``watch(None)``,
  trained over the same steps as the rest of ``unscaled``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from ampwatch_support.ddp_harness import rank_results

STEPS = 8
SAVE_AFTER = 4  # steps done when the checkpoint is saved
FED = {2: "last"}  # step -> whose first micro-batch holds an inf (the all-reduced found_inf makes every rank skip)
PLANTED = {5: 1}  # step -> the rank whose shard of 2.weight's gradient gets an inf after backward
UNSCALED_PLANTED = {3: 1}
UNSCALED_SAVE_AFTER = 3  # steps done when the scaler-less run is saved: the last clean one


def _net() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer)
    fully_shard(net)
    return net


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def shard_bits(net: nn.Module) -> list[list[int]]:
    return [local(p).detach().view(torch.int32).reshape(-1).tolist() for p in net.parameters()]


def grads_finite(net: nn.Module) -> bool:
    return all(bool(torch.isfinite(local(p.grad)).all()) for p in net.parameters())


def micro_batch(rank: int, step: int, micro: int, world_size: int, fed: dict) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + micro))
    if micro == 0 and fed.get(step) == "last" and rank == world_size - 1:
        x[0, 0] = float("inf")
    return x


def backward(net, rank, step, world_size, scaler, fed=FED, micros=2) -> None:
    for micro in range(micros):
        net.set_requires_gradient_sync(micro == micros - 1)  # FSDP2's no_sync: reduce on the last micro-batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(micro_batch(rank, step, micro, world_size, fed)).float().pow(2).mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()


def plant(net, rank, step, planted) -> None:
    if planted.get(step) == rank:
        local(net[2].weight.grad)[0, 0] = float("inf")


def scaled(rank: int, world_size: int, watched: bool, checkpoint: str) -> dict:
    from ampwatch import agent

    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    w = agent.watch(scaler, {"net": opt}, model=net, collector=(), run="fsdp", grad_norm=True) if watched else None
    if w is not None:
        w._recorder.inspect_interval = 0.0  # name every streak start: the clock must not decide what is named
    truth, reported, scales = [], [], []
    try:
        for step in range(STEPS):
            opt.zero_grad()
            backward(net, rank, step, world_size, scaler)
            plant(net, rank, step, PLANTED)
            before = shard_bits(net)
            scaler.step(opt)
            truth.append(before != shard_bits(net))
            reported.append(w.stepped(opt) if w is not None else None)
            scaler.update()
            scales.append(scaler.get_scale())
            if step + 1 == SAVE_AFTER:
                save(net, opt, checkpoint)
                torch.save(scaler.state_dict(), os.path.join(checkpoint, f"scaler{rank}.pt"))
    finally:
        result = _result(w)
    return {**result, "truth": truth, "reported": reported, "scales": scales, "bits": shard_bits(net)}


def restored(rank: int, world_size: int, checkpoint: str) -> dict:
    """A resumed process: fresh objects loaded from the checkpoint the watched run saved, watched anew."""
    from ampwatch import agent

    net, opt = load(checkpoint)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    w = agent.watch(scaler, {"net": opt}, model=net, collector=(), run="fsdp")
    scaler.load_state_dict(torch.load(os.path.join(checkpoint, f"scaler{rank}.pt")))
    reported = []
    try:
        for step in range(SAVE_AFTER, STEPS):
            opt.zero_grad()
            backward(net, rank, step, world_size, scaler)
            plant(net, rank, step, PLANTED)
            scaler.step(opt)
            reported.append(w.stepped(opt))
            scaler.update()
    finally:
        result = _result(w)
    return {**result, "reported": reported, "bits": shard_bits(net), "scale": scaler.get_scale()}


def save(net: nn.Module, opt: torch.optim.Optimizer, checkpoint: str) -> None:
    model_state, optim_state = get_state_dict(net, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)


def load(checkpoint: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model and optimizer, loaded from ``checkpoint``."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return net, opt


def checkpoint_keys(checkpoint: str) -> list[str]:
    """Every key the checkpoint holds (its metadata's), sorted."""
    return sorted(dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata)


def unscaled(rank: int, world_size: int, watched: bool, checkpoint: str, resume: bool = False) -> dict:
    """No scaler; saved to ``checkpoint`` after :data:`UNSCALED_SAVE_AFTER` steps, or (``resume``) loaded from it
    and trained from there."""
    from ampwatch import agent

    net, opt = load(checkpoint) if resume else (_net(), None)
    opt = opt or torch.optim.AdamW(net.parameters(), lr=1e-2)
    w = agent.watch(None, {"net": opt}, model=net, collector=(), run="fsdp", grad_norm=True) if watched else None
    poisoned = []  # ground truth: the steps whose gradient shards on this rank held inf/NaN
    try:
        for step in range(UNSCALED_SAVE_AFTER if resume else 0, STEPS):
            opt.zero_grad()
            backward(net, rank, step, world_size, None, fed={})  # two micro-batches, as scaled
            plant(net, rank, step, UNSCALED_PLANTED)
            if not grads_finite(net):
                poisoned.append(step)
            opt.step()
            if step + 1 == UNSCALED_SAVE_AFTER:
                save(net, opt, checkpoint)
    finally:
        result = _result(w)
    return {**result, "poisoned": poisoned, "bits": shard_bits(net)}


def _result(w) -> dict:
    if w is None:
        return {}
    w.close()
    events = w._recorder.events.drain()
    return {"state": w.snapshot()["state"], "scaler": w.snapshot()["scaler"],
            "events": [{k: v for k, v in e.items() if k != "time"} for e in events]}


def main(rank: int, out_dir: str, port: int, world_size: int) -> None:
    with rank_results(rank, world_size, out_dir, port) as results:
        checkpoints = {name: os.path.join(out_dir, f"checkpoint-{name}")
                       for name in ("watched", "plain", "unscaled-watched", "unscaled-plain")}
        results.update({
            "scaled": scaled(rank, world_size, True, checkpoints["watched"]),
            "scaled_plain": scaled(rank, world_size, False, checkpoints["plain"]),
            "unscaled": unscaled(rank, world_size, True, checkpoints["unscaled-watched"]),
            "unscaled_plain": unscaled(rank, world_size, False, checkpoints["unscaled-plain"]),
        })
        dist.barrier()
        results["restored"] = restored(rank, world_size, checkpoints["watched"])
        results["unscaled_restored"] = unscaled(rank, world_size, True, checkpoints["unscaled-watched"], resume=True)
        results["checkpoint_keys"] = {name: checkpoint_keys(path) for name, path in checkpoints.items()}


if __name__ == "__main__":
    size = int(sys.argv[3])
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2]), size), nprocs=size, join=True)
