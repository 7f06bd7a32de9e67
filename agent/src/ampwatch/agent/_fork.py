"""Agent objects that a forked child must not use: one weak registry, one at-fork hook for all of them.

A DataLoader worker forked from a training process inherits the agent's sockets, locks and relay
role, but none of its threads. Each object registered here drops what it inherited, in its
``_after_fork_in_child``, before the child runs any code of its own. The registry holds its
objects weakly, so registering keeps nothing alive.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["ForkAware", "forget_in_forked_children"]


class ForkAware(Protocol):
    """An object that knows what to drop in a forked child."""

    def _after_fork_in_child(self) -> None:
        """Drop, in a forked child, what the parent's threads own; take no lock (one may have been held at fork)."""


_live: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def forget_in_forked_children(obj: ForkAware) -> None:
    """Have ``obj._after_fork_in_child()`` called in every child this process forks while ``obj`` lives."""
    _live.add(obj)


def _forget_in_child() -> None:
    for obj in list(_live):
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
