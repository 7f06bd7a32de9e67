"""Per-client ingest budgets: new runs and events per client address, so one client cannot crowd out the rest.

``--max-runs`` and ``--max-body-bytes`` bound the collector as a whole; a single client (a runaway
script, a flood) could still take all of it, and real jobs would then wait for up to an hour. These
token buckets give each client address its own share, sized so that no real job reaches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ampwatch.contract.protocol import MAX_BATCH_EVENTS

from ._access import RateLimiter

__all__ = ["ClientBudget", "EVENT_BURST_SECONDS"]

EVENT_BURST_SECONDS = 10
"""A client may send this many seconds' worth of events at once (and always at least one full batch)."""


class ClientBudget:
    """Take a batch's share from its client's budgets, or say which one it is over. O(1) per batch."""

    def __init__(self, new_runs_per_hour: int, event_rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.new_runs_per_hour, self.event_rate = new_runs_per_hour, event_rate
        self._runs = (RateLimiter(new_runs_per_hour / 3600.0, burst=float(new_runs_per_hour), clock=clock)
                      if new_runs_per_hour > 0 else None)
        self._events = (RateLimiter(event_rate, burst=max(EVENT_BURST_SECONDS * event_rate, MAX_BATCH_EVENTS),
                                    clock=clock) if event_rate > 0 else None)

    def refusal(self, client: str, new_run: bool, events: int) -> tuple[str, str, int] | None:
        """Return ``(reason, message, retry_after_s)`` when the batch is over a budget of ``client``, else None."""
        if events and self._events is not None and not self._events.allow(client, events):
            wait = self._events.retry_after(client, events)
            return "client_events", (f"too many events from {client}: this collector takes {self.event_rate:g} "
                                     f"events per second per client address, bursts up to "
                                     f"{self._events.burst:g} (--client-event-rate); retry in {wait} s, or raise "
                                     f"the limit"), wait
        if new_run and self._runs is not None and not self._runs.allow(client):
            wait = self._runs.retry_after(client)
            return "client_runs", (f"too many new runs from {client}: this collector lets one client address "
                                   f"open {self.new_runs_per_hour} runs an hour (--client-new-runs); retry in "
                                   f"{wait} s, or raise the limit"), wait
        return None
