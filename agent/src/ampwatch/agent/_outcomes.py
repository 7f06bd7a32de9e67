"""What the collector's answers come to: the delivery counters, the backoff before a retry, one log line per kind.

Split from the sender, whose thread decides when to build and send: this module decides what an
answer means for the counters in ``state.delivery``, how long the same batch waits before it is
sent again, and what the user is told (once per kind of answer, in the collector's own words).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from ._http import Answer

__all__ = ["DeliveryOutcomes"]

log = logging.getLogger("ampwatch.agent")

_BACKOFF_BASE_MAX = 1.0  # seconds: the first retry waits at most this (or the push interval if shorter)


class DeliveryOutcomes:
    """Account for each attempt's answer: acknowledged, refused for good, or to be retried after a backoff.

    Updated on the sender thread only; the training thread reads the counters
    (``state.delivery``, plain ints). The backoff doubles per failure in a row
    from ``min(1 s, push_interval)`` up to ``max_backoff``, each wait drawn
    between 50% and 100% so ranks do not retry in lockstep, and at least the
    collector's ``Retry-After`` within the cap (docs/agent.md#delivery). The draws
    come from ``rng``, by default a generator of its own: never Python's global
    ``random``, whose stream belongs to the training job (data order, augmentation).
    :attr:`retry_at` is on ``clock`` (the sender's, ``time.monotonic``).
    """

    def __init__(self, push_interval: float, max_backoff: float, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self.push_interval = push_interval
        self.max_backoff = max_backoff
        self.send_failures = 0  # attempts to retry: no answer, 5xx, 408, 429, or the collector said "retry": true
        self.rejected_batches = 0  # batches the collector refused for good ("retry": false, other 4xx): dropped
        self.batches_acked = 0
        self.failures_in_row = 0
        self.retry_at = 0.0  # monotonic time before which the oldest batch is not sent again
        self._said: set[str] = set()

    def acked(self, url: str) -> bool:
        """Count a delivered batch; return whether it ended a run of failed attempts (delivery resumed)."""
        self.batches_acked += 1
        resumed = self.failures_in_row > 0
        if resumed:
            log.info("ampwatch: delivery to %s resumed after %d failed attempt(s)", url, self.failures_in_row)
        self.failures_in_row = 0
        return resumed

    def rejected(self, url: str, seq: int, answer: Answer) -> None:
        """Count batch ``seq`` refused for good (it is dropped) and say so once per reason."""
        self.rejected_batches += 1
        self._say_once(f"rejected {answer.status} {answer.body.get('error')}",
                       "ampwatch: %s refused batch seq=%d with HTTP %s: %s. It is dropped and counted in "
                       "rejected_batches, and so will be every batch refused for this reason.%s",
                       url, seq, answer.status, answer.reason, _advice(answer))

    def failed(self, url: str, seq: int, answer: Answer) -> None:
        """Count a failed attempt at batch ``seq`` and set when it is sent again (:attr:`retry_at`)."""
        self.send_failures += 1
        self.failures_in_row += 1
        delay = min(self.max_backoff, min(_BACKOFF_BASE_MAX, self.push_interval) * 2 ** (self.failures_in_row - 1))
        delay *= self._rng.uniform(0.5, 1.0)  # jitter: ranks spread out
        if answer.retry_after is not None:  # the collector said when: wait that long, within our cap
            delay = max(delay, min(answer.retry_after, self.max_backoff))
        self.retry_at = self._clock() + delay
        if answer.status is None:
            self._say_once("retry", "ampwatch: cannot deliver to %s (%s); retrying with backoff, training "
                           "is not affected. Check that the collector runs and AMPWATCH_URL is right.",
                           url, answer.detail)
        else:  # it answered: its own reason says more than any guess of ours
            self._say_once(f"retry {answer.status} {answer.body.get('error')}",
                           "ampwatch: %s cannot take batch seq=%d now (HTTP %s: %s); the batch is kept and "
                           "sent again with backoff, training is not affected.",
                           url, seq, answer.status, answer.reason)

    def _say_once(self, key: str, message: str, *args: Any) -> None:
        """Log ``message`` the first time ``key`` comes up."""
        if key not in self._said:
            self._said.add(key)
            log.warning(message, *args)


def _advice(answer: Answer) -> str:
    """Say what the user can do about a refused batch, where the collector's own message may not."""
    status = answer.status
    if answer.body.get("message"):
        return ""  # the collector said what was wrong and what to do
    if status in (401, 403):
        return " Set AMPWATCH_TOKEN (or token=) to the collector's token."
    if status == 404:
        return " Check AMPWATCH_URL: it should be the collector's base URL, e.g. http://host:9457."
    if status == 413:
        return " Raise the collector's body size limit."
    if status == 422:
        return " The collector speaks another protocol version, or the agent sent a bad batch: upgrade both."
    return " See the collector's log."
