"""Start a job's ranks as processes and collect what each wrote (``bench.gpu.ddp`` and ``bench.gpu.fsdp``)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from typing import Callable

import torch.multiprocessing as mp

__all__ = ["free_port", "spawn_ranks"]


def free_port() -> int:
    """Return a TCP port free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
