"""Sharded parameters and gradients (FSDP2's ``DTensor``): the shard this rank holds, and where it lies.

Under ``fully_shard`` every parameter and gradient is a ``DTensor``; each rank steps only its own
shard. The agent looks at that shard alone (``to_local()``: no communication; any reduction of a
``DTensor`` itself would be a collective, run on one rank only) and names it by the slice of the whole
parameter it holds. ``torch.distributed.tensor`` is imported lazily and feature-detected: a torch
without it has no sharded tensors to look at.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_sharded", "local", "shard_text"]

_DTensor: Any
try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed support
    _DTensor = None


def is_sharded(tensor: Any) -> bool:
    """Tell whether ``tensor`` is a ``DTensor`` (FSDP2's parameters and their gradients)."""
    return _DTensor is not None and isinstance(tensor, _DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """Return the part of ``tensor`` this rank holds: a ``DTensor``'s local shard, else ``tensor`` itself.

    No communication and no copy. Call under ``no_grad`` (``to_local()`` then returns the shard as it
    is, outside autograd).
    """
    if _DTensor is not None and isinstance(tensor, _DTensor):
        return tensor.to_local()
    return tensor


def shard_text(tensor: Any) -> str | None:
    """Return where this rank's shard of a ``DTensor`` lies in the whole, e.g. ``"[8:16, 0:8]"``; None otherwise.

    Read from ``DTensor.__create_chunk_list__()`` (the offsets and sizes ``torch.distributed.checkpoint``
    saves); None when it is missing or fails (a replicated or partial placement), and the name then
    goes without it.
    """
    if not is_sharded(tensor):
        return None
    try:
        chunks = tensor.__create_chunk_list__()
        if len(chunks) != 1:
            return None
        offsets, sizes = chunks[0].offsets, chunks[0].sizes
    except Exception:  # noqa: BLE001 - naming goes on without the slice
        return None
    if tuple(sizes) == tuple(tensor.shape):
        return None  # the whole parameter: nothing to say
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes, strict=True)) + "]"
