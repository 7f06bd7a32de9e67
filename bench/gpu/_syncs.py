"""Ways to see host-device synchronisation, from the cheapest to the most complete.

- CPU: a TorchDispatchMode counting ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ...), which is a
  sync on a GPU (``ampwatch_support.syncs.SyncCounter``).
- CUDA, ``torch.cuda.set_sync_debug_mode``: "error" raises and "warn" warns on every sync that goes through
  c10's ``memcpy_and_sync``/``stream_synchronize`` (``.item()``, ``.cpu()``, ``nonzero``...). It does not
  see ``torch.cuda.Event.synchronize()`` or ``torch.cuda.synchronize()``.
- CUDA, torch's GPU trace hooks (``torch.cuda._gpu_trace``, what the CUDA sanitizer uses): a callback on
  every stream, event and device synchronisation, event waits included. Once switched on it cannot be
  switched off and costs a Python call per traced CUDA call, so only the last section uses it.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ampwatch_support.syncs import SyncCounter

__all__ = ["SyncTrace", "count_syncs", "raised_syncing", "sync_debug", "sync_method"]

SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync


@contextlib.contextmanager
def sync_debug(mode: str) -> Iterator[None]:
    """Set ``torch.cuda.set_sync_debug_mode(mode)`` for the block, then restore the previous mode."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def raised_syncing(setups: Mapping[str, Any], iterations: int, sync: Callable[[], object]) -> dict[str, str]:
    """Run ``iterations`` of each of ``setups`` (variant -> a loop with ``iterate(n)``) under sync debug mode
    ``"error"``; return, per variant that synced, the first line of what torch raised (``sync`` waits for the
    device after each)."""
    raised = {}
    for variant, setup in setups.items():
        try:
            with sync_debug("error"):
                setup.iterate(iterations)
        except RuntimeError as error:
            raised[variant] = str(error).splitlines()[0]
        sync()
    return raised


def sync_method(cuda: bool) -> str:
    """Say how :func:`count_syncs` counts on this device."""
    return ("torch.cuda.set_sync_debug_mode('warn') warnings" if cuda
            else "aten._local_scalar_dense calls (TorchDispatchMode)")


def count_syncs(cuda: bool, work: Callable[[], object]) -> int:
    """Run ``work`` and return the syncs it made, counted as :func:`sync_method` says."""
    if not cuda:
        with SyncCounter() as counter:
            work()
        return counter.syncs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # else a warning from the same line is shown once only
        with sync_debug("warn"):
            work()
    return sum(SYNC_WARNING in str(w.message) for w in caught)


class SyncTrace:
    """Count every stream, event and device synchronisation through torch's GPU trace hooks (CUDA only)."""

    _instance: SyncTrace | None = None

    def __init__(self) -> None:
        from torch.cuda import _gpu_trace

        self.counts: collections.Counter = collections.Counter()
        self._on = False
        _gpu_trace.register_callback_for_stream_synchronization(lambda stream: self._hit("stream"))
        _gpu_trace.register_callback_for_event_synchronization(lambda event: self._hit("event"))
        _gpu_trace.register_callback_for_device_synchronization(lambda: self._hit("device"))
        torch._C._activate_gpu_trace()

    @classmethod
    def available(cls) -> str | None:
        """Return None when the trace hooks exist in this torch, else why not."""
        try:
            from torch.cuda import _gpu_trace
        except ImportError as error:
            return f"torch.cuda._gpu_trace is missing ({error})"
        if not hasattr(torch._C, "_activate_gpu_trace") or not hasattr(
                _gpu_trace, "register_callback_for_event_synchronization"):
            return "this torch has no GPU trace hooks (torch._C._activate_gpu_trace)"
        return None

    @classmethod
    def get(cls) -> SyncTrace:
        """Return the one trace of this process, switching the hooks on the first time."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _hit(self, kind: str) -> None:
        if self._on:
            self.counts[kind] += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[collections.Counter]:
        """Count the synchronisations made inside the block into the Counter it yields."""
        self.counts = collections.Counter()
        self._on = True
        try:
            yield self.counts
        finally:
            self._on = False
