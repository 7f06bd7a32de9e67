"""Background delivery of batches to the collector: one daemon thread per process."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from ampwatch.contract.batch import Event
from ampwatch.contract.protocol import LEVEL_HEARTBEATS

from ._batch import MAX_BATCH_EVENTS, build_batch, encode_batch, holds_levels
from ._config import AgentConfig
from ._errors import AgentErrors
from ._events import EventBuffer
from ._fork import forget_in_forked_children
from ._http import IngestClient, Outcome
from ._identity import Identity
from ._kinds import CollectorKinds
from ._limits import COLLECTOR_DEFAULTS
from ._outbox import REPLAYED, MemoryOutbox, Pending
from ._outcomes import DeliveryOutcomes
from ._relay_channel import NodeChannel, RelayedClient
from ._schedule import PushSchedule
from ._spool import SpoolOutbox

__all__ = ["Sender"]

log = logging.getLogger("ampwatch.agent")

# A batch is split to stay under a default collector's limit, with room for the mark a replay adds (_outbox).
MAX_BODY_BYTES = COLLECTOR_DEFAULTS["max_body_bytes"] - len(REPLAYED) + 1


class Sender:
    """Sends ``snapshot()`` + drained events to the collector from a daemon thread.

    ``snapshot()`` returns ``{"scaler": {...}, "state": {...}}`` as in
    docs/protocol.md, without ``state.delivery``: the sender adds those counters.
    ``errors`` and ``wake`` may be shared with the recorder: its failures are
    counted in the same ``agent_errors``, and setting ``wake`` is news: a batch soon.
    ``events`` sets ``wake`` itself when news is appended (``_schedule.is_news``).
    When batches go is :class:`~._schedule.PushSchedule`'s: news soon, the cumulative
    state at least every ``push_interval`` (the heartbeat).
    ``snapshot`` is called on the sender thread, so it must be safe to call there.

    The calling (training) thread only ever sets an event (:meth:`wake`) or,
    in :meth:`close`, waits at most ``timeout`` seconds. Nothing here raises
    into the caller: failures are logged once and counted in ``agent_errors``.
    What each answer counts, and how long a retry waits, is
    :class:`~._outcomes.DeliveryOutcomes`'s.
    """

    def __init__(self, config: AgentConfig, identity: Identity,
                 snapshot: Callable[[], dict[str, Any]], events: EventBuffer, *,
                 errors: AgentErrors | None = None, wake: threading.Event | None = None) -> None:
        config = config.for_job(identity.world_size)  # the default heartbeat follows the job's size
        self.config, self.identity, self.snapshot, self.events = config, identity, snapshot, events
        self.errors = errors if errors is not None else AgentErrors()
        self._outcomes = DeliveryOutcomes(config.heartbeat, config.max_backoff)  # counters, backoff, what was said
        self._pid = os.getpid()
        self._seq = 0  # seq of the last batch built
        self._wake = wake if wake is not None else threading.Event()
        events.wake = self._wake  # news appended by the training thread wakes this sender
        self._schedule = PushSchedule(config.heartbeat, ranks=identity.world_size)
        self._stop = threading.Event()
        self._deadline: float | None = None  # monotonic time by which close() gives up
        self._thread: threading.Thread | None = None
        self._outbox: MemoryOutbox | SpoolOutbox = MemoryOutbox()
        self._lost_by_outboxes = 0  # events dropped by an outbox we had to replace
        self._refused_spool_files = 0  # entries of the spool another user could have planted, refused unread
        self._clients: dict[str, IngestClient | RelayedClient] = {}
        # Listed event kinds go only to a collector that listed them (_kinds); this process's own go to one URL.
        own_url = config.collector_for(identity.run, identity.rank, identity.world_size) if config.collectors else ""
        self._kinds = CollectorKinds(own_url)
        self._node = NodeChannel(config, identity, self.errors) if config.relay else None  # no I/O until used
        self._built_at = float("-inf")  # monotonic time the last batch was built
        self._closed_built = False
        self._backlog = False  # the last batch was full and more events wait
        self._last_snapshot: dict[str, Any] = {}
        self._finish: Callable[[], None] | None = None
        self.device: Mapping[str, Any] | None = None  # set by watch(): sent until a batch carrying it is accepted
        self._device_through = 0  # seq of the last batch built with the device
        self._device_accepted = False
        self._levels_at = float("-inf")  # monotonic time the last batch with the rolling levels was built
        self._levels_through = 0  # its seq
        _live.add(self)  # for the exit flush
        forget_in_forked_children(self)

    # -- called from the training thread -------------------------------------------------

    def start(self) -> None:
        """Start the background thread (no-op without collectors, or in a forked child)."""
        if self._thread is not None or not self.config.sends or self._in_forked_child():
            return
        self._thread = threading.Thread(target=self._run, name="ampwatch-sender", daemon=True)
        self._thread.start()
        _register_exit_flush()

    def wake(self) -> None:
        """Note news: ask for a batch soon (within the schedule's news gap); never blocks."""
        self._wake.set()

    def close(self, timeout: float | None = None, *, wait: bool = True,
              finish: Callable[[], None] | None = None) -> None:
        """Send a final batch with ``closed: true`` and stop, waiting at most ``timeout`` seconds.

        ``timeout`` defaults to ``AMPWATCH_CLOSE_TIMEOUT``; it also bounds the
        thread's own work when ``wait`` is False (then this returns at once).
        ``finish`` runs on the sender thread before the final batch is built
        (e.g. the recorder's close, when closing from a finalizer). With a
        spool, what is still undelivered then stays on disk for the next agent.
        """
        thread = self._thread
        if thread is None or self._in_forked_child():
            return
        timeout = self.config.close_timeout if timeout is None else max(0.0, timeout)
        if not self._stop.is_set():
            self._finish = finish
            self._deadline = time.monotonic() + timeout
            self._stop.set()
            self._wake.set()
        if wait:
            thread.join(timeout)

    @property
    def delivery(self) -> dict[str, int]:
        """Return the delivery counters as sent in ``state.delivery``."""
        outcomes = self._outcomes
        return {
            "dropped_events": (self.events.dropped + self._outbox.dropped_events + self._lost_by_outboxes
                               + self._kinds.dropped),
            "send_failures": outcomes.send_failures,
            "rejected_batches": outcomes.rejected_batches,
            "agent_errors": self.errors.count,
            "refused_spool_files": self._refused_spool_files,
        }

    # Read-only views of the answers' counters (tests and tools read them here).
    send_failures = property(lambda self: self._outcomes.send_failures,
                             doc='Attempts to retry: no answer, 5xx, 408, 429, or the collector said "retry": true.')
    rejected_batches = property(lambda self: self._outcomes.rejected_batches,
                                doc='Batches the collector refused for good ("retry": false, another 4xx): dropped.')
    batches_acked = property(lambda self: self._outcomes.batches_acked,
                             doc="Batches the collector acknowledged.")

    # -- the sender thread -----------------------------------------------------------------

    def _run(self) -> None:
        """Build a batch when the schedule says (news soon, else every push interval), deliver oldest first."""
        self._open_spool()  # here, not in start(): adopting a big spool must not delay training
        schedule = self._schedule
        schedule.begin(time.monotonic())  # the first batch soon: at once for a small job, spread for a big one
        hurry = False
        while True:
            try:
                closing = self._stop.is_set()
                if closing and self._finish is not None:
                    finish, self._finish = self._finish, None
                    finish()
                now = time.monotonic()
                if self._wake.is_set():
                    self._wake.clear()  # always: a set flag would turn the wait below into a busy loop
                    schedule.news(now)
                if closing or hurry or now >= schedule.due():
                    self._build(closing)
                    schedule.built(max(now, self._built_at))
                hurry = False
                self._deliver()
                if closing and self._finished():
                    break
                if self._backlog and self._outbox.head() is None:
                    hurry = True  # more events than one batch holds: send the rest now
                    continue
                wait = schedule.due() - time.monotonic()
                if self._outbox.head() is not None:
                    wait = min(wait, self._outcomes.retry_at - time.monotonic())
                if closing:
                    wait = min(wait, self._deadline_left())
                self._wake.wait(max(0.0, min(wait, self.config.heartbeat)))
            except Exception as exc:  # never let the thread die: count, pause, carry on
                self.errors.report("the sender thread", exc)
                if self._stop.wait(min(1.0, self.config.heartbeat)):
                    if self._deadline_left() <= 0:
                        break
                    time.sleep(0.05)  # closing: keep trying until the deadline, but not in a tight loop
        self._shutdown()

    def _build(self, closing: bool) -> None:
        """Put the next batch in the outbox when there is room: cumulative state plus waiting events."""
        if self._outbox.full() or self._closed_built:
            return
        if self._outcomes.failures_in_row and not closing and not len(self.events):
            return  # collector unreachable: a heartbeat would only repeat state the next batch carries
        events = self.events.drain(MAX_BATCH_EVENTS)
        full = len(events) == MAX_BATCH_EVENTS
        events = self._kinds.sort(events)  # a listed kind its collector is known not to take is dropped
        snapshot = self._take_snapshot()
        closed = closing and not len(self.events)
        self._seq += 1
        if self.device and not self._device_accepted:
            self._device_through = self._seq
        now = time.monotonic()
        if closing or now - self._levels_at >= (LEVEL_HEARTBEATS - 0.5) * self.config.heartbeat:
            self._levels_through = self._seq  # one heartbeat in four, and the last batches
            if holds_levels(snapshot.get("state")):
                self._levels_at = now  # the first level goes at once: the collector compares ranks with it
        body = self._encode(snapshot, events, closed)
        while len(body) > MAX_BODY_BYTES and len(events) > 1:
            # A collector with default settings refuses a larger body for good (413): the later half of the
            # events goes back to the buffer's front for the next batch (rare: long names in a long outage).
            self.events.requeue(events[len(events) // 2:])
            events, full, closed = events[:len(events) // 2], True, False
            body = self._encode(snapshot, events, closed)
        self._backlog = full and len(self.events) > 0
        pending = Pending(seq=self._seq, events=len(events), run=self.identity.run, rank=self.identity.rank,
                          world_size=self.identity.world_size, body=body)
        try:
            if self._outbox.make_room(len(body)):
                pending.body = self._encode(snapshot, events, closed)  # so it reports the drops it just caused
            self._outbox.put(pending)
        except OSError as exc:
            # The disk is full or gone: keep delivering from memory rather than not at all.
            self.errors.report("writing to the spool (continuing without it)", exc)
            self._replace_outbox_with_memory()
            self._outbox.put(pending)
        self._built_at = time.monotonic()
        self._closed_built = closed

    def _encode(self, snapshot: dict[str, Any], events: list[Event], closed: bool) -> bytes:
        """Encode batch ``self._seq`` with the delivery counters as they are now."""
        device = self.device if self._device_through == self._seq else None
        batch = build_batch(self.identity, seq=self._seq, snapshot=snapshot, delivery=self.delivery,
                            events=events, closed=closed, device=device, levels=self._levels_through == self._seq)
        return encode_batch(batch)

    def _deliver(self) -> None:
        """Send outbox batches oldest first until it is empty, one fails, or a backoff is due."""
        while (pending := self._outbox.head()) is not None and not self._in_forked_child():
            now = time.monotonic()
            if now < self._outcomes.retry_at:
                return
            timeout = min(self.config.timeout, self._deadline_left())
            if timeout <= 0:
                return
            try:
                body = pending.load()
            except OSError as exc:
                self.errors.report("reading a spooled batch (dropped)", exc)
                self._outbox.pop()
                continue
            url = self.config.collector_for(pending.run, pending.rank, pending.world_size)  # down: retried there
            if (fitted := self._kinds.fit(url, body)) is not None:
                body = self._refit(pending, fitted)  # built before its collector said it does not take a kind
            answer = self._client(url).post(body, timeout)
            outcome = answer.outcome
            if outcome is Outcome.ACKED:
                self._outbox.pop()
                if pending.seq <= self._device_through and not pending.replayed:
                    self._device_accepted = True  # this process's batch carried the device: sent once is enough
                self._kinds.answered(url, answer)
                if self._outcomes.acked(url) and len(self.events):
                    self._wake.set()  # what waited out the outage goes soon, not at the next heartbeat
            elif answer.status == 422 and (fitted := self._kinds.fit(url, body, refused=True)) is not None:
                self._refit(pending, fitted)  # an older collector refuses a kind it does not know: once more without
            elif outcome is Outcome.REJECTED:
                self._outbox.pop()
                self._outcomes.rejected(url, pending.seq, answer)
            else:
                self._outcomes.failed(url, pending.seq, answer)  # sets when the same batch goes again
                return

    @staticmethod
    def _refit(pending: Pending, fitted: tuple[bytes, int]) -> bytes:
        """Send ``pending`` as ``fitted`` (its body less some events) from now on, its retries too; return the body."""
        pending.body, dropped = fitted
        pending.events -= dropped  # a spool that drops it later counts only what it still held
        return pending.body

    def _finished(self) -> bool:
        """Return whether closing is done: the closed batch was delivered, or time is up."""
        return (self._closed_built and self._outbox.head() is None) or self._deadline_left() <= 0

    def _shutdown(self) -> None:
        """Release connections and the spool (undelivered spooled batches stay for replay)."""
        for client in self._clients.values():
            client.close()
        if self._node is not None:
            self._node.close()
        try:
            self._outbox.close()
        except OSError as exc:
            self.errors.report("closing the spool", exc)
        if self._outbox.head() is not None:
            log.warning("ampwatch: %d batch(es) undelivered at close%s", len(self._outbox),
                        " (kept in the spool for the next run)" if isinstance(self._outbox, SpoolOutbox) else "")

    # -- helpers -----------------------------------------------------------------------------

    def _open_spool(self) -> None:
        """Use the on-disk spool when configured (adopting earlier processes' batches), else memory."""
        if not self.config.spool_dir:
            return
        try:
            self._outbox = SpoolOutbox(self.config.spool_dir, self.identity.incarnation,
                                       self.config.spool_max_bytes)
            self._refused_spool_files = self._outbox.refused_files
        except OSError as exc:
            self.errors.report(f"opening the spool in {self.config.spool_dir!r} (sending without it)", exc)

    def _take_snapshot(self) -> dict[str, Any]:
        """Call ``snapshot()``; on failure count it and reuse the last good one."""
        try:
            self._last_snapshot = dict(self.snapshot())
        except Exception as exc:
            self.errors.report("snapshot()", exc)
        return self._last_snapshot

    def _client(self, url: str) -> IngestClient | RelayedClient:
        """Return the kept-alive client for ``url`` (through the node relay when ``relay`` is on)."""
        client = self._clients.get(url)
        if client is None:
            client = IngestClient(url, self.config.token)
            if self._node is not None:
                client = RelayedClient(url, client, self._node)
            self._clients[url] = client
        return client

    def _replace_outbox_with_memory(self) -> None:
        """Fall back to an in-memory outbox, counting the events stranded in the old one."""
        old = self._outbox
        self._lost_by_outboxes += old.dropped_events
        try:
            old.close()
        except OSError:
            pass
        self._outbox = MemoryOutbox()

    def _deadline_left(self) -> float:
        """Return seconds left before close() gives up (infinite while not closing)."""
        return float("inf") if self._deadline is None else self._deadline - time.monotonic()

    def _in_forked_child(self) -> bool:
        """Return whether this process is a fork of the one that made the sender (it must never send)."""
        return os.getpid() != self._pid

    def _after_fork_in_child(self) -> None:
        """Forget the parent's thread and spool: a forked child never sends."""
        self._thread = None
        self.errors._lock = threading.Lock()  # the parent's thread may have held it at fork time
        reinit = getattr(self._wake, "_at_fork_reinit", None)  # in place: the recorder holds this event too
        if reinit is not None:
            reinit()
        else:  # pragma: no cover - every supported Python has it
            self._wake = self.events.wake = threading.Event()
        self._stop = threading.Event()
        self._outbox.after_fork_in_child()
        self._clients.clear()


_live: weakref.WeakSet[Sender] = weakref.WeakSet()


def close_all_senders() -> None:
    """Stop every sender still running and wait for their final batches within ONE close timeout in all.

    Runs at interpreter exit: ten unclosed watches wait as long as one, not ten times as long.
    """
    senders = [s for s in list(_live) if s._thread is not None and not s._in_forked_child()]
    if not senders:
        return
    for sender in senders:
        try:
            sender.close(wait=False)
        except Exception as exc:  # noqa: BLE001 - exit must never fail because of the agent
            sender.errors.report("the exit flush", exc)
    # Each sender's own deadline was set when it was first asked to close: a second call waits no longer.
    deadline = max(s._deadline if s._deadline is not None else time.monotonic() for s in senders)
    for sender in senders:
        thread = sender._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))


_exit_flush_registered = False


def _register_exit_flush() -> None:
    """Register :func:`close_all_senders` at exit once, when the first sender starts."""
    global _exit_flush_registered
    if not _exit_flush_registered:
        _exit_flush_registered = True
        atexit.register(close_all_senders)
