"""Which samples each iteration trained on: kept cheaply on the host, put on skip and poisoned-step events.

``watch.batch(ids)`` and ``watch(loader=)`` add one micro-batch's ids at a time (:meth:`SampleLog.add`: one
list append, the ids kept as they were given). The ids recorded before an iteration's first optimizer step
are that iteration's (with gradient accumulation, every micro-batch of it); the iteration is known when it
is assigned (:meth:`SampleLog.assign`: its update, or without a scaler its first optimizer step), and a few
ended iterations stay in a bounded ring for ``samples_before``. Nothing is flattened, converted or digested
until an event is built (:meth:`SampleLog.describe`), so a healthy run pays an append per micro-batch and
a few comparisons per iteration.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ampwatch.contract.batch import IterationSamples, Samples, samples_digest
from ampwatch.contract.protocol import MAX_SAMPLE_IDS, MAX_SAMPLES_BEFORE

__all__ = ["SampleLog", "as_ids", "sample_id"]

_KEPT = MAX_SAMPLES_BEFORE + 4  # ended iterations kept: samples_before, and a skip read a few iterations late
_MAX_MICRO_BATCHES = 4096  # micro-batches waiting for an iteration to take them (batch() in a loop that never steps)
_INT_MIN, _INT_MAX = -(2 ** 63), 2 ** 63 - 1  # what the collector stores as an integer id (SQLite's)
_ID_TYPES = frozenset({int, str})


class SampleLog:
    """The sample ids of the iteration in progress and of a few before it.

    >>> log = SampleLog()
    >>> log.add([3, 1]); log.add([2])  # two micro-batches
    >>> log.assign(0); log.end(0); log.add([7]); log.assign(1)
    >>> event = {}
    >>> log.describe(event, 1, current=True, first=True)
    >>> event["samples"]["ids"], [e["iteration"] for e in event["samples_before"]]
    ([7], [0])
    """

    __slots__ = ("_pending", "_iteration", "_current", "_ring")

    def __init__(self) -> None:
        self._pending: list[Sequence[Any]] = []  # micro-batches recorded since an iteration last took them
        self._iteration: int | None = None  # the iteration ``_current`` belongs to
        self._current: list[Sequence[Any]] = []
        self._ring: collections.deque[tuple[int, list[Sequence[Any]]]] = collections.deque(maxlen=_KEPT)

    def add(self, ids: Sequence[Any]) -> None:
        """Record one micro-batch's ids (a list, tuple or range, kept as it is: do not change it afterwards).

        Bounded: past :data:`_MAX_MICRO_BATCHES` waiting for an iteration (ids recorded in a loop that never
        steps, an evaluation), the older half is dropped.
        """
        pending = self._pending
        pending.append(ids)
        if len(pending) > _MAX_MICRO_BATCHES:
            del pending[:_MAX_MICRO_BATCHES // 2]

    def assign(self, iteration: int) -> None:
        """Say that ``iteration`` is in progress: the ids recorded since the last call are its."""
        if iteration != self._iteration:
            self._keep_current()
            self._iteration = iteration
        if self._pending:
            self._current += self._pending
            self._pending = []

    def end(self, iteration: int) -> None:
        """End ``iteration`` (its update): its ids, the ones recorded until now included, go to the ring."""
        self.assign(iteration)
        self._keep_current()
        self._iteration = None

    def _keep_current(self) -> None:
        if self._current:
            self._ring.append((self._iteration, self._current))  # type: ignore[arg-type] # set with _current
            self._current = []

    def describe(self, event: dict[str, Any] | Any, iteration: int, *, current: bool, first: bool) -> None:
        """Put ``samples`` (and, when ``first``, ``samples_before``) of ``iteration`` on ``event``.

        ``current``: ``iteration`` is the one in progress (its ids recorded until now are its). Flattens, converts
        and digests the ids here, only for an event: about a microsecond per id.
        """
        if current:
            self.assign(iteration)
        lists = self._current if iteration == self._iteration else next(
            (kept for it, kept in self._ring if it == iteration), None)
        if lists:
            event["samples"] = _samples(lists)
        if first:
            before = [(it, kept) for it, kept in self._ring if it < iteration][-MAX_SAMPLES_BEFORE:]
            if before:
                entries: list[IterationSamples] = [{"iteration": it, "samples": _samples(kept)} for it, kept in before]
                event["samples_before"] = entries


def _samples(lists: Iterable[Sequence[Any]]) -> Samples:
    ids = [sample_id(i) for part in lists for i in part]
    return {"ids": ids[:MAX_SAMPLE_IDS], "count": len(ids), "digest": samples_digest(ids)}


def sample_id(value: Any) -> int | str:
    """Return ``value`` as the protocol sends a sample id: an int in SQLite's range, else a string.

    >>> sample_id(3), sample_id(2 ** 70), sample_id("a"), sample_id(("shard", 4))
    (3, '1180591620717411303424', 'a', "('shard', 4)")
    """
    kind = type(value)
    if kind is str:
        return value
    if kind is not int:
        if isinstance(value, str):
            return str(value)
        try:
            value = operator.index(value)  # numpy integers, a 0-d integer tensor
        except TypeError:
            return str(value)  # a sampler's own kind of key (a tuple, a path): its text
    return value if _INT_MIN <= value <= _INT_MAX else str(value)


def as_ids(ids: Any) -> Sequence[int | str]:
    """Return the ids ``watch.batch()`` was given as a sequence of ints and strings, or raise saying what was wrong.

    Takes an int or a string (one id), a list, tuple or range of them, a CPU tensor of integers (read on the host:
    no sync) or a NumPy array of integers. Lists and tuples are kept as they are (checked, not copied).
    """
    kind = type(ids)
    if kind is list or kind is tuple:
        if not _ID_TYPES.issuperset(map(type, ids)):
            _check_each(ids)
        return ids
    if kind is int or kind is str:
        return (ids,)
    if kind is range:
        return ids
    if isinstance(ids, torch.Tensor):
        return _tensor_ids(ids)
    if isinstance(ids, bool):
        raise TypeError(f"watch.batch() takes sample ids (ints or strings), got the bool {ids!r}")
    if isinstance(ids, (int, str)):
        return (sample_id(ids),)
    if isinstance(ids, (bytes, bytearray, dict)) or not isinstance(ids, Iterable):
        raise TypeError(f"watch.batch() takes sample ids: an int, a string, a list, tuple or range of them, or a "
                        f"CPU tensor of integers; got a {kind.__name__}")
    tolist = getattr(ids, "tolist", None)  # a NumPy array
    if callable(tolist) and getattr(getattr(ids, "dtype", None), "kind", "i") not in "iuUO":  # ints, text, objects
        raise TypeError(f"watch.batch() takes integer or string ids; got an array of {ids.dtype}")  # type: ignore[attr-defined]
    values = tolist() if callable(tolist) else list(ids)
    values = values if isinstance(values, list) else [values]
    if not _ID_TYPES.issuperset(map(type, values)):
        _check_each(values)
    return values


def _check_each(ids: Sequence[Any]) -> None:
    for k, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            if not isinstance(value, bool) and hasattr(value, "__index__"):
                continue  # a NumPy integer: converted when an event is sent
            raise TypeError(f"watch.batch(): sample ids are ints or strings; item {k} is a "
                            f"{type(value).__name__} ({value!r:.40})")


def _tensor_ids(ids: torch.Tensor) -> list[int]:
    if ids.device.type != "cpu":
        raise ValueError(f"watch.batch() got a tensor on {ids.device}: reading it would wait for the device (a sync "
                         "in every iteration). Pass the ids from the host: the batch's ids before .to(device), "
                         "or a list")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype is torch.bool:
        raise TypeError(f"watch.batch() takes a tensor of integer ids; got {ids.dtype}")
    values = (ids if ids.dim() == 1 else ids.reshape(-1)).tolist()  # on the host: no sync
    return values
