"""``watch(loader=)``: record the sample ids a DataLoader yields, leaving the loader as it is.

A DataLoader refuses a new ``sampler`` or ``batch_sampler`` once made, and ``iter()`` looks ``__iter__`` up on
its type, so nothing on the loader itself can be swapped. Nothing is: while some watch follows a loader, two
methods of torch's own iterator class, ``_BaseDataLoaderIter._next_index`` (each index list drawn from the
sampler, prefetching included) and ``__next__`` (each batch handed to the loop), are wrapped on the class, and
each wrapper first does exactly what the original does, then looks its iterator's sampler up in a table of
followed loaders; for any other loader that is all it does. The wrappers go when the last follower closes. The
loader, its sampler, its iterators and the batches are never touched, and nothing of ampwatch is in a pickle of
them, so a watched loader yields the same batches in the same order, with the same random draws.

Map-style datasets: the ``k``-th batch an iterator yields holds the ``k``-th index list drawn from the sampler
(``in_order=True``, the default: the workers' batches come back in order), so the ids are the sampler's
indices. Iterable datasets have no indices: a batch's id is its position, ``r<rank>:e<epoch>:b<batch>``,
the same data on the same rank from the same seed, not comparable across ranks or loaders (docs/agent.md).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _dataloader

from ._errors import AgentErrors
from ._samples import SampleLog

__all__ = ["LoaderTap", "Tap", "close_taps", "followed_loader"]

log = logging.getLogger("ampwatch.agent")

_Iterator = _dataloader._BaseDataLoaderIter
_taps: dict[int, LoaderTap] = {}  # id(a followed loader's index sampler) -> its tap; a tap holds the sampler
_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}  # the iterator class's own methods, while wrapped


def followed_loader(loader: Any) -> DataLoader:
    """Return the torch DataLoader that yields ``loader``'s batches (Accelerate's wrappers hold it), or raise."""
    base = getattr(loader, "base_dataloader", loader)
    if not isinstance(base, DataLoader):
        raise TypeError(f"watch(loader=) takes a torch.utils.data.DataLoader, got a {type(loader).__name__}; "
                        "record other loaders' ids with watch.batch(ids)")
    if base.num_workers > 0 and not getattr(base, "in_order", True):
        raise ValueError("watch(loader=) cannot follow a DataLoader made with in_order=False: its batches come back "
                         "in whatever order the workers finish, so which indices a batch holds is unknown. Make "
                         "it with in_order=True (the default), or call watch.batch(ids) with each batch's ids")
    return base


class LoaderTap:
    """Follow one DataLoader: put the ids of each batch it yields in ``log``.

    ``lag``: the loop receives a batch that many batches after the loader yields it (Accelerate's loaders
    fetch one ahead). ``by_position``: the batches are not taken as they are yielded; an integration calls
    :meth:`take` with the position of the batch it trains on (Lightning's ``batch_idx``).
    """

    def __init__(self, loader: Any, log: SampleLog, rank: int, errors: AgentErrors, *, lag: int = 0,
                 by_position: bool = False) -> None:
        base = followed_loader(loader)
        self.sampler = base._index_sampler  # what its iterators draw from: fixed once the loader is made
        self.iterable = base._dataset_kind == _dataloader._DatasetKind.Iterable
        self.log, self.rank, self.errors = log, rank, errors
        self.lag, self.by_position = lag, by_position
        self.epoch = -1
        self._source: Any = None  # the sampler iterator of the current epoch (held: its id must not be reused)
        self._drawn: collections.deque[Any] = collections.deque()  # index lists drawn, not yet taken
        self._base = 0  # position in the epoch of _drawn[0]
        self._yielded = 0  # batches yielded in the epoch
        self.open = False

    def start(self) -> LoaderTap:
        """Start following (one at a time per loader: a loader already followed is refused).

        A torch whose DataLoader iterator lacks the two methods followed leaves the loader unfollowed, said once
        in the log and counted as an agent error: the job trains on, its events carry no sample ids.
        """
        with _lock:
            if id(self.sampler) in _taps:
                raise ValueError("this DataLoader is already followed by an open watch; close() that watch first")
            try:
                _install()
            except Exception as error:  # noqa: BLE001 - no ids is no reason to stop a job
                log.warning("ampwatch: cannot follow this torch's DataLoader (%s): skips will carry no sample ids; "
                            "call watch.batch(ids) with each batch's ids instead", error)
                self.errors.report("following a DataLoader", error)
                return self
            _taps[id(self.sampler)] = self
            self.open = True
        return self

    def close(self) -> None:
        """Stop following; the last tap to close takes the wrappers off torch's iterator class."""
        with _lock:
            if not self.open:
                return
            self.open = False
            if _taps.get(id(self.sampler)) is self:
                del _taps[id(self.sampler)]
            if not _taps:
                _uninstall()
            self._source = None
            self._drawn.clear()

    # ----- called by the wrappers, on the thread that iterates the loader --------------------------

    def drawn(self, iterator: Any, index: Any) -> None:
        """Note an index list the sampler gave (a new sampler iterator: a new epoch)."""
        source = iterator._sampler_iter
        if source is not self._source:
            self._source = source
            self.epoch += 1
            self._drawn.clear()
            self._base = self._yielded = 0
        if not self.iterable:
            self._drawn.append(index)

    def yielded(self) -> None:
        """Note a batch handed to the loop: its ids are the iteration's (unless taken by position)."""
        position = self._yielded
        self._yielded = position + 1
        if not self.by_position and position >= self.lag:
            self.take(position - self.lag)

    def exhausted(self) -> None:
        """The epoch ended: with a lag, the batches still held back reach the loop now."""
        if not self.by_position:
            for position in range(max(0, self._yielded - self.lag), self._yielded):
                self.take(position)

    def take(self, position: int) -> None:
        """Put the ids of the batch at ``position`` in the current epoch in the log (earlier ones are dropped)."""
        if self.iterable:
            self.log.add((f"r{self.rank}:e{max(self.epoch, 0)}:b{position}",))
            return
        drawn = self._drawn
        while drawn and self._base < position:
            drawn.popleft()
            self._base += 1
        if drawn and self._base == position:
            index = drawn.popleft()
            self._base += 1
            self.log.add(index if isinstance(index, (list, tuple, range)) else (index,))


class Tap(Protocol):
    """What a watch takes off at close: a loader's follower, or an integration's loss tap."""

    def close(self) -> None: ...


def close_taps(taps: list[Tap], errors: AgentErrors) -> None:
    """Close each of ``taps``; a failure is counted in ``errors`` and the others still close."""
    for tap in taps:
        try:
            tap.close()
        except Exception as error:  # noqa: BLE001 - closing must not fail the user's program
            errors.report("closing a loader's follower or loss tap", error)


def _tap_of(iterator: Any) -> LoaderTap | None:
    tap = _taps.get(id(iterator._index_sampler))
    return tap if tap is not None and tap.sampler is iterator._index_sampler else None


def _install() -> None:
    """Wrap the iterator class's two methods (once; called with the lock held); raise, wrapping nothing, when this
    torch's iterator class lacks them."""
    if _originals:
        return
    missing = [name for name in ("_next_index", "__next__") if name not in _Iterator.__dict__]
    if missing:
        raise RuntimeError(f"torch.utils.data.dataloader._BaseDataLoaderIter has no {' or '.join(missing)}")
    next_index, next_batch = _Iterator.__dict__["_next_index"], _Iterator.__dict__["__next__"]

    @functools.wraps(next_index)
    def _next_index(self: Any) -> Any:
        index = next_index(self)  # may raise StopIteration: the epoch's end, as without ampwatch
        tap = _taps.get(id(self._index_sampler)) if _taps else None
        if tap is not None:
            try:
                if tap.sampler is self._index_sampler:
                    tap.drawn(self, index)
            except Exception as error:  # noqa: BLE001 - the loader goes on as without ampwatch
                tap.errors.report("recording a loader's indices", error)
        return index

    @functools.wraps(next_batch)
    def __next__(self: Any) -> Any:
        try:
            batch = next_batch(self)
        except StopIteration:
            _noted(self, LoaderTap.exhausted)
            raise
        if _taps:
            _noted(self, LoaderTap.yielded)
        return batch

    _originals.update(_next_index=next_index, __next__=next_batch)
    _Iterator._next_index = _next_index  # type: ignore[method-assign]
    _Iterator.__next__ = __next__  # type: ignore[method-assign]
    _wrappers.update(_next_index=_next_index, __next__=__next__)


_wrappers: dict[str, Callable[..., Any]] = {}


def _noted(iterator: Any, note: Callable[[LoaderTap], None]) -> None:
    tap = _tap_of(iterator)
    if tap is not None:
        try:
            note(tap)
        except Exception as error:  # noqa: BLE001 - the loader goes on as without ampwatch
            tap.errors.report("recording a loader's batches", error)


def _uninstall() -> None:
    """Put the iterator class's own methods back (called with the lock held), unless someone wrapped ours since:
    then ours stay, passing straight through (no loader is followed), so their wrapper keeps working."""
    if not _originals:
        return
    if all(_Iterator.__dict__.get(name) is wrapper for name, wrapper in _wrappers.items()):
        for name, original in _originals.items():
            setattr(_Iterator, name, original)
        _originals.clear()
        _wrappers.clear()
