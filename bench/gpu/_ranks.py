"""Start a job's ranks as processes and collect what each wrote (``bench.gpu.ddp`` and ``bench.gpu.fsdp``)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ampwatch_support.ports import free_port

__all__ = ["rank_process", "spawn_ranks"]


def spawn_ranks(target: Callable[..., None], args: tuple, world: int, timeout: float,
                prefix: str = "ampwatch-gpu-ranks-") -> list[dict] | str:
    """Run ``target(rank, *args, out_dir, port)`` in ``world`` processes; return each rank's JSON, or why not.

    Each rank writes ``out_dir/rank{rank}.json``; ``AMPWATCH_*`` variables are kept from the ranks (nothing is
    sent). Past ``timeout`` seconds the ranks still alive are killed and the answer says so.
    """
    with tempfile.TemporaryDirectory(prefix=prefix) as out_dir:
        env_before = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("AMPWATCH_")}
        try:
            context = mp.spawn(target, args=(*args, out_dir, free_port()), nprocs=world, join=False)
            deadline = time.monotonic() + timeout
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        if process.is_alive():
                            process.kill()
                    return f"the {world}-rank job did not finish in {timeout:.0f} s"
        finally:
            os.environ.update(env_before)
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        return ranks


@contextlib.contextmanager
def rank_process(rank: int, world: int, device_type: str, out_dir: str,
                 port: int) -> Iterator[tuple[dict[str, Any], torch.device]]:
    """In a rank :func:`spawn_ranks` started: join the process group (NCCL on ``cuda``, else gloo) and yield
    ``(result, device)``; whatever happens, write ``result`` to ``out_dir/rank{rank}.json`` (an error in it,
    with its traceback) and leave the group."""
    result: dict[str, Any] = {"rank": rank}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                **({"device_id": device} if device.type == "cuda" else {}))
        yield result, device
    except Exception as error:  # noqa: BLE001 - reported by the parent
        result["error"] = "".join(traceback.format_exception(error))[-3000:]
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f, default=str)
        # DDP/FSDP objects in reference cycles freed now, before the group: freed at interpreter exit, after it,
        # gloo aborts the process ("terminate called without an active exception"), as ddp_harness says.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
