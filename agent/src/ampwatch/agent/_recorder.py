"""Turn what the scaler did into cumulative counters and events (the protocol's ``state`` and ``events``)."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from ampwatch.contract.batch import (
    CloseEvent,
    RankState,
    SchedulerAfterSkipEvent,
    SkipEvent,
    StreakEndEvent,
    WarningEvent,
)
from ampwatch.contract.protocol import STREAK_LADDER, is_rung  # streaks_reached lengths: 1, 2, 4, ..., 1024

from . import _device
from ._began import BeganFinder
from ._errors import AgentErrors
from ._events import EventBuffer
from ._inspection import SkipInspection
from ._origin import LocalGradients
from ._params import ParameterNames
from ._poison import PoisonCheck
from ._record import OptimizerRecord
from ._samples import SampleLog
from ._scale import LossScale
from ._spike_watch import SpikeWatch

__all__ = ["Recorder", "STREAK_LADDER"]

log = logging.getLogger("ampwatch.agent")

_MAX_PENDING = 64  # device reads in flight before we wait for the oldest (only if the device lags far behind)


def _no_scaler() -> None:
    """What :attr:`Recorder.scaler` reads in a watch without a GradScaler."""
    return None


class Recorder:
    """Count steps, skips, streaks and scale transitions of one scaler, and emit events.

    The training thread calls the ``on_*`` methods (through the wrappers in
    ``_attach``); the sender thread calls :meth:`snapshot`, which only copies
    plain Python values. The parameter scans of a skipped iteration (naming the
    offenders, poisoned steps) are :class:`~._inspection.SkipInspection`'s.
    """

    def __init__(self, scaler: Any | None, records: list[OptimizerRecord], names: ParameterNames,
                 events: EventBuffer, *, errors: AgentErrors | None = None, wake: threading.Event | None = None,
                 inspect_interval: float = 1.0) -> None:
        self.records = records
        self.names = names
        self.events = events
        self.errors = errors if errors is not None else AgentErrors()  # shared with the sender
        self.wake = wake if wake is not None else threading.Event()  # set: the sender sends soon
        self.inspection = SkipInspection(names, events, self.errors, inspect_interval)  # runs on skips only
        self.iteration = 0
        self.attached = False  # the wrappers and hooks pass straight through while False
        self.active: OptimizerRecord | None = None  # the record inside scaler.step right now
        self.scale = LossScale(events)
        # Without a GradScaler, or with a disabled one (enabled=False: nothing is scaled, nothing skips), every
        # step is checked instead: the optimizers' pre-hooks go to this check, and the scaler's step() and
        # update() count nothing.
        self.unscaled: PoisonCheck | None = None
        if scaler is None:
            self._scaler: Any = _no_scaler
            self.scale.unscaled()
            self.unscaled = PoisonCheck(self.inspection)
        else:
            self._scaler = weakref.ref(scaler)  # weak: a watch must not keep a dropped scaler alive
            self.scale.bind(scaler, self.iteration)
            if not self.scale.enabled:
                self.unscaled = PoisonCheck(self.inspection)
        self.open_iteration = False  # unscaled: some optimizer stepped in the current iteration
        self._skipped_this_iteration = False
        self._warned: set[int] = set()
        self._warned_outside = False
        self.orphaned = False  # the scaler was garbage-collected: the hooks only warn, once
        self.origin: LocalGradients | None = None  # set by watch(ddp=...): each parameter's own gradient, noted
        self.origin_iterations = 0  # skipped iterations where this rank's own gradients held inf/NaN
        self.samples: SampleLog | None = None  # set by watch.batch() or watch(loader=): each iteration's sample ids
        self.began: BeganFinder | None = None  # set by watch(): where a skip's or poisoned step's inf/NaN began
        self.spikes: SpikeWatch | None = None  # set by watch(): the loss's and gradient norms' spikes

    @property
    def scaler(self) -> Any:
        """The watched scaler, or None once it has been garbage-collected."""
        return self._scaler()

    @property
    def inspect_interval(self) -> float:
        """Seconds between naming scans at streak starts, per optimizer (tests raise it to rule the clock out)."""
        return self.inspection.interval

    @inspect_interval.setter
    def inspect_interval(self, seconds: float) -> None:
        self.inspection.interval = seconds

    def rebind(self, scaler: Any) -> None:
        """Follow ``scaler`` from now on; its settings and scale replace the old one's (``restored``).

        From a disabled scaler to an enabled one, the steps stop being checked one by one: the iteration in
        progress ends, with the checks still on their way; from an enabled one to a disabled one, they start.
        """
        self._scaler = weakref.ref(scaler)
        self.scale.bind(scaler, self.iteration)
        if self.scale.enabled and self.unscaled is not None:
            self.unscaled.close(self.poisoned_origin)
            self.unscaled = None
            self._end_unscaled_iteration()
        elif not self.scale.enabled and self.unscaled is None:
            for record in self.records:
                if record.pending:  # fused outcomes of the old scaler count before the first checked step
                    self._resolve_oldest(record, all_of_them=True)
            self.unscaled = PoisonCheck(self.inspection)

    def _end_unscaled_iteration(self) -> None:
        # Unscaled, ``iteration`` is the one in progress (once some optimizer stepped in it); with a scaler it
        # counts the update()s done.
        self.iteration += self.open_iteration
        self.open_iteration = False
        for record in self.records:
            record.stepped_this_iteration = False

    def restored(self, state_dict: Any) -> None:
        """Account for ``scaler.load_state_dict(state_dict)``: a ``restored`` transition, not a backoff or growth."""
        scaler = self.scaler
        if scaler is not None:
            self.scale.restored(scaler, state_dict, self.iteration)

    # ----- hooks called from the training thread -------------------------------------------

    def before_step(self, record: OptimizerRecord) -> None:
        """Mark that ``scaler.step(record.optimizer)`` is starting."""
        record.hook_fired = False
        record.found_inf = None
        self.active = record

    def on_optimizer_step(self, record: OptimizerRecord, *, in_watched_step: bool = False) -> None:
        """Note that ``optimizer.step()`` is being called (step pre-hook; without a scaler the hook calls
        :meth:`PoisonCheck.on_step <._poison.PoisonCheck.on_step>` instead).

        ``in_watched_step``: it is called inside the ``step()`` of a scaler some watch
        watches (this one's, or a newer watch's of the same optimizer, as when a
        notebook cell runs again): that step is reported, so it is not "outside".
        """
        if self.active is record:
            record.hook_fired = True
            # AMP-aware (fused) optimizers are stepped even on a skip; the scaler hands them found_inf.
            record.found_inf = _device.fused_found_inf(record.optimizer)
            if self.spikes is not None and self.spikes.compute:  # grad_norm=True: after unscale, before the step
                self.spikes.compute_norm(record.name, self.iteration, record.optimizer)
        elif self.active is None:
            record.last_stepped = None  # this watch no longer knows the optimizer's last step
            if not in_watched_step and not self._warned_outside:
                self._stepped_outside_scaler(record)

    def _stepped_outside_scaler(self, record: OptimizerRecord) -> None:
        # Typically resume code that made a new GradScaler: the watch would go quiet without a word.
        self._warned_outside = True
        if self.orphaned:
            message = (f"optimizer {record.name!r} stepped after the GradScaler ampwatch watched was "
                       "garbage-collected, so its steps and skips are no longer reported. If the job made a new "
                       "GradScaler (e.g. when resuming), keep the watch and call watch.rebind(new_scaler), or "
                       "call ampwatch.agent.watch() with the new scaler.")
        else:
            message = (f"optimizer {record.name!r} stepped outside the watched GradScaler's step(), so this and "
                       "later such steps are not reported. If the job made a new GradScaler (e.g. when "
                       "resuming), call watch.rebind(new_scaler) to carry the watch over to it.")
        log.warning("ampwatch: %s", message)
        if not self.orphaned:
            warning: WarningEvent = {"kind": "warning", "iteration": self.iteration, "optimizer": record.name,
                                     "code": "stepped_outside_scaler", "message": message}
            self.events.append(warning)

    def count_update(self, record: OptimizerRecord) -> None:
        """Count a step that updated ``record``'s parameters in this iteration (a watch without a scaler)."""
        self._outcome(record, True, self.iteration)

    def poisoned_origin(self, fields: dict[str, Any], iteration: int, current: bool) -> None:
        """With ``ddp=``: add to a poisoned step's ``fields`` whether this rank's own gradients held inf/NaN."""
        if self.origin is not None:
            self._add_origin(fields, iteration, current)

    def after_step(self, record: OptimizerRecord) -> None:
        """Decide whether the ``scaler.step`` that just returned updated ``record``'s parameters."""
        self.active = None
        if record.pending:
            self._resolve_ready(record)
        found_inf = record.found_inf
        record.found_inf = None
        if found_inf is None and record.hook_fired and _device.steps_with_amp_scaling(record.optimizer):
            found_inf = _device.found_inf_from_scaler(self._scaler(), record.optimizer)
        if found_inf is None:
            # Non-fused: the scaler calls optimizer.step() only when found_inf is 0 (it already synced).
            self._outcome(record, record.hook_fired, self.iteration)
            return
        if not record.pending and found_inf.device.type == "cpu":
            # Already on the host: read it now (no sync) and skip the deferred-read bookkeeping.
            self._outcome(record, not _device.host_scalar(found_inf), self.iteration)
            return
        read = _device.read_later(found_inf)
        record.pending.append((read, self.iteration))
        self._resolve_ready(record)
        if len(record.pending) > _MAX_PENDING:
            self._resolve_oldest(record)

    def after_update(self, manual: bool) -> None:
        """Account for one ``scaler.update()``: scale transition, poisoned-step check, next iteration.

        A disabled scaler's update() does nothing, and counts nothing: its steps are checked as without a scaler.
        """
        if self.unscaled is not None:
            return
        iteration = self.iteration
        for record in self.records:
            if record.pending:  # fused outcomes that have landed count toward the iteration they belong to
                self._resolve_ready(record)
        samples = self.samples
        if samples is not None:
            samples.assign(iteration)  # the ids recorded until now are this iteration's (its poisoned steps')
        if self._skipped_this_iteration:
            self.inspection.check_poisoned_steps(self.records, iteration)  # whatever the naming rate limit did
        pending = False  # some outcome of this iteration is still on its way (a loop: cheaper than any() here)
        for record in self.records:
            if record.pending:
                pending = True
        if self.began is not None:
            self.began.assign(iteration, keep=pending)
        if self.origin is not None:
            self.origin.end_iteration(iteration, keep=pending)
        scaler = self._scaler()
        if scaler is not None:
            self.scale.after_update(scaler, iteration, manual=manual, skipped=self._skipped_this_iteration)
        for record in self.records:
            record.stepped_this_iteration = False
        self._skipped_this_iteration = False
        if samples is not None:
            samples.end(iteration)
        self.iteration = iteration + 1

    def on_scheduler_step(self, record: OptimizerRecord, scheduler: str) -> None:
        """Count an LR scheduler step taken right after ``record``'s optimizer skipped."""
        if record.pending:
            self._resolve_oldest(record, all_of_them=True)  # rare: fused optimizer on a device
        if record.last_stepped is False:
            record.scheduler_steps_after_skip += 1
            event: SchedulerAfterSkipEvent = {"kind": "scheduler_after_skip", "iteration": self.iteration,
                                              "optimizer": record.name, "scheduler": scheduler}
            self.events.append(event)

    def on_unknown_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn once per optimizer that ``scaler.step`` was called with one that is not watched."""
        if id(optimizer) in self._warned:
            return
        self._warned.add(id(optimizer))
        message = (f"scaler.step() was called with a {type(optimizer).__name__} that was not passed to "
                   "ampwatch.agent.watch(); its skips are not reported. Pass every optimizer to watch().")
        log.warning("ampwatch: %s", message)
        warning: WarningEvent = {"kind": "warning", "iteration": self.iteration,
                                 "code": "stepped_unknown_optimizer", "message": message}
        self.events.append(warning)

    def stepped(self, record: OptimizerRecord) -> bool | None:
        """Return whether the last ``scaler.step`` of ``record`` updated parameters (None before any)."""
        if record.pending:
            self._resolve_oldest(record, all_of_them=True)  # one device sync, only when asked
        return record.last_stepped

    def sample_log(self) -> SampleLog:
        """Return the log of each iteration's sample ids, made at its first use (a watch that records none has none)."""
        if self.samples is None:
            self.samples = self.inspection.samples = SampleLog()
        return self.samples

    def internal_error(self, site: str, error: BaseException) -> None:
        """Count an agent failure and log it once per site; never raise."""
        self.errors.report(site, error)

    def close(self) -> None:
        """Resolve what is still pending, end open streaks and emit ``close``."""
        for record in self.records:
            if record.pending:
                self._resolve_oldest(record, all_of_them=True)
        if self.unscaled is not None:
            self.unscaled.close(self.poisoned_origin)
            self._end_unscaled_iteration()
        self.scale.close()
        if self.origin is not None:
            self.origin.close()
        if self.began is not None:
            self.began.close()
        if self.spikes is not None:
            self.spikes.close()
        for record in self.records:
            if record.consecutive:
                self._end_streak(record)
        close: CloseEvent = {"kind": "close", "iteration": self.iteration}
        self.events.append(close)

    # ----- read from the sender thread ----------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Return ``{"scaler": ..., "state": ...}`` as in docs/protocol.md (plain values only)."""
        scale = self.scale
        state: RankState = {
            "iteration": self.iteration + self.open_iteration,
            "loss_scale": scale.value if scale.enabled else None,
            "backoffs": scale.backoffs,
            "growths": scale.growths,
            "manual_sets": scale.manual_sets,
            "optimizers": {r.name: r.counters() for r in self.records},
        }
        if self.origin is not None:
            state["origin_iterations"] = self.origin_iterations
            if self.origin.norms is not None:  # this rank's own gradient norm per optimizer: its level
                self.origin.norms.levels(state["optimizers"])
        if self.spikes is not None:
            self.spikes.add_to(state)
        return {"scaler": dict(scale.settings), "state": state}

    # ----- outcomes ------------------------------------------------------------------------

    def _resolve_ready(self, record: OptimizerRecord) -> None:
        while record.pending and record.pending[0][0].done():
            read, iteration = record.pending.popleft()
            self._outcome(record, not read.wait()[0], iteration)

    def _resolve_oldest(self, record: OptimizerRecord, all_of_them: bool = False) -> None:
        while record.pending:
            read, iteration = record.pending.popleft()
            self._outcome(record, not read.wait()[0], iteration)
            if not all_of_them:
                break

    def _outcome(self, record: OptimizerRecord, stepped: bool, iteration: int) -> None:
        record.last_stepped = stepped
        if self.spikes is not None:  # a gradient norm noted for this step is judged if it went through
            self.spikes.outcome(record.name, stepped, iteration)
        if stepped:
            record.steps += 1
            record.last_step_iteration = iteration
            record.stepped_this_iteration = iteration == self.iteration
            if record.consecutive:
                self._end_streak(record, iteration)
            return
        record.skipped += 1
        record.consecutive += 1
        position = record.consecutive
        if position == 1:
            record.streaks += 1
            record.streak_start = iteration
        if position > record.longest:
            record.longest = position
        if is_rung(position) and position <= STREAK_LADDER[-1]:
            record.reached[position.bit_length() - 1] += 1
        if iteration == self.iteration:
            self._skipped_this_iteration = True
        self._report_skip(record, position, iteration)
        if position == 1:
            self.wake.set()  # a new streak is news: send it now, not at the next push interval

    def _end_streak(self, record: OptimizerRecord, iteration: int | None = None) -> None:
        event: StreakEndEvent = {"kind": "streak_end", "optimizer": record.name,
                                 "iteration": self.iteration if iteration is None else iteration,
                                 "start_iteration": record.streak_start, "length": record.consecutive}
        self.events.append(event)
        record.consecutive = 0

    def _report_skip(self, record: OptimizerRecord, position: int, iteration: int) -> None:
        # A streak is reported by its rungs (positions 1, 2, 4, 8, ...: where naming may scan) and its
        # streak_end; a skip in between is sent only when it carries news: a change of origin.
        # The counters count every skip, so storage and wire grow with log2 of a streak, not its length.
        rung = is_rung(position)
        if position == 1:
            record.origin_sent = None
        event: SkipEvent = {"kind": "skip", "iteration": iteration, "optimizer": record.name,
                            "streak": position, "params": [], "params_total": None, "inspected": False}
        # Gradients and weights of a deferred (fused, on-device) outcome may already belong to a later iteration.
        current = iteration == self.iteration
        # A streak start looks at the weights its optimizer's last step left: in this scan when it names,
        # else in update(), with the optimizers that stepped (one scan, one copy, either way).
        check_weights = current and position == 1 and record.last_step_iteration is not None
        weights = None
        if current:
            weights, check_weights = self.inspection.name_offenders(record, position, event, check_weights)
        record.check_weights = check_weights
        if self.origin is not None:
            self._add_origin(event, iteration, current)
        origin = (event["origin"], tuple(event["origin_params"])) if "origin" in event else None
        if rung or (origin is not None and origin != record.origin_sent):
            if origin is not None:
                record.origin_sent = origin
            if record.steps == 0 or self.scale.grew_since_skip():
                event["calibration"] = True  # the scaler settling (docs/agent.md#calibration)
            # One scan's offenders serve began when it scanned every watched gradient.
            scanned = self.inspection.scanned if current and len(self.records) == 1 else None
            self.inspection.scanned = None  # holds parameters: a dropped job's must go with it
            self.inspection.explain(event, iteration, current=current, first=position == 1,
                                    flagged=scanned.flagged if scanned is not None else None)
            self.events.append(event)
        if weights is not None and weights.total:
            self.inspection.report_poisoned(record, record.last_step_iteration,  # type: ignore[arg-type] # stepped
                                            weights, "nonfinite_param")

    def _add_origin(self, event: SkipEvent | dict[str, Any], iteration: int, current: bool) -> None:
        # Whether this rank's own gradients held inf/NaN before DDP's all-reduce: read once per
        # skipped iteration, shared by the skip events of every optimizer that skipped in it.
        try:
            report, new = self.origin.report(iteration, current)  # type: ignore[union-attr] # called with one
        except Exception as error:  # noqa: BLE001 - the skip itself is still reported
            self.internal_error("origin flags", error)
            return
        if report is None:
            return
        if new and report.origin:
            self.origin_iterations += 1
        event["origin"], event["origin_params"] = report.origin, report.params
        event["origin_params_total"] = report.params_total
