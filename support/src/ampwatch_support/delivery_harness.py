"""Build a real Sender around a stand-in recorder (a counting snapshot and a real EventBuffer)."""

from __future__ import annotations

import threading
from typing import Any

from ampwatch.agent._config import AgentConfig
from ampwatch.agent._errors import AgentErrors
from ampwatch.agent._events import EventBuffer
from ampwatch.agent._identity import resolve_identity
from ampwatch.agent._sender import Sender
from ampwatch_support.batches import optimizer

__all__ = ["StandInRecorder", "make_sender", "record_sender_joins", "FAST"]

FAST = {"push_interval": 0.05, "max_backoff": 0.2, "timeout": 2.0, "close_timeout": 5.0}
"""Delivery settings that keep tests quick: short interval, short backoff cap."""


class StandInRecorder:
    """Plays the recorder's side of the Sender contract: ``snapshot()`` and ``events``.

    Each ``skip()`` appends a skip event and bumps the cumulative counters the
    snapshot reports, as the real recorder does.
    """

    def __init__(self, max_events: int = 10_000) -> None:
        self.events = EventBuffer(capacity=max_events)
        self.iteration = 0
        self.skipped = 0
        self.fail_snapshots = False
        self.errors = AgentErrors()  # the recorder's own internal failures; the sender shares this counter
        self._lock = threading.Lock()

    def skip(self) -> dict[str, Any]:
        """Record one skipped step of optimizer ``opt`` and return its event."""
        with self._lock:
            self.iteration += 1
            self.skipped += 1
            iteration = self.iteration
        return self.events.append({"kind": "skip", "iteration": iteration, "optimizer": "opt", "streak": 1,
                                   "params": [], "params_total": None, "inspected": False})

    def spike(self, kind: str = "loss_spike") -> dict[str, Any]:
        """Record one spike of the loss (or, ``kind="grad_norm_spike"``, of optimizer ``opt``'s gradient norm) in a
        new iteration and return its event: a kind a collector must list before it is sent one."""
        with self._lock:
            self.iteration += 1
            iteration = self.iteration
        event: dict[str, Any] = {"kind": kind, "iteration": iteration, "value": 50.0, "mean": 1.0, "std": 0.5,
                                 "z": 98.0, "streak": 1}
        if kind == "grad_norm_spike":
            event["optimizer"] = "opt"
        return self.events.append(event)  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, Any]:
        """Return the cumulative state, as the real recorder's snapshot() does."""
        if self.fail_snapshots:
            raise RuntimeError("stand-in snapshot failure")
        with self._lock:
            return {
                "scaler": {"enabled": True, "kind": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
                           "backoff_factor": 0.5, "growth_interval": 2000},
                "state": {"iteration": self.iteration, "loss_scale": 1024.0, "backoffs": self.skipped,
                          "growths": 0, "manual_sets": 0,
                          "optimizers": {"opt": optimizer(steps=self.iteration - self.skipped, skipped=self.skipped,
                                                          longest=1, streaks=self.skipped)}},
            }


def make_sender(collector: str | list[str] | None, *, run: str = "test-run", rank: int = 0,
                world_size: int = 1, max_events: int = 10_000, recorder: StandInRecorder | None = None,
                wake: threading.Event | None = None, **overrides: Any) -> tuple[Sender, StandInRecorder]:
    """Return a started Sender for ``rank`` and its stand-in recorder; ``overrides`` tune AgentConfig.

    ``wake`` is the sender's wake event (default: its own).
    """
    settings = {**FAST, **overrides}
    config = AgentConfig.from_env(collector=collector or "", run=run, environ={}, max_events=max_events,
                                  **settings)
    identity = resolve_identity(config.run, environ={"RANK": str(rank), "WORLD_SIZE": str(world_size)})
    recorder = recorder or StandInRecorder(max_events)
    sender = Sender(config, identity, recorder.snapshot, recorder.events, errors=recorder.errors, wake=wake)
    sender.start()
    return sender, recorder


def record_sender_joins() -> list[float]:
    """From now on, record the timeout of every ``join()`` on an agent sender thread (the real join still runs).

    How long a close or an exit flush may wait for senders is the sum of these: a fact of its logic,
    which a loaded machine does not change (it only returns from each wait later).
    """
    joins: list[float] = []
    join = threading.Thread.join

    def recording(thread: threading.Thread, timeout: float | None = None) -> None:
        if thread.name == "ampwatch-sender":
            joins.append(float("inf") if timeout is None else timeout)
        join(thread, timeout)

    threading.Thread.join = recording  # type: ignore[method-assign]
    return joins
