"""Cumulative counters of a rank and of each of its optimizers, typed: of one process, or summed over a rank's.

Both kinds are immutable; an update returns a new value (a few hundred nanoseconds), so a
snapshot handed to the alert evaluator or a label cache can keep a reference without a copy.
A streak-ladder tuple that did not move is handed on as the same object, which lets the
exposition format its 11 lines per optimizer only when one of them changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from operator import attrgetter
from typing import Any, ClassVar, TypeVar

from ampwatch.contract.protocol import STREAK_LADDER

from ._schema import WireOptimizerCounters, WireRankState

__all__ = ["RankTotals", "OptimizerTotals", "NO_STREAKS", "ladder"]

NO_STREAKS: tuple[int, ...] = (0,) * len(STREAK_LADDER)
_RUNG = {length: i for i, length in enumerate(STREAK_LADDER)}
_KEYS = tuple(map(str, STREAK_LADDER))  # how the wire and the database name the rungs
_REACHED_KEYS = tuple(f"reached_{key}" for key in _KEYS)

T = TypeVar("T", bound="_Counters")


def ladder(reached: Mapping[int, int]) -> tuple[int, ...]:
    """Return the streak-ladder tuple of ``{length: count}`` (lengths left out count 0)."""
    return tuple(reached.get(length, 0) for length in STREAK_LADDER)


class _Counters:
    """Field-wise arithmetic shared by both kinds of totals (every field an int or a ladder tuple)."""

    __slots__ = ()

    _fields: Callable[[Any], tuple]  # every field's value in order: an attrgetter set below each class (one C call)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # each kind is a dataclass

    def _values(self) -> tuple:
        return self._fields(self)

    def at_least(self: T, floor: T) -> T:
        """Return these counters, none lower than in ``floor``: an agent's batch can never undo a count."""
        return type(self)(*map(_larger, self._values(), floor._values()))

    def moved_by(self: T, new: T, old: T) -> T:
        """Return these totals moved by the difference between a process's ``new`` and ``old`` counters."""
        return type(self)(*map(_moved, self._values(), new._values(), old._values()))

    def to_json(self) -> dict[str, int]:
        """Return the counters by name, a ladder's rungs as ``reached_<L>`` (the database's form)."""
        values = dict(zip(self.__dataclass_fields__, self._values(), strict=True))
        ladder = values.pop("streaks_reached", NO_STREAKS)
        if ladder is not NO_STREAKS:
            values.update((key, count) for key, count in zip(_REACHED_KEYS, ladder, strict=True) if count)
        return values

    @classmethod
    def from_json(cls: type[T], values: Mapping[str, int]) -> T:
        """Rebuild from :meth:`to_json` (names left out count 0)."""
        args = []
        for name, field in cls.__dataclass_fields__.items():
            if field.default is NO_STREAKS:
                reached = tuple(values.get(key, 0) for key in _REACHED_KEYS)
                args.append(reached if any(reached) else NO_STREAKS)
            else:
                args.append(values.get(name, 0))
        return cls(*args)


def _larger(a: Any, b: Any) -> Any:
    if isinstance(a, tuple):
        return a if a == b else tuple(map(max, a, b))
    return a if a >= b else b


def _moved(total: Any, new: Any, old: Any) -> Any:
    if isinstance(total, tuple):
        return total if new == old else tuple(t + n - o for t, n, o in zip(total, new, old, strict=True))
    return total + new - old


@dataclasses.dataclass(frozen=True, slots=True)
class RankTotals(_Counters):
    """A rank's scale transitions and its agent's delivery health."""

    backoffs: int = 0
    growths: int = 0
    manual_sets: int = 0
    dropped_events: int = 0
    send_failures: int = 0
    rejected_batches: int = 0
    agent_errors: int = 0
    origin_iterations: int = 0
    """Skipped iterations where the rank's own gradients held inf/NaN before DDP's all-reduce."""
    refused_spool_files: int = 0
    loss_spikes: int = 0
    """Iterations whose loss spiked (above its rolling window, or non-finite)."""

    @classmethod
    def of(cls, state: WireRankState) -> RankTotals:
        """Return the counters a batch's ``state`` carries."""
        d = state.delivery
        return cls(state.backoffs, state.growths, state.manual_sets, d.dropped_events, d.send_failures,
                   d.rejected_batches, d.agent_errors, state.origin_iterations or 0, d.refused_spool_files,
                   state.loss_spikes)


@dataclasses.dataclass(frozen=True, slots=True)
class OptimizerTotals(_Counters):
    """One optimizer's steps, skips, streaks and misuse."""

    steps: int = 0
    skipped: int = 0
    streaks: int = 0
    scheduler_steps_after_skip: int = 0
    poisoned_steps: int = 0
    streaks_reached: tuple[int, ...] = NO_STREAKS
    """Skip streaks that reached at least L consecutive skips, one count per rung L of STREAK_LADDER."""
    grad_norm_spikes: int = 0
    """Iterations whose gradient norm (the one the optimizer stepped with) spiked."""

    @classmethod
    def of(cls, wire: WireOptimizerCounters) -> OptimizerTotals:
        """Return the counters a batch carries for one optimizer."""
        reached = wire.streaks_reached
        return cls(wire.steps, wire.skipped, wire.streaks, wire.scheduler_steps_after_skip, wire.poisoned_steps,
                   tuple(reached.get(key, 0) for key in _KEYS) if reached else NO_STREAKS, wire.grad_norm_spikes)

    def reached(self, length: int) -> int:
        """Return how many skip streaks reached ``length`` (a rung of the streak ladder)."""
        return self.streaks_reached[_RUNG[length]]


for _kind in (RankTotals, OptimizerTotals):
    _kind._fields = attrgetter(*_kind.__dataclass_fields__)
