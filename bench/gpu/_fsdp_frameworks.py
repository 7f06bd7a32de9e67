"""The ``fsdp`` section's framework runs (CUDA only): Lightning's ``FSDPStrategy``, Accelerate's FSDP plugin.

Each rank is a process started by ``bench.gpu.fsdp.spawn_ranks`` with ``LOCAL_RANK``, ``RANK`` and
``WORLD_SIZE`` set, so that the framework takes the processes as launched (it neither re-runs the script
nor spawns its own). fp16, the frameworks' own scaler (``ShardedGradScaler`` for FSDP1), an inf fed into
the last rank's batch at one step; ground truth is this rank's own shards' bits around each step and the
scaler's settings, compared with ``_truth.compare``. Lightning and Accelerate are imported here only, and
only when installed: ``bench.gpu`` itself needs neither.
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from bench.gpu._amp import changed, snapshot_bits
from bench.gpu._fsdp_model import FED_AT, STEPS, micro_batch, sequential, shards
from bench.gpu._truth import Plan, Run, compare, drain_events

__all__ = ["ok", "rank"]


def _batches(rank: int, world: int) -> list[torch.Tensor]:
    cpu = torch.device("cpu")
    return [micro_batch(rank, step, 0, cpu, rank == world - 1 and step == FED_AT) for step in range(STEPS)]


def _judge(watch: Any, scaler: Any, init_scale: float, growth_interval: int, flags: list[torch.Tensor],
           answers: list[bool | None]) -> dict[str, Any]:
    state = watch.snapshot()["state"]
    (name,) = state["optimizers"]  # one optimizer, named by the integration
    truth = [{name: stepped} for stepped in torch.stack(flags).tolist()]  # the one read of the truth
    run = Run(truth=truth, answers=[{name: a} for a in answers], nonfinite={}, final_scale=float(scaler.get_scale()))
    plan = Plan(iterations=STEPS, init_scale=init_scale, growth_interval=growth_interval)
    problems = compare(run, plan, state, drain_events(watch))
    skipped = [i for i, row in enumerate(truth) if not row[name]]
    if FED_AT not in skipped:
        problems.append(f"the truth is off: the inf fed at step {FED_AT} did not skip (skipped {skipped})")
    if state["delivery"]["agent_errors"]:
        problems.append(f"{state['delivery']['agent_errors']} agent errors")
    counters = state["optimizers"][name]
    return {"problems": problems, "skipped": skipped, "scaler": type(scaler).__name__,
            "agent": {"steps": counters["steps"], "skipped": counters["skipped"], "backoffs": state["backoffs"],
                      "growths": state["growths"], "loss_scale": state["loss_scale"]}}


def _lightning(rank: int, world: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy

    from ampwatch.agent.lightning import AmpWatchCallback

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = sequential()

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return self.net(batch).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Truth(pl.Callback):
        """This rank's shards' bits before (after unscale_) and after each optimizer step."""

        def __init__(self, watching: AmpWatchCallback) -> None:
            self.watching, self.flags, self.answers = watching, [], []
            self.before: list[torch.Tensor] = []
            self.settings: tuple[float, int] = (0.0, 0)

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            scaler = trainer.precision_plugin.scaler
            self.settings = (float(scaler.get_scale()), scaler.get_growth_interval())

        def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
            self.before = snapshot_bits(shards(trainer.optimizers[0]))

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            optimizer = trainer.optimizers[0]
            self.flags.append(changed(self.before, shards(optimizer)))
            self.answers.append(self.watching.watch.stepped(optimizer))

    watching = AmpWatchCallback(collector=(), run="bench-gpu-lightning-fsdp")
    truth = Truth(watching)
    trainer = pl.Trainer(accelerator="cuda", devices=world, num_nodes=1, strategy=FSDPStrategy(),
                         precision="16-mixed", max_steps=STEPS, callbacks=[watching, truth], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    loader = torch.utils.data.DataLoader(_batches(rank, world), batch_size=None)
    trainer.fit(Model(), loader)
    return _judge(watching.watch, trainer.precision_plugin.scaler, *truth.settings, truth.flags, truth.answers)


def _accelerate(rank: int, world: int, version: int) -> dict[str, Any]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    from ampwatch.agent import accelerate as ampwatch

    accelerator = Accelerator(mixed_precision="fp16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=version))
    if accelerator.distributed_type != DistributedType.FSDP or accelerator.scaler is None:
        raise RuntimeError(f"Accelerate set up {accelerator.distributed_type} with scaler {accelerator.scaler}, "
                           "not FSDP with a scaler")
    net = sequential()
    model, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    scaler = accelerator.scaler
    settings = (float(scaler.get_scale()), scaler.get_growth_interval())
    flags, answers = [], []
    with ampwatch.watch(accelerator, opt, model=model, collector=(), run="bench-gpu-accelerate-fsdp") as watch:
        for x in _batches(rank, world):
            opt.zero_grad()
            with accelerator.autocast():
                loss = model(x.to(accelerator.device)).float().pow(2).mean()
            accelerator.backward(loss)
            before = snapshot_bits(shards(opt.optimizer))
            opt.step()
            flags.append(changed(before, shards(opt.optimizer)))
            answers.append(watch.stepped(opt))
    return _judge(watch, scaler, *settings, flags, answers)


def rank(rank: int, world: int, name: str, out_dir: str, port: int) -> None:
    """One rank of the framework run ``name``; write what it saw to ``rank{rank}.json``."""
    result: dict[str, Any] = {"rank": rank}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0")
        torch.cuda.set_device(rank)
        runs = {"lightning-fsdp-strategy": lambda: _lightning(rank, world),
                "accelerate-fsdp1": lambda: _accelerate(rank, world, 1),
                "accelerate-fsdp2": lambda: _accelerate(rank, world, 2)}
        result[name] = runs[name]()
    except Exception as error:  # noqa: BLE001 - reported by the parent
        result[name] = {"error": "".join(traceback.format_exception(error))[-3000:]}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f, default=str)
        if dist.is_initialized():
            dist.destroy_process_group()


def ok(r: dict[str, Any]) -> str:
    """Summarise one rank's passing run."""
    a = r["agent"]
    return (f"{r['scaler']}, skipped {r['skipped']} = truth, steps {a['steps']}/skipped {a['skipped']}, "
            f"backoffs {a['backoffs']}, scale {a['loss_scale']:g}")
