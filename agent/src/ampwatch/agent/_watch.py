"""``watch()``: attach the agent to a GradScaler and its optimizers; the Watch handle it returns."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ._arguments import check_scaler, named_optimizers, named_params, per_step_schedulers
from ._attach import OptimizerHooks, ScalerPatch, record_of
from ._began import find_where_it_began
from ._config import AgentConfig
from ._device_info import watched_device
from ._disabled import DisabledWatch
from ._errors import AgentErrors
from ._events import EventBuffer
from ._identity import resolve_identity
from ._limits import warn_past_collector_limits
from ._loader import LoaderTap, Tap
from ._local_norm import LocalNorms
from ._origin import observe_ddp
from ._params import ParameterNames
from ._record import OptimizerRecord
from ._recorder import Recorder
from ._samples import as_ids
from ._sender import Sender
from ._session import NO_FINALIZER, Session, finalize_with, register_exit_flush, watched, watched_lock
from ._spike_watch import SpikeWatch

__all__ = ["DisabledWatch", "Watch", "watch"]

log = logging.getLogger("ampwatch.agent")

class Watch:
    """The agent attached to one scaler: ask :meth:`stepped`, then :meth:`close` (or use ``with``).

    Closing is optional: a watch whose scaler is garbage-collected ends by
    itself, and watches still open at exit are flushed, within one
    ``AMPWATCH_CLOSE_TIMEOUT`` for all of them.

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

    def __init__(self, session: Session, patch: ScalerPatch | None, by_id: dict[int, OptimizerRecord]) -> None:
        self._session = session
        self._recorder, self._sender = session.recorder, session.sender
        self._patch = patch  # None: a job without a GradScaler
        self._by_id = by_id
        self._finalizer = finalize_with(patch.scaler, session) if patch is not None else NO_FINALIZER
        self._samples = session.recorder.samples  # made by the first batch() when no loader made it

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._session.closed

    def stepped(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Tell whether the last ``scaler.step(optimizer)`` updated its parameters; None before the first.

        Free for ordinary optimizers. For fused ones on a GPU the answer may
        still be on its way from the device; then this waits for it (one
        device sync, only when you ask, only for fused optimizers).
        """
        record = record_of(self._by_id, optimizer)
        if record is None:
            names = ", ".join(r.name for r in self._recorder.records)
            raise ValueError(f"stepped() got a {type(optimizer).__name__} that this watch does not know; "
                             f"watched optimizers: {names}. Pass it to ampwatch.agent.watch().")
        return self._recorder.stepped(record)

    def batch(self, ids: Any) -> None:
        """Record the sample ids this rank trains on in the current iteration (docs/agent.md#which-batch).

        ``ids``: an int or a string (one sample), a list, tuple or range of them, or a CPU tensor of integers
        (read on the host: a CUDA tensor is refused, reading it would sync). With gradient accumulation, call it
        once per micro-batch: the iteration (its ``scaler.update()``; without a scaler its first optimizer step)
        holds every id recorded since the last one. A list is kept as it is until the iteration is a few
        iterations old: do not change it afterwards. Costs one check and one append; the ids are converted and
        digested only for an event.
        """
        values = as_ids(ids)
        samples = self._samples
        if samples is None:
            samples = self._samples = self._recorder.sample_log()
        samples.add(values)

    def _follow(self, loader: Any, *, lag: int = 0, by_position: bool = False) -> LoaderTap:
        """Record the ids of ``loader``'s batches (``watch(loader=)``; the integrations, with ``lag`` or
        ``by_position``: see :class:`~._loader.LoaderTap`). Stops at close()."""
        if self.closed:
            raise RuntimeError("this watch is closed")
        tap = LoaderTap(loader, self._recorder.sample_log(), self._sender.identity.rank, self._recorder.errors,
                        lag=lag, by_position=by_position).start()
        self._samples = self._recorder.samples
        self._session.taps.append(tap)
        return tap

    def _close_with(self, tap: Tap) -> None:
        """Close ``tap`` (an integration's loss tap) when this watch closes."""
        self._session.taps.append(tap)

    def loss(self, loss: torch.Tensor | float) -> None:
        """Note a loss of the current iteration, for a job without a GradScaler (``scaler.scale(loss)`` notes it
        by itself): with gradient accumulation, every micro-batch's.

        Free: the loss is kept as it is and read if the iteration skips or is poisoned, to say whether the inf/NaN
        began in the forward pass (``began``, docs/agent.md); the iteration's losses are summed for the spike watch
        at its end (on CPU read directly, on a device copied without a sync: docs/agent.md#spikes). Never raises.
        """
        recorder = self._recorder
        if recorder.attached and recorder.began is not None:
            try:
                recorder.began.note_loss(loss)
            except Exception as error:  # noqa: BLE001 - the agent must never break the loop
                recorder.internal_error("watch.loss", error)

    def grad_norm(self, total_norm: torch.Tensor | float,
                  optimizer: torch.optim.Optimizer | str | None = None) -> None:
        """Hand over the gradient norm the job computed for ``optimizer``'s step in the current iteration (the
        return of ``clip_grad_norm_``, after ``scaler.unscale_``), to watch it for spikes (docs/agent.md#spikes).

        ``total_norm``: a 0-d (or one-element) tensor, on any device, or a number; ``optimizer``: a watched
        optimizer or its name, which may be left out when the watch has one. Free: a tensor on a device is
        copied to the host without blocking and read an iteration later (no sync); on CPU it is read at once.
        The norm of a step the scaler skips is not judged (its skip reports it). Raises only for bad arguments.
        """
        recorder = self._recorder
        records = recorder.records
        if optimizer is None:
            if len(records) != 1:
                raise ValueError("grad_norm() needs optimizer= when the watch has several optimizers; watched: "
                                 + ", ".join(r.name for r in records))
            record = records[0]
        elif isinstance(optimizer, str):
            named = [r for r in records if r.name == optimizer]
            if not named:
                raise ValueError(f"grad_norm() got optimizer={optimizer!r}, which this watch does not know; "
                                 f"watched: {', '.join(r.name for r in records)}")
            record = named[0]
        else:
            found = record_of(self._by_id, optimizer)
            if found is None:
                raise ValueError(f"grad_norm() got a {type(optimizer).__name__} that this watch does not know; "
                                 f"watched: {', '.join(r.name for r in records)}. Pass it to ampwatch.agent.watch().")
            record = found
        if isinstance(total_norm, torch.Tensor):
            if total_norm.numel() != 1 or not total_norm.is_floating_point():
                raise ValueError(f"grad_norm() takes the total norm: a tensor of one floating value, got a "
                                 f"{total_norm.dtype} tensor of shape {tuple(total_norm.shape)}")
        elif isinstance(total_norm, bool) or not isinstance(total_norm, (int, float)):
            raise TypeError(f"grad_norm() takes the total norm as a tensor or a number, got a "
                            f"{type(total_norm).__name__}")
        spikes = recorder.spikes
        if spikes is None or not recorder.attached:
            return
        try:
            # Without a scaler, an optimizer that already stepped in this iteration starts the next one.
            iteration = recorder.iteration + (recorder.unscaled is not None and record.stepped_this_iteration)
            spikes.note_norm(record.name, iteration, total_norm.detach() if isinstance(total_norm, torch.Tensor)
                             else total_norm)
        except Exception as error:  # noqa: BLE001 - the agent must never break the loop
            recorder.internal_error("watch.grad_norm", error)

    def rebind(self, scaler: torch.amp.GradScaler) -> None:
        """Carry this watch over to ``scaler``, e.g. a new GradScaler made when resuming from a checkpoint.

        Counters, streaks and the connection to the collector carry on; the new
        scaler's settings are reported, and its scale, if it differs, as a
        ``restored`` transition (never a backoff or growth). Reads the new
        scale once (one device sync on a GPU). A disabled scaler
        (``enabled=False``) is watched as a job without one: from an enabled
        scaler to a disabled one every step is checked from now on, and the
        other way round the scaler's skips are reported instead.
        """
        if self.closed:
            raise RuntimeError("this watch is closed; call ampwatch.agent.watch() with the new scaler instead")
        if self._patch is None:
            raise RuntimeError("this watch has no GradScaler (watch(None, ...)): close() it and call "
                               "ampwatch.agent.watch() with the scaler")
        check_scaler(scaler)
        if scaler is self._patch.scaler:
            return
        with watched_lock:
            if id(scaler) in watched:
                raise ValueError("this scaler is already watched; close() the other watch before rebind()")
            watched.add(id(scaler))
        patch = ScalerPatch(scaler, self._recorder)
        try:
            patch.attach(self._by_id)
        except BaseException:
            watched.discard(id(scaler))
            raise
        self._finalizer.detach()
        self._patch.detach()
        watched.discard(self._session.scaler_id)
        self._patch, self._session.scaler_id = patch, id(scaler)
        self._recorder.rebind(scaler)
        self._finalizer = finalize_with(scaler, self._session)

    def snapshot(self) -> dict[str, Any]:
        """Return the counters as sent to the collector (``{"scaler": ..., "state": ...}``, delivery included)."""
        snapshot = self._recorder.snapshot()
        snapshot["state"]["delivery"] = self._sender.delivery
        return snapshot

    def summary(self) -> str:
        """Return a short human-readable account of steps, skips and loss-scale transitions."""
        state = self._recorder.snapshot()["state"]
        if self._patch is None:
            lines = [f"iteration {state['iteration']}, no GradScaler: nothing skips, every step is checked"]
        elif self._recorder.unscaled is not None:
            lines = [f"iteration {state['iteration']}, GradScaler disabled (enabled=False): nothing skips, every "
                     "step is checked"]
        else:
            lines = [f"iteration {state['iteration']}, loss scale {state['loss_scale']}, backoffs "
                     f"{state['backoffs']}, growths {state['growths']}, manual sets {state['manual_sets']}"]
        for name, c in state["optimizers"].items():
            lines.append(f"  {name}: {c['steps']} stepped, {c['skipped']} skipped "
                         f"(longest streak {c['longest_streak']}, now {c['consecutive_skipped']}), "
                         f"{c['poisoned_steps']} poisoned, "
                         f"{c['scheduler_steps_after_skip']} scheduler steps after a skip")
        spikes = [f"loss {state.get('loss_spikes', 0)}"] if "loss" in state or "loss_spikes" in state else []
        spikes += [f"{name}'s gradient norm {c.get('grad_norm_spikes', 0)}" for name, c in state["optimizers"].items()
                   if "grad_norm" in c or "grad_norm_spikes" in c]
        if spikes:  # the watched signals (docs/agent.md#spikes)
            lines.append(f"  spikes: {', '.join(spikes)}")
        if "origin_iterations" in state:  # watch(ddp=...): skips whose inf/NaN was in this rank's own gradients
            what = "skipped" if self._patch is not None else "poisoned"
            lines.append(f"  {what} iterations that started on this rank (DDP): {state['origin_iterations']}")
        return "\n".join(lines)

    def close(self, timeout: float | None = None) -> None:
        """Stop watching: restore the scaler, flush what is left (waiting at most ``timeout`` s).

        ``timeout`` defaults to ``AMPWATCH_CLOSE_TIMEOUT`` (5 s).
        """
        self._finalizer.detach()
        if not self._session.closed:
            self._recorder.attached = False
            if self._patch is not None:
                self._patch.detach()
        self._session.close(timeout)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ", ".join(r.name for r in self._recorder.records)
        kind = type(self._patch.scaler).__name__ if self._patch is not None else "no GradScaler"
        return f"<ampwatch Watch of {kind} [{names}]{' closed' if self.closed else ''}>"


def watch(scaler: torch.amp.GradScaler | None,
          optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | Mapping[str, torch.optim.Optimizer],
          *, model: torch.nn.Module | None = None,
          named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
          schedulers: Any = None, collector: str | Sequence[str] | None = None, run: str | None = None,
          token: str | None = None, push_interval: float | None = None, ddp: torch.nn.Module | None = None,
          comm_hook: Any = None, comm_state: Any = None, loader: Any = None,
          grad_norm: bool | None = None) -> Watch | DisabledWatch:
    """Attach the agent to ``scaler`` and ``optimizers``; the training loop stays as it is.

    ``scaler=None`` watches a job without a GradScaler (bf16, float32): nothing skips, so every
    ``optimizer.step()`` is checked for gradients holding inf/NaN, a poisoned step (docs/agent.md).
    A disabled scaler (``GradScaler(enabled=False)``, the usual bf16 recipe) is watched the same way.

    ``optimizers``: one optimizer, a list, or ``{"name": optimizer}``. ``model``
    or ``named_parameters`` only name parameters in reports; ``model`` (or ``ddp``'s)
    also names their modules, and is where the forward probes of an event's ``began``
    look (docs/agent.md, "Where it began"). ``schedulers``:
    ``{"name": scheduler_or_list}`` keyed like ``optimizers`` (or one scheduler
    with one optimizer). ``collector``, ``run``, ``token``, ``push_interval``
    override ``AMPWATCH_URL``, ``AMPWATCH_RUN``, ``AMPWATCH_TOKEN``,
    ``AMPWATCH_PUSH_INTERVAL``.

    ``ddp``: the job's DistributedDataParallel model, to report whether this rank's own gradients held
    inf/NaN before DDP reduced them (the rank where a skip started; docs/agent.md). A tensor hook on each
    of its parameters looks at the gradient on its way in; DDP's reduction, and any communication hook the
    job registers on the model itself, run as they would without ampwatch. Names parameters by
    ``ddp.module`` when ``model`` is not given. ``comm_hook`` and ``comm_state`` are refused: register your
    hook with ``ddp.register_comm_hook(state, hook)``, as without ampwatch.

    ``loader``: the job's training DataLoader, to record the sample ids of each iteration itself (as
    :meth:`Watch.batch` does): the sampler's indices of a map-style dataset, a batch's position in an iterable
    one. The loader, its batches and their order stay exactly as they are (docs/agent.md#which-batch).

    ``grad_norm``: each optimizer step computes its gradient norm (after unscaling; steps that go through only), to
    watch it for spikes (over ``AMPWATCH_GRAD_NORM``; docs/agent.md#spikes). Without it, the loss is watched, and
    the norms handed over with :meth:`Watch.grad_norm`.
    """
    if comm_hook is not None or comm_state is not None:
        raise TypeError("watch() no longer takes comm_hook= or comm_state=: ampwatch does not wrap DDP's "
                        "reduction, it looks at each parameter's own gradient before DDP takes it. Register "
                        "your communication hook on the model yourself, model.register_comm_hook(state, hook), "
                        "as you would without ampwatch, and call watch(..., ddp=model) without them.")
    config = AgentConfig.from_env(collector=collector, run=run, token=token, push_interval=push_interval)
    if grad_norm is not None:
        config = dataclasses.replace(config, grad_norm=bool(grad_norm))
    if config.disabled:
        return DisabledWatch()
    check_scaler(scaler, none=True)
    named = named_optimizers(optimizers)
    if ddp is not None and model is None and named_parameters is None:
        model = getattr(ddp, "module", None)
    names = ParameterNames(named_params(model, named_parameters))
    records = [OptimizerRecord.of(n, o) for n, (o, _) in named.items()]
    by_id = {id(alias): record for record, (_, aliases) in zip(records, named.values(), strict=True)
             for alias in (record.optimizer, *aliases)}
    scheduler_list = per_step_schedulers(schedulers, {r.name: r for r in records})
    with watched_lock:
        if scaler is not None:
            if id(scaler) in watched:
                raise ValueError("this scaler is already watched; close() the earlier watch before watching it "
                                 "again")
            watched.add(id(scaler))
    hooks = patch = recorder = None
    taps: list[Tap] = []
    try:
        events = EventBuffer(capacity=config.max_events)
        identity = resolve_identity(config.run)
        warn_past_collector_limits(len(records), identity.world_size, sending=config.sends)
        errors, wake = AgentErrors(), threading.Event()  # one failure count and one "send soon" for both
        recorder = Recorder(scaler, records, names, events, errors=errors, wake=wake)
        sender = Sender(config, identity, recorder.snapshot, events, errors=errors, wake=wake)
        hooks = OptimizerHooks(recorder, scheduler_list)
        hooks.attach()
        if scaler is not None:
            patch = ScalerPatch(scaler, recorder)
            patch.attach(by_id)
        if ddp is not None:
            recorder.origin = observe_ddp(ddp, names, errors)
            recorder.origin.norms = LocalNorms(recorder.origin, recorder,  # this rank's own gradient norms
                                               window=config.spike_window, sigma=config.spike_sigma)
        find_where_it_began(recorder, model if model is not None else getattr(ddp, "module", None),
                            config.probe_iterations)
        recorder.spikes = recorder.began.spikes = SpikeWatch(  # type: ignore[union-attr] # made just now
            events, config.spike_window, config.spike_sigma, functools.partial(getattr, recorder.inspection, "samples"),
            compute=config.grad_norm, errors=errors)
        if loader is not None:
            taps.append(LoaderTap(loader, recorder.sample_log(), identity.rank, errors).start())
        sender.device = watched_device(records, errors)
        recorder.attached = True
    except BaseException:
        if recorder is not None and recorder.began is not None:
            recorder.began.close()
        for tap in taps:
            tap.close()
        if patch is not None:
            patch.detach()
        if hooks is not None:
            hooks.detach()
        watched.discard(id(scaler))
        raise
    session = Session(recorder, hooks, sender, id(scaler))
    session.taps = taps
    handle = Watch(session, patch, by_id)
    sender.start()
    register_exit_flush()
    return handle
