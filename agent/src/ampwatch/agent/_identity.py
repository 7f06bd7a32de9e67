"""Who is this rank: run id, rank, world size, local rank, host, incarnation."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping

from ._config import _number

__all__ = ["Identity", "resolve_identity", "launcher_run_id", "new_run_id", "process_key"]

log = logging.getLogger("ampwatch.agent")

# Launcher variables that name the job, in order of preference.
# torchrun sets TORCHELASTIC_RUN_ID to "none" when --rdzv-id is not given: not an id.
_LAUNCHER_RUN_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
_NOT_AN_ID = ("", "none")


_process_key = uuid.uuid4().hex


def process_key() -> str:
    """Return this process's secret: sent with every batch, never shown by the collector.

    Every ``watch()`` in one process sends the same one, so the collector tells a second ``watch()``
    (a notebook cell run again) from another process claiming the rank with the same host and pid,
    which its read API shows. A forked child makes its own.
    """
    return _process_key


def _new_process_key() -> None:
    global _process_key
    _process_key = uuid.uuid4().hex


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_process_key)


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """The rank a batch speaks for; ``incarnation`` is new in every ``watch()``, ``process_key`` in every process."""

    run: str
    rank: int
    world_size: int
    local_rank: int
    host: str
    pid: int
    incarnation: str
    process_key: str = dataclasses.field(default_factory=process_key, repr=False)


def launcher_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """Return the job id set by the launcher (torchrun, Slurm, PBS, LSF), or ``None``."""
    env = os.environ if environ is None else environ
    for var in _LAUNCHER_RUN_VARS:
        value = env.get(var, "").strip()
        if value.lower() not in _NOT_AN_ID:
            return value[:128]
    return None


def new_run_id() -> str:
    """Make a readable, unique run id: time of day plus random hex."""
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def resolve_identity(run: str | None = None, *, environ: Mapping[str, str] | None = None) -> Identity:
    """Work out this process's rank identity and the run id every rank shares.

    Rank and world size come from ``torch.distributed`` when it is initialised,
    else from ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``. The run id is ``run``,
    else ``AMPWATCH_RUN``, else the launcher's job id, else agreed among ranks:
    rank 0 makes one and broadcasts it (a collective: every rank must call this).
    """
    env = os.environ if environ is None else environ
    rank, world_size = _rank_and_world(env)
    local_rank = _number(env, "LOCAL_RANK", int, rank if world_size > 1 else 0)
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {local_rank}")
    run = run or env.get("AMPWATCH_RUN") or launcher_run_id(env) or _agree_on_run(world_size)
    return Identity(run=run, rank=rank, world_size=world_size, local_rank=local_rank,
                    host=socket.gethostname()[:255], pid=os.getpid(), incarnation=uuid.uuid4().hex)


def _rank_and_world(env: Mapping[str, str]) -> tuple[int, int]:
    """Return (rank, world_size) from torch.distributed, else from the environment."""
    dist = _initialised_dist()
    if dist is not None:
        return dist.get_rank(), dist.get_world_size()
    world_size = _number(env, "WORLD_SIZE", int, 1)
    rank = _number(env, "RANK", int, 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world_size} are inconsistent: "
                         f"need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE")
    return rank, world_size


def _agree_on_run(world_size: int) -> str:
    """Return a run id shared by all ranks: rank 0's, broadcast over the default group."""
    dist = _initialised_dist()
    if dist is None:
        if world_size > 1:
            log.warning("ampwatch: %d ranks but no shared run id and torch.distributed is not initialised; "
                        "each rank makes its own. Set AMPWATCH_RUN (or pass run=) to group them.", world_size)
        return new_run_id()
    box = [new_run_id() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _initialised_dist():
    """Return ``torch.distributed`` when available and initialised, else ``None``."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    return dist if dist.is_available() and dist.is_initialized() else None
