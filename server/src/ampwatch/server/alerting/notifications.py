"""Deliver alert notifications (firing / resolved) to webhook, Alertmanager and Slack targets, off the ingest path.

>>> targets = parse_targets("alertmanager:http://127.0.0.1:9093, slack:https://hooks.slack.com/services/T/B/x")
>>> [t.name for t in targets]
['alertmanager:127.0.0.1:9093', 'slack:hooks.slack.com']

:meth:`Notifier.submit` returns at once: it puts each alert in a target's
group (webhook, Slack: grouped as Alertmanager groups, one notification per
alert name and run, paced by ``group_wait_s`` and ``group_interval_s``, repeated every ``repeat_interval_s`` while
still firing; see
``grouping``) or on its bounded queue (Alertmanager, which groups by itself:
every change in one post). One background thread per target sends, retries with
capped exponential backoff and jitter while the target is down, and gives up
(counted) after a while. Outcomes count alerts: a notification of a group of
1,024 alerts counts 1,024 sent.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable

from .alert import Alert
from .grouping import REPEAT_INTERVAL_S, AlertGroups
from .payloads import alertmanager_body, slack_body, webhook_body

__all__ = [
    "Target", "NotifyConfig", "Notifier", "parse_targets", "KINDS", "OUTCOMES", "ENV_VAR",
]

log = logging.getLogger("ampwatch.server.notify")

KINDS = ("webhook", "alertmanager", "slack")
OUTCOMES = ("sent", "failed", "dropped")
"""sent: a notification delivered; failed: one attempt that failed (it is retried); dropped: given up."""
ENV_VAR = "AMPWATCH_SERVER_WEBHOOK"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """Where notifications go: ``kind`` (webhook, alertmanager, slack) and an http(s) URL."""

    kind: str
    url: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"notification target kind {self.kind!r} is unknown; use one of {', '.join(KINDS)} "
                             f"(e.g. {ENV_VAR}=alertmanager:http://alertmanager:9093)")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"notification target URL {self.url!r} of kind {self.kind} must be an http:// or "
                             f"https:// URL with a host (e.g. {self.kind}:http://127.0.0.1:9093)")

    @property
    def name(self) -> str:
        """Return ``kind:host[:port]``: a label value without the path or credentials (Slack URLs hold a secret)."""
        parts = urllib.parse.urlsplit(self.url)
        return f"{self.kind}:{parts.hostname}" + (f":{parts.port}" if parts.port else "")

    @property
    def post_url(self) -> str:
        """Return the URL to POST to (Alertmanager's v2 alerts endpoint below its base URL)."""
        if self.kind == "alertmanager":
            return self.url.rstrip("/") + "/api/v2/alerts"
        return self.url


def parse_targets(spec: str | Iterable[str] | None) -> tuple[Target, ...]:
    """Parse ``kind:url`` entries, comma-separated and/or repeated; a bare URL is a generic webhook."""
    entries = [spec] if isinstance(spec, str) else list(spec or ())
    targets = []
    for entry in (e.strip() for chunk in entries for e in chunk.split(",")):
        if not entry:
            continue
        kind, sep, rest = entry.partition(":")
        if kind in ("http", "https"):
            kind, rest = "webhook", entry
        elif not sep or not rest:
            raise ValueError(f"notification target {entry!r} must look like kind:url, with kind one of "
                             f"{', '.join(KINDS)} (set by --webhook or {ENV_VAR})")
        targets.append(Target(kind=kind, url=rest))
    return tuple(targets)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NotifyConfig:
    """How notifications are queued, retried and repeated."""

    queue_size: int = 1000
    """Alerts waiting per Alertmanager target; past it the oldest is dropped (counted). Webhook and Slack
    targets hold one entry per alert in its group instead (as many as the evaluator holds alerts)."""
    timeout_s: float = 5.0
    """Timeout of one HTTP attempt."""
    backoff_initial_s: float = 0.5
    """Delay before the first retry; doubled after each failure ..."""
    backoff_max_s: float = 30.0
    """... up to this cap, with random jitter (50-100 % of the delay)."""
    give_up_after_s: float = 600.0
    """A notification not delivered this long after it was queued is dropped (counted)."""
    resend_interval_s: float = 60.0
    """Alertmanager targets: firing alerts are posted again this often, as Prometheus does."""
    external_url: str = ""
    """The collector's own URL, put in generatorURL / externalURL (empty: left out)."""
    group_wait_s: float = 5.0
    """Webhook and Slack: a new group (alert name, run) waits this long for the rest of its alerts."""
    group_interval_s: float = 60.0
    """Webhook and Slack: a group's later changes (more ranks, resolved ranks) go out at most this often."""
    repeat_interval_s: float = REPEAT_INTERVAL_S
    """Webhook and Slack: a group still firing with nothing new is sent again this often."""

    def __post_init__(self) -> None:
        for name in ("queue_size", "timeout_s", "backoff_initial_s", "backoff_max_s", "give_up_after_s",
                     "resend_interval_s", "repeat_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"NotifyConfig.{name}={getattr(self, name)!r} must be > 0")
        for name in ("group_wait_s", "group_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"NotifyConfig.{name}={getattr(self, name)!r} must be >= 0")


class _Counts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str], int] = {}

    def add(self, target: str, outcome: str, n: int = 1) -> None:
        with self._lock:
            self._values[(target, outcome)] = self._values.get((target, outcome), 0) + n

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._values)


class _Permanent(Exception):
    """The target refused the notification in a way a retry cannot fix (a 4xx other than 408/429)."""


class _Worker(threading.Thread):
    """Send one target's notifications in order, retrying the head while the target is down."""

    def __init__(self, target: Target, config: NotifyConfig, counts: _Counts, clock: Callable[[], float]) -> None:
        super().__init__(name=f"ampwatch-notify-{target.kind}", daemon=True)
        self.target, self.config, self.counts, self.clock = target, config, counts, clock
        self._queue: collections.deque[tuple[float, Alert]] = collections.deque()
        self._cond = threading.Condition()
        self._stop_at: float | None = None  # monotonic deadline once close() was called
        self._firing: dict[str, Alert] = {}  # alertmanager only: re-posted every resend interval
        self._next_resend = time.monotonic() + config.resend_interval_s
        self._down = False
        # webhook, slack: alerts wait in their group until its notification is due
        self._groups = None if target.kind == "alertmanager" else AlertGroups(
            config.group_wait_s, config.group_interval_s, config.repeat_interval_s)

    def put(self, alerts: list[Alert]) -> None:
        """Queue the transitions of one evaluation together: the sender never takes half of them."""
        with self._cond:
            now = time.monotonic()
            if self._groups is not None:  # one entry per alert in its group: bounded by the alerts themselves
                for alert in alerts:
                    self._groups.add(alert, now)
                self._cond.notify()
                return
            for alert in alerts:
                if len(self._queue) >= self.config.queue_size:
                    self._queue.popleft()
                    self.counts.add(self.target.name, "dropped")
                self._queue.append((now, alert))
            self._cond.notify()

    def stop(self, deadline: float) -> None:
        with self._cond:
            self._stop_at = deadline
            self._cond.notify()

    def run(self) -> None:
        if self._groups is not None:
            return self._run_grouped(self._groups)
        while True:
            with self._cond:
                while not self._queue and self._stop_at is None and not self._resend_due():
                    # Only this thread fills _firing, so with nothing firing there is nothing to wake up for.
                    self._cond.wait(max(0.05, self._next_resend - time.monotonic()) if self._firing else None)
                if self._stop_at is not None and (not self._queue or time.monotonic() >= self._stop_at):
                    if self._queue:
                        self.counts.add(self.target.name, "dropped", len(self._queue))
                        self._queue.clear()
                    return
                batch = [self._queue.popleft() for _ in range(len(self._queue))]
            self._deliver_safely(batch)

    def _run_grouped(self, groups: AlertGroups) -> None:
        """Send each group's notification when it is due; on close, every group's at once."""
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    due = groups.next_due()
                    if self._stop_at is not None or (due is not None and due <= now):
                        break
                    self._cond.wait(None if due is None else due - now)
                stop_at = self._stop_at
                stopping = stop_at is not None
                if stop_at is not None and now >= stop_at:
                    left = sum(len(n) for n in groups.take_due(now, everything=True))
                    if left:
                        self.counts.add(self.target.name, "dropped", left)
                    return
                notifications = groups.take_due(now, everything=stopping)
                if stopping and not notifications:
                    return
            for alerts in notifications:
                self._deliver_safely([(now, a) for a in alerts])

    def _deliver_safely(self, batch: list[tuple[float, Alert]]) -> None:
        try:
            self._deliver(batch)
        except Exception:  # never let one bad notification kill the thread
            log.exception("notification to %s failed unexpectedly", self.target.name)
            self.counts.add(self.target.name, "dropped", max(len(batch), 1))

    def _resend_due(self) -> bool:
        return bool(self._firing) and time.monotonic() >= self._next_resend

    def _deliver(self, batch: list[tuple[float, Alert]]) -> None:
        alerts = [a for _, a in batch]
        if self.target.kind == "alertmanager":
            for a in alerts:
                if a.ends_at is None:
                    self._firing[a.fingerprint] = a
                else:
                    self._firing.pop(a.fingerprint, None)
            # Send what changed plus every alert still firing, so Alertmanager never lets one expire.
            changed = {a.fingerprint for a in alerts}
            alerts = alerts + [a for fp, a in self._firing.items() if fp not in changed]
            self._next_resend = time.monotonic() + self.config.resend_interval_s
            if not alerts:
                return
            body: object = alertmanager_body(alerts, self.clock(), 4 * self.config.resend_interval_s,
                                             self.config.external_url)
        elif self.target.kind == "slack":
            body = slack_body(alerts, self.config.external_url)
        else:
            body = webhook_body(alerts, self.config.external_url)
        queued_at = batch[0][0] if batch else time.monotonic()
        self._send_with_retries(json.dumps(body).encode(), queued_at, len(batch))

    def _send_with_retries(self, data: bytes, queued_at: float, count: int) -> None:
        delay = self.config.backoff_initial_s
        while True:
            try:
                self._post(data)
            except _Permanent as error:
                log.error("%s refused a notification (%s); not retried: check the target's URL and configuration",
                          self.target.name, error)
                self.counts.add(self.target.name, "dropped", max(count, 1))
                return
            except (OSError, urllib.error.URLError) as error:
                self.counts.add(self.target.name, "failed")
                if not self._down:  # once per outage, not once per retry
                    log.warning("cannot deliver notifications to %s (%s); retrying with backoff", self.target.name,
                                error)
                    self._down = True
                now = time.monotonic()
                stopping = self._stop_at is not None and now >= self._stop_at
                if stopping or now - queued_at >= self.config.give_up_after_s:
                    self.counts.add(self.target.name, "dropped", max(count, 1))
                    return
                with self._cond:
                    wait = delay * random.uniform(0.5, 1.0)
                    if self._stop_at is not None:
                        wait = min(wait, max(0.0, self._stop_at - now))
                    self._cond.wait(wait)
                delay = min(delay * 2, self.config.backoff_max_s)
                continue
            if self._down:
                log.warning("notifications to %s are delivered again", self.target.name)
                self._down = False
            self.counts.add(self.target.name, "sent", count)
            return

    def _post(self, data: bytes) -> None:
        request = urllib.request.Request(self.target.post_url, data=data, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "User-Agent": "ampwatch-collector"})
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as error:
            if 400 <= error.code < 500 and error.code not in (408, 429):
                raise _Permanent(f"HTTP {error.code}") from None
            raise


class Notifier:
    """Fan alert transitions out to every target without ever blocking the caller.

    Each transition is sent once: a second submit of the same alert in the same
    state (same fingerprint, status and start) is ignored.
    """

    def __init__(self, targets: Iterable[Target], config: NotifyConfig | None = None, *,
                 clock: Callable[[], float] = time.time, remember: int = 10_000) -> None:
        self.config = config or NotifyConfig()
        self._counts = _Counts()
        self._workers = [_Worker(t, self.config, self._counts, clock) for t in targets]
        self._last: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._remember = remember
        self._lock = threading.Lock()
        for worker in self._workers:
            worker.start()

    @property
    def targets(self) -> list[Target]:
        """Return the configured targets."""
        return [w.target for w in self._workers]

    def submit(self, changes: Iterable[Alert]) -> None:
        """Queue alert transitions for every target (returns at once).

        The transitions of one call reach each target's sender at once, so a group's first notification
        lists all of them however long queueing takes (a whole-job storm submits thousands together).
        """
        new = []
        with self._lock:
            for alert in changes:
                state = (alert.status, alert.starts_at)
                if self._last.get(alert.fingerprint) == state:
                    continue
                self._last[alert.fingerprint] = state
                self._last.move_to_end(alert.fingerprint)
                if len(self._last) > self._remember:
                    self._last.popitem(last=False)
                new.append(alert)
        if new:
            for worker in self._workers:
                worker.put(new)

    def counts(self) -> dict[tuple[str, str], int]:
        """Return notifications by ``(target name, outcome)``, for ``ampwatch_collector_notifications_total``."""
        values = self._counts.snapshot()
        for worker in self._workers:
            for outcome in OUTCOMES:
                values.setdefault((worker.target.name, outcome), 0)
        return values

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued within ``timeout_s`` (one attempt each once it is up), then stop the threads."""
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.stop(deadline)
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()) + self.config.timeout_s)
            if worker.is_alive():
                log.warning("notification thread for %s did not stop in time", worker.target.name)

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
