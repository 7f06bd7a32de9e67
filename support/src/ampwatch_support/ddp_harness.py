"""What the real-DDP and FSDP2 workers and their tests share: a rank's scaled backward, its process group and
results, and running a worker once.

The workers (``ampwatch_support.ddp_worker``, ``ddp_matrix_worker``, ``origin_worker``, ``fsdp_worker``,
``fsdp_plain_first_worker``) run as ``python -m`` modules, one process per rank, outside pytest:
:func:`run_ranks` imports pytest when it runs, so that every rank can import this module cheaply.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ampwatch_support.ports import free_port

__all__ = ["rank_results", "run_ranks", "scaled_backward"]


def scaled_backward(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, *,
                    rank: int, iteration: int, inject: bool, dtype: torch.dtype = torch.float32) -> None:
    """Run one iteration up to ``scaler.step``: this rank's input (an inf in it when ``inject``), a bf16 forward.

    The input depends only on ``rank`` and ``iteration``, so the same job run with and
    without the agent (or its comm hook) trains on the same data. ``dtype``: the input's (float64 for a
    float64 model: autocast leaves float64 alone, so its forward stays float64).
    """
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + iteration)).to(dtype)
    if inject:
        x[0, 0] = float("inf")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()


@contextlib.contextmanager
def rank_results(rank: int, world_size: int, out_dir: str, port: int, **environ: str) -> Iterator[dict]:
    """Be rank ``rank`` of a gloo process group on ``port`` for the block; yield the dict of its results.

    The agent is kept from sending (no ``AMPWATCH_URL``); ``environ`` adds to the environment. Whatever
    happens, the results go to ``out_dir/rank{rank}.json`` (with the traceback under ``"error"`` when the block
    raised, which then fails the process), reference cycles are collected and the group is destroyed, in that
    order: a DDP or FSDP model freed while the interpreter shuts down, after the group, makes gloo abort.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **environ)
    os.environ.pop("AMPWATCH_URL", None)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results: dict = {}
    try:
        yield results
    except BaseException:
        results["error"] = traceback.format_exc()[-4000:]
        raise
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        gc.collect()
        dist.destroy_process_group()


def run_ranks(worker: str, out: Path, world_size: int, args: Sequence[str] = (), *,
              timeout: int, what: str) -> list[dict]:
    """Run ``python -m worker OUT PORT [args]`` once (``worker``: a module name) and return each rank's
    ``OUT/rank{r}.json``.

    Bounded in time: past ``timeout`` seconds its whole process group is killed and the
    test fails, naming the worker as ``what``. The agent's settings are kept out of its
    environment, so a developer's ``AMPWATCH_URL`` cannot make it send.
    """
    import pytest  # here, not above: the workers import this module outside pytest

    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPWATCH_")}
    proc = subprocess.Popen([sys.executable, "-m", worker, str(out), str(free_port()), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the {what} DDP worker did not finish within {timeout} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
