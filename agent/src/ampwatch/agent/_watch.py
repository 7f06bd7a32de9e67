"""``watch()``: attach the agent to a GradScaler and its optimizers; the Watch handle it returns."""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any, Iterable, Mapping, Sequence

import torch

from ._attach import Attachment
from ._config import AgentConfig
from ._events import EventBuffer
from ._identity import resolve_identity
from ._limits import warn_past_collector_limits
from ._params import ParameterNames
from ._recorder import OptimizerRecord, Recorder
from ._sender import Sender

__all__ = ["DisabledWatch", "Watch", "watch"]

log = logging.getLogger("ampwatch.agent")

_watched: set[int] = set()  # ids of scalers with an open Watch
_watched_lock = threading.Lock()


class Watch:
    """The agent attached to one scaler: ask :meth:`stepped`, then :meth:`close` (or use ``with``).

    >>> import torch
    >>> from ampwatch import agent
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = torch.amp.GradScaler("cpu")
    >>> with agent.watch(scaler, opt, model=model, collector=()) as w:
    ...     scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    ...     _ = scaler.step(opt); scaler.update()
    ...     w.stepped(opt)
    True
    """

    def __init__(self, recorder: Recorder, attachment: Attachment, sender: Sender) -> None:
        self._recorder = recorder
        self._attachment = attachment
        self._sender = sender
        self._by_id = {id(r.optimizer): r for r in recorder.records}
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def stepped(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Tell whether the last ``scaler.step(optimizer)`` updated its parameters; None before the first.

        Free for ordinary optimizers. For fused ones on a GPU the answer may
        still be on its way from the device; then this waits for it (one
        device sync, only when you ask, only for fused optimizers).
        """
        record = self._by_id.get(id(optimizer))
        if record is None:
            names = ", ".join(r.name for r in self._recorder.records)
            raise ValueError(f"stepped() got a {type(optimizer).__name__} that this watch does not know; "
                             f"watched optimizers: {names}. Pass it to ampwatch.agent.watch().")
        return self._recorder.stepped(record)

    def snapshot(self) -> dict[str, Any]:
        """Return the counters as sent to the collector (``{"scaler": ..., "state": ...}``)."""
        return self._recorder.snapshot()

    def summary(self) -> str:
        """Return a short human-readable account of steps, skips and loss-scale transitions."""
        state = self._recorder.snapshot()["state"]
        lines = [f"iteration {state['iteration']}, loss scale {state['loss_scale']}, "
                 f"backoffs {state['backoffs']}, growths {state['growths']}, manual sets {state['manual_sets']}"]
        for name, c in state["optimizers"].items():
            lines.append(f"  {name}: {c['steps']} stepped, {c['skipped']} skipped "
                         f"(longest streak {c['longest_streak']}, now {c['consecutive_skipped']}), "
                         f"{c['poisoned_steps']} poisoned, "
                         f"{c['scheduler_steps_after_skip']} scheduler steps after a skip")
        return "\n".join(lines)

    def close(self, timeout: float | None = None) -> None:
        """Stop watching: restore the scaler, flush what is left (waiting at most ``timeout`` s).

        ``timeout`` defaults to ``AMPWATCH_CLOSE_TIMEOUT`` (5 s).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        try:
            self._attachment.detach()
            self._recorder.close()
        except Exception as error:  # noqa: BLE001 - closing must not fail the user's program
            self._recorder.internal_error("close", error)
        finally:
            with _watched_lock:
                _watched.discard(id(self._recorder.scaler))
        self._sender.close(timeout)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ", ".join(r.name for r in self._recorder.records)
        return f"<ampwatch Watch of {type(self._recorder.scaler).__name__} [{names}]{' closed' if self._closed else ''}>"


class DisabledWatch:
    """What ``watch()`` returns under ``AMPWATCH_DISABLED=1``: records nothing, patches nothing."""

    closed = False

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """Return None: nothing is recorded."""
        return None

    def snapshot(self) -> dict[str, Any]:
        """Return an empty snapshot."""
        return {"scaler": {}, "state": {}}

    def summary(self) -> str:
        """Say that the agent is disabled."""
        return "ampwatch agent disabled (AMPWATCH_DISABLED)"

    def close(self, timeout: float | None = None) -> None:
        """Do nothing."""

    def __enter__(self) -> "DisabledWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def watch(scaler: torch.amp.GradScaler,
          optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | Mapping[str, torch.optim.Optimizer],
          *, model: torch.nn.Module | None = None,
          named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
          schedulers: Any = None, collector: str | Sequence[str] | None = None, run: str | None = None,
          token: str | None = None, push_interval: float | None = None) -> Watch | DisabledWatch:
    """Attach the agent to ``scaler`` and ``optimizers``; the training loop stays as it is.

    ``optimizers``: one optimizer, a list, or ``{"name": optimizer}``. ``model``
    or ``named_parameters`` only name parameters in reports. ``schedulers``:
    ``{"name": scheduler_or_list}`` keyed like ``optimizers`` (or one scheduler
    with one optimizer). ``collector``, ``run``, ``token``, ``push_interval``
    override ``AMPWATCH_URL``, ``AMPWATCH_RUN``, ``AMPWATCH_TOKEN``,
    ``AMPWATCH_PUSH_INTERVAL``.
    """
    config = AgentConfig.from_env(collector=collector, run=run, token=token, push_interval=push_interval)
    if config.disabled:
        return DisabledWatch()
    _check_scaler(scaler)
    named = _named_optimizers(optimizers)
    names = ParameterNames(_named_params(model, named_parameters))
    records = [OptimizerRecord(name=n, optimizer=o) for n, o in named.items()]
    scheduler_list = _schedulers(schedulers, {r.name: r for r in records})
    with _watched_lock:
        if id(scaler) in _watched:
            raise ValueError("this scaler is already watched; close() the earlier watch before watching it again")
        _watched.add(id(scaler))
    try:
        events = EventBuffer(capacity=config.max_events)
        identity = resolve_identity(config.run)
        warn_past_collector_limits(len(records), identity.world_size, sending=config.sends)
        sender_ref: list[Sender] = []
        recorder = Recorder(scaler, records, names, events,
                            on_streak_start=lambda: sender_ref[0].wake() if sender_ref else None)
        sender = Sender(config, identity, recorder.snapshot, events)
        sender_ref.append(sender)
        attachment = Attachment(scaler, recorder, scheduler_list)
        attachment.attach()
    except BaseException:
        with _watched_lock:
            _watched.discard(id(scaler))
        raise
    handle = Watch(recorder, attachment, sender)
    sender.start()
    atexit.register(handle.close)
    return handle


def _check_scaler(scaler: Any) -> None:
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (or a subclass such as ShardedGradScaler), "
                        f"got {type(scaler).__name__}")


def _named_optimizers(optimizers: Any) -> dict[str, torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    if isinstance(optimizers, Mapping):
        named = dict(optimizers)
        for name, opt in named.items():
            if not isinstance(name, str) or not 1 <= len(name) <= 128 or not name.isprintable():
                raise ValueError(f"optimizers: names must be printable strings of 1-128 characters, got {name!r}")
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizers[{name!r}] must be a torch.optim.Optimizer, got {type(opt).__name__}")
    elif isinstance(optimizers, (list, tuple)):
        for i, opt in enumerate(optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizers[{i}] must be a torch.optim.Optimizer, got {type(opt).__name__}")
        classes = [type(o).__name__ for o in optimizers]
        unique = len(set(classes)) == len(classes)
        named = {(c if unique else f"optimizer{i}"): o for i, (c, o) in enumerate(zip(classes, optimizers))}
    else:
        raise TypeError("optimizers must be a torch.optim.Optimizer, a list of them, or a dict "
                        f"{{name: optimizer}}, got {type(optimizers).__name__}")
    if not named:
        raise ValueError("optimizers is empty: pass at least one optimizer to watch")
    if len({id(o) for o in named.values()}) != len(named):
        raise ValueError("optimizers: the same optimizer is listed twice; pass each optimizer once")
    return named


def _named_params(model: Any, named_parameters: Any) -> list[tuple[str, torch.Tensor]]:
    if model is not None and named_parameters is not None:
        raise ValueError("pass either model= or named_parameters=, not both")
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        return list(model.named_parameters())
    if named_parameters is None:
        return []
    pairs = list(named_parameters)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError("named_parameters must yield (name, tensor) pairs, as model.named_parameters() does")
    return pairs


def _schedulers(schedulers: Any, records: dict[str, OptimizerRecord]) -> list[tuple[OptimizerRecord, str, Any]]:
    if schedulers is None:
        return []
    if not isinstance(schedulers, Mapping):
        if len(records) != 1:
            raise ValueError("schedulers must be a dict {optimizer name: scheduler} when watching several "
                             f"optimizers (names: {', '.join(records)})")
        schedulers = {next(iter(records)): schedulers}
    result = []
    for name, value in schedulers.items():
        if name not in records:
            raise ValueError(f"schedulers: {name!r} is not the name of a watched optimizer "
                             f"(names: {', '.join(records)})")
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        classes = [type(s).__name__ for s in items]
        for i, scheduler in enumerate(items):
            if not callable(getattr(scheduler, "step", None)):
                raise TypeError(f"schedulers[{name!r}] must be an LR scheduler with a step() method, "
                                f"got {type(scheduler).__name__}")
            owner = getattr(scheduler, "optimizer", None)
            if owner is not None and owner is not records[name].optimizer:
                raise ValueError(f"schedulers[{name!r}] schedules a different optimizer than optimizers[{name!r}]")
            label = classes[i] if classes.count(classes[i]) == 1 else f"{classes[i]}{i}"
            result.append((records[name], label, scheduler))
    return result
