"""Who is this rank: run id, rank, world size, local rank, host, incarnation."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid

__all__ = ["Identity", "resolve_identity"]


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    run: str
    rank: int
    world_size: int
    local_rank: int
    host: str
    pid: int
    incarnation: str


def resolve_identity(run: str | None = None) -> Identity:
    """Placeholder: env-only identity (the delivery work adds torch.distributed and run agreement)."""
    rank = int(os.environ.get("RANK", "0"))
    return Identity(run=run or os.environ.get("AMPWATCH_RUN") or "default", rank=rank,
                    world_size=int(os.environ.get("WORLD_SIZE", "1")),
                    local_rank=int(os.environ.get("LOCAL_RANK", str(rank))),
                    host=socket.gethostname(), pid=os.getpid(), incarnation=uuid.uuid4().hex)
