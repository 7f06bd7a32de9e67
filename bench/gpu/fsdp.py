"""Sharded training: FSDP2 and FSDP1 with and without a scaler, Lightning's and Accelerate's FSDP, per rank.

Every rank of the job (NCCL on two GPUs, or one GPU alone; gloo with two processes for ``--device cpu``)
compares what the agent reported with its own ground truth: its own shards' bits before and after each
step (a skip leaves them unchanged) and, without a scaler, whether its own gradient shards held inf/NaN.

- ``fsdp2-scaled``: ``fully_shard`` with ``torch.amp.GradScaler``, two micro-batches per step (the first
  without gradient sync). An inf is fed into the last rank's input at one step and planted into the last
  rank's gradient shard at another; every rank skips both (the scaler all-reduces ``found_inf``). Counters,
  skip and scale-change events, ``stepped()`` and the scale are compared with the truth (``_truth.compare``).
- ``fsdp2-unscaled``: the same model in bf16, ``watch(None, ...)``: an inf planted into the last rank's
  gradient shard; each rank's poisoned steps and events must be its own truth (the planting rank from that
  step on, the others from the next, once the NaN weights are all-gathered).
- ``fsdp1-orig-params``, ``fsdp1-flat-params``: ``FullyShardedDataParallel`` with ``ShardedGradScaler`` (what
  Lightning's ``FSDPStrategy`` and Accelerate's FSDP1 plugin set up), ``use_orig_params`` True (Lightning's
  default) and False; as ``fsdp2-scaled``, the first micro-batch under ``no_sync()``. torch's FSDP1 itself
  runs on CPU over gloo (``device_id`` cpu, ``ShardedGradScaler("cpu")``); the frameworks do not.
- ``lightning-fsdp-strategy``, ``accelerate-fsdp1``, ``accelerate-fsdp2`` (CUDA, and the package installed):
  the integrations on the frameworks' own FSDP set-up, fp16, an inf fed at one step
  (``bench/gpu/_fsdp_frameworks.py``). On CPU each is a skip saying why: Lightning refuses
  ``FSDPStrategy`` without a GPU, and Accelerate runs the job as plain multi-process CPU, the plugin unused.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.gpu._amp import Amp, changed, params_of, snapshot_bits
from bench.gpu._checks import check, verdict
from bench.gpu._fsdp_model import FED_AT, STEPS, local, micro_batch, sequential, shards
from bench.gpu._ranks import rank_process, spawn_ranks
from bench.gpu._truth import Plan, Run, compare, drain_events

__all__ = ["run"]

PLANTED_AT = 5  # the last rank's shard of a gradient gets an inf after backward
UNSCALED_PLANTED_AT = 3
INIT_SCALE = 2.0 ** 10
GROWTH_INTERVAL = 2  # growths happen between the skips too, and are counted
FSDP1 = ("fsdp1-orig-params", "fsdp1-flat-params")
"""FSDP1's checks, by ``use_orig_params`` (True: Lightning's FSDPStrategy default; False: FSDP1's own)."""




def _plant(opt: torch.optim.Optimizer) -> None:
    """Write an inf into the first element of this rank's first non-empty gradient shard."""
    with torch.no_grad():
        grad = next(g for g in (local(p.grad) for p in params_of(opt) if p.grad is not None) if g.numel())
        grad.view(-1)[0] = float("inf")


def _fsdp2(device: torch.device, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))  # explicit: the default mesh is on the accelerator, if any
    net = sequential().to(device)
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _fsdp1(device: torch.device, use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(sequential().to(device), device_id=device, use_orig_params=use_orig_params)


def _scaled(amp: Amp, rank: int, world: int, net: nn.Module, scaler: Any,
            backward: Callable[[nn.Module, Callable[[int], torch.Tensor]], None]) -> dict[str, Any]:
    """Train ``STEPS`` steps with ``scaler``, watched, asking ``stepped()``; compare with this rank's truth."""
    from ampwatch import agent

    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    last = rank == world - 1
    flags, answers = [], []
    with agent.watch(scaler, {"net": opt}, model=net, collector=(), run="bench-gpu-fsdp") as watch:
        for step in range(STEPS):
            opt.zero_grad()
            fed = last and step == FED_AT
            backward(net, lambda micro, step=step, fed=fed:
                     micro_batch(rank, step, micro, amp.device, fed and micro == 0))
            if last and step == PLANTED_AT:
                _plant(opt)
            before = snapshot_bits(shards(opt))
            scaler.step(opt)
            flags.append(changed(before, shards(opt)))
            answers.append({"net": watch.stepped(opt)})
            scaler.update()
    truth = [{"net": stepped} for stepped in torch.stack(flags).tolist()]  # the one read of the truth
    run = Run(truth=truth, answers=answers, nonfinite={}, final_scale=float(scaler.get_scale()))
    plan = Plan(iterations=STEPS, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    state = watch.snapshot()["state"]
    problems = compare(run, plan, state, drain_events(watch))
    skipped = [i for i, row in enumerate(truth) if not row["net"]]
    if skipped != [FED_AT, PLANTED_AT]:
        problems.append(f"the truth is off: skipped steps {skipped}, planned [{FED_AT}, {PLANTED_AT}]")
    if state["delivery"]["agent_errors"]:
        problems.append(f"{state['delivery']['agent_errors']} agent errors")
    counters = state["optimizers"]["net"]
    return {"problems": problems, "skipped": skipped, "scaler": type(scaler).__name__,
            "agent": {"steps": counters["steps"], "skipped": counters["skipped"], "backoffs": state["backoffs"],
                      "growths": state["growths"], "loss_scale": state["loss_scale"]}}


def _unscaled(device: torch.device, rank: int, world: int) -> dict[str, Any]:
    """bf16 without a scaler, ``watch(None, ...)``: poisoned steps against this rank's own gradient shards."""
    from ampwatch import agent
    from ampwatch.contract.protocol import is_rung

    net = _fsdp2(device, world)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    bad = []
    with agent.watch(None, {"net": opt}, model=net, collector=(), run="bench-gpu-fsdp-bf16") as watch:
        for step in range(STEPS):
            opt.zero_grad()
            _micro_batches(net, lambda micro, step=step: micro_batch(rank, step, micro, device, False),
                           lambda: torch.autocast(device.type, dtype=torch.bfloat16), None)
            if rank == world - 1 and step == UNSCALED_PLANTED_AT:
                _plant(opt)
            bad.append(torch.stack([~torch.isfinite(g).all() for g in (local(p.grad) for p in params_of(opt))
                                    if g.numel()]).any())
            opt.step()
    truth = [i for i, b in enumerate(torch.stack(bad).tolist()) if b]  # the one read of the truth
    state = watch.snapshot()["state"]
    events = [(e["iteration"], e["streak"]) for e in drain_events(watch) if e["kind"] == "poisoned_step"]
    first = UNSCALED_PLANTED_AT if rank == world - 1 else UNSCALED_PLANTED_AT + 1
    problems = []
    if truth != list(range(first, STEPS)):
        problems.append(f"the truth is off: poisoned steps {truth}, planned {first}..{STEPS - 1}")
    reported = state["optimizers"]["net"]["poisoned_steps"]
    if reported != len(truth):
        problems.append(f"poisoned_steps: agent {reported} != truth {len(truth)}")
    want = [(truth[k - 1], k) for k in range(1, len(truth) + 1) if is_rung(k)]
    if events != want:
        problems.append(f"poisoned_step events (iteration, streak): agent {events} != truth {want}")
    if state["loss_scale"] is not None:
        problems.append(f"loss_scale: agent {state['loss_scale']} without a scaler")
    if state["delivery"]["agent_errors"]:
        problems.append(f"{state['delivery']['agent_errors']} agent errors")
    return {"problems": problems, "poisoned": truth, "agent": {"poisoned_steps": reported}}


def _micro_batches(net: nn.Module, batch: Callable[[int], torch.Tensor], autocast: Callable[[], Any],
                   scaler: Any) -> None:
    """Two micro-batches, FSDP2's gradient sync only on the second (its ``no_sync``)."""
    for micro in (0, 1):
        net.set_requires_gradient_sync(micro == 1)
        with autocast():
            loss = net(batch(micro)).float().pow(2).mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()


def _scenarios(amp: Amp, rank: int, world: int) -> dict[str, Callable[[], dict[str, Any]]]:
    def fsdp2_scaled() -> dict[str, Any]:
        scaler = amp.scaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        return _scaled(amp, rank, world, _fsdp2(amp.device, world), scaler,
                       lambda net, batch: _micro_batches(net, batch, amp.autocast, scaler))

    def fsdp1(use_orig_params: bool) -> dict[str, Any]:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(amp.device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)

        def backward(net: nn.Module, batch: Callable[[int], torch.Tensor]) -> None:
            with net.no_sync():  # FSDP1's accumulation: the first micro-batch's gradients stay unsharded
                with amp.autocast():
                    loss = net(batch(0)).float().pow(2).mean()
                scaler.scale(loss).backward()
            with amp.autocast():
                loss = net(batch(1)).float().pow(2).mean()
            scaler.scale(loss).backward()
        return _scaled(amp, rank, world, _fsdp1(amp.device, use_orig_params), scaler, backward)

    found = {"fsdp2-scaled": fsdp2_scaled, "fsdp2-unscaled": lambda: _unscaled(amp.device, rank, world)}
    found[FSDP1[0]] = lambda: fsdp1(True)
    found[FSDP1[1]] = lambda: fsdp1(False)
    return found


def _rank(rank: int, world: int, device_type: str, out_dir: str, port: int) -> None:
    """One rank: every scenario in one process group; write what it saw to ``rank{rank}.json``."""
    with rank_process(rank, world, device_type, out_dir, port) as (result, device):
        for name, scenario in _scenarios(Amp(device), rank, world).items():
            try:
                result[name] = scenario()
            except Exception as error:  # noqa: BLE001 - reported by the parent; the other scenarios go on
                result[name] = {"error": "".join(traceback.format_exception(error))[-3000:]}
            dist.barrier()


def _judge(name: str, ranks: list[dict], ok: Callable[[dict], str], backend: str) -> dict:
    problems: list[str] = []
    for r in ranks:
        found = r.get(name, r)
        if "error" in found:
            problems.append(f"rank {r['rank']} crashed: {found['error'].strip().splitlines()[-1]}")
        else:
            problems += [f"rank {r['rank']}: {p}" for p in found["problems"]]
    summary = "" if problems else "; ".join(f"rank {r['rank']}: {ok(r[name])}" for r in ranks)
    return verdict("fsdp", name, problems, f"{backend}, {len(ranks)} rank(s): {summary}",
                   ranks=[{"rank": r["rank"], **r.get(name, {})} for r in ranks])


def _scaled_ok(r: dict) -> str:
    a = r["agent"]
    return (f"{r['scaler']}, skipped {r['skipped']} = truth, steps {a['steps']}/skipped {a['skipped']}, "
            f"backoffs {a['backoffs']}, growths {a['growths']}, scale {a['loss_scale']:g}")


def _sharded(amp: Amp) -> list[dict]:
    world = min(2, torch.cuda.device_count()) if amp.cuda else 2
    backend = "nccl" if amp.cuda else "gloo"
    ranks = spawn_ranks(_rank, (world, amp.device.type), world, timeout=240.0, prefix="ampwatch-gpu-fsdp-")
    names = ["fsdp2-scaled", "fsdp2-unscaled", *FSDP1]
    if isinstance(ranks, str):
        return [check("fsdp", n, "fail", ranks) for n in names]
    crashed = [r for r in ranks if "error" in r]
    if crashed:
        return [check("fsdp", n, "error", f"rank {crashed[0]['rank']} crashed: "
                      f"{crashed[0]['error'].strip().splitlines()[-1]}", ranks=ranks) for n in names]
    checks = [_judge("fsdp2-scaled", ranks, _scaled_ok, backend),
              _judge("fsdp2-unscaled", ranks, lambda r: f"poisoned {r['poisoned']} = truth, "
                     f"poisoned_steps {r['agent']['poisoned_steps']}", backend + ", bf16 without a scaler")]
    return checks + [_judge(n, ranks, _scaled_ok, f"{backend}, FullyShardedDataParallel("
                            f"use_orig_params={n == FSDP1[0]})") for n in FSDP1]


_LIGHTNING_ON_CPU = "Lightning refuses it without a GPU (\"The strategy `fsdp` requires a GPU accelerator\")"
_ACCELERATE_ON_CPU = "on CPU Accelerate runs the job as plain multi-process CPU (MULTI_CPU), the plugin unused"
FRAMEWORKS = {"lightning-fsdp-strategy": ("lightning", "Lightning's FSDPStrategy (FSDP1)", _LIGHTNING_ON_CPU),
              "accelerate-fsdp1": ("accelerate", "Accelerate's FSDP plugin (FSDP1)", _ACCELERATE_ON_CPU),
              "accelerate-fsdp2": ("accelerate", "Accelerate's FSDP plugin (fsdp_version=2)", _ACCELERATE_ON_CPU)}
"""check -> (the package it needs, what it runs, why it needs CUDA)."""


def _frameworks(amp: Amp) -> list[dict]:
    checks = []
    for name, (package, what, on_cpu) in FRAMEWORKS.items():
        if not amp.cuda:
            checks.append(check("fsdp", name, "skip", f"needs CUDA: {what}; {on_cpu}"))
        elif importlib.util.find_spec(package) is None:
            checks.append(check("fsdp", name, "skip", f"{package} is not installed: pip install ./contract "
                                f"\"./agent[{package}]\" to run {what}"))
        else:
            from bench.gpu import _fsdp_frameworks

            world = min(2, torch.cuda.device_count())
            ranks = spawn_ranks(_fsdp_frameworks.rank, (world, name), world, timeout=240.0,
                                prefix="ampwatch-gpu-fsdp-")
            if isinstance(ranks, str):
                checks.append(check("fsdp", name, "fail", ranks))
                continue
            checks.append(_judge(name, ranks, _fsdp_frameworks.ok, f"nccl, {what}"))
    return checks


def run(amp: Amp, quick: bool) -> list[dict]:
    """Run the sharded checks for this device (the same few steps with or without ``quick``)."""
    from bench.gpu._checks import guarded

    return guarded("fsdp", "sharded", lambda: _sharded(amp)) + guarded("fsdp", "frameworks", lambda: _frameworks(amp))
