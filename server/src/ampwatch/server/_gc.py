"""Memory settings of the collector process: fewer and shorter collector pauses on the ingest path, and large
buffers handed back to the system once freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time
from collections.abc import Callable

__all__ = ["tune_gc", "GC_THRESHOLDS", "FREEZE_EVERY_S", "FULL_COLLECTION_EVERY_S", "MMAP_THRESHOLD",
           "release_free_memory"]

# Young collections every 1,000 allocations instead of 700, and older ones never between two freezes (below):
# each ingested batch allocates ~100 short-lived containers, and at 1,024 ranks the defaults ran a 60-100 ms
# full collection every ~3 s (bench: docs/benchmarks.md, "Ingest tail").
GC_THRESHOLDS = (1_000, 1_000, 1_000)

# Nearly everything an applied batch allocates lives until that rank's next batch (its view, totals,
# history entries), so the collector's young generations fill with live objects that every collection
# walks again for nothing. Freezing moves what is tracked now out of the collector's reach (O(1)); a
# collection then walks only what came since. Often: CPython counts a young collection's allocations net of
# the objects freed, and a batch frees the rank's previous state as it makes the new one, so in a whole-job
# storm the young generation held 30,000-43,000 live objects when its count reached 5,000, and each young
# collection took 30-70 ms of CPU while batches waited. The collector makes next to no cyclic garbage to find
# (in a 3-minute storm run at 1,024 ranks, 1,918 collections after start-up found none): what matters is how
# much live state a collection walks, so it is frozen every half second and collected every 1,000.
FREEZE_EVERY_S = 0.5
# Frozen objects are still freed by reference counting; only garbage *cycles* among them would wait. Once
# an hour everything is thawed and collected in full (one pause of about a second at the default
# max_ranks_per_run, ampwatch.contract.protocol.COLLECTOR_DEFAULTS).
FULL_COLLECTION_EVERY_S = 3600.0


MMAP_THRESHOLD = 512 * 1024
"""Bytes from which glibc's malloc maps an allocation of its own, unmapped when freed. Its default moves up to
the largest block freed so far (32 MiB at most): once a scrape freed a 4 MB exposition, every later one was
carved from the heap, which kept the pages; with the threshold fixed, a scrape's buffers go back at once."""

_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()  # glibc (Linux); elsewhere None and the two calls below do nothing


def release_free_memory() -> None:
    """Hand the pages malloc holds free back to the system (``malloc_trim``): after a ``/metrics`` render, whose
    megabytes of text are garbage once sent. A few milliseconds; nothing where the C library is not glibc."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def tune_gc() -> None:
    """Freeze the start-up heap and keep freezing what survives; collect less often; map large buffers on their
    own (:data:`MMAP_THRESHOLD`). Call once before serving."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    gc.collect()
    gc.freeze()  # objects that live as long as the process: full collections no longer walk them
    gc.set_threshold(*GC_THRESHOLDS)
    threading.Thread(target=_keep_frozen, name="ampwatch-gc-freeze", daemon=True).start()


def _keep_frozen(sleep: Callable[[float], object] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 rounds: int | None = None) -> None:
    """Freeze every :data:`FREEZE_EVERY_S`; thaw and collect in full every :data:`FULL_COLLECTION_EVERY_S`."""
    last_full = clock()
    while rounds is None or rounds > 0:
        sleep(FREEZE_EVERY_S)
        if clock() - last_full >= FULL_COLLECTION_EVERY_S:
            last_full = clock()
            gc.unfreeze()
            gc.collect()
        gc.freeze()
        if rounds is not None:
            rounds -= 1
