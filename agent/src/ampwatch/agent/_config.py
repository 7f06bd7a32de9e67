"""Agent configuration: keyword arguments of ``watch()`` over ``AMPWATCH_*`` environment variables."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ampwatch.contract import placement
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS

from ._schedule import default_heartbeat

__all__ = ["AgentConfig", "PROBE_ITERATIONS"]

PROBE_ITERATIONS = 128
"""Iterations the forward probes stay armed by default: a skip streak's rungs up to the 64th and 128th are that far
apart, so an occurrence at the next rung is still seen."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclasses.dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Everything the agent needs besides the scaler and optimizers.

    Build it with :meth:`from_env`; explicit arguments win over the environment.
    Every field is validated in ``__post_init__``; a bad value raises a
    ``ValueError`` naming the variable and saying what is accepted.

    >>> AgentConfig.from_env(collector="http://a:1, http://b:2", environ={}).collectors
    ('http://a:1', 'http://b:2')
    """

    collectors: tuple[str, ...] = ()
    """Collector base URLs (``AMPWATCH_URL``, comma-separated), normalized
    (:func:`~ampwatch.contract.placement.normalize`) and without repeats. Empty: record only, send nothing."""
    block_ranks: int = placement.BLOCK_RANKS
    """Ranks of one run a collector holds whole (``AMPWATCH_BLOCK_RANKS``); a bigger run goes to the collectors
    in blocks of this many ranks (:mod:`ampwatch.contract.placement`). The collectors' ``--block-ranks`` must
    match it."""
    run: str | None = None
    """Run id shared by all ranks (``AMPWATCH_RUN``); resolved from the launcher when ``None``."""
    token: str | None = dataclasses.field(default=None, repr=False)  # a secret never lands in a log
    """Bearer token for ingest (``AMPWATCH_TOKEN``)."""
    push_interval: float | None = None
    """Seconds between heartbeats, batches of the cumulative state when nothing happened
    (``AMPWATCH_PUSH_INTERVAL``). ``None``, the default: 15 s, longer for a job of more than 7,500
    ranks per collector (at most 30 s; :func:`~._schedule.default_heartbeat`), resolved by
    :meth:`for_job` once the job's size is known. News (a skip streak starting or reaching a rung,
    its end, a poisoned step, a warning, the close) is sent within a second (a job of more than 500 ranks:
    within 2 s), whatever this is."""
    spool_dir: str | None = None
    """Directory for an on-disk spool of unsent batches (``AMPWATCH_SPOOL_DIR``)."""
    spool_max_bytes: int = 64 * 1024 * 1024
    """Cap on the spool's size; the oldest batches go first (``AMPWATCH_SPOOL_MAX_BYTES``)."""
    disabled: bool = False
    """``AMPWATCH_DISABLED=1``: ``watch()`` returns a do-nothing object."""
    timeout: float = 5.0
    """Seconds one HTTP request may take before it counts as failed (``AMPWATCH_TIMEOUT``)."""
    max_backoff: float = 30.0
    """Cap on the wait between retries, in seconds (``AMPWATCH_MAX_BACKOFF``)."""
    close_timeout: float = 5.0
    """Seconds ``close()`` and interpreter exit may spend flushing (``AMPWATCH_CLOSE_TIMEOUT``)."""
    max_events: int = 10_000
    """Events held in memory while undelivered; the oldest are dropped first (``AMPWATCH_MAX_EVENTS``)."""
    relay: bool = False
    """``AMPWATCH_RELAY=1``: the ranks of one host hand their batches to one of them, which posts them in one
    request (protocol v2; docs/agent.md, "One request per node")."""
    relay_dir: str | None = None
    """Private directory for the relay's socket (``AMPWATCH_RELAY_DIR``); default ``$XDG_RUNTIME_DIR/ampwatch``,
    else ``/tmp/ampwatch-<uid>``."""
    probe_iterations: int = PROBE_ITERATIONS
    """Iterations the forward probes stay armed after an event whose loss was not finite, unless they name the
    module sooner (``AMPWATCH_PROBE_ITERATIONS``; docs/agent.md, "Where it began"). 0: never armed."""
    spike_window: int = DEFAULT_THRESHOLDS.spike_window_iterations
    """Iterations in the rolling window of the loss and of each gradient norm (``AMPWATCH_SPIKE_WINDOW``;
    docs/agent.md, "Spikes")."""
    spike_sigma: float = DEFAULT_THRESHOLDS.spike_sigma
    """Standard deviations above the window's mean that make a spike (``AMPWATCH_SPIKE_SIGMA``)."""
    grad_norm: bool = False
    """``AMPWATCH_GRAD_NORM=1`` / ``watch(grad_norm=True)``: each optimizer step computes its gradient norm
    (docs/agent.md, "Spikes"); otherwise only norms handed over with ``watch.grad_norm()`` are watched."""

    def __post_init__(self) -> None:
        for url in self.collectors:
            _check_url(url)
        # The form placement answers in, so a URL it names is found here (the relay checks it).
        self.collectors = tuple(dict.fromkeys(placement.normalize(url) for url in self.collectors))
        if isinstance(self.block_ranks, bool) or not isinstance(self.block_ranks, int) or self.block_ranks < 1:
            raise ValueError(f"AMPWATCH_BLOCK_RANKS / block_ranks= must be a whole number of ranks >= 1, got "
                             f"{self.block_ranks!r}")
        if self.run is not None and not (1 <= len(self.run) <= 128 and self.run.isprintable()):
            raise ValueError(f"AMPWATCH_RUN / run= must be 1-128 printable characters, got {self.run!r}")
        for name, var in (("push_interval", "AMPWATCH_PUSH_INTERVAL"), ("timeout", "AMPWATCH_TIMEOUT"),
                          ("max_backoff", "AMPWATCH_MAX_BACKOFF")):
            value = getattr(self, name)
            if value is None and name == "push_interval":
                continue
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{var} / {name}= must be a positive number of seconds, got {value!r}")
        if not (math.isfinite(self.close_timeout) and self.close_timeout >= 0):
            raise ValueError(f"AMPWATCH_CLOSE_TIMEOUT must be >= 0 seconds, got {self.close_timeout!r}")
        if self.spool_max_bytes < 1:
            raise ValueError(f"AMPWATCH_SPOOL_MAX_BYTES must be a positive integer, got {self.spool_max_bytes!r}")
        if self.probe_iterations < 0:
            raise ValueError(f"AMPWATCH_PROBE_ITERATIONS must be an integer >= 0, got {self.probe_iterations!r}")
        if self.max_events < 1:
            raise ValueError(f"AMPWATCH_MAX_EVENTS must be a positive integer, got {self.max_events!r}")
        if isinstance(self.spike_window, bool) or not isinstance(self.spike_window, int) or self.spike_window < 2:
            raise ValueError(f"AMPWATCH_SPIKE_WINDOW must be a whole number of iterations >= 2 (a deviation needs two "
                             f"values), got {self.spike_window!r}")
        if not (math.isfinite(self.spike_sigma) and self.spike_sigma > 0):
            raise ValueError(f"AMPWATCH_SPIKE_SIGMA must be a number of standard deviations > 0, got "
                             f"{self.spike_sigma!r}")

    def for_job(self, world_size: int) -> AgentConfig:
        """Return this config with its push interval resolved for a job of ``world_size`` ranks.

        An explicit ``AMPWATCH_PUSH_INTERVAL`` (or ``push_interval=``) is kept as it is; the default
        follows the most ranks of the job one collector holds (:meth:`ranks_per_collector`,
        :func:`~._schedule.default_heartbeat`).

        >>> AgentConfig().for_job(16_384).push_interval, AgentConfig(push_interval=2.0).for_job(16_384).push_interval
        (30.0, 2.0)
        """
        if self.push_interval is not None:
            return self
        return dataclasses.replace(self, push_interval=default_heartbeat(self.ranks_per_collector(world_size)))

    def ranks_per_collector(self, world_size: int) -> int:
        """Return the most ranks of a job of ``world_size`` ranks that one collector holds.

        A run of at most ``block_ranks`` ranks lives whole on one collector; a bigger one's blocks are dealt out
        in turn, so the run's first collector holds the most. The same for every run name (block ``b`` goes to
        the run's ``b % n``-th collector), so no run is needed.

        >>> two = AgentConfig(collectors=("http://a:1", "http://b:2"), block_ranks=8)
        >>> two.ranks_per_collector(5), two.ranks_per_collector(16), two.ranks_per_collector(20)
        (5, 8, 12)
        """
        if not self.collectors:
            return world_size
        held: collections.Counter[str] = collections.Counter()
        for block in placement.blocks("", world_size, self.collectors, self.block_ranks):
            held[block.collector] += block.last_rank - block.first_rank + 1
        return max(held.values())

    @property
    def heartbeat(self) -> float:
        """The push interval of a config :meth:`for_job` resolved (seconds)."""
        if self.push_interval is None:
            raise ValueError("the push interval is resolved by AgentConfig.for_job(world_size): call it first")
        return self.push_interval

    @property
    def sends(self) -> bool:
        """Return whether a collector is configured (otherwise the agent only records)."""
        return bool(self.collectors) and not self.disabled

    def collector_for(self, run: str, rank: int, world_size: int) -> str:
        """Return the one collector ``rank`` of ``run`` (a job of ``world_size`` ranks) reports to.

        :func:`ampwatch.contract.placement.collector_for` over this config's collectors and block size: a whole
        run on the collector that ranks first for it, a run of more than ``block_ranks`` ranks in blocks. Every
        process (and every collector) computes the same answer without talking to the others; a collector that
        is down keeps its ranks (they are retried, never sent elsewhere).

        >>> config = AgentConfig(collectors=("http://a:1", "http://b:2", "http://c:3"))
        >>> len({config.collector_for("exp-7", rank, 64) for rank in range(64)})
        1
        """
        return placement.collector_for(run, rank, world_size, self.collectors, self.block_ranks)

    @classmethod
    def from_env(cls, *, collector: str | Sequence[str] | None = None, run: str | None = None,
                 token: str | None = None, push_interval: float | None = None,
                 spool_dir: str | None = None, environ: Mapping[str, str] | None = None,
                 **overrides: Any) -> AgentConfig:
        """Merge explicit arguments (and ``overrides`` of other fields) over ``AMPWATCH_*`` variables."""
        env = os.environ if environ is None else environ
        raw = collector if collector is not None else env.get("AMPWATCH_URL", "")
        parts = [raw] if isinstance(raw, str) else list(raw)
        urls = tuple(u.strip().rstrip("/") for part in parts for u in part.split(",") if u.strip())
        fields = {
            "collectors": urls,
            "run": run or env.get("AMPWATCH_RUN") or None,
            "token": token or env.get("AMPWATCH_TOKEN") or None,
            "push_interval": push_interval if push_interval is not None
            else _number(env, "AMPWATCH_PUSH_INTERVAL", float, None),
            "spool_dir": spool_dir or env.get("AMPWATCH_SPOOL_DIR") or None,
            "spool_max_bytes": _number(env, "AMPWATCH_SPOOL_MAX_BYTES", int, 64 * 1024 * 1024),
            "disabled": _flag(env, "AMPWATCH_DISABLED"),
            "timeout": _number(env, "AMPWATCH_TIMEOUT", float, 5.0),
            "max_backoff": _number(env, "AMPWATCH_MAX_BACKOFF", float, 30.0),
            "close_timeout": _number(env, "AMPWATCH_CLOSE_TIMEOUT", float, 5.0),
            "max_events": _number(env, "AMPWATCH_MAX_EVENTS", int, 10_000),
            "block_ranks": _number(env, "AMPWATCH_BLOCK_RANKS", int, placement.BLOCK_RANKS),
            "relay": _flag(env, "AMPWATCH_RELAY"),
            "relay_dir": env.get("AMPWATCH_RELAY_DIR") or None,
            "probe_iterations": _number(env, "AMPWATCH_PROBE_ITERATIONS", int, PROBE_ITERATIONS),
            "spike_window": _number(env, "AMPWATCH_SPIKE_WINDOW", int, DEFAULT_THRESHOLDS.spike_window_iterations),
            "spike_sigma": _number(env, "AMPWATCH_SPIKE_SIGMA", float, DEFAULT_THRESHOLDS.spike_sigma),
            "grad_norm": _flag(env, "AMPWATCH_GRAD_NORM"),
        }
        unknown = set(overrides) - set(fields)
        if unknown:
            raise TypeError(f"unknown AgentConfig field(s): {', '.join(sorted(unknown))}")
        fields.update(overrides)
        return cls(**fields)


def _check_url(url: str) -> None:
    """Raise a ValueError unless ``url`` is an http(s) base URL with a host."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"AMPWATCH_URL / collector= must be http(s)://host[:port] URLs separated by commas, "
                         f"got {url!r}")
    try:
        parsed.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"AMPWATCH_URL / collector= has a bad port in {url!r}") from None


def _number(env: Mapping[str, str], var: str, kind: Callable[[str], Any], default: Any) -> Any:
    """Parse ``env[var]`` as ``kind``, or return ``default`` when unset or empty."""
    text = env.get(var, "").strip()
    if not text:
        return default
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{var} must be {what}, got {text!r}") from None


def _flag(env: Mapping[str, str], var: str) -> bool:
    """Parse ``env[var]`` as a boolean flag."""
    text = env.get(var, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{var} must be one of 1/0, true/false, yes/no, on/off, got {text!r}")
